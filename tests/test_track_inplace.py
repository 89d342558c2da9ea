"""track(nonfinite=...) describes an in-place or out= op's inputs as the op
received them: an input the op wrote over by its amax read before the op
ran (not the inf it holds after), out= arguments not at all (they are
results, whatever bits they held), under both engines (the C++ watch serves
"record" on CPU programs, the dispatch mode "raise_at_op")."""
import pytest
import torch

import torchcast
from torchcast.tracker import NonFiniteError


def origin_of(action, fn):
    """The first origin fn makes under track(nonfinite=action)."""
    if action == "raise_at_op":
        with pytest.raises(NonFiniteError) as caught:
            with torchcast.track(nonfinite="raise_at_op"):
                fn()
        return caught.value.origin
    with torchcast.track(nonfinite=action) as report:
        fn()
    assert len(report.nonfinite) == 1, report.nonfinite
    return report.nonfinite[0]


def inputs_of(origin):
    return [(i.dtype, i.shape, i.amax, i.overwritten) for i in origin.inputs]


ACTIONS = ["record", "raise_at_op"]
HALF = torch.float16


@pytest.mark.parametrize("action", ACTIONS)
def test_mul_(action):
    h = torch.ones(3, dtype=HALF)
    origin = origin_of(action, lambda: h.mul_(1e5))
    assert origin.op == "aten::mul_" and origin.posinf == 3
    assert inputs_of(origin) == [(HALF, (3,), 1.0, True)]
    text = origin.describe()
    assert "float16[3] amax 1 (before the op wrote to it)" in text
    assert "non-finite in float32 too" not in text and "wrote over its input" in text


@pytest.mark.parametrize("action", ACTIONS)
def test_iadd(action):
    def step():
        h = torch.full((4,), 2.0, dtype=HALF)
        h += 70000
    origin = origin_of(action, step)
    assert origin.op == "aten::add_" and inputs_of(origin) == [(HALF, (4,), 2.0, True)]


@pytest.mark.parametrize("action", ACTIONS)
def test_copy_(action):
    h = torch.full((3,), 0.5, dtype=HALF)
    src = torch.full((3,), 1e6)
    origin = origin_of(action, lambda: h.copy_(src))
    assert origin.op == "aten::copy_"
    assert inputs_of(origin) == [(HALF, (3,), 0.5, True), (torch.float32, (3,), 1e6, False)]
    assert "A cast to float16 of values up to 1e+06" in origin.note


@pytest.mark.parametrize("action", ACTIONS)
def test_out_argument_is_a_result_not_an_input(action):
    a = torch.ones(3, dtype=HALF)
    out = torch.full((3,), float("nan"), dtype=HALF)  # garbage bits, as torch.empty may hold
    origin = origin_of(action, lambda: torch.mul(a, 1e5, out=out))
    assert origin.op == "aten::mul" and inputs_of(origin) == [(HALF, (3,), 1.0, False)]
    assert "float16's range overflowed" in origin.note


@pytest.mark.parametrize("action", ACTIONS)
def test_foreach_in_place(action):
    hs = [torch.full((2,), 3.0, dtype=HALF), torch.full((5,), 0.25, dtype=HALF)]
    origin = origin_of(action, lambda: torch._foreach_mul_(hs, 1e5))
    assert origin.op == "aten::_foreach_mul_"
    assert inputs_of(origin) == [(HALF, (2,), 3.0, True), (HALF, (5,), 0.25, True)]


def test_overwritten_inputs_round_trip_through_json():
    h = torch.ones(3, dtype=HALF)
    with torchcast.track(nonfinite="record") as report:
        h.mul_(1e5)
    back = type(report).from_json(report.to_json())
    assert inputs_of(back.nonfinite[0]) == inputs_of(report.nonfinite[0])


@pytest.mark.parametrize("action", ACTIONS)
def test_out_overload_after_the_functional_one(action):
    # The C++ watch once knew ops by name alone: addmm's functional overload,
    # seen first, made addmm.out's out= argument (here holding the inf of an
    # earlier result, as a reused buffer does) count as an input.
    b, x, w = torch.zeros(8), torch.ones(4, 8), torch.full((8, 8), 1e38)
    out = torch.full((4, 8), float("inf"))

    def step():
        torch.addmm(b, x, torch.ones(8, 8))
        torch.addmm(b, x, w, out=out)
    origin = origin_of(action, step)
    assert origin.op == "aten::addmm" and len(origin.inputs) == 3
