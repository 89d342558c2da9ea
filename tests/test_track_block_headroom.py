"""Headroom in the block-scaled formats (tracker/block_headroom.py): each
row of report.headroom(format) is what real block casts of the tensors the
watch measured lose, checked here against block_cast run on the same
tensors captured independently with module hooks."""
import functools
import math
import operator

import pytest
import torch

import torchcast
from scalar_writer import ScalarWriter

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
COUNTS = ("numel", "nan", "inf", "inexact", "overflow", "saturated", "underflow", "subnormal")


def model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 40))  # 40: a ragged last block of 8
    x = torch.randn(8, 64)
    x[0, 3] = 3e4  # an outlier: its block's other elements flush to zero
    x[5, :] *= 1e-6
    return model, x


def captured(model, x, steps):
    """Each child's forward outputs and the gradients flowing into them, by
    (name, phase), captured with hooks of this test's own."""
    seen = {}
    handles = []
    for name, module in model.named_children():
        def forward_hook(mod, args, out, name=name):
            seen.setdefault((name, "forward"), []).append(out.detach().clone())
            out.register_hook(
                lambda g, name=name: seen.setdefault((name, "backward"), []).append(g.clone()))
        handles.append(module.register_forward_hook(forward_hook))
    for _ in range(steps):
        model(x).square().mean().backward()
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("steps", [1, 3])
def test_rows_are_the_stats_of_real_block_casts_of_what_was_measured(steps):
    model, x = model_and_input()
    expected = captured(model, x, steps)
    with torchcast.track(health=True, block_formats=FORMATS) as report:
        for _ in range(steps):
            model(x).square().mean().backward()
    for fmt in FORMATS:
        rows = {(r.module, r.phase): r for r in report.headroom(fmt)}
        for (name, phase), tensors in expected.items():
            want = functools.reduce(operator.add,
                                    [torchcast.block_cast(t, fmt).stats for t in tensors])
            got = rows[(name, phase)].stats
            assert [getattr(got, k) for k in COUNTS] == [getattr(want, k) for k in COUNTS], \
                (fmt, name, phase)
            assert math.isclose(got.sqnr_db, want.sqnr_db, rel_tol=1e-12), (fmt, name, phase)
        # the outlier's block: elements flushed to zero in the first layer's input rows
        assert any(r.stats.underflow for r in rows.values()) or fmt.startswith("mxfp8")



def test_html_tensorboard_json_carry_them_and_unmeasured_formats_are_refused(tmp_path):
    model, x = model_and_input()
    with torchcast.track(health=True, block_formats=("nvfp4",)) as report:
        model(x).sum().backward()
    report.to_html(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "Headroom in block-scaled formats" in page and "<h3>nvfp4</h3>" in page
    tags = ScalarWriter()
    report.to_tensorboard(tags, step=0)
    first = next(r for r in report.headroom("nvfp4") if r.module == "0" and r.phase == "forward")
    tag = "torchcast/block_headroom/0/forward/torch.float32/nvfp4/underflow_fraction"
    assert tags.scalars[tag] == first.stats.underflow / first.stats.numel
    back = torchcast.Report.from_json(report.to_json())
    assert str(back.headroom("nvfp4")) == str(report.headroom("nvfp4"))
    assert [r.stats for r in back.headroom("nvfp4")] == [r.stats for r in report.headroom("nvfp4")]
    with pytest.raises(ValueError, match="block_formats=\\('mxfp4',\\)"):
        report.headroom("mxfp4")
    with pytest.raises(ValueError, match="leave scale=None"):
        report.headroom("nvfp4", scale="amax")
    assert "headroom in nvfp4" in str(report.headroom("nvfp4"))


def test_block_formats_need_health_and_known_names():
    with pytest.raises(ValueError, match="pass health=True"):
        torchcast.track(block_formats=("nvfp4",))
    with pytest.raises(ValueError, match="unknown format 'mxfp6'"):
        torchcast.track(health=True, block_formats=("mxfp6",))
    with torchcast.track(health=True) as report:  # none asked for: none measured
        torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert report.block_rows == [] and report.block_formats == ()
