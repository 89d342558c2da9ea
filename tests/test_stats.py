"""The table of statistics (CastStats' fields in stats.py) against the C++
StatIndex, which lays out every stats tensor the kernels write."""
import dataclasses
import os
import re

import pytest
import torch

import torchcast
from torchcast import _ops
from torchcast.stats import (COUNT_FIELDS, LOSS_COUNTS, MAX_FIELDS, STAT_FIELDS, SUM_FIELDS,
                             CastStats, PendingStats, dtype_from_name)
from torchcast.tracker.origin import NonFiniteOrigin
from torchcast.violations import STRICT, Violations

from track_ref import assert_stats_match, stats_of_cast

# The source tree the tests came with (absent where they run against an installed wheel).
HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "csrc", "numerics.h")


def stat_index_of_header(path):
    """StatIndex's names in order, parsed from the TORCHCAST_STATS list of
    numerics.h, whose entries X(kMaxAbsErr, "max_abs_err") make both the enum
    and the names _C.stat_fields reports; each enumerator must spell its
    name."""
    with open(path) as f:
        text = f.read()
    assert re.search(r"enum StatIndex\b[^{]*\{\s*TORCHCAST_STATS\(\w+\)\s*kNumStats\s*\}", text)
    body = re.search(r"#define TORCHCAST_STATS\(X\)(.*?)\n\n", text, re.S).group(1)
    entries = re.findall(r'X\(k([A-Za-z]+),\s*"([a-z_]+)"\)', body)
    assert entries, body
    for enumerator, name in entries:
        assert re.sub(r"(?<!^)(?=[A-Z])", "_", enumerator).lower() == name, (enumerator, name)
    return tuple(name for _, name in entries)


def test_stat_fields_follow_the_cpp_stat_index():
    """Every compiled build reports its StatIndex (torchcast._C.stat_fields);
    a source tree is also read directly."""
    orders = {}
    if _ops.WITH_EXTENSION:
        orders["torchcast._C.stat_fields"] = tuple(_ops._C.stat_fields)
    if os.path.exists(HEADER):
        orders[HEADER] = stat_index_of_header(HEADER)
    if not orders:
        pytest.skip(f"a build without the extension and no source tree ({HEADER}): "
                    "no C++ StatIndex to compare with")
    for source, order in orders.items():
        assert order == STAT_FIELDS, (source, order, STAT_FIELDS)


def test_table_groups_and_merge_rules():
    assert STAT_FIELDS == ("numel", "nan", "inf", "inexact", "overflow", "saturated", "underflow",
                           "subnormal", "max_abs_err", "max_rel_err", "amax", "sum_abs_err",
                           "sum_sq_err", "sum_sq")
    assert MAX_FIELDS == ("max_abs_err", "max_rel_err", "amax")
    assert sorted(COUNT_FIELDS + MAX_FIELDS + SUM_FIELDS) == sorted(STAT_FIELDS)
    n = len(STAT_FIELDS)
    a = CastStats(torch.float64, torch.float16, *range(1, n + 1))
    b = CastStats(torch.float64, torch.float16, *range(n, 0, -1))
    merged = a + b
    for name in STAT_FIELDS:
        pick = max if name in MAX_FIELDS else (lambda u, v: u + v)
        assert getattr(merged, name) == pick(getattr(a, name), getattr(b, name)), name


def test_from_values_is_the_constructor():
    """from_values sets the fields without the dataclass __init__ (for
    speed): it must give the object the constructor gives, ints for counts."""
    n = len(STAT_FIELDS)
    values = [float(i) for i in range(3, n + 3)]
    made = CastStats.from_values(values, torch.float32, torch.bfloat16)
    built = CastStats(torch.float32, torch.bfloat16,
                      *[int(v) if name in COUNT_FIELDS else v
                        for v, name in zip(values, STAT_FIELDS)])
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert all(type(getattr(made, name)) is int for name in COUNT_FIELDS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.nan = 0
    for wrong in (values[:-1], values + [0.0]):
        with pytest.raises(ValueError, match=f"expected {n} values"):
            CastStats.from_values(wrong)


@pytest.mark.parametrize("loss", [None, *LOSS_COUNTS])
def test_has_loss_is_what_the_violation_kinds_can_find(loss):
    """PendingStats.has_loss lets safe_to skip building the stats: False must
    mean that no kind finds anything, even every kind at threshold 0."""
    values = [0.0] * len(STAT_FIELDS)
    for name, v in (("numel", 100), ("inexact", 90), ("max_abs_err", 0.5), ("max_rel_err", 1e-3),
                    ("amax", 3.0), ("sum_abs_err", 4.0), ("sum_sq_err", 1.0), ("sum_sq", 9.0)):
        values[STAT_FIELDS.index(name)] = v
    if loss is not None:
        values[STAT_FIELDS.index(loss)] = 1
    every = Violations({kind: 0.0 for kind in LOSS_COUNTS})
    for dtype in (torch.float16, torch.int8):
        pending = PendingStats(torch.tensor(values, dtype=torch.float64), torch.float32, dtype)
        found = every.found(CastStats.from_values(values, torch.float32, dtype))
        assert pending.has_loss() == (loss is not None)
        assert pending.has_loss() or not found
        counted = dtype.is_floating_point or loss in ("nan", "overflow")  # integer targets' kinds
        assert (loss is not None and counted) == bool(found)
        assert pending.value == CastStats.from_values(values, torch.float32, dtype)
    assert set(Violations(STRICT).thresholds) - set(LOSS_COUNTS) == {"graph_cut", "imag_dropped"}


def test_stats_tensor_layout_is_the_table():
    """Every count differs from the others, so that stats read in another
    order than the op wrote them would not match the reference."""
    x = torch.tensor([float("nan")] + [1e6, -1e6] + [1e-10, -1e-10, 2e-10] + [1e-6] * 4
                     + [1.0, 2.0, 0.5, 0.25, 4.0], dtype=torch.float64)
    y, stats = torchcast.cast_with_stats(x, torch.float16)
    s = CastStats.from_tensor(stats, torch.float64, torch.float16)
    assert [s.numel, s.nan, s.inexact, s.overflow, s.underflow, s.subnormal] == \
        [15, 1, 9, 2, 3, 4]
    assert_stats_match(s, stats_of_cast(x, y))


def test_reports_name_dtypes_one_way():
    """Every saved report (casts, non-finite origins, module health) reads
    dtype names with dtype_from_name: both spellings, and a ValueError that
    names anything else."""
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16
    assert dtype_from_name("float8_e4m3fn") is torch.float8_e4m3fn
    for bad in ("torch.float17", "nn", "torch.Tensor"):
        with pytest.raises(ValueError, match=f"unknown dtype '{bad}'"):
            dtype_from_name(bad)
    health = torchcast.tensor_health(torch.ones(3)).to_dict()
    with pytest.raises(ValueError, match="unknown dtype 'torch.float17'"):
        torchcast.TensorHealth.from_dict({**health, "dtype": "torch.float17"})
    origin = {"op": "aten::log", "module": None, "phase": "forward", "node": None, "file": "a.py",
              "line": 1, "via": None, "dtype": "torch.float17", "nan": 1, "posinf": 0,
              "neginf": 0, "inputs": [], "note": "", "count": 1}
    with pytest.raises(ValueError, match="unknown dtype 'torch.float17'"):
        NonFiniteOrigin.from_dict(origin)
    assert NonFiniteOrigin.from_dict({**origin, "dtype": "torch.float16"}).dtype is torch.float16
