"""A float16 training step whose feed-forward overflows, tracked with every
watch on, written as an HTML report (docs/report.png is its screenshot).

    PYTHONPATH=. python tools/report_example.py [OUT.html]
"""
import sys

import torch

import torchcast


def make_model():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64),
                                torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(64, 4)).half()
    with torch.no_grad():  # the second layer's feed-forward grows past float16's range
        model[1].layers[1].linear1.weight.mul_(40000)
    return model


def main(out="report.html"):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, target = torch.randn(8, 32, 16).half(), torch.randn(8, 32, 4)
    with torchcast.track(all_casts=True, nonfinite="record", health=True,
                         policy="record") as report:
        for _ in range(2):
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
    print(report)
    print(report.headroom(torch.float8_e4m3fn, scale="amax"))
    report.to_html(out)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main(*sys.argv[1:])
