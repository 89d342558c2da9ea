"""torchcast.optim.Adam and AdamW: drop-in for torch.optim.Adam/AdamW, one
fused pass per dtype group, with parameters kept in their own dtype and their
rounding errors carried to the next step (Kahan compensation, or the low half
of a float32 master weight for bfloat16)."""
import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from .. import _ops
from .._reference import adam as adam_reference

__all__ = ["Adam", "AdamW"]

_NARROW = (torch.bfloat16, torch.float16)
_STATE_DTYPES = (None, torch.float32, torch.bfloat16)
_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_OWN_GROUP_KEYS = ("compensated", "compensation", "state_dtype", "cast_grads")
_OWN_STATE_KEYS = ("compensation", "remainder")
_KNOWN_STATE_KEYS = ("step",) + _MOMENTS + _OWN_STATE_KEYS
# The state keys of a param, by (compensation mode, amsgrad).
_STATE_KEYS = {
    (mode, ams): ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())
    + {"none": (), "kahan": ("compensation",), "remainder": ("remainder",)}[mode]
    for mode in ("none", "kahan", "remainder") for ams in (False, True)
}
_DTENSOR = None  # torch.distributed.tensor.DTensor once looked up, False without it
# torch's message names the hyperparameter this way (torch.optim.Adam.__init__).
_INVALID = {"lr": "Invalid learning rate", "eps": "Invalid epsilon value",
            "weight_decay": "Invalid weight_decay value",
            "betas[0]": "Invalid beta parameter at index 0",
            "betas[1]": "Invalid beta parameter at index 1"}


def _real_dtype(t):
    return t.real.dtype if t.is_complex() else t.dtype


def _local(t):
    """The tensor the kernel works on: a DTensor's local shard, complex as
    (real, imag) pairs (as torch's Adam steps complex params)."""
    if _is_dtensor(t):
        t = t.to_local()
    return torch.view_as_real(t) if t.is_complex() else t


def _is_dtensor(t):
    global _DTENSOR
    if _DTENSOR is None:
        _DTENSOR = False
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor
            _DTENSOR = DTensor
    return _DTENSOR is not False and isinstance(t, _DTENSOR)


def _describe(gi, i, p):
    return f"param {i} of param group {gi} (shape {tuple(p.shape)}, {p.dtype})"


def _fused_devices():
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    return _get_fused_kernels_supported_devices()


_MISSING = object()
_STEP_DTYPES = (torch.float32, torch.float64)


def _overlaps(t):
    """Whether two elements of t share memory (an expanded tensor: stride 0).
    Called only for non-contiguous tensors; a DTensor is checked shard-wise
    by its own ops."""
    return not _is_dtensor(t) and torch._debug_has_internal_overlap(t) == 1


def _what(value):
    """A value described for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"{type(value).__name__} {value!r}"[:120]


def _check_number(key, value, below_one=False):
    """A hyperparameter the step reads: a number in range, or a 1-element
    tensor (whose value is not read here)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {key} must be 1-element")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{key} must be a number or a 1-element tensor, got {_what(value)}")
    if not 0.0 <= value or (below_one and not value < 1.0):
        raise ValueError(f"{_INVALID[key]}: {value}")


def _check_foreach_tensors(lr, betas, foreach):
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


def _check_differentiable_options(name, compensated, compensation, state_dtype):
    """differentiable=True runs torch's own Adam step, which has none of the
    torchcast options."""
    bad = [f"{key}={value!r}" for key, value, default in (
        ("compensated", compensated, (None, False)), ("compensation", compensation, ("kahan",)),
        ("state_dtype", state_dtype, (None,))) if value not in default]
    if bad:
        raise ValueError(f"torchcast.optim.{name}: differentiable=True runs torch's own Adam "
                         f"step, without compensation or other state dtypes; {', '.join(bad)} "
                         "cannot be used with it (leave them at their defaults)")


def _check_hyperparameter_types(where, lr, betas, eps, weight_decay):
    """TypeError at construction for what the step refuses (_check_number)
    and torch.optim.Adam does not say clearly: a bool lr, eps or
    weight_decay, which torch takes as 0 or 1, and a value that is not a
    number, which torch's range checks meet with "'<=' not supported".
    ``where`` heads the message."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{where}: betas must be a pair of floats or of 1-element tensors, "
                        f"got {_what(betas)}")
    for key, value in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1]),
                       ("eps", eps), ("weight_decay", weight_decay)):
        # A bool beta is left to torch's range checks, which refuse it with
        # torch's ValueError.
        bool_refused = not key.startswith("betas")
        if isinstance(value, torch.Tensor) or (
                isinstance(value, (int, float)) and not (bool_refused and isinstance(value, bool))):
            continue
        raise TypeError(f"{where}: {key} must be a float or a 1-element tensor, got "
                        f"{_what(value)}; pass a float")


def _check_hyperparameters(lr, betas, eps, weight_decay):
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


@dataclasses.dataclass(slots=True)
class _Batch:
    """The tensors of one adam_step_ call (one device, param dtype, state
    dtype and compensation mode), in the op's argument order; lists left
    empty where amsgrad or compensation is off. Slots: step() appends to
    these once per param, and a slot is the quickest attribute to reach."""

    params: List[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: List[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avgs: List[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avg_sqs: List[torch.Tensor] = dataclasses.field(default_factory=list)
    max_exp_avg_sqs: List[torch.Tensor] = dataclasses.field(default_factory=list)
    compensations: List[torch.Tensor] = dataclasses.field(default_factory=list)
    state_steps: List[torch.Tensor] = dataclasses.field(default_factory=list)


class _Loaded:
    """One param's loaded state, carried opaquely through
    Optimizer.load_state_dict, which would cast every floating state tensor
    to its param's dtype (pytorch issue 43706): float32 moments or
    compensation kept for bfloat16 params would silently lose their bits."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Adam(Optimizer):
    """Implements Adam, as ``torch.optim.Adam``, in one fused pass per device
    and dtype, with each parameter kept in its own dtype and the rounding
    error of its update carried into the next step: Kahan compensation, or
    for bfloat16 the low 16 bits of a float32 master weight.

    A drop-in for torch.optim.Adam: the same arguments and validation errors,
    param groups, ``step(closure)``, hooks, lr schedulers, ``GradScaler`` and
    state-dict keys (plus the compensation state); docs/adam.md lists what is
    tested against torch.

    Args:
        params (iterable): iterable of parameters or named_parameters to
            optimize or iterable of dicts defining parameter groups, as in
            torch.optim.
        lr (float, Tensor, optional): learning rate (default: 1e-3). A
            tensor must be 1-element; it is not supported with
            ``foreach=True``.
        betas (tuple[float | Tensor, float | Tensor], optional): coefficients
            used for computing running averages of gradient and its square,
            each in [0, 1); both floats or both 1-element tensors
            (default: (0.9, 0.999)).
        eps (float, optional): term added to the denominator to improve
            numerical stability (default: 1e-8).
        weight_decay (float, optional): weight decay coefficient: an L2
            penalty added to the gradient, or with ``decoupled_weight_decay``
            a decay of the parameter inside the compensated update
            (default: 0).
        amsgrad (bool, optional): whether to use the AMSGrad variant of this
            algorithm from the paper "On the Convergence of Adam and Beyond"
            (default: False).
        maximize (bool, optional): maximize the objective with respect to
            the params, instead of minimizing (default: False).
        compensated (bool, optional): whether updates are compensated. None
            compensates bfloat16 and float16 params, not float32 or float64;
            True also float32 (where updates fall below half an ulp of the
            weights), and rejects float64 params, which need none; False
            never (default: None).
        compensation (str, optional): "kahan" keeps a buffer of the param's
            dtype with what the last rounding lost; "remainder" (bfloat16
            params only) keeps the low 16 bits of a float32 master weight as
            int16, so that param + remainder is the float32 master bit for
            bit, at the same 2 bytes per parameter (default: "kahan").
        state_dtype (torch.dtype, optional): the dtype of ``exp_avg`` and
            ``exp_avg_sq`` (and ``max_exp_avg_sq``) of bfloat16 and float16
            params: torch.float32 or torch.bfloat16; None means float32.
            float32 and float64 params keep theirs in their own dtype
            (default: None).
        cast_grads (bool, optional): whether a gradient whose dtype or device
            differs from its param's is cast with ``torchcast.safe_to``;
            False raises before anything changes (default: False).
        decoupled_weight_decay (bool, optional): if True, this optimizer is
            equivalent to AdamW and the algorithm will not accumulate weight
            decay in the momentum nor variance (default: False).
        foreach (bool, optional): accepted for compatibility with
            torch.optim.Adam and changes nothing (there is one implementation
            per device); as in torch, True with a tensor lr or tensor betas
            raises (default: None).
        fused (bool, optional): None runs the compiled kernel where one
            exists and elsewhere the pure-PyTorch step (same results, slower)
            with a one-time RuntimeWarning; True requires the kernel (a param
            without one raises at ``step``); False always runs the
            pure-PyTorch step, silently (default: None).
        capturable (bool, optional): must be False: CUDA graph capture is not
            supported (default: False).
        differentiable (bool, optional): whether autograd should occur
            through the optimizer step in training. If True, the step is
            torch's own single-tensor Adam on the same tensors, with states in
            the param's dtype and none of the torchcast options
            (``compensated``, ``compensation``, ``state_dtype`` left at their
            defaults) (default: False).

    Raises:
        ValueError: a hyperparameter out of range (torch's messages), a
            tensor lr or betas with ``foreach=True``, torchcast options that
            contradict ``differentiable``, or a param group's options that do
            not fit one of its params (for example ``compensation="remainder"``
            on a float16 param).
        RuntimeError: ``capturable=True``, or ``fused`` with ``foreach`` or
            ``differentiable``.
        TypeError: a param that is not floating point; an lr, eps or
            weight_decay that is a bool or not a number (torch.optim.Adam
            takes a bool as 0 or 1, which the step here refuses), betas
            that are not a pair, or a beta that is not a number.
    """

    # GradScaler passes grad_scale/found_inf and lets the step skip itself.
    _step_supports_amp_scaling = True

    def __init__(self, params: ParamsT, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (
                     0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, *,
                 maximize: bool = False, compensated: Optional[bool] = None,
                 compensation: str = "kahan", state_dtype: Optional[torch.dtype] = None,
                 cast_grads: bool = False, decoupled_weight_decay: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False):
        name = type(self).__name__
        if isinstance(betas, torch.Tensor) and betas.dim() == 1:
            betas = tuple(betas)  # torch takes a 2-element tensor as two tensor betas
        _check_hyperparameter_types(f"torchcast.optim.{name}", lr, betas, eps, weight_decay)
        _check_hyperparameters(lr, betas, eps, weight_decay)
        _check_foreach_tensors(lr, betas, foreach)
        if capturable:
            raise RuntimeError(f"torchcast.optim.{name} does not support capturable=True "
                               "(CUDA graph capture); use torch.optim." + name)
        if fused and differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        if differentiable:
            _check_differentiable_options(name, compensated, compensation, state_dtype)
        self._valid_configs = set()  # (options, dtype) already checked by _check_param
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, compensated=compensated,
                        compensation=compensation, state_dtype=state_dtype,
                        cast_grads=cast_grads, decoupled_weight_decay=decoupled_weight_decay,
                        foreach=foreach, fused=fused, capturable=False,
                        differentiable=bool(differentiable))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a param group, as ``torch.optim.Optimizer.add_param_group``,
        and checks its params against its options.

        Args:
            param_group (dict): the params and the options of this group that
                differ from the optimizer's defaults.

        Raises:
            TypeError, ValueError: a param does not fit the group's options
                (see the class's Raises), or an lr, betas, eps or
                weight_decay of the group is not a number or 1-element tensor
                (a bool included); the group is then not added.
        """
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            _check_hyperparameter_types(f"torchcast.optim.{type(self).__name__}: param group {gi}",
                                        group["lr"], group["betas"], group["eps"],
                                        group["weight_decay"])
            for i, p in enumerate(group["params"]):
                self._check_param(group, gi, i, p)
        except (TypeError, ValueError):
            self.param_groups.pop()  # as torch's own checks: a bad group is not added
            raise

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_valid_configs", set())
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for p_state in self.state.values():
            if isinstance(p_state, dict) and "step" in p_state:
                p_state["step"] = self._step_tensor(p_state["step"])

    # -- configuration --------------------------------------------------------

    def _mode(self, group, dtype):
        if group["differentiable"]:
            return "none"
        on = group["compensated"]
        if on is None:
            on = dtype in _NARROW
        return group["compensation"] if on else "none"

    @staticmethod
    def _state_dtype(group, p):
        if group["differentiable"]:
            return p.dtype  # torch's own step keeps states in the param's dtype
        dtype = _real_dtype(p)
        sd = group["state_dtype"] if group["state_dtype"] is not None else torch.float32
        sd = sd if dtype in _NARROW else dtype
        return _COMPLEX_OF[sd] if p.is_complex() else sd

    def _check_param(self, group, gi, i, p):
        key = (group["compensated"], group["compensation"], group["state_dtype"], p.dtype,
               group["differentiable"])
        if key in self._valid_configs:
            return
        name = type(self).__name__
        where = _describe(gi, i, p)
        if group["differentiable"]:
            try:
                _check_differentiable_options(name, group["compensated"], group["compensation"],
                                              group["state_dtype"])
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(f"torchcast.optim.{name}: {where} is not floating point; "
                            "only floating-point params can be optimized")
        if group["compensation"] not in ("kahan", "remainder"):
            raise ValueError(f"torchcast.optim.{name}: {where}: compensation must be 'kahan' or "
                             f"'remainder', got {group['compensation']!r}")
        if group["state_dtype"] not in _STATE_DTYPES:
            raise ValueError(f"torchcast.optim.{name}: {where}: state_dtype must be None, "
                             f"torch.float32 or torch.bfloat16, got {group['state_dtype']}")
        dtype = _real_dtype(p)
        mode = self._mode(group, dtype)
        if mode == "kahan" and dtype == torch.float64:
            raise ValueError(f"torchcast.optim.{name}: {where}: compensation is for float32, "
                             "bfloat16 and float16 params; float64 needs none "
                             "(pass compensated=None or False)")
        if mode == "remainder" and (dtype != torch.bfloat16 or p.is_complex()):
            raise ValueError(
                f"torchcast.optim.{name}: {where}: compensation='remainder' holds float32 "
                "master weights as bfloat16 + int16 and needs bfloat16 params; use "
                "compensation='kahan' for this one (e.g. in its own param group)")
        if p.is_complex() and dtype in _NARROW and group["state_dtype"] == torch.bfloat16:
            raise ValueError(f"torchcast.optim.{name}: {where}: there is no complex bfloat16 "
                             "for the states of a complex param; use state_dtype=None")
        self._valid_configs.add(key)

    @staticmethod
    def _step_tensor(step):
        # Kept on the CPU (as torch's non-fused Adam does): the kernels read it
        # on the host, no device synchronization.
        if torch.is_tensor(step):
            return step if step.device.type == "cpu" and step.dtype in (
                torch.float32, torch.float64) else step.to("cpu", torch.float32)
        return torch.tensor(float(step), dtype=torch.float32)

    def _state(self, group, p, mode):
        """The param's state, complete for its mode (the usual case: checked
        by its keys alone)."""
        state = self.state[p]
        keys = _STATE_KEYS[(mode, bool(group["amsgrad"]))]
        if len(state) == len(keys) and all(k in state for k in keys):
            return state
        return self._init_state(group, p)

    def _init_state(self, group, p):
        """The param's state, with whatever is missing created: lazily on the
        first step, after loading a torch.optim.Adam state (no compensation),
        or after amsgrad or another compensation mode was switched on."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        sd = self._state_dtype(group, p)
        for key in _MOMENTS[:3 if group["amsgrad"] else 2]:
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=sd, memory_format=torch.preserve_format)
        mode = self._mode(group, _real_dtype(p))
        if mode == "kahan" and "compensation" not in state:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if mode == "remainder" and "remainder" not in state:
            state["remainder"] = torch.zeros_like(p, dtype=torch.int16,
                                                  memory_format=torch.preserve_format)
        # A group switched to another mode drops what the old one kept.
        for key, owner in (("compensation", "kahan"), ("remainder", "remainder")):
            if mode != owner:
                state.pop(key, None)
        return state

    # -- step -----------------------------------------------------------------

    def _checked_work(self):
        """(group, [(param, grad)]) for every group, with every hyperparameter,
        grad, param and existing state checked (and grads cast under
        cast_grads) before anything is written: a step that raises changes no
        param, state or step count. Only Python attribute checks: no kernels,
        no device synchronization."""
        work = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, gi)
            items = []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                self._check_param(group, gi, i, p)
                if group["fused"]:
                    self._check_fused(gi, i, p)
                g = self._checked_grad(group, gi, i, p, g)
                if not p.is_contiguous() and _overlaps(p):
                    raise self._overlap_error(_describe(gi, i, p), p)
                state = self.state.get(p)
                if state:
                    self._check_state(group, gi, i, p, state)
                items.append((p, g))
            work.append((group, items))
        return work

    def _check_group(self, group, gi):
        """The group's hyperparameters as the step will read them: they may
        have been changed since construction (schedulers, user code). A
        tensor's value is not read (that would be a kernel, or a device sync)."""
        betas = group["betas"]
        try:
            if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
                raise TypeError(f"betas must be a pair, got {betas!r}")
            _check_number("lr", group["lr"])
            _check_number("betas[0]", betas[0], below_one=True)
            _check_number("betas[1]", betas[1], below_one=True)
            _check_number("eps", group["eps"])
            _check_number("weight_decay", group["weight_decay"])
        except (TypeError, ValueError) as e:
            raise type(e)(f"torchcast.optim.{type(self).__name__}: param group {gi}: {e}; "
                          "nothing was updated") from None

    def _check_fused(self, gi, i, p):
        """fused=True and a param that is stepped: torch's error (and message)
        where torch has no fused kernel, torchcast's own where torchcast has none."""
        if p.device.type not in _fused_devices() or not (p.is_floating_point()
                                                          or p.is_complex()):
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of "
                f"supported devices: {_fused_devices()} but {p.dtype} and {p.device.type} "
                f"({_describe(gi, i, p)}); nothing was updated")
        if not _ops.has_kernel("adam_step_", p.device):
            raise RuntimeError(
                f"torchcast.optim.{type(self).__name__}: fused=True but torchcast has no "
                f"compiled Adam kernel for {p.device.type} ({_describe(gi, i, p)}); pass "
                "fused=None to use the pure-PyTorch step there; nothing was updated")

    def _checked_grad(self, group, gi, i, p, g):
        """The grad the step uses: checked, and cast under cast_grads."""
        name = type(self).__name__
        if g.layout != torch.strided:
            raise RuntimeError(
                f"torchcast.optim.{name} does not support sparse gradients "
                f"({_describe(gi, i, p)} has a {g.layout} grad), please consider "
                "torch.optim.SparseAdam instead")
        if g.dtype != p.dtype or g.device != p.device:
            where = _describe(gi, i, p)
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
                               f"{_describe(gi, i, p)} has shape {tuple(g.shape)}; "
                               "nothing was updated")
        return g

    def _check_state(self, group, gi, i, p, state):
        """The param's existing state, as the step will use it. Missing
        entries are fine (created on this step); present ones must fit. The
        checks are attribute reads only; messages are built on failure."""
        if not isinstance(state, dict):
            raise TypeError(f"torchcast.optim.{type(self).__name__}: the state of "
                            f"{_describe(gi, i, p)} is {_what(state)}, not a dict; nothing "
                            "was updated")
        mode = self._mode(group, _real_dtype(p))
        moments = self._state_dtype(group, p)
        shape, device = p.shape, p.device
        for key in _STATE_KEYS[(mode, bool(group["amsgrad"]))]:
            t = state.get(key, _MISSING)
            if t is _MISSING:
                continue
            if key == "step":
                if not (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in _STEP_DTYPES
                        and t.numel() == 1):
                    self._raise_bad_state(gi, i, p, key, t, None)
                continue
            want = (p.dtype if key == "compensation" else
                    torch.int16 if key == "remainder" else moments)
            if not (isinstance(t, torch.Tensor) and t.dtype == want and t.shape == shape
                    and t.device == device and t.layout is torch.strided
                    and (t.is_contiguous() or not _overlaps(t))):
                self._raise_bad_state(gi, i, p, key, t, want)

    def _raise_bad_state(self, gi, i, p, key, t, want):
        name = type(self).__name__
        where = f"state '{key}' of {_describe(gi, i, p)}"
        if key == "step":
            raise TypeError(f"torchcast.optim.{name}: {where} must be a one-element float32 "
                            f"or float64 CPU tensor, got {_what(t)}; nothing was updated")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"torchcast.optim.{name}: {where} is {_what(t)}, expected a {want} "
                            f"tensor of shape {tuple(p.shape)}; nothing was updated")
        if t.layout is torch.strided and t.shape == p.shape and _overlaps(t):
            raise self._overlap_error(where, t)
        raise ValueError(
            f"torchcast.optim.{name}: {where} is {_what(t)}, but must be a dense {want} tensor "
            f"of shape {tuple(p.shape)} on {p.device}; nothing was updated (was a state dict "
            "of another model loaded, or the state replaced by hand?)")

    def _overlap_error(self, what, t):
        return RuntimeError(
            f"torchcast.optim.{type(self).__name__}: {what} has overlapping memory (strides "
            f"{t.stride()}, e.g. an expanded tensor) and cannot be updated in place; make it "
            "a tensor of its own with .clone(); nothing was updated")

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Performs a single optimization step, on every param with a grad.

        Everything is checked before anything is written (the group's
        hyperparameters, every grad, param and existing state): if the step
        raises, no param, state or step count has changed. Under
        ``torch.amp.GradScaler`` a step with inf or NaN grads changes nothing.

        Args:
            closure (Callable, optional): a closure that reevaluates the model
                and returns the loss.

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            RuntimeError: a grad of another dtype or device than its param
                (without ``cast_grads``), a sparse grad, a param or state with
                overlapping memory, or ``fused=True`` where no kernel exists.
            TypeError, ValueError: a hyperparameter changed since
                construction to an invalid value, or a state that does not
                fit its param (e.g. replaced by hand).
        """
        # As torch's optimizers: gradients flow through the step only when
        # the optimizer was built with differentiable=True.
        with torch.set_grad_enabled(bool(self.defaults["differentiable"])):
            return self._step(closure)

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group, items in self._checked_work():
            if group["differentiable"]:
                self._torch_step(group, items, grad_scale, found_inf)
                continue
            amsgrad = bool(group["amsgrad"])
            batches = {}  # (device, dtype, state dtype, mode) -> _Batch
            for p, g in items:
                plain = not (p.is_complex() or _is_dtensor(p))
                local = p if plain else _local(p)
                mode = self._mode(group, local.dtype)
                state = self._state(group, p, mode)
                tensors = [g, state["exp_avg"], state["exp_avg_sq"]]
                if amsgrad:
                    tensors.append(state["max_exp_avg_sq"])
                if mode != "none":
                    tensors.append(state["compensation" if mode == "kahan" else "remainder"])
                if not plain:
                    tensors = [_local(t) for t in tensors]
                key = (local.device, local.dtype, tensors[1].dtype, mode)
                b = batches.get(key)
                if b is None:
                    b = batches[key] = _Batch()
                b.params.append(local)
                b.grads.append(tensors[0])
                b.exp_avgs.append(tensors[1])
                b.exp_avg_sqs.append(tensors[2])
                if amsgrad:
                    b.max_exp_avg_sqs.append(tensors[3])
                if mode != "none":
                    b.compensations.append(tensors[-1])
                b.state_steps.append(state["step"])
            for (device, _, _, mode), batch in batches.items():
                self._launch(group, device, mode, batch, grad_scale, found_inf)
        return loss

    def _torch_step(self, group, items, grad_scale, found_inf):
        """differentiable=True: torch's own single-tensor Adam on this group's
        tensors, so that autograd sees every operation (torchcast's kernel is
        opaque to it). No compensation in this mode (checked at construction)."""
        from torch.optim.adam import adam as torch_adam
        lists = [[] for _ in range(6)]
        for p, g in items:
            state = self._state(group, p, "none")
            for lst, t in zip(lists, (p, g, state["exp_avg"], state["exp_avg_sq"],
                                      state.get("max_exp_avg_sq"), state["step"])):
                if t is not None:
                    lst.append(t)
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
        beta1, beta2 = group["betas"]
        torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                   foreach=False, capturable=False, differentiable=True, fused=False,
                   grad_scale=grad_scale, found_inf=found_inf,
                   has_complex=any(p.is_complex() for p in params),
                   decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
                   amsgrad=bool(group["amsgrad"]), beta1=beta1, beta2=beta2, lr=group["lr"],
                   weight_decay=group["weight_decay"], eps=group["eps"],
                   maximize=bool(group["maximize"]))

    def _launch(self, group, device, mode, batch, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        _ops.adam_step_(
            batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs,
            batch.max_exp_avg_sqs, batch.compensations, batch.state_steps,
            fused=group["fused"], lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
            weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
            amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]), compensation=mode,
            grad_scale=None if grad_scale is None else grad_scale.to(device),
            found_inf=None if found_inf is None else found_inf.to(device))

    # -- state ----------------------------------------------------------------

    def state_dict(self, *, torch_format: bool = False) -> Dict[str, Any]:
        """Returns the state of the optimizer as a dict, as
        ``torch.optim.Optimizer.state_dict``: ``state`` per param (``step``,
        ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` under amsgrad, and
        ``compensation`` or ``remainder``) and ``param_groups``.

        Args:
            torch_format (bool, optional): leave out what only torchcast uses
                (compensation, remainders, the torchcast group options), for
                loading into torch.optim.Adam/AdamW (default: False).

        Returns:
            dict: ``{"state": ..., "param_groups": ...}``.
        """
        sd = super().state_dict()
        if not torch_format:
            return sd
        return {
            "state": {k: {n: v for n, v in s.items() if n not in _OWN_STATE_KEYS}
                      for k, s in sd["state"].items()},
            "param_groups": [{n: v for n, v in g.items() if n not in _OWN_GROUP_KEYS}
                             for g in sd["param_groups"]],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads the optimizer state, as ``torch.optim.Optimizer.load_state_dict``,
        but every state keeps its own dtype (torch's casts each floating state
        to its param's dtype, pytorch issue 43706): moments in this
        optimizer's state dtype, compensation in the param's, remainders in
        int16, the step count on the CPU. A torch.optim.Adam/AdamW state loads
        too: compensation then starts at zero, and compensation of a mode this
        optimizer does not use is dropped.

        Args:
            state_dict (dict): optimizer state. Should be an object returned
                from a call to ``state_dict()`` of this class or of
                torch.optim.Adam/AdamW.

        Raises:
            ValueError: the dict does not fit this optimizer (param groups
                and their options, every state entry's keys, shapes and
                dtypes against its param, all checked before anything is
                installed); the message names the param group, the index in
                it and what is wrong, and the optimizer is left as it was.
        """
        pre = self.register_load_state_dict_pre_hook(_check_and_adopt_states)
        post = self.register_load_state_dict_post_hook(_unwrap_states, prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()

    def _loaded_groups(self, saved_groups):
        """{saved param id: (group index, index in group, param, group as it
        will be after loading)}, every saved group checked."""
        name = type(self).__name__
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        out = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
            merged = dict(self.defaults)
            merged.update(saved)
            merged["params"] = group["params"]
            try:
                self._check_group(merged, gi)
                for i, p in enumerate(group["params"]):
                    self._check_param(merged, gi, i, p)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{name}.load_state_dict: {e}".replace(
                    "nothing was updated", "nothing was loaded")) from None
            for i, (p, pid) in enumerate(zip(group["params"], saved["params"])):
                out[pid] = (gi, i, p, merged)
        return out

    def _check_loaded_state(self, group, gi, i, p, saved):
        """One param's saved state fits it: a dict of known keys, tensors of
        its shape and of a dtype kind that casts to the state's."""
        name = type(self).__name__
        where = f"{name}.load_state_dict: the state of {_describe(gi, i, p)}"
        tail = "; nothing was loaded"
        if not isinstance(saved, dict):
            raise ValueError(f"{where} is {_what(saved)}, expected a dict of its Adam state "
                             f"({', '.join(_KNOWN_STATE_KEYS)}){tail}")
        unknown = sorted(str(k) for k in saved if k not in _KNOWN_STATE_KEYS)
        if unknown:
            raise ValueError(f"{where} has {unknown}, which Adam does not keep (known: "
                             f"{', '.join(_KNOWN_STATE_KEYS)}): is this the state dict of "
                             f"another optimizer (torch.optim.SGD keeps 'momentum_buffer')?"
                             f"{tail}")
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if saved and k not in saved]
        if missing:
            raise ValueError(f"{where} lacks {missing}{tail}")
        for key, value in saved.items():
            if key == "step":
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                    isinstance(value, torch.Tensor) and value.numel() == 1
                    and not value.is_complex())
                if not ok:
                    raise ValueError(f"{where}: 'step' is {_what(value)}, expected a number "
                                     f"or a one-element tensor{tail}")
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{where}: {key!r} is {_what(value)}, expected a tensor of "
                                 f"shape {tuple(p.shape)}{tail}")
            if value.shape != p.shape:
                raise ValueError(f"{where}: {key!r} has shape {tuple(value.shape)} but the "
                                 f"param has shape {tuple(p.shape)} (a state dict of another "
                                 f"model, or params in another order?){tail}")
            if value.layout != torch.strided:
                raise ValueError(f"{where}: {key!r} is a {value.layout} tensor; optimizer "
                                 f"states are dense{tail}")
            if key == "remainder":
                ok, want = value.dtype == torch.int16, "torch.int16"
            elif p.is_complex():
                ok, want = value.is_complex(), "a complex dtype (the param is complex)"
            else:
                ok, want = value.is_floating_point(), "a floating-point dtype"
            if not ok:
                raise ValueError(f"{where}: {key!r} is {value.dtype}, expected {want}"
                                 f" (param: {p.dtype}){tail}")

    def _adopt(self, group, p, saved):
        mode = self._mode(group, _real_dtype(p))
        target = {key: self._state_dtype(group, p) for key in _MOMENTS}
        if mode == "kahan":
            target["compensation"] = p.dtype
        if mode == "remainder":
            target["remainder"] = torch.int16
        out = {}
        for key, value in saved.items():
            if key == "step":
                out[key] = self._step_tensor(value)
            elif key in target:
                out[key] = _like(p, value, target[key])
            elif key not in _OWN_STATE_KEYS:
                out[key] = value
        return out

    @torch.no_grad()
    def seed_compensation(self, fp32_params: Iterable[torch.Tensor]) -> None:
        """Starts compensation (or remainders) from higher-precision weights:
        each param becomes its weight rounded to the param's dtype and its
        compensation what that rounding lost, so a float32 checkpoint moves
        to bfloat16 training without losing its low bits. Params without
        compensation are just set. Runs under ``torch.no_grad()``.

        Every weight, param and existing state is checked before anything is
        written: a call that raises changes no param, state or step count.
        Values are not read (as ``Tensor.copy_``, a non-finite weight is
        copied as it is).

        Args:
            fp32_params (iterable of Tensor): one weight per param, in
                param-group order, each a dense floating tensor (complex for
                a complex param) of its param's shape, in a wider floating
                dtype (float32 typically), on any device; a DTensor for a
                DTensor param, placed as it is.

        Raises:
            ValueError: not one weight per param, or a weight of another
                shape than its param (or, for a DTensor param, of another
                local shape).
            TypeError: a weight that is not a dense floating tensor, or real
                for a complex param (or complex for a real one).
            TypeError, ValueError: a param or existing state that ``step``
                would refuse (its messages).
        """
        params = [(gi, i, p, group) for gi, group in enumerate(self.param_groups)
                  for i, p in enumerate(group["params"])]
        weights = list(fp32_params)
        if len(weights) != len(params):
            raise ValueError(f"torchcast.optim.{type(self).__name__}.seed_compensation: "
                             f"{len(weights)} weights given for {len(params)} params; pass one "
                             "per param, in param-group order; nothing was changed")
        for (gi, i, p, group), w in zip(params, weights):
            self._check_seed_weight(gi, i, p, w)
            self._check_param(group, gi, i, p)
            state = self.state.get(p)
            if state:
                self._check_state(group, gi, i, p, state)
        for (gi, i, p, group), w in zip(params, weights):
            state = self._init_state(group, p)
            mode = self._mode(group, _real_dtype(p))
            local = _local(p)
            w = _local(w.detach()).to(local.device)
            if mode == "remainder":
                hi, lo = adam_reference.split_bf16_remainder(w.float())
                local.copy_(hi)
                _local(state["remainder"]).copy_(lo)
                continue
            local.copy_(w)
            if mode == "kahan":
                wide = w.dtype if w.dtype == torch.float64 else torch.float32
                w = w.to(wide)
                _local(state["compensation"]).copy_(w - local.to(wide))

    def _check_seed_weight(self, gi, i, p, w):
        """seed_compensation's checks of one weight, attribute reads only."""
        head = f"torchcast.optim.{type(self).__name__}.seed_compensation: the weight for"
        where = f"{head} {_describe(gi, i, p)}"
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{where} is {_what(w)}; pass a tensor; nothing was changed")
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
        if _is_dtensor(p) and (not _is_dtensor(w) or w.to_local().shape != p.to_local().shape):
            raise ValueError(f"{where} is {_what(w)}, not a DTensor of the param's local "
                             f"shape {tuple(p.to_local().shape)}; pass it placed as the param "
                             "(torch.distributed.tensor.distribute_tensor); nothing was changed")


class AdamW(Adam):
    """Implements AdamW, as ``torch.optim.AdamW``: ``torchcast.optim.Adam``
    with decoupled weight decay, whatever state dict is loaded.

    Args:
        params, lr, betas, eps, amsgrad, maximize, compensated, compensation,
        state_dtype, cast_grads, foreach, fused, capturable, differentiable:
            as ``torchcast.optim.Adam``.
        weight_decay (float, optional): weight decay coefficient: each step
            decays the param by ``lr * weight_decay``, inside the compensated
            update (default: 1e-2).

    Raises:
        As ``torchcast.optim.Adam``.
    """

    def __init__(self, params: ParamsT, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (
                     0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, compensated: Optional[bool] = None,
                 compensation: str = "kahan", state_dtype: Optional[torch.dtype] = None,
                 cast_grads: bool = False, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         compensated=compensated, compensation=compensation,
                         state_dtype=state_dtype, cast_grads=cast_grads,
                         decoupled_weight_decay=True, foreach=foreach, fused=fused,
                         capturable=capturable, differentiable=differentiable)

    def __setstate__(self, state):
        # As torch.optim.AdamW: whatever state is loaded (a torch.optim.Adam
        # one included), the weight decay stays decoupled.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


def _like(p, value, dtype):
    """value as a state of p: p's device, the given dtype, p's memory order."""
    if not torch.is_tensor(value):
        return value
    out = value.to(device=p.device, dtype=dtype)
    if out.shape == p.shape and out.stride() != p.stride():
        out = torch.empty_like(p, dtype=dtype).copy_(out)
    return out


def _check_and_adopt_states(optimizer, state_dict):
    """Load pre-hook, the last one to run: checks the whole dict against the
    optimizer and converts every param's state before torch installs any of
    it (a failed load leaves the optimizer as it was). The converted states
    travel wrapped in _Loaded, so that torch's load does not cast them again."""
    targets = optimizer._loaded_groups(state_dict["param_groups"])
    state = {}
    for key, value in state_dict["state"].items():
        if key not in targets:
            state[key] = value  # not a param's state: torch keeps it as it is
            continue
        gi, i, p, group = targets[key]
        optimizer._check_loaded_state(group, gi, i, p, value)
        state[key] = _Loaded(optimizer._adopt(group, p, value))
    state_dict["state"] = state
    return state_dict


def _unwrap_states(optimizer):
    for key, value in list(optimizer.state.items()):
        if isinstance(value, _Loaded):
            optimizer.state[key] = value.value
