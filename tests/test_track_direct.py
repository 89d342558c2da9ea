"""The direct route of track(all_casts=True) (tracker/mode.py): with the
compiled extension the tracking thread enters no dispatch mode; its casts
reach the track through csrc/thread_casts.cpp's kernels and the rest
through csrc/dtype_watch.cpp. Each check compares with what the same
program does without any track, and with the dispatch-mode route, which
a Python non-finite watch ("raise_at_op") still takes."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchcast
from torchcast import _ops

pytestmark = pytest.mark.skipif(not _ops.WITH_EXTENSION,
                                reason="the direct route needs the compiled extension")

WIDE = torch.tensor([1 / 3, 1e5, -7e4, 2.0 ** -30, 0.0])  # overflows float16
FINITE = torch.tensor([1 / 3, 1e4, -7e3, 2.0 ** -30, 0.0])


def sites(report):
    return sorted((r.origin, str(r.src_dtype), str(r.dtype), r.calls) for r in report.records)


def program():
    """Casts of every kind the mode recorded: _to_copy, copy_, a promotion."""
    y = FINITE.half()
    z = torch.zeros(5, dtype=torch.bfloat16)
    z.copy_(FINITE)
    w = FINITE * torch.ones(5, dtype=torch.float64)
    return y, z, w


def test_no_dispatch_mode_and_the_same_sites_as_the_mode_route():
    with torchcast.track(all_casts=True, policy="record") as direct:
        assert torch._C._len_torch_dispatch_stack() == 0
        got = program()
    # nonfinite="raise_at_op" needs the dispatch mode: the same casts through it
    with torchcast.track(all_casts=True, policy="record", nonfinite="raise_at_op") as moded:
        assert torch._C._len_torch_dispatch_stack() == 1
        program()
    assert sites(direct) == sites(moded) == [
        ("cast", "torch.float32", "torch.float16", 1),
        ("copy_", "torch.float32", "torch.bfloat16", 1),
        ("promotion (mul)", "torch.float32", "torch.float64", 1)]
    for a, b in zip(got, program()):
        assert torch.equal(a, b) and a.dtype == b.dtype


def test_copy_into_another_dtype_bumps_the_version_and_keeps_autograd():
    src = WIDE.clone().requires_grad_()
    plain = torch.zeros(5, dtype=torch.float16)
    tracked = torch.zeros(5, dtype=torch.float16)
    plain.copy_(src)
    with torchcast.track(all_casts=True, policy="record") as report:
        before = tracked._version
        tracked.copy_(src)
        assert tracked._version == before + 1
    assert torch.equal(tracked, plain) and tracked.grad_fn is not None
    tracked.float().sum().backward()
    assert torch.equal(src.grad, torch.ones(5))
    assert sites(report) == [("copy_", "torch.float32", "torch.float16", 1)]


def test_raise_on_copy_leaves_the_destination_unwritten():
    dst = torch.zeros(5, dtype=torch.float16)
    with pytest.raises(torchcast.PrecisionLossError, match="copy_"):
        with torchcast.track(all_casts=True, policy="raise"):
            dst.copy_(WIDE)
    assert torch.equal(dst, torch.zeros(5, dtype=torch.float16)) and dst._version == 0


def test_casts_under_a_programs_own_dispatch_mode_are_recorded():
    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    with torchcast.track(all_casts=True, policy="record") as report:
        with Counting() as counting:
            y = WIDE.half()
    # the program's mode sees the program's op, not the tracker's measuring
    assert counting.ops == 1 and torch.equal(y, WIDE.half())
    assert sites(report) == [("cast", "torch.float32", "torch.float16", 1)]


def test_casts_under_inference_mode_are_recorded_once():
    with torchcast.track(all_casts=True, policy="record") as report:
        with torch.inference_mode():
            inference = WIDE.clone()  # an inference tensor: no ADInplaceOrView key
            a = WIDE.half()          # a normal tensor cast in inference mode
            b = inference.bfloat16()
            c = torch.empty(5, dtype=torch.float16)
            c.copy_(inference)
    assert torch.equal(a, WIDE.half()) and torch.equal(b, WIDE.bfloat16())
    assert torch.equal(c, WIDE.half())
    assert sites(report) == [("cast", "torch.float32", "torch.bfloat16", 1),
                             ("cast", "torch.float32", "torch.float16", 1),
                             ("copy_", "torch.float32", "torch.float16", 1)]


def test_raise_on_an_inference_mode_cast_raises_as_the_track_exits():
    inference = None
    with pytest.raises(torchcast.PrecisionLossError):
        with torchcast.track(all_casts=True, policy="raise"):
            with torch.inference_mode():
                inference = WIDE.clone()
                y = inference.half()  # seen after the cast: it cannot raise here
            reached = True
    assert reached and y.dtype == torch.float16


def test_the_dtype_watch_works_beside_the_profiler():
    with torchcast.track(all_casts=True, policy="record") as report:
        with torch.profiler.profile() as prof:
            program()
    assert sites(report)[-1][0] == "promotion (mul)"
    assert any(e.name == "aten::_to_copy" for e in prof.events())


def test_tracks_in_two_threads_record_their_own_casts():
    import threading
    reports = {}

    def run(name, dtype):
        with torchcast.track(all_casts=True, policy="record") as report:
            WIDE.to(dtype)
        reports[name] = report

    threads = [threading.Thread(target=run, args=(n, d))
               for n, d in (("half", torch.float16), ("bf16", torch.bfloat16))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r[2] for r in sites(reports["half"])] == ["torch.float16"]
    assert [r[2] for r in sites(reports["bf16"])] == ["torch.bfloat16"]
