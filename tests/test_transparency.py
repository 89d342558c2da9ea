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

``pytest -q`` runs a slice (SLICE: every feature under inductor with bf16
autocast training, everything on at once in the other backends and dtypes;
the attention block in that configuration with all_casts); the rest of both
matrices (the attention block's under Inductor alone) is marked slow (``TORCHCAST_TESTS=slow``, .ci/run's slow stage).
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
TRACKED = [f for f in FEATURES if f != "plain"]


# pytest -q's slice: every feature where a tracker is likeliest to change a
# run (inductor, bf16 autocast, training), and everything on at once in the
# other backends and dtypes of the old slice.
SLICE = {("inductor", "autocast", "train"): TRACKED,
         ("aot_eager", "autocast", "train"): ["all"],
         ("eager", "autocast", "train"): ["all"],
         ("eager", "float32", "train"): ["all"],
         ("eager", "bf16", "no_grad"): ["all"]}


# The attention block's configuration that inductor's fused casts changed,
# and its one cell in the slice.
ATTENTION_SLICE = {("inductor", "autocast", "train"): ["all_casts"]}


def _cases(model, fast, backends=BACKENDS):
    for config in itertools.product(backends, DTYPES, MODES):
        for feature in TRACKED:
            # One xdist worker runs a configuration's features: they share its plain run.
            marks = [pytest.mark.xdist_group("-".join(("transparency", model) + config))]
            if feature not in fast.get(config, ()):
                marks.append(pytest.mark.slow)
            yield pytest.param(*config, feature, marks=marks)


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


@pytest.mark.parametrize("backend,dtype,mode,feature", list(_cases("block", SLICE)))
def test_a_tracked_run_is_the_plain_run(backend, dtype, mode, feature):
    tracked = _same_run(backend, dtype, mode, feature, "block")
    if feature in ("record", "raise", "all") and backend == "eager":
        # The mask's -inf, made by log(0) each step, is seen and absorbed.
        assert tracked["origins"] == 1 and tracked["absorbed"] == 1


# Inductor alone: the attention block is here for the casts it fuses (the
# other backends run each op as its own kernel, as the block shows).
@pytest.mark.parametrize("backend,dtype,mode,feature",
                         list(_cases("mha", ATTENTION_SLICE, backends=("inductor",))))
def test_a_tracked_attention_block_is_the_plain_run(backend, dtype, mode, feature):
    tracked = _same_run(backend, dtype, mode, feature, "mha")
    if feature in ("all_casts", "all") and (backend, dtype, mode) == ("inductor", "autocast",
                                                                      "train"):
        # Its casts are in the report: measured where the compiled code
        # rounds, named "fused by inductor, not measured" where it does not.
        assert tracked["measured_sites"] > 0 and tracked["fused_sites"] > 0
