"""torchcast.optim.Adam and AdamW: drop-in for torch.optim.Adam/AdamW, one
fused pass per dtype group, with parameters kept in their own dtype and their
rounding errors carried to the next step (Kahan compensation, or the low half
of a float32 master weight for bfloat16)."""
import torch
from torch.optim import Optimizer

from .. import _ops
from . import _reference

__all__ = ["Adam", "AdamW"]

_NARROW = (torch.bfloat16, torch.float16)
_STATE_DTYPES = (None, torch.float32, torch.bfloat16)
_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_OWN_GROUP_KEYS = ("compensated", "compensation", "state_dtype", "cast_grads")
_OWN_STATE_KEYS = ("compensation", "remainder")
# The state keys of a param, by (compensation mode, amsgrad).
_STATE_KEYS = {
    (mode, ams): ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())
    + {"none": (), "kahan": ("compensation",), "remainder": ("remainder",)}[mode]
    for mode in ("none", "kahan", "remainder") for ams in (False, True)
}
_DTENSOR = None  # torch.distributed.tensor.DTensor once looked up, False without it


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


class _Loaded:
    """One param's loaded state, carried opaquely through
    Optimizer.load_state_dict, which would cast every floating state tensor
    to its param's dtype (pytorch issue 43706): float32 moments or
    compensation kept for bfloat16 params would silently lose their bits."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Adam(Optimizer):
    """Adam with the arguments, param-group semantics and ``step(closure)`` of
    ``torch.optim.Adam``, and three more:

    compensated: None (default) compensates bfloat16/float16 params and not
        float32/float64 ones; True compensates float32 too (where updates fall
        below half an ulp of the weights); False never.
    compensation: "kahan" keeps a buffer of the param's dtype with what the
        last rounding lost; "remainder" (bfloat16 only) keeps the low 16 bits
        of a float32 master weight as int16, so param + remainder is the
        float32 master bit for bit, at the same 2 bytes per parameter.
    state_dtype: exp_avg/exp_avg_sq dtype for bfloat16/float16 params, float32
        (default) or bfloat16; float32/float64 params keep theirs in their dtype.
    cast_grads: a gradient whose dtype or device differs from its param is
        an error (raised before anything changes) unless this is True: then it
        is cast with ``torchcast.safe_to``.

    ``fused=False`` runs the pure-PyTorch reference step (same results) even
    where a compiled kernel exists; ``foreach`` is accepted for drop-in
    compatibility and changes nothing (there is one implementation per
    device). ``capturable`` and ``differentiable`` are not supported.
    """

    # GradScaler passes grad_scale/found_inf and lets the step skip itself.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False, compensated=None, compensation="kahan",
                 state_dtype=None, cast_grads=False, decoupled_weight_decay=False, foreach=None,
                 fused=None, capturable=False, differentiable=False):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        name = type(self).__name__
        if capturable:
            raise RuntimeError(f"torchcast.optim.{name} does not support capturable=True "
                               "(CUDA graph capture); use torch.optim." + name)
        if differentiable:
            raise RuntimeError(f"torchcast.optim.{name} does not support differentiable=True; "
                               "use torch.optim." + name)
        self._valid_configs = set()  # (options, dtype) already checked by _check_param
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, compensated=compensated,
                        compensation=compensation, state_dtype=state_dtype,
                        cast_grads=cast_grads, decoupled_weight_decay=decoupled_weight_decay,
                        foreach=foreach, fused=fused, capturable=False, differentiable=False)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        try:
            for i, p in enumerate(self.param_groups[gi]["params"]):
                self._check_param(self.param_groups[gi], gi, i, p)
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
        on = group["compensated"]
        if on is None:
            on = dtype in _NARROW
        return group["compensation"] if on else "none"

    @staticmethod
    def _state_dtype(group, p):
        dtype = _real_dtype(p)
        sd = group["state_dtype"] if group["state_dtype"] is not None else torch.float32
        sd = sd if dtype in _NARROW else dtype
        return _COMPLEX_OF[sd] if p.is_complex() else sd

    def _check_param(self, group, gi, i, p):
        key = (group["compensated"], group["compensation"], group["state_dtype"], p.dtype)
        if key in self._valid_configs:
            return
        name = type(self).__name__
        where = _describe(gi, i, p)
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(f"torchcast.optim.{name}: {where} is not floating point; "
                            "only floating-point params can be optimized")
        if group["compensation"] not in ("kahan", "remainder"):
            raise ValueError(f"torchcast.optim.{name}: compensation must be 'kahan' or "
                             f"'remainder', got {group['compensation']!r}")
        if group["state_dtype"] not in _STATE_DTYPES:
            raise ValueError(f"torchcast.optim.{name}: state_dtype must be None, "
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

    def _checked_grads(self):
        """(group, [(param, grad)]) for every group, every grad checked (and
        cast under cast_grads) before anything is written."""
        name = type(self).__name__
        work = []
        for gi, group in enumerate(self.param_groups):
            items = []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.layout != torch.strided:
                    raise RuntimeError(
                        f"torchcast.optim.{name} does not support sparse gradients "
                        f"({_describe(gi, i, p)} has a {g.layout} grad), please consider "
                        "torch.optim.SparseAdam instead")
                self._check_param(group, gi, i, p)
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
                items.append((p, g))
            work.append((group, items))
        return work

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step; closure re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group, items in self._checked_grads():
            amsgrad = bool(group["amsgrad"])
            batches = {}  # (device, dtype, state dtype, mode) -> the op's seven lists
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
                    b = batches[key] = [[] for _ in range(7)]
                b[0].append(local)
                b[1].append(tensors[0])
                b[2].append(tensors[1])
                b[3].append(tensors[2])
                if amsgrad:
                    b[4].append(tensors[3])
                if mode != "none":
                    b[5].append(tensors[-1])
                b[6].append(state["step"])
            for (device, _, _, mode), lists in batches.items():
                self._launch(group, device, mode, lists, grad_scale, found_inf)
        return loss

    def _launch(self, group, device, mode, lists, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        kwargs = dict(
            beta1=float(beta1), beta2=float(beta2), weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]), amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]), compensation=mode,
            grad_scale=None if grad_scale is None else grad_scale.to(device),
            found_inf=None if found_inf is None else found_inf.to(device))
        kernel = _ops.has_kernel("adam_step_", device)
        if group["fused"] and not kernel:
            raise RuntimeError(f"torchcast.optim.{type(self).__name__}: fused=True but "
                               f"torchcast has no compiled Adam kernel for {device.type}; "
                               "pass fused=None to use the pure-PyTorch step there")
        if kernel and group["fused"] is not False:
            if isinstance(lr, torch.Tensor):
                lr = lr.to("cpu") if device.type == "cpu" else lr.to(device)
            _ops.adam_step_(*lists, lr=lr, **kwargs)
        else:
            if group["fused"] is None:
                _ops._warn_fallback(device)
            _reference.adam_step_(*lists, lr=lr, **kwargs)

    # -- state ----------------------------------------------------------------

    def state_dict(self, *, torch_format=False):
        """The optimizer state. ``torch_format=True`` leaves out what only
        torchcast uses (compensation, remainders, the torchcast group
        options), for loading into torch.optim.Adam/AdamW."""
        sd = super().state_dict()
        if not torch_format:
            return sd
        return {
            "state": {k: {n: v for n, v in s.items() if n not in _OWN_STATE_KEYS}
                      for k, s in sd["state"].items()},
            "param_groups": [{n: v for n, v in g.items() if n not in _OWN_GROUP_KEYS}
                             for g in sd["param_groups"]],
        }

    def load_state_dict(self, state_dict):
        """Optimizer.load_state_dict, but every state keeps its own dtype:
        moments in this optimizer's state dtype, compensation in the param's,
        remainders in int16, the step count on the CPU. Loads a
        torch.optim.Adam/AdamW state too: compensation then starts at zero,
        and compensation of a mode this optimizer does not use is dropped."""
        pre = self.register_load_state_dict_pre_hook(_hide_states)
        post = self.register_load_state_dict_post_hook(_adopt_states, prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()

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
    def seed_compensation(self, fp32_params):
        """Starts compensation (or remainders) from higher-precision weights,
        one per param in param-group order: each param becomes its weight
        rounded to the param's dtype and the compensation what that rounding
        lost, so a float32 checkpoint moves to bfloat16 training without
        losing its low bits. Params without compensation are just set."""
        params = [(gi, i, p, group) for gi, group in enumerate(self.param_groups)
                  for i, p in enumerate(group["params"])]
        weights = list(fp32_params)
        if len(weights) != len(params):
            raise ValueError(f"seed_compensation: {len(weights)} weights given for "
                             f"{len(params)} params")
        for (gi, i, p, group), w in zip(params, weights):
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(f"seed_compensation: the weight for {_describe(gi, i, p)} has "
                                 f"shape {tuple(w.shape)}")
            state = self._init_state(group, p)
            mode = self._mode(group, _real_dtype(p))
            local = _local(p)
            w = _local(w.detach()).to(local.device)
            if mode == "remainder":
                hi, lo = _reference.split_bf16_remainder(w.float())
                local.copy_(hi)
                _local(state["remainder"]).copy_(lo)
                continue
            local.copy_(w)
            if mode == "kahan":
                wide = w.dtype if w.dtype == torch.float64 else torch.float32
                w = w.to(wide)
                _local(state["compensation"]).copy_(w - local.to(wide))


class AdamW(Adam):
    """torchcast.optim.Adam with decoupled weight decay (default 1e-2), the
    arguments of ``torch.optim.AdamW``; see Adam for the torchcast options."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, compensated=None, compensation="kahan",
                 state_dtype=None, cast_grads=False, foreach=None, fused=None, capturable=False,
                 differentiable=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         compensated=compensated, compensation=compensation,
                         state_dtype=state_dtype, cast_grads=cast_grads,
                         decoupled_weight_decay=True, foreach=foreach, fused=fused,
                         capturable=capturable, differentiable=differentiable)


def _like(p, value, dtype):
    """value as a state of p: p's device, the given dtype, p's memory order."""
    if not torch.is_tensor(value):
        return value
    out = value.to(device=p.device, dtype=dtype)
    if out.shape == p.shape and out.stride() != p.stride():
        out = torch.empty_like(p, dtype=dtype).copy_(out)
    return out


def _hide_states(optimizer, state_dict):
    state_dict["state"] = {k: _Loaded(v) for k, v in state_dict["state"].items()}
    return state_dict


def _adopt_states(optimizer):
    group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
    for key, value in list(optimizer.state.items()):
        if isinstance(value, _Loaded):
            group = group_of.get(key)
            optimizer.state[key] = (value.value if group is None
                                    else optimizer._adopt(group, key, value.value))
