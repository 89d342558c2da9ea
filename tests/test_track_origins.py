"""Who made a cast (torchcast.tracker.origins): the program, autocast, or an
op's own implementation, labelled "internal (op)" instead of the program's
line or autocast."""
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchcast
from torchcast.tracker.origins import _callee, call_name

SDPA = "internal (scaled_dot_product_attention)"


def origins(report):
    """{(origin, src, dst): calls} of a report."""
    out = {}
    for r in report.records:
        key = (r.origin, r.src_dtype, r.dtype)
        out[key] = out.get(key, 0) + r.calls
    return out


def test_the_math_attention_paths_own_casts_are_internal():
    """scaled_dot_product_attention with dropout takes the math path on the
    CPU, which upcasts bfloat16 to float32 and back inside the op."""
    x = torch.randn(2, 4, 8, 16).bfloat16()
    with torchcast.track(all_casts=True) as report:
        torch.manual_seed(0)
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)
        x.float()
    bf16, f32 = torch.bfloat16, torch.float32
    assert origins(report) == {(SDPA, bf16, f32): 3, (SDPA, f32, bf16): 2, ("cast", bf16, f32): 1}


def test_under_autocast_the_ops_upcast_of_autocasts_result_is_internal():
    x = torch.randn(2, 4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torchcast.track(all_casts=True) as report:
        F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)
    got = origins(report)
    # autocast's casts of q, k and v (and, a known limit, the op's own two
    # float32 -> bfloat16 casts of its intermediates) read as autocast's
    assert got[("autocast", torch.float32, torch.bfloat16)] == 5
    assert got[(SDPA, torch.bfloat16, torch.float32)] == 3
    assert len(got) == 2


@pytest.mark.skipif(not torchcast._ops.WITH_EXTENSION,
                    reason="the program's casts under autocast are marked by the compiled "
                           "extension's kernel; a build without it labels them autocast's")
def test_program_casts_are_the_programs():
    x = torch.randn(4, 4, dtype=torch.float64)
    model = torch.nn.Linear(4, 4)
    y = torch.empty(4, 4, dtype=torch.float16)
    with torchcast.track(all_casts=True) as report:
        x.to(torch.float32)
        x.float()
        x.type(torch.float16)
        x.half().bfloat16()
        torch.as_tensor(np.ones(3), dtype=torch.float32)
        model.half()
        y.copy_(x)
        y[:2] = x[:2]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x.float()  # a program cast inside autocast
            model.float()(x.float())  # the linear's own casts: autocast's
    kinds = {r.origin for r in report.records}
    assert kinds == {"cast", "copy_", "autocast"}, kinds
    assert sum(r.calls for r in report.records if r.origin == "autocast") == 3


@pytest.mark.parametrize("segment, name", [
    ("F.linear(x, w)", "linear"), ("x.float().half()", "half"), ("x.to(torch.float16)", "to"),
    ("torch.nn.functional.scaled_dot_product_attention(\n    q, k, v)",
     "scaled_dot_product_attention"),
    ("f(g(x))", "f"), ("fns[0](x)", None), ("(a + b)", None), ("x", None), ("lambda: 0", None),
])
def test_the_called_name_is_read_from_the_call_expression(segment, name):
    assert _callee(segment) == name


def test_without_source_the_labels_are_the_lines():
    """Code without source (exec of a string): the call cannot be read, so
    the origin falls back to the program's."""
    x = torch.randn(2, 4, 8, 16).bfloat16()
    scope = {"F": F, "x": x}
    with torchcast.track(all_casts=True) as report:
        torch.manual_seed(0)
        exec("F.scaled_dot_product_attention(x, x, x, dropout_p=0.1)", scope)
    assert {r.origin for r in report.records} == {"cast"}


def test_the_call_a_frame_executes():
    frame = sys._getframe()
    name = call_name(frame); here = name  # noqa: E702
    assert here == "call_name"


class UpcastInAutocast(torch.nn.Module):
    """x.float() @ w.float() inside autocast: the matmul is still bfloat16."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8).bfloat16())

    def forward(self, x):
        return x.float() @ self.w.float()


@pytest.mark.skipif(not torchcast._ops.WITH_EXTENSION,
                    reason="the program's casts under autocast are marked by the compiled "
                           "extension's kernel; a build without it labels them autocast's")
def test_an_upcast_autocast_undoes_is_one_finding():
    model, x = UpcastInAutocast(), torch.randn(4, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torchcast.track(all_casts=True) as report:
        out = model(x)
    assert out.dtype == torch.bfloat16
    ((up, back),) = report.undone_upcasts()
    assert (up.origin, up.src_dtype, up.dtype) == ("cast", torch.bfloat16, torch.float32)
    assert (back.origin, back.src_dtype, back.dtype) == ("autocast", torch.float32,
                                                         torch.bfloat16)
    assert up.line == back.line and up.module == back.module == "UpcastInAutocast"
    # the finding follows the table (compiled regions of other tests may come after it)
    lines = str(report).splitlines()
    finding = next(i for i, line in enumerate(lines) if "has no effect under autocast" in line)
    assert lines[finding].startswith(up.site) and "cast sites" in "".join(lines[:finding])
    # the same upcasts outside autocast are no such thing
    with torchcast.track(all_casts=True) as plain:
        model(x)
    assert plain.undone_upcasts() == [] and "no effect" not in str(plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        audit = torchcast.audit(model, (x,))
    undone = audit.of_kind("undone_upcast")
    assert len(undone) == 1 and undone[0].severity == "warning"
    assert "enabled=False" in undone[0].fix
    assert not [f for f in audit.findings if f.kind == "rounding" and f.where == up.site]
