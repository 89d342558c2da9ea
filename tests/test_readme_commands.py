"""The tracker commands README shows, run as written on a training script
that compiles its model and trains under bf16 autocast, with an
intentional -inf attention mask (tests/transparency_run.py's block): each
exits 0, prints its report and no C++ stack trace, and leaves the losses
the script prints without torchcast."""
import os
import re
import shlex
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TRAIN = '''
import argparse, sys, torch
sys.path.insert(0, {here!r})
from transparency_run import Block
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
model = Block()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
compiled = torch.compile(model)
g = torch.Generator().manual_seed(1)
for epoch in range(args.epochs):
    for _ in range(3):
        tokens = torch.randint(0, 64, (4, 9), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = compiled(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("loss", loss.item().hex())
'''


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return [line.split("  #")[0].strip() for line in re.findall(r"^python -m torchcast track .*$",
                                                                 text, re.M)]


COMMANDS = _readme_commands()


def test_readme_shows_tracker_commands():
    assert len(COMMANDS) >= 2 and all("train.py" in c for c in COMMANDS)


# pytest -q runs the commands that stop on NaN/inf (the tracker's most
# features at once), the slow stage the others.
@pytest.mark.parametrize("command", [
    pytest.param(c, marks=() if "--nonfinite" in c else pytest.mark.slow) for c in COMMANDS])
def test_a_readme_command_on_a_compiled_autocast_script(command, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN.format(here=HERE))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=900, env=env)
    argv = shlex.split(command)
    argv[0] = sys.executable
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "frame #" not in run.stderr and "Exception raised from" not in run.stderr
    assert "torchcast.track:" in run.stderr
    losses = [line for line in run.stdout.splitlines() if line.startswith("loss")]
    expected = [line for line in plain.stdout.splitlines() if line.startswith("loss")]
    epochs = 1 if "--epochs 1" in command else 2
    assert losses == expected[:3 * epochs] and losses
    if "--html" in argv:
        assert (tmp_path / argv[argv.index("--html") + 1]).read_text().startswith("<!DOCTYPE")
