"""The table of Adam's compensation modes (torchcast/adam_modes.py) against
its C++ mirror (TORCHCAST_COMPENSATIONS, csrc/adam_modes.h), and the one
statement of the checks that read it: the op (kernel or reference) and the
optimizer refuse the same params with the same reason."""
import os
import re

import pytest
import torch

from torchcast import _ops
from torchcast._reference import adam as ref
from torchcast.adam_modes import COMPENSATIONS, compensation_names, refusal
from torchcast.optim import Adam

from adam_common import make_operands

HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "csrc", "adam_modes.h")
_CARRIED = {"kCarriesNothing": "nothing", "kCarriesParamDtype": "param",
            "kCarriesInt16": "int16", "kCarriesInt8": "int8"}
_DTYPE_BITS = {"kParamFloat64": "float64", "kParamFloat32": "float32",
               "kParamBFloat16": "bfloat16", "kParamFloat16": "float16"}


def python_rows():
    """The Python table in the C++ table's terms."""
    rows = []
    for c in COMPENSATIONS.values():
        carried = {None: "nothing", "param": "param"}.get(c.carried) or str(c.carried)[6:]
        rows.append((c.name, carried, tuple(str(d)[6:] for d in c.param_dtypes), c.instead,
                     c.needs))
    return tuple(rows)


def header_rows(path):
    """TORCHCAST_COMPENSATIONS' rows, read from the header: X(enumerator,
    "name", carried, dtype bits, "instead", "needs" (string pieces joined))."""
    with open(path) as f:
        text = f.read()
    body = re.search(r"#define TORCHCAST_COMPENSATIONS\(X\)(.*?)\n\n", text, re.S).group(1)
    body = body.replace("\\\n", " ")
    rows = []
    for entry in re.findall(r"X\((.*?)\)\s*(?=X\(|$)", body, re.S):
        enumerator, rest = entry.split(",", 1)
        name, rest = re.match(r'\s*"([a-z0-9]+)",(.*)', rest, re.S).groups()
        carried, rest = rest.split(",", 1)
        bits, rest = rest.split(",", 1)
        strings = re.findall(r'"((?:[^"\\]|\\.)*)"', rest)
        instead = strings[0]
        needs = "".join(strings[1:])
        dtypes = tuple(_DTYPE_BITS[b.strip()] for b in bits.split("|"))
        assert enumerator.strip().lower() == "k" + name, (enumerator, name)
        rows.append((name, _CARRIED[carried.strip()], dtypes, instead, needs))
    return tuple(rows)


def test_python_table_equals_the_cpp_table():
    tables = {}
    if _ops.WITH_EXTENSION:
        tables["torchcast._C.adam_compensations"] = tuple(
            tuple(row) for row in _ops._C.adam_compensations)
    if os.path.exists(HEADER):
        tables[HEADER] = header_rows(HEADER)
    if not tables:
        pytest.skip(f"a build without the extension and no source tree ({HEADER})")
    for source, rows in tables.items():
        assert rows == python_rows(), source


def test_table_facts():
    assert list(COMPENSATIONS) == ["none", "kahan", "remainder", "stochastic", "remainder8"]
    assert compensation_names() == "'none', 'kahan', 'remainder', 'stochastic' or 'remainder8'"
    assert refusal("remainder", torch.float16).endswith("needs bfloat16 params")
    assert refusal("kahan", torch.float64) is not None
    assert refusal("none", torch.float64) is None
    assert COMPENSATIONS["remainder"].carried_dtype(torch.bfloat16) == torch.int16
    assert COMPENSATIONS["kahan"].carried_dtype(torch.float16) == torch.float16
    assert COMPENSATIONS["stochastic"].carried_dtype(torch.bfloat16) is None


def _op_error(step, pdtype, mode):
    gen = torch.Generator().manual_seed(0)
    ops = make_operands(pdtype, pdtype if pdtype in (torch.float32, torch.float64)
                        else torch.float32, "none", False, (3,), gen)
    carried = COMPENSATIONS[mode].carried_dtype(pdtype) if mode in COMPENSATIONS else None
    ops[5] = [torch.zeros(3, dtype=carried)] if carried is not None else []
    before = [[t.clone() for t in lst] for lst in ops]
    with pytest.raises((TypeError, ValueError)) as e:
        step(*ops, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
             amsgrad=False, maximize=False, decoupled_weight_decay=False, compensation=mode)
    for la, lb in zip(ops, before):
        for x, y in zip(la, lb):
            assert torch.equal(x, y)
    return type(e.value), str(e.value).splitlines()[0]


@pytest.mark.parametrize("pdtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", [*COMPENSATIONS, "bogus"])
def test_op_and_reference_refuse_alike(pdtype, mode):
    """Every (param dtype, mode) the table refuses: the kernel and the
    reference raise the same exception with the same message, the table's
    reason and the mode to use instead; the ones it allows step."""
    if mode in COMPENSATIONS and refusal(mode, pdtype) is None:
        return
    kind, message = _op_error(ref.adam_step_, pdtype, mode)
    if mode == "bogus":
        assert kind is ValueError and compensation_names() in message
    else:
        c = COMPENSATIONS[mode]
        assert kind is TypeError
        assert message == (f"torchcast.adam_step_: {c.needs}, got {pdtype}; "
                           f"use compensation='{c.instead}'")
    if _ops.WITH_EXTENSION:
        assert _op_error(torch.ops.torchcast.adam_step_, pdtype, mode) == (kind, message)


@pytest.mark.parametrize("pdtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["kahan", "remainder", "stochastic", "remainder8"])
def test_optimizer_refuses_what_the_table_refuses(pdtype, mode):
    p = torch.nn.Parameter(torch.zeros(3, dtype=pdtype))
    needs = refusal(mode, pdtype)
    if needs is None:
        Adam([p], compensated=True, compensation=mode)
        return
    with pytest.raises(ValueError) as e:
        Adam([p], compensated=True, compensation=mode)
    assert needs in str(e.value)
