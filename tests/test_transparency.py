"""Tracking never changes or breaks the run it watches: the transparency
matrix. A small transformer block with an intentional -inf mask
(tests/transparency_run.py), trained for a few steps or run under no_grad,
each configuration in a fresh process with one thread:

    {eager, aot_eager, inductor} x {float32, bf16 autocast, bf16 weights}
    x {training step, no_grad}
    x {plain, track(), all_casts, nonfinite="record", nonfinite="raise",
       health, all together}

Every tracked run exits 0, prints no C++ stack trace, gives the plain
run's losses and weights bit for bit, and compiles the plain run's graphs
with its graph breaks (none added).

The matrix runs two models: the block above, and issue 47's block with
nn.MultiheadAttention (``transparency_run.AttentionBlock``), whose casts
Inductor fuses under bf16 autocast: a tracker that kept them in buffers of
their dtype, to measure them, rounded where the compiled program does not.

``pytest -q`` runs a slice (every feature on every backend with bf16
autocast training; eager also in float32 and with bf16 weights under
no_grad; the attention block compiled by Inductor under bf16 autocast,
training, with all_casts), ``TORCHCAST_TESTS=slow`` the attention block's
other features in that configuration; ``TORCHCAST_TRANSPARENCY=full`` runs
the whole matrix for both models (.ci/run's transparency stage).
"""
import functools
import itertools
import json
import os
import subprocess
import sys

import pytest

from transparency_run import BACKENDS, DTYPES, FEATURES, MODES

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "transparency_run.py")
FULL = os.environ.get("TORCHCAST_TRANSPARENCY") == "full"
TRACKED = [f for f in FEATURES if f != "plain"]


SLICE = {("eager", "autocast", "train"), ("eager", "float32", "train"),
         ("eager", "bf16", "no_grad"), ("aot_eager", "autocast", "train"),
         ("inductor", "autocast", "train")}


# The attention block's configuration that inductor's fused casts changed,
# and the one of its cells in ``pytest -q``'s slice.
FUSED_CASTS = ("inductor", "autocast", "train")
FUSED_CASTS_FAST = "all_casts"


def _configs():
    for config in itertools.product(BACKENDS, DTYPES, MODES):
        if FULL or config in SLICE:
            yield config


def _attention_cells():
    """The attention block's cells: the whole matrix under FULL, else
    FUSED_CASTS under every feature, all_casts in the fast slice and the
    others slow."""
    for config in itertools.product(BACKENDS, DTYPES, MODES):
        for feature in TRACKED:
            if FULL:
                yield pytest.param(*config, feature)
            elif config == FUSED_CASTS:
                yield pytest.param(*config, feature, marks=() if feature == FUSED_CASTS_FAST
                                   else pytest.mark.slow)


@functools.lru_cache(maxsize=None)
def run(backend, dtype, mode, feature, model="block"):
    """One configuration in a fresh process: (its JSON line, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    name = f"{model} {backend} {dtype} {mode} {feature}"
    done = subprocess.run([sys.executable, RUNNER, backend, dtype, mode, feature, model],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}"
    for trace in ("frame #", "Exception raised from", "C++ CapturedTraceback"):
        assert trace not in done.stderr, f"{name}:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _same_run(backend, dtype, mode, feature, model):
    plain, _ = run(backend, dtype, mode, "plain", model)
    tracked, _ = run(backend, dtype, mode, feature, model)
    assert tracked["losses"] == plain["losses"]
    assert tracked["weights"] == plain["weights"]
    # The tracker adds no graph and no graph break to a compiled model.
    assert (tracked["graphs"], tracked["graph_breaks"]) == (plain["graphs"], plain["graph_breaks"])
    return tracked


@pytest.mark.parametrize("feature", TRACKED)
@pytest.mark.parametrize("backend,dtype,mode", list(_configs()))
def test_a_tracked_run_is_the_plain_run(backend, dtype, mode, feature):
    tracked = _same_run(backend, dtype, mode, feature, "block")
    if feature in ("record", "raise", "all") and backend == "eager":
        # The mask's -inf, made by log(0) each step, is seen and absorbed.
        assert tracked["origins"] == 1 and tracked["absorbed"] == 1


@pytest.mark.parametrize("backend,dtype,mode,feature", list(_attention_cells()))
def test_a_tracked_attention_block_is_the_plain_run(backend, dtype, mode, feature):
    tracked = _same_run(backend, dtype, mode, feature, "mha")
    if feature in ("all_casts", "all") and (backend, dtype, mode) == FUSED_CASTS:
        # Its casts are in the report: measured where the compiled code
        # rounds, named "fused by inductor, not measured" where it does not.
        assert tracked["measured_sites"] > 0 and tracked["fused_sites"] > 0
