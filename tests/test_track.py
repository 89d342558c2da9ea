"""torchcast.track: every cast PyTorch performs in a block, measured against
an independent numpy reference of what PyTorch actually produced, attributed
to module and line, merged by site, reported; nothing intercepted outside."""
import datetime
import inspect
import json
import math
import os
import socket
import sys
import tempfile
import warnings

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcast
from torchcast import _ops
from torchcast import Record, Report
from torchcast.stats import STAT_FIELDS, SUM_FIELDS, CastStats, merge_stats_tensors
from torchcast.tracker.sites import user_site

from track_ref import assert_stats_match, double_rounding_values, merge_refs, stats_of_cast
from values import every_value

HERE = os.path.abspath(__file__)


def here():
    """The line of the caller (the test), for attribution checks."""
    return inspect.currentframe().f_back.f_lineno


def only(report, **match):
    records = [r for r in report.records
               if all(getattr(r, k) == v for k, v in match.items())]
    assert len(records) == 1, (match, [r.key for r in report.records])
    return records[0]


def bits(t):
    """Bit patterns, so that equality also covers -0.0 and NaN positions."""
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
    return t.contiguous().view(view)


def wide(n, dtype=torch.float64, seed=0, lo=-40, hi=40):
    g = np.random.default_rng(seed)
    x = np.exp(g.uniform(lo, hi, n)) * g.choice([-1.0, 1.0], n)
    return torch.from_numpy(x).to(dtype)


def with_edges(x):
    edges = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-320, 65519.99999999999,
                          70000.0, 3e38, 4e38, 1e-8, 2.0 ** -25], dtype=torch.float64)
    return torch.cat([x, edges.to(x.dtype)])


# --- the interception paths, each returning exactly torch's result ------------------

SRC = torch.float64

PATHS = {
    "to": lambda x: x.to(torch.float32),
    "to_kw": lambda x: x.to(dtype=torch.float16),
    "float": lambda x: x.float(),
    "half": lambda x: x.half(),
    "bfloat16": lambda x: x.bfloat16(),
    "type_dtype": lambda x: x.type(torch.float32),
    "type_str": lambda x: x.type("torch.HalfTensor"),
    "copy_": lambda x: torch.empty(x.shape, dtype=torch.bfloat16).copy_(x),
    "setitem": lambda x: _setitem(x),
    "as_tensor_numpy": lambda x: torch.as_tensor(x.numpy(), dtype=torch.float32),
    "tensor_numpy": lambda x: torch.tensor(x.numpy(), dtype=torch.float16),
}


def _setitem(x):
    out = torch.zeros(x.shape, dtype=torch.float32)
    out[:] = x  # SETITEM_LINE
    return out


def marked_line(marker):
    return next(i + 1 for i, line in enumerate(open(HERE)) if line.rstrip().endswith(marker))


def cast_line(path):
    """The line that performs the cast: the lambda's, or _setitem's."""
    if path == "setitem":
        return marked_line("# SETITEM_LINE")
    return PATHS[path].__code__.co_firstlineno


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_path_is_recorded_and_returns_torchs_result(path):
    x = with_edges(wide(4099, SRC, seed=len(path)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = PATHS[path](x)
        with torchcast.track(all_casts=True, policy="record") as report:
            got = PATHS[path](x)
    assert got.dtype == expected.dtype
    assert torch.equal(bits(got), bits(expected))  # behaviour unchanged, bit for bit
    rec = only(report)
    assert (rec.file, rec.src_dtype, rec.dtype, rec.calls) == (HERE, SRC, expected.dtype, 1)
    assert rec.line == cast_line(path)
    assert rec.origin == ("copy_" if path in ("copy_", "setitem") else "cast")
    assert rec.module is None
    assert_stats_match(rec.stats, stats_of_cast(x, expected), path)
    assert rec.stats.overflow > 0 and rec.violations()  # the edge values overflow every target


@pytest.mark.parametrize("src,dst", [(torch.float64, torch.float32),
                                     (torch.float32, torch.float16),
                                     (torch.float32, torch.bfloat16),
                                     (torch.float16, torch.bfloat16),
                                     (torch.bfloat16, torch.float16)])
@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(0, 7), min_size=0, max_size=3), transpose=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_single_rounding_pairs_match_torch_bitwise(src, dst, shape, transpose, seed):
    """For every pair but float64 -> float16/bfloat16 the op's correctly
    rounded y is torch's y, so its stats are the stats of what torch did."""
    n = math.prod(shape)
    x = wide(max(1, n), torch.float64, seed, -30, 30)[:n].to(src).reshape(shape)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, 1)  # non-contiguous
    expected = x.to(dst)
    with torchcast.track(all_casts=True, policy="record") as report:
        got = x.to(dst)
    assert torch.equal(bits(got), bits(expected))
    y_op, _ = torchcast.cast_with_stats(x, dst) if src not in (torch.float16, torch.bfloat16) \
        else torchcast.cast_with_stats(x.float(), dst)
    assert torch.equal(bits(y_op), bits(expected))
    rec = only(report)
    assert rec.double_rounded == 0
    assert_stats_match(rec.stats, stats_of_cast(x, expected))


def _to_copy_calls(fn):
    """fn()'s result and how many aten::_to_copy calls the dispatcher ran
    (the program's own, and the tracker's where it casts again)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(1 for e in prof.events() if e.name == "aten::_to_copy")


def _every_value(dtype):
    if dtype in (torch.float16, torch.bfloat16):
        return every_value(dtype)
    return with_edges(wide(20000, torch.float64, seed=5, lo=-110, hi=100)).to(dtype)


@pytest.mark.parametrize("src,dst", [
    (s, d) for s in (torch.float32, torch.float16, torch.bfloat16)
    for d in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2) if s != d])
def test_tracked_cast_returns_the_measured_result_where_it_has_torchs_bits(src, dst):
    """For a contiguous x without NaN the tracker returns the fused op's y
    instead of casting again (with the compiled kernels, one aten::_to_copy:
    the program's), and y has
    torch's bits: every 16-bit value (or wide float32 values with zeros,
    infinities, overflow and subnormals), in grad mode and under autocast.
    With NaN in x (whose bits torch may spell otherwise) torch casts: two
    aten::_to_copy calls, torch's bits."""
    values = _every_value(src)
    nan = values.isnan()
    for x, reused in ((values[~nan], True), (values, False)):
        expected = x.to(dst)
        with torchcast.track(all_casts=True, policy="record") as report:
            got, calls = _to_copy_calls(lambda: x.to(dst))
        assert torch.equal(bits(got), bits(expected)) and got.stride() == expected.stride()
        if _ops.WITH_EXTENSION:  # the pure-PyTorch measuring op casts inside
            assert calls == (1 if reused else 2)
        assert_stats_match(only(report).stats, stats_of_cast(x, expected))
    x = values[~nan][:4096].reshape(64, 64).clone().requires_grad_()
    with torchcast.track(all_casts=True, policy="record") as report:
        got = x.to(dst)
        got.float().sum().backward()
    assert got.requires_grad and torch.equal(bits(got), bits(x.detach().to(dst)))
    assert torch.equal(x.grad, torch.ones_like(x))
    if dst in (torch.float16, torch.bfloat16) and src == torch.float32:
        w = torch.randn(64, 64)
        with torch.autocast("cpu", dtype=dst):
            expected = x.detach() @ w
            with torchcast.track(all_casts=True, policy="record") as report:
                got, calls = _to_copy_calls(lambda: x.detach() @ w)
        assert torch.equal(bits(got), bits(expected))
        assert calls == 2 or not _ops.WITH_EXTENSION  # x's and w's casts
        assert sum(r.calls for r in report.records if r.origin == "autocast") == 2


@pytest.mark.parametrize("src", [torch.float64, torch.float32])
def test_tracked_cast_to_complex_returns_torchs_complex_result(src):
    """A real x cast to a complex dtype: measured on its real part, and the
    result is torch's complex tensor, not the measured real part."""
    x = wide(1000, src, seed=2, lo=-30, hi=30)
    for dtype in (torch.complex64, torch.complex128):
        expected = x.to(dtype)
        with torchcast.track(all_casts=True, policy="record") as report:
            got = x.to(dtype)
        assert got.dtype == dtype and torch.equal(got, expected)
        assert torch.equal(bits(torch.view_as_real(got)), bits(torch.view_as_real(expected)))
        assert only(report).dtype == dtype


@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16])
def test_double_rounding_returns_torchs_value_and_measures_it(dst):
    """torch casts float64 -> float16/bfloat16 through float32 (two
    roundings). The tracked cast returns torch's value, and its stats are
    those of torch's value, not of the correctly rounded one."""
    x = torch.cat([double_rounding_values(dst, 4000), wide(4000, seed=3),
                   with_edges(torch.empty(0, dtype=torch.float64))])
    expected = x.to(dst)
    correct, _ = torchcast.cast_with_stats(x, dst)
    differ = int(((expected != correct) & ~expected.isnan()).sum())
    assert differ > 1000  # the construction makes about half of them differ
    with torchcast.track(all_casts=True, policy="record") as report:
        got = x.to(dst)
    assert torch.equal(bits(got), bits(expected))
    rec = only(report)
    assert rec.double_rounded == differ
    assert_stats_match(rec.stats, stats_of_cast(x, expected))
    # One element: 1 + half an ulp + 2^-40 rounds up once, but float32 drops
    # the 2^-40 and the tie goes to 1.0: the error is half an ulp + 2^-40,
    # not half an ulp - 2^-40.
    half_ulp = torch.finfo(dst).eps / 2
    one = torch.tensor([1 + half_ulp + 2.0 ** -40], dtype=torch.float64)
    with torchcast.track(all_casts=True, policy="record") as report:
        assert one.to(dst).item() == 1.0
    assert only(report).stats.max_abs_err == half_ulp + 2.0 ** -40
    assert torchcast.safe_to(one, dst, policy="ignore").item() == 1 + 2 * half_ulp


def test_double_rounding_can_overflow_and_underflow_where_one_rounding_does_not():
    # 65519.99999999999 rounds to 65520.0 in float32, the float16 tie between
    # 65504 and 65536 (inf), which goes to the even one: inf. Likewise just
    # above 2^-25 float32 gives exactly 2^-25, the tie between 0 and 2^-24.
    x = torch.tensor([65519.99999999999, 2.0 ** -25 * (1 + 2.0 ** -40)], dtype=torch.float64)
    assert torch.isinf(x.half()[0]) and x.half()[1] == 0
    correct = torchcast.safe_to(x, torch.float16, policy="ignore")
    assert correct[0] == 65504 and correct[1] == 2.0 ** -24
    with torchcast.track(all_casts=True, policy="record") as report:
        x.half()
    s = only(report).stats
    assert (s.overflow, s.underflow, s.inexact) == (1, 1, 2)
    assert only(report).double_rounded == 2


def test_graph_of_tracked_casts_is_unchanged():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with torchcast.track(all_casts=True, policy="record"):
        y = x.float() * 3
        y.sum().backward()
    assert x.grad.dtype == torch.float64
    assert torch.equal(x.grad, torch.full((5,), 3.0, dtype=torch.float64))


def test_widening_and_same_dtype():
    x = torch.randn(7, dtype=torch.float16)
    with torchcast.track(all_casts=True, policy="record") as report:
        x.float()
        x.to(torch.float16)   # no-op: not a cast
        x.to("cpu")           # device only: not a cast
        x.clone()
    rec = only(report)
    assert (rec.src_dtype, rec.dtype, rec.stats.numel, rec.stats.inexact) == \
        (torch.float16, torch.float32, 7, 0)


def test_empty_zero_dim_and_float8():
    with torchcast.track(all_casts=True, policy="record") as report:
        torch.empty(0, dtype=torch.float64).half()
        torch.tensor(1 / 3, dtype=torch.float64).float()
        torch.tensor([1 / 3, 1e6]).to(torch.float8_e4m3fn)
    assert only(report, dtype=torch.float16).stats.numel == 0
    assert_stats_match(only(report, dtype=torch.float32).stats,
                       stats_of_cast(torch.tensor(1 / 3, dtype=torch.float64),
                                     torch.tensor(1 / 3, dtype=torch.float64).float()))
    f8 = only(report, dtype=torch.float8_e4m3fn)
    assert f8.measured and (f8.stats.numel, f8.stats.saturated, f8.stats.inexact) == (2, 1, 2)
    assert "saturated" in [line for line in str(report).splitlines() if "float8" in line][0]


# --- autocast --------------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x))  # BLOCK_LINE


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.skipif(not torchcast._ops.WITH_EXTENSION,
                    reason="the program's casts under autocast are marked by the compiled "
                           "extension's kernel; a build without it labels them autocast's")
def test_autocast_casts_are_recorded_as_autocasts():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    with torchcast.track(all_casts=True, policy="record") as report:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            line = here() + 1
            out = net(x)
            mine = x.to(torch.bfloat16)     # the program's own cast, inside autocast
        out.float().sum().backward()        # the program's cast, outside autocast
    fc = only(report, module="blocks.0.fc", origin="autocast")
    # the innermost frame outside torch is Block.forward's
    assert (fc.line, fc.src_dtype, fc.dtype, fc.calls) == \
        (marked_line("# BLOCK_LINE"), torch.float32, torch.bfloat16, 3)
    # input, weight and bias, each measured
    w = net.blocks[0].fc
    ref = merge_refs([stats_of_cast(t, t.bfloat16()) for t in (x, w.weight, w.bias)])
    assert_stats_match(fc.stats, ref)
    # blocks.1.fc gets blocks.0.norm's bfloat16 output: only its weight and bias
    assert only(report, module="blocks.1.fc", origin="autocast").calls == 2
    assert only(report, line=line + 1).origin == "cast"
    assert not [r for r in report.records if r.line == line]  # all casts are inside Block
    assert mine.dtype == torch.bfloat16
    assert only(report, line=line + 2, origin="cast").src_dtype == torch.bfloat16
    # the gradient is cast back by autograd: attributed to the module whose
    # forward made the node
    back = [r for r in report.records if r.origin == "backward"]
    assert back and {r.module for r in back} >= {"blocks.0.fc", "blocks.1.fc"}
    # the watch on torch.set_autocast_enabled stays, installed once however
    # many tracks came and went
    assert not hasattr(torch.set_autocast_enabled.__wrapped__, "__wrapped__")


def test_autocast_entered_before_track_and_disabled_inside():
    net, x = Net(), torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torchcast.track(all_casts=True, policy="record") as report:
            net(x)
            with torch.autocast("cpu", enabled=False):
                line = here() + 1
                x.half()
    assert only(report, module="blocks.0.fc").origin == "autocast"
    assert only(report, line=line).origin == "cast"


# --- attribution and merging --------------------------------------------------------------

class Rounder(torch.nn.Module):
    def forward(self, x):
        return x.float()  # ROUNDER_LINE


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Identity(), Rounder())
                                           for _ in range(4)])

    def forward(self, x):
        return [layer(x) for layer in self.layers]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()

    def forward(self, x):
        return self.encoder(x)


ROUNDER_LINE = marked_line("# ROUNDER_LINE")


def test_module_path_and_line_and_merging_by_site():
    model = Model()
    xs = [wide(33, seed=s) for s in range(3)]
    with torchcast.track(all_casts=True, policy="record") as report:
        for x in xs:
            model(x)
    assert len(report.records) == 4
    for i in range(4):
        rec = only(report, module=f"encoder.layers.{i}.1")
        assert (rec.file, rec.line, rec.calls) == (HERE, ROUNDER_LINE, 3)
        assert_stats_match(rec.stats, merge_refs([stats_of_cast(x, x.float()) for x in xs]))
    assert only(report, module="encoder.layers.2.1").site.startswith(
        f"encoder.layers.2.1 {os.path.relpath(HERE)}:{ROUNDER_LINE}")


def test_transformer_encoder_paths():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 3, 16)
    with torchcast.track(all_casts=True, policy="record") as report:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            line = here() + 1
            out = enc(x)
        out.float().sum().backward()
    modules = {r.module for r in report.records if r.origin == "autocast"}
    assert {"layers.0.self_attn", "layers.0.linear1", "layers.1.linear2"} <= modules
    assert {r.line for r in report.records if r.origin == "autocast"} == {line}
    assert all(r.file == HERE for r in report.records)


def test_collapse_merges_many_calls_exactly():
    xs = [wide(17, seed=s) for s in range(150)]  # more than the collapse threshold
    with torchcast.track(all_casts=True, policy="record") as report:
        for x in xs:
            x.half()
    rec = only(report)
    assert rec.calls == 150
    assert_stats_match(rec.stats, merge_refs([stats_of_cast(x, x.half()) for x in xs]))


def test_merge_stats_tensors_matches_caststats_add():
    xs = [wide(50, seed=s) for s in range(5)]
    tensors = [torchcast.cast_with_stats(x, torch.float16)[1] for x in xs]
    merged = CastStats.from_tensor(merge_stats_tensors(torch.stack(tensors)),
                                   torch.float64, torch.float16)
    added = CastStats.from_tensor(tensors[0], torch.float64, torch.float16)
    for t in tensors[1:]:
        added = added + CastStats.from_tensor(t, torch.float64, torch.float16)
    # float64 sources' sums are float64: torch.sum may add them in another
    # order than + does, within a rounding of the last bit.
    for name in STAT_FIELDS:
        expected = getattr(added, name)
        assert getattr(merged, name) == (pytest.approx(expected, rel=1e-15)
                                         if name in SUM_FIELDS else expected), name


def test_dtype_pairs_at_one_site_stay_apart():
    x = wide(9)
    with torchcast.track(all_casts=True, policy="record") as report:
        for dtype in (torch.float32, torch.float16, torch.float32):
            x.to(dtype)
    assert only(report, dtype=torch.float32).calls == 2
    assert only(report, dtype=torch.float16).calls == 1


# --- safe_to, nesting, zero interception outside -----------------------------------------

def test_track_collects_safe_to_by_site_and_name():
    x = wide(20)
    with torchcast.track() as report:
        line = here() + 1
        torchcast.safe_to(x, torch.float16, policy="record", name="w")
        torchcast.safe_to(x, torch.float16, policy="ignore")  # not recorded
        x.float()                                            # not intercepted
        torchcast.nn.Cast(torch.float32, policy="record")(x)  # through nn.Cast
    rec = only(report, line=line)
    assert (rec.origin, rec.name, rec.calls) == ("safe_to", "w", 1)
    assert f"safe_to(w)" in rec.site
    # safe_to rounds correctly: its stats are those of the correctly rounded y
    y = torchcast.safe_to(x, torch.float16, policy="ignore")
    assert_stats_match(rec.stats, stats_of_cast(x, y))
    assert only(report, line=line + 3).dtype == torch.float32
    assert len(report.records) == 2


def test_safe_to_under_all_casts_is_recorded_once():
    x = torch.randn(6, dtype=torch.float16, requires_grad=True)
    with torchcast.track(all_casts=True, policy="record") as report:
        torchcast.safe_to(x, torch.float32, policy="record")   # exact: the op copies
        torchcast.safe_to(x.double(), torch.float32, policy="record", rtol=1e-30)
    origins = sorted((r.origin, str(r.src_dtype), str(r.dtype)) for r in report.records)
    assert origins == [("cast", "torch.float16", "torch.float64"),
                       ("safe_to", "torch.float16", "torch.float32"),
                       ("safe_to", "torch.float64", "torch.float32")]


def test_nested_tracks_each_record_once():
    x = wide(5)
    with torchcast.track(all_casts=True, policy="record") as outer:
        x.half()
        with torchcast.track(all_casts=True, policy="record") as inner:
            x.float()
        with torchcast.track() as safe_only:
            x.bfloat16()
    assert sorted(r.calls for r in outer.records) == [1, 1, 1]
    assert [r.dtype for r in inner.records] == [torch.float32]
    assert len(safe_only) == 0


@pytest.mark.parametrize("module, own", [
    ("cast.py", True), ("_ops.py", True), ("stats.py", True), ("nn.py", True),
    (os.path.join("_reference", "cast.py"), True),
    ("demo.py", False), ("reduce.py", False), (os.path.join("optim", "adam.py"), False),
    (os.path.join("tracker", "mode.py"), False),
])
def test_casts_in_torchcast_own_modules_are_not_the_users(module, own):
    """A cast made in safe_to's or the ops' modules (the _reference package
    included) is torchcast's own; the rest of the package is walked
    past, to the user's line that called it."""
    path = os.path.join(os.path.dirname(os.path.abspath(torchcast.__file__)), module)
    code = compile("site = user_site(sys._getframe(), skip_own=False)", path, "exec")
    scope = {"user_site": user_site, "sys": sys}
    line = here() + 1
    exec(code, scope)
    assert scope["site"] == (None if own else (HERE, line, None))
    skipping = compile("site = user_site(sys._getframe(), skip_own=True)", path, "exec")
    line = here() + 1
    exec(skipping, scope)
    assert scope["site"] == (HERE, line, None)


def _interception_state():
    mod = torch.nn.modules.module
    return (torch._C._len_torch_dispatch_stack(), len(mod._global_forward_pre_hooks),
            len(mod._global_forward_hooks),
            torch._C._dispatch_has_kernel_for_dispatch_key("aten::_to_copy", "AutocastCPU"),
            torch._C._dispatch_has_kernel_for_dispatch_key("aten::_to_copy", "ADInplaceOrView"),
            torchcast.cast.recorders())


def test_nothing_is_intercepted_outside_track():
    """Outside track nothing intercepts. What stays: the kernels registered
    once at import and never removed (tearing a kernel down crashes threads
    dispatching through it), which outside a track only count or check a
    flag and redispatch, and the watch on torch.set_autocast_enabled."""
    before = _interception_state()
    assert before[0] == 0 and before[3] == before[4] == _ops.WITH_EXTENSION and before[5] == ()
    with torchcast.track(all_casts=True, policy="record") as report:
        inside = _interception_state()
        x = wide(8)
        x.half()
    # With the extension the thread's casts reach the track through the
    # kernels (the direct route, tracker/mode.py): no dispatch mode.
    assert inside[0] == (0 if _ops.WITH_EXTENSION else 1) and inside[1] == before[1] + 1
    assert _interception_state() == before
    x.float()
    torchcast.safe_to(x, torch.float16, policy="record")
    assert only(report).calls == 1  # nothing after the block
    # and when the block raises
    with pytest.raises(ZeroDivisionError):
        with torchcast.track(all_casts=True):
            1 / 0
    assert _interception_state() == before


def test_inplace_op_with_a_wider_operand_is_not_a_cast():
    """A known limit: x32.add_(y64) computes in float64 and stores float32
    inside one op; the dispatcher sees no cast, and track records none."""
    x, y = torch.zeros(3), torch.full((3,), 1 / 3, dtype=torch.float64)
    with torchcast.track(all_casts=True, policy="record") as report:
        x.add_(y)
    assert x.dtype == torch.float32 and x[0].item() != 1 / 3 and len(report) == 0


def test_compiled_function_inside_track():
    """The mode's handler is marked for Dynamo to skip instead of wrapped per
    call; a torch.compile'd function in the block still runs as in eager."""
    @torch.compile(backend="eager")
    def f(x):
        return x.half() * 2

    x = torch.tensor([1 / 3, 1e6], dtype=torch.float64)
    with torchcast.track(all_casts=True, policy="record") as report:
        got = f(x)
    assert torch.equal(bits(got), bits(x.half() * 2))
    assert only(report).stats.overflow == 1


def test_meta_tensors_pass_through():
    with torchcast.track(all_casts=True, policy="record") as report:
        y = torch.empty(3, device="meta", dtype=torch.float64).half()
    assert y.device.type == "meta" and len(report) == 0


# --- policies ---------------------------------------------------------------------------

def test_raise_stops_at_the_first_violation_with_its_site():
    x = torch.tensor([1.0, 1e6])
    with torchcast.track(all_casts=True, policy="raise") as report:
        x.bfloat16()  # in range: fine
        with pytest.raises(torchcast.PrecisionLossError) as err:
            line = here() + 1
            x.half()
    assert f"{os.path.relpath(HERE)}:{line}" in str(err.value)
    assert err.value.site.endswith(f":{line}")
    assert "1 overflowed to inf" in str(err.value) and err.value.stats.overflow == 1
    assert only(report, dtype=torch.float16).stats.overflow == 1  # recorded before raising


def test_raise_leaves_copy_destination_untouched():
    dst = torch.zeros(2, dtype=torch.float16)
    with torchcast.track(all_casts=True, policy="raise"):
        with pytest.raises(torchcast.PrecisionLossError):
            dst.copy_(torch.tensor([1.0, 1e6]))
    assert torch.equal(dst, torch.zeros(2, dtype=torch.float16))


def test_warn_once_per_site_at_the_users_line_and_global_policy():
    x = torch.tensor([1e-30])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchcast.policy("warn"), torchcast.track(all_casts=True) as report:
            for _ in range(3):
                line = here() + 1
                x.half()
    mine = [w for w in caught if issubclass(w.category, torchcast.PrecisionWarning)]
    assert len(mine) == 1
    assert (mine[0].filename, mine[0].lineno) == (HERE, line)
    assert "1 underflowed to zero" in str(mine[0].message)
    assert only(report).calls == 3


def test_rtol_makes_plain_rounding_a_violation():
    x = torch.tensor([1 / 3], dtype=torch.float64)
    with torchcast.track(all_casts=True, policy="raise", rtol=1e-9):
        with pytest.raises(torchcast.PrecisionLossError, match="broke rtol"):
            x.float()
    with torchcast.track(all_casts=True, policy="record", rtol=1e-9) as report:
        x.float()
    assert report.violations and report.violations[0].violations(1e-9) == ["max rel err > rtol=1e-09"]
    assert _cast_lines(str(report))[-1].endswith("rtol=1e-09")


def _cast_lines(text):
    """A report's text up to the list of compiled regions, which names the
    regions other tests of this process compiled (tracker/regions.py)."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if "torch.compile'd region" in line), len(lines))
    return lines[:end]


# --- graph cuts and complex ---------------------------------------------------------------

class Quantize(torch.nn.Module):
    def forward(self, x):
        idx = (x * 4).long()  # QUANTIZE_LINE
        return torch.nn.functional.embedding(idx.clamp(0, 9), torch.eye(10)).sum() + x.sum()


QUANTIZE_LINE = marked_line("# QUANTIZE_LINE")


def test_cast_to_int_inside_forward_is_a_graph_cut():
    x = torch.rand(6, requires_grad=True)
    with torchcast.track(all_casts=True, policy="record") as report:
        Quantize()(x).backward()
    rec = only(report, graph_cuts=1)
    assert (rec.module, rec.line, rec.dtype, rec.measured) == \
        ("Quantize", QUANTIZE_LINE, torch.int64, False)
    assert report.records[0] is not None and report.records[0].graph_cuts == 1  # worst first
    assert "graph cut" in str(report)
    with torchcast.track(all_casts=True, policy="raise"):
        with pytest.raises(torchcast.PrecisionLossError, match="cuts the autograd graph"):
            Quantize()(x)
    # no cut: detached, or no gradient wanted
    with torchcast.track(all_casts=True, policy="raise") as report:
        (x.detach() * 4).long()
        with torch.no_grad():
            (x * 4).long()
    assert len(report) == 0


def test_complex_to_real_drops_imaginary_parts():
    z = torch.tensor([1 + 2j, 3 + 0j, -1j], dtype=torch.complex128)
    with torchcast.track(all_casts=True, policy="record") as report:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own "discards the imaginary part"
            r = z.to(torch.float32)
        z.real.float()                      # explicit: nothing dropped
        z.to(torch.complex64)               # complex narrowing, both parts measured
    dropped = only(report, src_dtype=torch.complex128, dtype=torch.float32, calls=1,
                   imag_dropped=2)
    assert dropped.violations() == ["2 imaginary parts dropped"]
    assert_stats_match(dropped.stats, stats_of_cast(z.real, r))
    narrowed = only(report, dtype=torch.complex64)
    assert_stats_match(narrowed.stats, stats_of_cast(torch.view_as_real(z),
                                                     torch.view_as_real(z.to(torch.complex64))))
    with torchcast.track(all_casts=True, policy="raise"):
        with pytest.raises(torchcast.PrecisionLossError, match="imaginary"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                z.to(torch.float64)


# --- the report -------------------------------------------------------------------------

def _mixed_report():
    z = torch.tensor([1 + 1j])
    with torchcast.track(all_casts=True, policy="record") as report:
        torch.tensor([1.0, 1e6]).half()
        wide(10).float()
        torch.randn(3, requires_grad=True).long()
        torch.randn(4, dtype=torch.float16).float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z.real.to(torch.float16)
            z.to(torch.float32)
        torchcast.safe_to(wide(3), torch.bfloat16, policy="record", name="b")
    return report


def test_table_is_sorted_worst_first():
    report = _mixed_report()
    records = report.records
    flags = [bool(r.violations()) for r in records]
    assert flags == sorted(flags, reverse=True) and sum(flags) == 3
    calm = [r.stats.max_rel_err for r in records if not r.violations()]
    assert calm == sorted(calm, reverse=True)
    lines = _cast_lines(str(report))
    assert lines[0].startswith("torchcast.track: 7 cast sites, 7 casts, 3 with violations")
    header = lines[1].split()
    assert header[:4] == ["site", "origin", "calls", "dtypes"]
    assert header[4:11] == ["elements", "inexact", "nan", "overflow", "saturated", "underflow",
                            "subnormal"]
    assert "max rel err" in lines[1] and header[-2:] == ["violations", "notes"]
    assert len(lines) == 2 + len(records)
    assert len(_cast_lines(report.table(limit=2))) == 5


def test_json_round_trip():
    report = _mixed_report()
    text = report.to_json()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert data["records"][0]["stats"]["overflow"] == 1 or data["records"][0]["graph_cuts"]
    again = Report.from_json(text)
    assert again.to_dict() == report.to_dict()
    assert str(again) == str(report)
    assert [r.stats for r in again.records] == [r.stats for r in report.records]
    with pytest.raises(ValueError, match="not a torchcast.track report"):
        Report.from_dict({"records": []})


def test_record_and_report_reading_do_not_change_the_stats():
    x = wide(100)
    with torchcast.track(all_casts=True, policy="record") as report:
        for i in range(2):
            x.half()
            if i == 0:
                first = report.records[0].stats
    assert report.records[0].stats.numel == 2 * first.numel
    assert isinstance(report.records[0], Record)


# --- all_reduce across 2 ranks (gloo) --------------------------------------------------------

def _rank_main(rank, port, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        x = wide(64 * (rank + 1), seed=rank)
        with torchcast.track(all_casts=True, policy="record") as report:
            x.half()                                  # the same site on both ranks
            if rank == 1:
                torch.tensor([1e6]).half()            # a site only rank 1 has
        with open(os.path.join(out_dir, f"local{rank}.json"), "w") as f:
            f.write(report.to_json())
        report.all_reduce()
        with open(os.path.join(out_dir, f"merged{rank}.json"), "w") as f:
            f.write(report.to_json())
    finally:
        dist.destroy_process_group()


def test_all_reduce_across_two_gloo_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_rank_main, args=(port, out_dir), nprocs=2, join=False,
                                 start_method="spawn")
        try:
            for p in ctx.processes:
                p.join(180)
            assert all(p.exitcode == 0 for p in ctx.processes), \
                [p.exitcode for p in ctx.processes]
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        read = lambda name: Report.from_json(open(os.path.join(out_dir, name)).read())
        local = [read(f"local{r}.json") for r in range(2)]
        merged = [read(f"merged{r}.json") for r in range(2)]
    assert merged[0].to_dict() == merged[1].to_dict()
    shared = [only(r, dtype=torch.float16, src_dtype=torch.float64) for r in local]
    both = only(merged[0], dtype=torch.float16, src_dtype=torch.float64)
    assert both.calls == 2
    assert both.stats == shared[0].stats + shared[1].stats
    assert only(merged[0], src_dtype=torch.float32).stats.overflow == 1


def test_all_reduce_needs_an_initialized_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Report().all_reduce()
