"""The README's main job: the demo runs, and its table is the op's truth."""
import subprocess
import sys

import pytest
import torch

from torchcast import _ops, demo
from torchcast.__main__ import main

from numpy_ref import stats_reference


def test_demo_reports_real_losses_and_catches_the_overflow():
    lines = []
    rows = demo.run(out=lines.append, n=48, steps=3)
    text = "\n".join(lines)
    assert "PrecisionLossError: safe_to(angular momentum)" in text
    assert "144 overflowed to inf" in text  # 48 stars x 3 components
    assert "silently became inf" in text
    data = demo.simulate(48, 3)
    for name, s in rows:
        ref = stats_reference(data[name], s.dtype)
        for field in ("inexact", "overflow", "underflow", "subnormal", "max_rel_err"):
            assert getattr(s, field) == ref[field], (name, s.dtype, field)
    # float16 cannot hold accelerations of ~1e-12 m/s^2: every one underflows
    acc = dict(((n, s.dtype), s) for n, s in rows)[("acceleration [m/s^2]", torch.float16)]
    assert acc.underflow == acc.numel


def test_cli_usage_and_unknown_command(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "python -m torchcast demo" in capsys.readouterr().out
    assert main(["fly"]) == 2


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "torchcast", "--help"], capture_output=True,
                         text=True, check=True)
    assert "usage: python -m torchcast demo" in out.stdout


@pytest.mark.skipif(not _ops.WITH_EXTENSION,
                    reason="this install has no compiled extension to fail loading")
def test_import_error_says_how_to_build():
    code = ("import sys; sys.modules['torchcast._C'] = None\n"
            "try:\n    import torchcast\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install --no-build-isolation -e ." in out.stdout
