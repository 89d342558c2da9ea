"""The update accounting of torchcast.optim (track_updates=True) in a
track's report (tracker/updates.py): the rows are what the optimizer's own
update_stats() reads, and every writer carries them."""
import dataclasses

import torch

import torchcast
from torchcast.optim import AdamW
from scalar_writer import ScalarWriter



def train(lr, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).to(torch.bfloat16)
    # a tiny lr: most bfloat16 updates round away
    opt = AdamW(model.named_parameters(), lr=lr, compensated=False, track_updates=True)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    x = torch.randn(64, 16, dtype=torch.bfloat16)
    with torchcast.track() as report:
        for _ in range(steps):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            plain.step()  # not a torchcast optimizer: no rows
    return report, opt


def test_the_rows_are_the_optimizers_own_records():
    report, opt = train(lr=1e-6)
    stats = opt.update_stats()
    expected = [dataclasses.asdict(r) for r in stats.groups + stats.params]
    got = [{k: v for k, v in r.items()
            if k not in ("optimizer", "lost_fraction", "shrunk_fraction")} for r in report.updates]
    assert got == expected and {r["optimizer"] for r in report.updates} == {0}
    group = report.updates[0]
    assert group["index"] is None and group["elements"] == 5 * sum(
        p.numel() for p in opt.param_groups[0]["params"])
    assert group["lost_fraction"] > 0.5  # lr 1e-6 on bfloat16 weights of size ~0.1


def test_text_html_tensorboard_and_json_carry_them(tmp_path):
    report, _ = train(lr=1e-6)
    text = str(report)
    assert "optimizer updates" in text and "lost" in text
    assert "raise the learning rate" in text  # over 1% lost
    assert "0.weight" in text  # a named parameter among the notable ones
    report.to_html(tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    assert "<h2>Optimizer updates</h2>" in html and "raise the learning rate" in html
    tags = ScalarWriter()
    report.to_tensorboard(tags, step=3)
    lost = {t: v for t, v in tags.scalars.items() if "/updates/" in t and t.endswith("lost_fraction")}
    assert "torchcast/updates/optimizer0/group0/lost_fraction" in lost
    assert "torchcast/updates/optimizer0/group0/0.weight/lost_fraction" in lost
    back = torchcast.Report.from_json(report.to_json())
    assert back.updates == report.updates


def test_a_large_lr_loses_little_and_gives_no_advice():
    report, _ = train(lr=1e-1)
    assert report.updates[0]["lost_fraction"] < 0.01
    assert "raise the learning rate" not in str(report)


def test_a_track_without_such_an_optimizer_has_no_rows():
    with torchcast.track() as report:
        p = torch.nn.Parameter(torch.ones(3))
        opt = AdamW([p], lr=0.1)  # track_updates off
        p.sum().backward()
        opt.step()
    assert report.updates == [] and "optimizer updates" not in str(report)
    assert "updates" not in report.to_dict()
