"""The compensation modes and moment formats of the Adam step: one table
each, read by torchcast.optim (the options it accepts, the state it keeps),
the pure-PyTorch reference (its argument checks) and the tests.

csrc/adam_modes.h states the same table for the kernels
(``TORCHCAST_COMPENSATIONS``, whose rows make the C++ enum, the name parser,
the argument checks and the compiled instantiations);
tests/test_adam_modes.py checks that the two agree. A new mode is a row here,
a row there, and its element math in ``AdamElement`` (csrc/adam_common.h)
and ``_reference/adam.py``.
"""
import dataclasses
from typing import Optional, Tuple, Union

import torch

__all__ = ["Compensation", "COMPENSATIONS", "CARRIED_STATE_KEYS", "MomentFormat",
           "MOMENT_FORMATS", "EIGHT_BIT", "compensation_names", "refusal"]


@dataclasses.dataclass(frozen=True)
class Compensation:
    """One compensation mode.

    Args:
        name: the ``compensation`` string of the op and of the optimizer.
        carried: what the mode keeps per param between steps, in the op's
            ``compensations`` list: None (nothing), "param" (a buffer of the
            param's dtype) or a dtype.
        state_key: the optimizer state entry that holds it (None: nothing).
        param_dtypes: the param dtypes the mode steps.
        instead: the mode the error messages suggest for other params.
        needs: why other params are refused, as the messages say it.
        draws_bits: whether the step rounds with random bits, so that the
            optimizer passes the op a seed.
    """

    name: str
    carried: Optional[Union[str, torch.dtype]]
    state_key: Optional[str]
    param_dtypes: Tuple[torch.dtype, ...]
    instead: str
    needs: str
    draws_bits: bool = False

    def carried_dtype(self, param_dtype: torch.dtype) -> Optional[torch.dtype]:
        """The dtype of what the mode carries for a param of ``param_dtype``
        (None where it carries nothing)."""
        return param_dtype if self.carried == "param" else self.carried


_ALL = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

COMPENSATIONS = {c.name: c for c in (
    Compensation("none", None, None, _ALL, "", ""),
    Compensation("kahan", "param", "compensation", (torch.float32, torch.bfloat16, torch.float16),
                 "none", "compensation is for float32, bfloat16 and float16 params"),
    Compensation("remainder", torch.int16, "remainder", (torch.bfloat16,), "kahan",
                 "compensation='remainder' stores float32 master weights as bfloat16 + int16 "
                 "and needs bfloat16 params"),
    Compensation("stochastic", None, None, (torch.bfloat16, torch.float16), "kahan",
                 "compensation='stochastic' rounds updates into 16-bit params and needs "
                 "bfloat16 or float16 params", draws_bits=True),
    Compensation("remainder8", torch.int8, "remainder8", (torch.bfloat16,), "kahan",
                 "compensation='remainder8' stores 24-bit master weights as bfloat16 + int8 "
                 "and needs bfloat16 params", draws_bits=True),
)}

# The state keys of the modes that carry something.
CARRIED_STATE_KEYS = tuple(c.state_key for c in COMPENSATIONS.values() if c.state_key)


def compensation_names(modes=COMPENSATIONS) -> str:
    """"'none', 'kahan', 'remainder' or 'stochastic'": the names for a message."""
    names = [f"'{m}'" for m in modes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def refusal(mode: str, param_dtype: torch.dtype) -> Optional[str]:
    """Why ``mode`` (a name of the table) cannot step a param of
    ``param_dtype`` (its real dtype), or None where it can."""
    c = COMPENSATIONS[mode]
    return None if param_dtype in c.param_dtypes else c.needs


@dataclasses.dataclass(frozen=True)
class MomentFormat:
    """How a bfloat16 or float16 param's moments are kept (``state_dtype``).

    Args:
        name: its name.
        option: the ``state_dtype`` value that selects it.
        exp_avg, exp_avg_sq: the dtypes of the two state tensors (of the
            param's shape).
        bytes_per_param: what both moments cost per parameter, scales
            included.
        scaled: whether a float32 scale per block of elements goes with
            them (state key ``"moment_scales"``; csrc/adam_moments8.h).
    """

    name: str
    option: object
    exp_avg: torch.dtype
    exp_avg_sq: torch.dtype
    bytes_per_param: float
    scaled: bool = False


# state_dtype="8bit": a string, not torch.int8, because the moments are not
# int8 tensors alone but codes (int8 and uint8, companded) with a float32
# scale per block, read back only through the step and the state dict
# conversions; the name says what they cost, as bitsandbytes' and torchao's
# 8-bit optimizers do.
EIGHT_BIT = "8bit"
SCALE_BLOCK = 256  # csrc/adam_moments8.h Moments8::kBlock
MOMENT_FORMATS = {f.name: f for f in (
    MomentFormat("float32", torch.float32, torch.float32, torch.float32, 8.0),
    MomentFormat("bfloat16", torch.bfloat16, torch.bfloat16, torch.bfloat16, 4.0),
    MomentFormat(EIGHT_BIT, EIGHT_BIT, torch.int8, torch.uint8, 2.0 + 2 * 4 / SCALE_BLOCK,
                 scaled=True),
)}
