"""torchcast.optim.Adam and AdamW: drop-in for torch.optim.Adam/AdamW, one
fused pass per dtype group, with parameters kept in their own dtype and their
rounding errors carried to the next step (Kahan compensation, or the low half
of a float32 master weight for bfloat16)."""
from functools import partial
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from ..adam_modes import EIGHT_BIT
from . import _state, _step, _update_stats, _validation
from ._update_stats import UpdateStats
from ._validation import real_dtype

__all__ = ["Adam", "AdamW"]

_OWN_GROUP_KEYS = ("compensated", "compensation", "state_dtype", "cast_grads", "seed",
                   "track_updates")


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
        seed (int, optional): the seed of ``compensation="stochastic"`` and
            ``"remainder8"`` and of 8-bit moments, in
            [0, 2^63): the random bits of element j of a param at step s are
            a hash of (seed, param group, param, s, j), so the same seed
            gives the same bits whatever the thread count or device, and a
            state dict (which keeps the seed in its param groups) continues
            bit for bit. None draws one from torch's default generator
            (``torch.manual_seed`` governs it) (default: None).
        track_updates (bool or int, optional): whether the step also counts,
            per param and in the same pass, the updates that rounding lost or
            shrank and the compensation carried, into a small int64 tensor
            on the param's device, read by ``update_stats()`` (no host sync
            per step; docs/adam.md, "Update accounting"). True counts every
            step; an int N counts every N-th step (the first, the N+1-th,
            ...), which divides the counting's cost by N (default: False).
        compensation (str, optional): "kahan" keeps a buffer of the param's
            dtype with what the last rounding lost; "remainder" (bfloat16
            params only) keeps the low 16 bits of a float32 master weight as
            int16, so that param + remainder is the float32 master bit for
            bit, at the same 2 bytes per parameter; "stochastic" (bfloat16
            and float16 params) keeps nothing and rounds each updated weight
            to the param's dtype up or down at random, unbiased, from ``seed``;
            "remainder8" (bfloat16 params only) keeps an int8 remainder, so
            that param + remainder is a 24-bit master weight, rounded to 24
            bits stochastically each step (default: "kahan").
        state_dtype (torch.dtype or str, optional): how bfloat16 and float16
            params keep ``exp_avg`` and ``exp_avg_sq`` (and
            ``max_exp_avg_sq``): torch.float32, torch.bfloat16, or "8bit" (a
            byte per moment and a float32 scale per block of 256 elements,
            square-root companded, rounded stochastically from ``seed``; no
            amsgrad, DTensor or complex params); None means float32. float32
            and float64 params keep theirs in their own dtype. A loaded
            state dict's moments convert to it (see ``load_state_dict``)
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
                 compensation: str = "kahan", seed: Optional[int] = None,
                 track_updates: Union[bool, int] = False,
                 state_dtype: Optional[Union[torch.dtype, str]] = None,
                 cast_grads: bool = False, decoupled_weight_decay: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False):
        name = type(self).__name__
        if isinstance(betas, torch.Tensor) and betas.dim() == 1:
            betas = tuple(betas)  # torch takes a 2-element tensor as two tensor betas
        _validation.check_arguments(
            name, lr, betas, eps, weight_decay, foreach=foreach, fused=fused,
            capturable=capturable, differentiable=differentiable, compensated=compensated,
            compensation=compensation, state_dtype=state_dtype, seed=seed,
            track_updates=track_updates)
        if seed is None:
            seed = int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))
        self._valid_configs = set()  # (options, dtype) already checked by _check_param
        self._update_counters = {}  # param -> int64 counter (track_updates), made at its step
        self._steps_taken = 0  # step() calls: which ones track_updates=N counts
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, compensated=compensated,
                        compensation=compensation, seed=seed, track_updates=track_updates,
                        state_dtype=state_dtype,
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
            _validation.check_hyperparameter_types(
                f"torchcast.optim.{type(self).__name__}: param group {gi}", group["lr"],
                group["betas"], group["eps"], group["weight_decay"])
            for i, p in enumerate(group["params"]):
                self._check_param(group, gi, i, p)
        except (TypeError, ValueError):
            self.param_groups.pop()  # as torch's own checks: a bad group is not added
            raise

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_valid_configs", set())
        self.__dict__.setdefault("_update_counters", {})
        self.__dict__.setdefault("_steps_taken", 0)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for p_state in self.state.values():
            if isinstance(p_state, dict) and "step" in p_state:
                p_state["step"] = _state.step_tensor(p_state["step"])

    # -- configuration --------------------------------------------------------

    def _check_param(self, group, gi, i, p):
        """The param fits its group's options (once per combination of
        options and dtype)."""
        key = (group["compensated"], group["compensation"], group["state_dtype"], p.dtype,
               group["differentiable"])
        if key in self._valid_configs:
            return
        _validation.check_param(type(self).__name__, group, gi, i, p,
                                _state.mode_of(group, real_dtype(p)))
        self._valid_configs.add(key)

    def _full_state(self, group, p, mode):
        """The param's state, complete for its mode (the usual case: checked
        by its keys alone)."""
        state = self.state[p]
        keys = _state.state_keys(group, p, mode)
        if len(state) == len(keys) and all(k in state for k in keys):
            return state
        return _state.init_state(state, group, p)

    # -- step -----------------------------------------------------------------

    def _checked_work(self):
        """(group, [(param, grad)]) for every group, with every hyperparameter,
        grad, param and existing state checked (and grads cast under
        cast_grads) before anything is written: a step that raises changes no
        param, state or step count. Only Python attribute checks: no kernels,
        no device synchronization."""
        name = type(self).__name__
        work = []
        for gi, group in enumerate(self.param_groups):
            _validation.check_group(name, group, gi)
            items = []
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                self._check_param(group, gi, i, p)
                if group["fused"]:
                    _validation.check_fused(name, gi, i, p)
                g = _validation.checked_grad(name, group, gi, i, p, g)
                _validation.check_param_memory(name, gi, i, p)
                state = self.state.get(p)
                if state:
                    self._check_state(group, gi, i, p, state)
                items.append((p, g))
            work.append((group, items))
        return work

    def _check_state(self, group, gi, i, p, state):
        """The param's existing state fits what the step will use."""
        mode = _state.mode_of(group, real_dtype(p))
        _validation.check_state(type(self).__name__, gi, i, p, state,
                                _state.state_keys(group, p, mode),
                                _state.moment_dtype(group, p))

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
        for gi, (group, items) in enumerate(self._checked_work()):
            if group["differentiable"]:
                _step.torch_step(group, items, partial(self._full_state, group), grad_scale,
                                 found_inf)
                continue
            every = int(group["track_updates"])
            track = every > 0 and self._steps_taken % every == 0
            _step.step_group(group, gi, items, partial(self._full_state, group),
                             self._counter if track else None, grad_scale, found_inf)
        self._steps_taken += 1
        return loss

    def _counter(self, p, lp):
        """p's update_stats counter, on the device of lp (the tensor the
        kernel steps), made at its first counted step."""
        counter = self._update_counters.get(p)
        if counter is None or counter.device != lp.device:
            counter = self._update_counters[p] = _update_stats.new_counter(lp)
        return counter

    def update_stats(self, reset: bool = False) -> UpdateStats:
        """What rounding did to the updates of the params stepped with
        ``track_updates=True``, summed since their first tracked step (or
        the last reset): per param and per param group, the fraction of
        element-steps whose update was rounded away entirely (``lost``) or
        shrunk below half (``shrunk``), and for the compensated modes the
        compensation carried, in ulps of the param. Reading synchronizes
        with the device once (one transfer per device); the steps never do.

        Args:
            reset (bool, optional): zero the counts after reading them
                (default: False).

        Returns:
            UpdateStats: ``params`` (one UpdateRecord per tracked param that
            has stepped) and ``groups`` (one total per param group);
            ``str()`` of it is a table.
        """
        return _update_stats.collect(self.param_groups, self._update_counters, reset)

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
            "state": {k: _state.torch_format(s) for k, s in sd["state"].items()},
            "param_groups": [{n: v for n, v in g.items() if n not in _OWN_GROUP_KEYS}
                             for g in sd["param_groups"]],
        }

    def load_state_dict(self, state_dict: Dict[str, Any], *, round_moments: bool = False) -> None:
        """Loads the optimizer state, as ``torch.optim.Optimizer.load_state_dict``,
        but every state keeps its own dtype (torch's casts each floating state
        to its param's dtype, pytorch issue 43706): moments in this
        optimizer's moment format, compensation in the param's, remainders in
        int16 or int8, the step count on the CPU. A torch.optim.Adam/AdamW
        state loads too: compensation then starts at zero, and compensation of
        a mode this optimizer does not use is dropped. The moment format
        (``state_dtype``) stays this optimizer's, and the saved moments
        convert to it where nothing is lost (bfloat16 or 8-bit ones to
        float32, 8-bit codes dequantized exactly); a conversion that would
        round them (float32 to bfloat16 or 8-bit, bfloat16 to 8-bit) raises,
        unless ``round_moments``.

        Args:
            state_dict (dict): optimizer state. Should be an object returned
                from a call to ``state_dict()`` of this class or of
                torch.optim.Adam/AdamW.
            round_moments (bool, optional): round moments kept in a wider
                format to this optimizer's (to the nearest bfloat16 or 8-bit
                code) instead of raising (default: False).

        Raises:
            ValueError: the dict does not fit this optimizer (param groups
                and their options, every state entry's keys, shapes and
                dtypes against its param, moments this optimizer's format
                cannot hold without ``round_moments``, all checked before
                anything is installed); the message names the param group,
                the index in it and what is wrong, and the optimizer is left
                as it was.
        """
        pre = self.register_load_state_dict_pre_hook(
            partial(_check_and_adopt_states, round_moments=round_moments))
        post = self.register_load_state_dict_post_hook(_unwrap_states, prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()

    def _loaded_groups(self, saved_groups):
        """{saved param id: (group index, index in group, param, group as it
        will be after loading)}, every saved group checked."""
        _validation.check_loaded_group_count(self.param_groups, saved_groups)
        out = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            _validation.check_loaded_group_size(group, saved)
            merged = dict(self.defaults)
            merged.update(saved)
            merged["params"] = group["params"]
            # The moment format is this optimizer's: the saved moments convert to it.
            merged["state_dtype"] = saved["state_dtype"] = group["state_dtype"]
            try:
                _validation.check_group(type(self).__name__, merged, gi)
                for i, p in enumerate(group["params"]):
                    self._check_param(merged, gi, i, p)
            except (TypeError, ValueError, RuntimeError) as e:
                raise _validation.load_error(type(self).__name__, e) from None
            for i, (p, pid) in enumerate(zip(group["params"], saved["params"])):
                out[pid] = (gi, i, p, merged)
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
        name = type(self).__name__
        weights = list(fp32_params)
        _validation.check_seed_count(name, len(weights), len(params))
        for (gi, i, p, group), w in zip(params, weights):
            _validation.check_seed_weight(name, gi, i, p, w)
            self._check_param(group, gi, i, p)
            # Written in place, as step() writes it: refused as step() refuses it.
            _validation.check_param_memory(name, gi, i, p)
            state = self.state.get(p)
            if state:
                self._check_state(group, gi, i, p, state)
        for (gi, i, p, group), w in zip(params, weights):
            _state.seed(self.state[p], group, p, w)


class AdamW(Adam):
    """Implements AdamW, as ``torch.optim.AdamW``: ``torchcast.optim.Adam``
    with decoupled weight decay, whatever state dict is loaded.

    Args:
        params, lr, betas, eps, amsgrad, maximize, compensated, compensation,
        seed, track_updates, state_dtype, cast_grads, foreach, fused, capturable, differentiable:
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
                 compensation: str = "kahan", seed: Optional[int] = None,
                 track_updates: Union[bool, int] = False,
                 state_dtype: Optional[Union[torch.dtype, str]] = None,
                 cast_grads: bool = False, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         compensated=compensated, compensation=compensation, seed=seed,
                         track_updates=track_updates,
                         state_dtype=state_dtype, cast_grads=cast_grads,
                         decoupled_weight_decay=True, foreach=foreach, fused=fused,
                         capturable=capturable, differentiable=differentiable)

    def __setstate__(self, state):
        # As torch.optim.AdamW: whatever state is loaded (a torch.optim.Adam
        # one included), the weight decay stays decoupled.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


def _check_and_adopt_states(optimizer, state_dict, round_moments):
    """Load pre-hook, the last one to run: checks the whole dict against the
    optimizer and converts every param's state before torch installs any of
    it (a failed load leaves the optimizer as it was). The converted states
    travel wrapped in _Loaded, so that torch's load does not cast them again."""
    state_dict["param_groups"] = [dict(g) for g in state_dict["param_groups"]]  # not the caller's
    targets = optimizer._loaded_groups(state_dict["param_groups"])
    state = {}
    for key, value in state_dict["state"].items():
        if key not in targets:
            state[key] = value  # not a param's state: torch keeps it as it is
            continue
        gi, i, p, group = targets[key]
        _validation.check_loaded_state(type(optimizer).__name__, gi, i, p, value,
                                       _state.KNOWN_STATE_KEYS)
        try:
            state[key] = _Loaded(_state.adopt(type(optimizer).__name__, gi, i, group, p, value,
                                              round_moments))
        except (TypeError, RuntimeError) as e:  # a dict of mismatched tensors
            raise _validation.load_error(type(optimizer).__name__, e) from None
    state_dict["state"] = state
    return state_dict


def _unwrap_states(optimizer):
    for key, value in list(optimizer.state.items()):
        if isinstance(value, _Loaded):
            optimizer.state[key] = value.value
