"""What torchcast.optim.Adam/AdamW refuse, and the messages that say why:
hyperparameters (types and values, at construction and as each step reads
them), params against their group's options, grads, existing states,
loaded state dicts and seed_compensation's weights.

Every check reads attributes only (no kernels, no device synchronization)
and raises before the optimizer writes anything. ``name`` is the
optimizer's class name ("Adam" or "AdamW"), which heads the messages; the
optimizer decides what a param's compensation mode, state keys and moment
dtype are, and passes them in. Also here: the tensor facts both modules
read (``is_dtensor``, ``real_dtype``)."""
import torch

from .. import _ops
from .._reference.moments8 import blocks_of
from ..adam_modes import EIGHT_BIT, MOMENT_FORMATS, COMPENSATIONS, compensation_names, refusal

_STATE_DTYPES = (None,) + tuple(f.option for f in MOMENT_FORMATS.values())
_SCALES = "moment_scales"
_CODES = ("exp_avg_code", "exp_avg_sq_code")  # _state.CODES
# The compensation modes by the state key of what they carry.
_CARRIED_BY_KEY = {c.state_key: c for c in COMPENSATIONS.values() if c.state_key}
# The compensation options of the optimizer: every mode but "none" (compensated=False).
_OPTIONS = tuple(m for m in COMPENSATIONS if m != "none")
_STEP_DTYPES = (torch.float32, torch.float64)
_MISSING = object()
_DTENSOR = None  # torch.distributed.tensor.DTensor once looked up, False without it
# torch's message names the hyperparameter this way (torch.optim.Adam.__init__).
_INVALID = {"lr": "Invalid learning rate", "eps": "Invalid epsilon value",
            "weight_decay": "Invalid weight_decay value",
            "betas[0]": "Invalid beta parameter at index 0",
            "betas[1]": "Invalid beta parameter at index 1"}


# -- tensor facts ---------------------------------------------------------------

def is_dtensor(t) -> bool:
    """Whether t is a torch.distributed.tensor.DTensor."""
    global _DTENSOR
    if _DTENSOR is None:
        _DTENSOR = False
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor
            _DTENSOR = DTensor
    return _DTENSOR is not False and isinstance(t, _DTENSOR)


def real_dtype(t) -> torch.dtype:
    """t's dtype, or for a complex t the dtype of its real part."""
    return t.real.dtype if t.is_complex() else t.dtype


def overlaps(t) -> bool:
    """Whether two elements of t share memory (an expanded tensor: stride 0).
    Called only for non-contiguous tensors; a DTensor is checked shard-wise
    by its own ops."""
    return not is_dtensor(t) and torch._debug_has_internal_overlap(t) == 1


def describe(gi, i, p) -> str:
    """A param named for an error message."""
    return f"param {i} of param group {gi} (shape {tuple(p.shape)}, {p.dtype})"


def what(value) -> str:
    """A value described for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"{type(value).__name__} {value!r}"[:120]


def fused_devices():
    """The device types torch has fused optimizer kernels for."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    return _get_fused_kernels_supported_devices()


# -- hyperparameters --------------------------------------------------------------

def check_arguments(name, lr, betas, eps, weight_decay, *, foreach, fused, capturable,
                    differentiable, compensated, compensation, state_dtype, seed,
                    track_updates) -> None:
    """The constructor's arguments, in torch.optim.Adam's order and with its
    messages where it has them."""
    check_hyperparameter_types(f"torchcast.optim.{name}", lr, betas, eps, weight_decay)
    check_hyperparameters(lr, betas, eps, weight_decay)
    check_foreach_tensors(lr, betas, foreach)
    if capturable:
        raise RuntimeError(f"torchcast.optim.{name} does not support capturable=True "
                           "(CUDA graph capture); use torch.optim." + name)
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if differentiable:
        check_differentiable_options(name, compensated, compensation, state_dtype)
    if seed is not None:
        try:
            check_seed(seed)
        except (TypeError, ValueError) as e:
            raise type(e)(f"torchcast.optim.{name}: {e}") from None
    try:
        check_track_updates(track_updates)
    except (TypeError, ValueError) as e:
        raise type(e)(f"torchcast.optim.{name}: {e}") from None
    if track_updates and differentiable:
        raise ValueError(f"torchcast.optim.{name}: differentiable=True runs torch's own Adam "
                         "step, which does not count lost updates; track_updates=True "
                         "cannot be used with it")


def check_track_updates(track_updates) -> None:
    """track_updates: a bool, or the interval in steps between counted steps."""
    if isinstance(track_updates, bool):
        return
    if not isinstance(track_updates, int):
        raise TypeError("track_updates must be a bool or an int (count every N-th step), "
                        f"got {what(track_updates)}")
    if track_updates < 0:
        raise ValueError("track_updates must be >= 0 (0: off, N: count every N-th step), "
                         f"got {track_updates}")


def check_seed(seed) -> None:
    """The stochastic-rounding seed: an int in [0, 2^63), the op's int64."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int in [0, 2**63), got {what(seed)}")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def check_number(key, value, below_one=False) -> None:
    """A hyperparameter the step reads: a number in range, or a 1-element
    tensor (whose value is not read here)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {key} must be 1-element")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{key} must be a number or a 1-element tensor, got {what(value)}")
    if not 0.0 <= value or (below_one and not value < 1.0):
        raise ValueError(f"{_INVALID[key]}: {value}")


def check_foreach_tensors(lr, betas, foreach) -> None:
    # torch.optim.Adam's rule and messages: its foreach step cannot take a
    # tensor lr or tensor betas without capturable (which torchcast lacks).
    if not foreach:
        return
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor):
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False "
                             "and foreach=True")


def check_differentiable_options(name, compensated, compensation, state_dtype) -> None:
    """differentiable=True runs torch's own Adam step, which has none of the
    torchcast options."""
    bad = [f"{key}={value!r}" for key, value, default in (
        ("compensated", compensated, (None, False)), ("compensation", compensation, ("kahan",)),
        ("state_dtype", state_dtype, (None,))) if value not in default]
    if bad:
        raise ValueError(f"torchcast.optim.{name}: differentiable=True runs torch's own Adam "
                         f"step, without compensation or other state dtypes; {', '.join(bad)} "
                         "cannot be used with it (leave them at their defaults)")


def check_hyperparameter_types(where, lr, betas, eps, weight_decay) -> None:
    """TypeError at construction for what the step refuses (check_number)
    and torch.optim.Adam does not say clearly: a bool lr, eps or
    weight_decay, which torch takes as 0 or 1, and a value that is not a
    number, which torch's range checks meet with "'<=' not supported".
    ``where`` heads the message."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{where}: betas must be a pair of floats or of 1-element tensors, "
                        f"got {what(betas)}")
    for key, value in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1]),
                       ("eps", eps), ("weight_decay", weight_decay)):
        # A bool beta is left to torch's range checks, which refuse it with
        # torch's ValueError.
        bool_refused = not key.startswith("betas")
        if isinstance(value, torch.Tensor) or (
                isinstance(value, (int, float)) and not (bool_refused and isinstance(value, bool))):
            continue
        raise TypeError(f"{where}: {key} must be a float or a 1-element tensor, got "
                        f"{what(value)}; pass a float")


def check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    # torch.optim.Adam's checks and messages.
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not (all(isinstance(b, float) for b in betas)
            or all(isinstance(b, torch.Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")


def check_group(name, group, gi) -> None:
    """The group's hyperparameters as the step will read them: they may
    have been changed since construction (schedulers, user code). A
    tensor's value is not read (that would be a kernel, or a device sync)."""
    betas = group["betas"]
    try:
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise TypeError(f"betas must be a pair, got {betas!r}")
        check_number("lr", group["lr"])
        check_number("betas[0]", betas[0], below_one=True)
        check_number("betas[1]", betas[1], below_one=True)
        check_number("eps", group["eps"])
        check_number("weight_decay", group["weight_decay"])
        check_seed(group.get("seed", 0))
        check_track_updates(group.get("track_updates", False))
    except (TypeError, ValueError) as e:
        raise type(e)(f"torchcast.optim.{name}: param group {gi}: {e}; "
                      "nothing was updated") from None


# -- params and grads -------------------------------------------------------------

def check_param(name, group, gi, i, p, mode) -> None:
    """Param i of group gi fits the group's options; ``mode`` is the
    compensation the optimizer gives it ("none", "kahan", "remainder" or
    "stochastic")."""
    where = describe(gi, i, p)
    if group["differentiable"]:
        try:
            check_differentiable_options(name, group["compensated"], group["compensation"],
                                         group["state_dtype"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not (p.is_floating_point() or p.is_complex()):
        raise TypeError(f"torchcast.optim.{name}: {where} is not floating point; "
                        "only floating-point params can be optimized")
    if group["compensation"] not in _OPTIONS:
        raise ValueError(f"torchcast.optim.{name}: {where}: compensation must be "
                         f"{compensation_names(_OPTIONS)}, got {group['compensation']!r}")
    if not any(group["state_dtype"] is d or group["state_dtype"] == d for d in _STATE_DTYPES):
        raise ValueError(f"torchcast.optim.{name}: {where}: state_dtype must be None, "
                         f"torch.float32, torch.bfloat16 or '{EIGHT_BIT}', got "
                         f"{group['state_dtype']!r}")
    if group["state_dtype"] == EIGHT_BIT and p.dtype in (torch.bfloat16, torch.float16):
        why = ("amsgrad" if group["amsgrad"] else "a DTensor param" if is_dtensor(p) else None)
        if why:
            raise ValueError(f"torchcast.optim.{name}: {where}: state_dtype='{EIGHT_BIT}' does "
                             f"not support {why}; use state_dtype=torch.bfloat16 (or None) "
                             "for it, e.g. in its own param group")
    dtype = real_dtype(p)
    needs = refusal(mode, dtype)
    if needs:
        instead = COMPENSATIONS[mode].instead
        fix = ("float64 needs none (pass compensated=None or False)" if instead == "none" else
               f"use compensation='{instead}' for this one (e.g. in its own param group)")
        raise ValueError(f"torchcast.optim.{name}: {where}: {needs}; {fix}")
    # complex32 is the one complex dtype of a narrow (float16) real part.
    if p.dtype == torch.complex32 and (group["state_dtype"] is torch.bfloat16
                                       or group["state_dtype"] == EIGHT_BIT):
        raise ValueError(f"torchcast.optim.{name}: {where}: there is no complex "
                         f"{group['state_dtype']} for the states of a complex param; use "
                         "state_dtype=None")


def check_fused(name, gi, i, p) -> None:
    """fused=True and a param that is stepped: torch's error (and message)
    where torch has no fused kernel, torchcast's own where torchcast has none."""
    if p.device.type not in fused_devices() or not (p.is_floating_point()
                                                     or p.is_complex()):
        raise RuntimeError(
            "`fused=True` requires all the params to be floating point Tensors of "
            f"supported devices: {fused_devices()} but {p.dtype} and {p.device.type} "
            f"({describe(gi, i, p)}); nothing was updated")
    if not _ops.has_kernel("adam_step_", p.device):
        raise RuntimeError(
            f"torchcast.optim.{name}: fused=True but torchcast has no "
            f"compiled Adam kernel for {p.device.type} ({describe(gi, i, p)}); pass "
            "fused=None to use the pure-PyTorch step there; nothing was updated")


def check_param_memory(name, gi, i, p) -> None:
    """The param can be updated in place: no two elements share memory."""
    if not p.is_contiguous() and overlaps(p):
        raise overlap_error(name, describe(gi, i, p), p)


def checked_grad(name, group, gi, i, p, g) -> torch.Tensor:
    """The grad the step uses: checked, and cast under cast_grads."""
    if g.layout != torch.strided:
        raise RuntimeError(
            f"torchcast.optim.{name} does not support sparse gradients "
            f"({describe(gi, i, p)} has a {g.layout} grad), please consider "
            "torch.optim.SparseAdam instead")
    if g.dtype != p.dtype or g.device != p.device:
        where = describe(gi, i, p)
        if not group["cast_grads"]:
            raise RuntimeError(
                f"torchcast.optim.{name}: the grad of {where} is {g.dtype} on "
                f"{g.device} but the param is {p.dtype} on {p.device} (expected "
                f"scalar type {p.dtype} but found {g.dtype}); nothing was updated. "
                "Make the grad match its param, or pass cast_grads=True to cast "
                "it with torchcast.safe_to.")
        from ..cast import safe_to
        g = safe_to(g, p.dtype, name=f"grad of {where}").to(p.device)
    if g.shape != p.shape:
        raise RuntimeError(f"torchcast.optim.{name}: the grad of "
                           f"{describe(gi, i, p)} has shape {tuple(g.shape)}; "
                           "nothing was updated")
    return g


def overlap_error(name, where, t) -> RuntimeError:
    """The error for a param or state ``where`` whose elements share memory."""
    return RuntimeError(
        f"torchcast.optim.{name}: {where} has overlapping memory (strides "
        f"{t.stride()}, e.g. an expanded tensor) and cannot be updated in place; make it "
        "a tensor of its own with .clone(); nothing was updated")


# -- states -----------------------------------------------------------------------

def check_state(name, gi, i, p, state, keys, moments) -> None:
    """The param's existing state, as the step will use it: ``keys`` are
    the ones its mode keeps, ``moments`` the dtype of its moments. Missing
    entries are fine (created on this step); present ones must fit. The
    checks are attribute reads only; messages are built on failure."""
    if not isinstance(state, dict):
        raise TypeError(f"torchcast.optim.{name}: the state of "
                        f"{describe(gi, i, p)} is {what(state)}, not a dict; nothing "
                        "was updated")
    shape, device = p.shape, p.device
    for key in keys:
        t = state.get(key, _MISSING)
        if t is _MISSING:
            continue
        if key == "step":
            if not (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in _STEP_DTYPES
                    and t.numel() == 1):
                _raise_bad_state(name, gi, i, p, key, t, None)
            continue
        if key == _SCALES:
            blocks = blocks_of(p.numel())
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                    and tuple(t.shape) == (2, blocks) and t.device == device
                    and t.layout is torch.strided and t.is_contiguous()):
                _raise_bad_state(name, gi, i, p, key, t, torch.float32, (2, blocks))
            continue
        carrier = _CARRIED_BY_KEY.get(key)
        want = moments if carrier is None else carrier.carried_dtype(p.dtype)
        if key == _CODES[1]:
            want = torch.uint8  # 8-bit moments
        if not (isinstance(t, torch.Tensor) and t.dtype == want and t.shape == shape
                and t.device == device and t.layout is torch.strided
                and (t.is_contiguous() or not overlaps(t))):
            _raise_bad_state(name, gi, i, p, key, t, want)


def _raise_bad_state(name, gi, i, p, key, t, want, shape=None):
    where = f"state '{key}' of {describe(gi, i, p)}"
    shape = tuple(p.shape) if shape is None else shape
    if key == "step":
        raise TypeError(f"torchcast.optim.{name}: {where} must be a one-element float32 "
                        f"or float64 CPU tensor, got {what(t)}; nothing was updated")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"torchcast.optim.{name}: {where} is {what(t)}, expected a {want} "
                        f"tensor of shape {shape}; nothing was updated")
    if t.layout is torch.strided and t.shape == p.shape and overlaps(t):
        raise overlap_error(name, where, t)
    raise ValueError(
        f"torchcast.optim.{name}: {where} is {what(t)}, but must be a dense {want} tensor "
        f"of shape {shape} on {p.device}; nothing was updated (was a state dict "
        "of another model loaded, or the state replaced by hand?)")


# -- loaded state dicts -----------------------------------------------------------

def check_loaded_group_count(param_groups, saved_groups) -> None:
    # torch.optim.Optimizer.load_state_dict's message.
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")


def check_loaded_group_size(group, saved) -> None:
    # torch.optim.Optimizer.load_state_dict's message.
    if len(group["params"]) != len(saved["params"]):
        raise ValueError("loaded state dict contains a parameter group that doesn't "
                         "match the size of optimizer's group")


def load_error(name, e) -> ValueError:
    """A step's error (check_group, check_param) met while loading a state
    dict, as load_state_dict raises it."""
    return ValueError(f"{name}.load_state_dict: {e}".replace(
        "nothing was updated", "nothing was loaded"))


def check_loaded_state(name, gi, i, p, saved, known) -> None:
    """One param's saved state fits it: a dict of ``known`` keys, tensors of
    its shape and of a dtype kind that casts to the state's."""
    where = f"{name}.load_state_dict: the state of {describe(gi, i, p)}"
    tail = "; nothing was loaded"
    if not isinstance(saved, dict):
        raise ValueError(f"{where} is {what(saved)}, expected a dict of its Adam state "
                         f"({', '.join(known)}){tail}")
    unknown = sorted(str(k) for k in saved if k not in known)
    if unknown:
        raise ValueError(f"{where} has {unknown}, which Adam does not keep (known: "
                         f"{', '.join(known)}): is this the state dict of "
                         f"another optimizer (torch.optim.SGD keeps 'momentum_buffer')?"
                         f"{tail}")
    scaled = _SCALES in saved
    old = saved.get("exp_avg")
    if scaled and isinstance(old, torch.Tensor) and old.dtype == torch.int8:
        raise ValueError(f"{where} holds 8-bit codes under 'exp_avg' with 'moment_scales': "
                         "a state dict of an earlier torchcast, whose codes are in another "
                         "format (127 and 254 levels, rounded in the companded domain); "
                         "load it with the torchcast that saved it and save it with "
                         f"state_dict(torch_format=True), which this one loads{tail}")
    wanted = ("step",) + (_CODES if scaled else ("exp_avg", "exp_avg_sq"))
    missing = [k for k in wanted if saved and k not in saved]
    if missing:
        raise ValueError(f"{where} lacks {missing}{tail}")
    codes = [k for k in _CODES if k in saved]
    if codes and not scaled:
        raise ValueError(f"{where} has 8-bit codes {codes} without their 'moment_scales'{tail}")
    for key, value in saved.items():
        if key == _SCALES:
            blocks = blocks_of(p.numel())
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and tuple(value.shape) == (2, blocks)):
                raise ValueError(f"{where}: {key!r} is {what(value)}, expected a float32 "
                                 f"tensor of shape (2, {blocks}) (8-bit moments){tail}")
            continue
        if key == "step":
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, torch.Tensor) and value.numel() == 1
                and not value.is_complex())
            if not ok:
                raise ValueError(f"{where}: 'step' is {what(value)}, expected a number "
                                 f"or a one-element tensor{tail}")
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: {key!r} is {what(value)}, expected a tensor of "
                             f"shape {tuple(p.shape)}{tail}")
        if value.shape != p.shape:
            raise ValueError(f"{where}: {key!r} has shape {tuple(value.shape)} but the "
                             f"param has shape {tuple(p.shape)} (a state dict of another "
                             f"model, or params in another order?){tail}")
        if value.layout != torch.strided:
            raise ValueError(f"{where}: {key!r} is a {value.layout} tensor; optimizer "
                             f"states are dense{tail}")
        carrier = _CARRIED_BY_KEY.get(key)
        if carrier is not None and carrier.carried != "param":
            ok, want = value.dtype == carrier.carried, str(carrier.carried)
        elif key in _CODES:
            want = torch.int8 if key == _CODES[0] else torch.uint8
            ok, want = value.dtype == want, f"{want} (8-bit moments, with 'moment_scales')"
        elif p.is_complex():
            ok, want = value.is_complex(), "a complex dtype (the param is complex)"
        else:
            ok, want = value.is_floating_point(), "a floating-point dtype"
        if not ok:
            raise ValueError(f"{where}: {key!r} is {value.dtype}, expected {want}"
                             f" (param: {p.dtype}){tail}")


def lossy_load_error(name, gi, i, p, key, have, want) -> ValueError:
    """A loaded state whose moments the optimizer's format cannot hold as
    they are."""
    return ValueError(
        f"{name}.load_state_dict: the state of {describe(gi, i, p)} keeps {key!r} as "
        f"{have}, which this optimizer's moment format ({want}) cannot hold as it is: "
        "loading would round it; nothing was loaded. Load it into an optimizer whose "
        "state_dtype holds it, or pass round_moments=True to round the moments")


# -- seed_compensation ------------------------------------------------------------

def check_seed_count(name, n_weights, n_params) -> None:
    if n_weights != n_params:
        raise ValueError(f"torchcast.optim.{name}.seed_compensation: "
                         f"{n_weights} weights given for {n_params} params; pass one "
                         "per param, in param-group order; nothing was changed")


def check_seed_weight(name, gi, i, p, w) -> None:
    """seed_compensation's checks of one weight, attribute reads only."""
    head = f"torchcast.optim.{name}.seed_compensation: the weight for"
    where = f"{head} {describe(gi, i, p)}"
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{where} is {what(w)}; pass a tensor; nothing was changed")
    if w.layout != torch.strided:
        raise TypeError(f"{where} is a {w.layout} tensor; call .to_dense() on it first; "
                        "nothing was changed")
    if not (w.is_floating_point() or w.is_complex()) or w.is_complex() != p.is_complex():
        kind = "complex" if p.is_complex() else "real floating"
        raise TypeError(f"{where} is {w.dtype} but the param is {p.dtype}; pass a {kind} "
                        "weight (float32, or complex64 for a complex param, typically); "
                        "nothing was changed")
    if tuple(w.shape) != tuple(p.shape):
        raise ValueError(f"{where} has shape {tuple(w.shape)}; pass one of the param's "
                         "shape; nothing was changed")
    if is_dtensor(p) and (not is_dtensor(w) or w.to_local().shape != p.to_local().shape):
        raise ValueError(f"{where} is {what(w)}, not a DTensor of the param's local "
                         f"shape {tuple(p.to_local().shape)}; pass it placed as the param "
                         "(torch.distributed.tensor.distribute_tensor); nothing was changed")
