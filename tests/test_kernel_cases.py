"""The cases of tests/kernel_cases.py check something: a case whose expected
results are mostly NaN or infinite passes whatever the kernel does (NaN
matches NaN), so none may be, unless its name says it is about specials.
The expected results are the CPU ops' outputs (written in place, for
adam_step_), recorded while the case's own check runs them."""
import pytest
import torch

from kernel_cases import KERNELS, Device

CASES = [(kernel, case) for kernel, (cases, _) in KERNELS.items() for case in cases]


class RecordedOp:
    """A torch.ops.torchcast op (or overload packet) that notes the
    floating-point tensors it returns, or, returning none, writes in place."""

    def __init__(self, op, seen: list):
        self.op, self.seen = op, seen

    def __getattr__(self, overload):
        return RecordedOp(getattr(self.op, overload), self.seen)

    def __call__(self, *args, **kwargs):
        out = self.op(*args, **kwargs)
        self.seen += floats(out) or floats(args)
        return out


class RecordedOps:
    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def __getattr__(self, name):
        return RecordedOp(getattr(torch.ops.torchcast, name), self.seen)


def floats(value) -> list[torch.Tensor]:
    """The floating-point tensors in value (nested tuples and lists)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in floats(v)]
    return []


def nonfinite_share(tensors: list[torch.Tensor]) -> float:
    total = sum(t.numel() for t in tensors)
    bad = sum(int((~torch.isfinite(t.double())).sum()) for t in tensors)
    return bad / total if total else 0.0


@pytest.mark.parametrize("kernel,case", CASES, ids=[f"{k}-{c.id}" for k, c in CASES])
def test_a_case_expects_mostly_finite_results_unless_named_specials(kernel, case):
    ops = RecordedOps()
    try:
        KERNELS[kernel][1](case, Device("cpu", ops))
    except AssertionError:
        pass  # the CPU op is not CUDA's (its float32 sums differ by design): only its outputs count
    assert ops.seen, "the case's check ran no op"
    share = nonfinite_share(ops.seen)
    if "specials" not in case.id:
        assert share <= 0.5, (f"{share:.0%} of what the case expects is NaN or infinite: it "
                              "checks little (name it 'specials' if that is its point)")


def test_the_guard_refuses_a_case_of_mostly_nan():
    assert nonfinite_share([torch.tensor([float("nan")] * 3 + [1.0], dtype=torch.float16)]) > 0.5
    assert nonfinite_share([torch.tensor([float("inf"), 1.0, 2.0])]) < 0.5
