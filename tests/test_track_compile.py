"""track(all_casts=True) and torch.compile: compiled code stays compiled under
track, its casts are measured (Inductor: in the graph, tracker/compiled.py;
"aot_eager": by the dispatch mode at run time) against the numpy reference,
results are bit-identical to the untracked compiled run, and nothing done
inside a track changes how code compiles after it."""
import os
import warnings

import pytest
import torch

import torchcast
from track_ref import assert_stats_match, stats_of_cast

_FILE = os.path.abspath(__file__)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.head(self.proj(x.float()))  # line of the bfloat16 -> float32 cast
        # h too: the cast's input as the compiled graph computed it, for the reference
        return h, h.half()  # line of the float32 -> float16 cast


def _line(text):
    with open(_FILE) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


class _Graphs:
    """A torch.compile backend that counts the graphs Dynamo hands it, then
    compiles them with ``backend``."""

    def __init__(self, backend):
        self.backend, self.graphs = backend, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.backend)(gm, example_inputs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 16, generator=g) * 1e5).to(torch.bfloat16)  # 21 of 256 overflow float16
    return x


def _net():
    torch.manual_seed(0)
    return _Net()


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_model_stays_compiled_and_its_casts_are_measured(backend):
    model, x = _net(), _inputs()
    with torch.no_grad():
        expected = torch.compile(_net(), backend=backend)(x)  # the untracked compiled run
    torch._dynamo.reset()
    counter = _Graphs(backend)
    compiled = torch.compile(model, backend=counter)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither torchcast nor torch warns here
        # (but a build without the extension says once that it sees one thread)
        warnings.filterwarnings("ignore", "torchcast was installed without", RuntimeWarning)
        with torch.no_grad(), torchcast.track(all_casts=True, policy="record") as report:
            y = compiled(x)
    assert counter.graphs == 1
    assert torch.equal(y[0], expected[0])
    assert torch.equal(y[1].view(torch.int16), expected[1].view(torch.int16))

    h, half = y
    by_pair = {(r.src_dtype, r.dtype): r for r in report.records}
    assert set(by_pair) == {(torch.bfloat16, torch.float32), (torch.float32, torch.float16)}
    for (src, dst), (a, b) in {(torch.bfloat16, torch.float32): (x, x.float()),
                               (torch.float32, torch.float16): (h, half)}.items():
        r = by_pair[(src, dst)]
        assert (r.origin, r.calls, r.file) == ("cast", 1, _FILE)
        assert "_orig_mod" not in (r.module or "")
        assert r.module == "_Net"  # the compiled module itself, as eager tracking names it
        ref = stats_of_cast(a, b)
        if src == torch.bfloat16:  # widening: exact, counted (track measures no error sums)
            assert (r.stats.numel, r.stats.inexact, r.stats.nan) == (ref["numel"], 0, 0)
        else:
            assert_stats_match(r.stats, ref, (backend, src, dst))
    assert by_pair[(torch.float32, torch.float16)].stats.overflow > 0
    if backend == "inductor":  # the graph knows each cast's line
        assert by_pair[(torch.bfloat16, torch.float32)].line == _line("line of the bfloat16")
        assert by_pair[(torch.float32, torch.float16)].line == _line("line of the float32 ->")


def test_inductor_backward_and_submodule_casts():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.compile(_Net(), backend="inductor")

        def forward(self, x):
            return self.block(x)

    torch.manual_seed(0)
    model = Outer()
    x = _inputs().requires_grad_()
    with torchcast.track(all_casts=True, policy="record") as report:
        h, y = model(x)
        (h.sum() + y.float().sum()).backward()  # line of backward
    records = report.records
    assert all("_orig_mod" not in (r.module or "") for r in records)
    forward = {(r.src_dtype, r.dtype): r for r in records if r.origin == "cast" and r.module}
    assert {r.module for r in forward.values()} == {"block"}
    backward = [r for r in records if r.origin == "backward" and r.module == "block"]
    # the gradients of x.float() and .half(), cast back by the compiled backward graph
    assert {(r.src_dtype, r.dtype) for r in backward} == {(torch.float32, torch.bfloat16),
                                                         (torch.float16, torch.float32)}
    assert all(r.line == _line("line of backward") for r in backward)


def test_function_first_called_inside_track_is_compiled_after_it():
    def f(x):
        return (x.float() * 2).half()

    counter = _Graphs("aot_eager")
    compiled = torch.compile(f, backend=counter)
    x = _inputs()
    with torchcast.track(all_casts=True, policy="record") as report:
        inside = compiled(x)
    assert counter.graphs == 1
    assert {(r.src_dtype, r.dtype) for r in report.records} == {
        (torch.bfloat16, torch.float32), (torch.float32, torch.float16)}
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    after = compiled(x)
    assert torch.equal(after.view(torch.int16), inside.view(torch.int16))
    assert counter.graphs == 1  # the graph compiled inside the track runs after it
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    plain = torch.compile(lambda x: x.double() + 1, backend=counter)
    plain(x)
    assert counter.graphs == 2  # and new code compiles as usual


def test_instrumented_graph_outside_track_records_nothing():
    compiled = torch.compile(_net(), backend="inductor")
    x = _inputs()
    with torch.no_grad():
        with torchcast.track(all_casts=True, policy="record"):
            inside = compiled(x)
        with torchcast.track() as report:  # no all_casts: compiled casts are not its business
            outside = compiled(x)
    assert len(report) == 0
    assert torch.equal(inside[1].view(torch.int16), outside[1].view(torch.int16))


def test_inductor_config_restored_and_warning_for_graphs_compiled_before():
    from torch._inductor import config
    before = config.post_grad_custom_post_pass
    compiled = torch.compile(_net(), backend="inductor")
    x = _inputs()
    with torch.no_grad():
        compiled(x)  # compiled outside any track
        with pytest.warns(RuntimeWarning, match="torch.compiler.reset"):
            with torchcast.track(all_casts=True, policy="record") as report:
                assert config.post_grad_custom_post_pass is not before
                compiled(x)
    assert config.post_grad_custom_post_pass is before
    assert not [r for r in report.records if r.module]  # the documented limit


def test_policy_raise_in_a_compiled_graph():
    compiled = torch.compile(_net(), backend="inductor")
    with torch.no_grad(), torchcast.track(all_casts=True, policy="raise"):
        with pytest.raises(torchcast.PrecisionLossError, match="overflow"):
            compiled(_inputs())


def test_the_warning_of_graphs_compiled_before_points_at_the_track(tmp_path):
    compiled = torch.compile(lambda t: t * 2, backend="inductor")
    compiled(torch.ones(3))  # compiled outside any track
    with pytest.warns(RuntimeWarning, match="compiled 1 frame") as caught:
        with torchcast.track(all_casts=True):
            pass  # the track warned
    (warning,) = caught
    assert (warning.filename, warning.lineno) == (_FILE, _line("pass  # the track warned") - 1)
