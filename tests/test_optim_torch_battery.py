"""PyTorch's own optimizer battery, run on torchcast.optim.Adam and AdamW.

Source: ``TestOptimRenewed`` in pytorch/pytorch test/test_optim.py (the
version matching the installed torch 2.13), restated here test by test: that
file is not shipped with torch. What is shipped is the machinery it runs on,
used here as it is: ``torch.testing._internal.common_optimizers`` (the
``optim_db`` OptimizerInfo entries for Adam and AdamW, their inputs, error
inputs, schedulers and tolerance decorators) and
``common_device_type.instantiate_device_type_tests``. The only change is the
optimizer class: each OptimizerInfo is copied with ``optim_cls`` swapped for
torchcast's (so ``optim_info.name`` and the test names stay torch's).

Ported: every test that applies to the CPU. Not ported, because they only run
on CUDA (torch marks them onlyCUDA or skips them on CPU) and this battery runs
on the CPU: test_forloop_goes_right_direction_multigpu, test_mixed_device_dtype,
test_set_default_dtype_works_with_foreach, test_foreach_large_tensor,
test_peak_memory_foreach, test_fused_does_not_step_if_foundinf,
test_cpu_load_state_dict (torch skips it on CPU: "Test is only for non-cpu
devices"), test_state_dict_with_cuda_params, test_fused_cpu_matches_cuda,
test_defaults_changed_to_foreach (it mocks torch's _multi_tensor_adam, which
torchcast does not call). Not instantiated for Adam/AdamW by torch either:
test_rosenbrock_sparse (no sparse support), test_second_order_optims_return_
consistent_types (LBFGS only). test_fused_large_tensor is kept with torch's
largeTensorTest("64GB"), which skips it on smaller machines.

Where torch's test reads a torch internal that torchcast's optimizer does not
have, the restatement says so in a comment.
"""
import copy
import functools
import tempfile

import torch
from torch.nn import Parameter
from torch.optim import SGD
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.testing._internal.common_device_type import (
    instantiate_device_type_tests, largeTensorTest, onlyCPU, onlyNativeDeviceTypes)
from torch.testing._internal.common_dtype import floating_types_and
from torch.testing._internal.common_optimizers import (
    _get_device_type, _get_optim_inputs_including_global_cliquey_kwargs, optim_db,
    OptimizerErrorEnum, optims, TensorTracker)
from torch.testing._internal.common_utils import parametrize, TestCase

import torchcast.optim


def _swapped(cls):
    """torch's OptimizerInfo for torch.optim.<name>, with torchcast's class."""
    torch_info = next(i for i in optim_db if i.optim_cls.__name__ == cls.__name__
                      and i.optim_cls.__module__.startswith("torch.optim"))
    info = copy.copy(torch_info)
    info.optim_cls = cls
    return info


TC_OPTIM_DB = [_swapped(torchcast.optim.Adam), _swapped(torchcast.optim.AdamW)]
FP16_REDUCED_PRECISION = {"atol": 1e-5, "rtol": 1e-4}


def rosenbrock(tensor):
    x, y = tensor
    return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2


def _linear_closure(optimizer, weight, bias, inpt):
    optimizer.zero_grad()
    loss = (weight.mv(inpt) + bias).pow(2).sum()
    loss.backward()
    return loss


def _small_model(dtype, device):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(),
                               torch.nn.Linear(3, 1), torch.nn.Sigmoid()).to(dtype=dtype,
                                                                             device=device)


def _conv_model(dtype, device):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2),
                               torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1)).to(
                                   dtype=dtype, device=device)


def _step_schedulers(schedulers, loss):
    for s in schedulers:
        if isinstance(s, ReduceLROnPlateau):
            s.step(loss)
        else:
            s.step()


class TestOptimRenewed(TestCase):
    """Named as torch's class, so that the OptimizerInfo decorators (tolerance
    overrides, skips) keyed by "TestOptimRenewed" apply as they do in torch."""

    @onlyCPU
    @optims(TC_OPTIM_DB)
    def test_optim_infos_do_not_specify_global_cliquey_kwargs(self, device, dtype, optim_info):
        for optim_input in optim_info.optim_inputs_func(device=device):
            self.assertFalse(any(f in optim_input.kwargs
                                 for f in ("foreach", "fused", "differentiable")))

    @optims(TC_OPTIM_DB)
    def test_errors(self, device, dtype, optim_info):
        """Every error input of the OptimizerInfo raises (or warns) with torch's
        exception type and message."""
        optim_cls = optim_info.optim_cls
        for error_input in optim_info.optim_error_inputs_func(device=device, dtype=dtype):
            optim_input = error_input.optimizer_error_input
            params, kwargs = optim_input.params, optim_input.kwargs
            expect = (self.assertWarnsRegex if issubclass(error_input.error_type, Warning)
                      else self.assertRaisesRegex)
            if error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
                with expect(error_input.error_type, error_input.error_regex):
                    optim_cls(params, **kwargs)
            elif error_input.error_on == OptimizerErrorEnum.STEP_ERROR:
                optim = optim_cls(params, **kwargs)
                with expect(error_input.error_type, error_input.error_regex):
                    optim.step()
            else:
                raise NotImplementedError(f"Unknown error type {error_input.error_on}")

    @parametrize("contiguous", [True, False])
    @parametrize("with_lrsched", [True, False])
    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_forloop_goes_right_direction(self, device, dtype, optim_info, contiguous,
                                          with_lrsched):
        optim_cls = optim_info.optim_cls
        for scheduler_cs in (optim_info.scheduler_inputs if with_lrsched else [None]):
            # fresh inputs per scheduler: a tensor lr is mutated by schedulers
            for optim_input in optim_info.optim_inputs_func(device=device):
                optim_input.kwargs["foreach"] = False  # torch forces its forloop here
                if contiguous:
                    weight = Parameter(torch.randn((10, 5), device=device, dtype=dtype))
                    bias = Parameter(torch.randn(10, device=device, dtype=dtype))
                else:
                    weight = Parameter(torch.randn((10, 5, 2), device=device, dtype=dtype)[..., 0])
                    bias = Parameter(torch.randn((10, 2), device=device, dtype=dtype)[..., 0])
                inpt = torch.randn(5, device=device, dtype=dtype)
                optimizer = optim_cls([weight, bias], **optim_input.kwargs)
                schedulers = [s(optimizer) for s in (scheduler_cs or [])]
                closure = functools.partial(_linear_closure, optimizer, weight, bias, inpt)
                initial_value = closure().item()
                for _ in range(20):
                    loss = closure()
                    optimizer.step()
                    _step_schedulers(schedulers, loss)
                if optim_input.kwargs.get("maximize", False):
                    self.assertGreater(closure().item(), initial_value)
                else:
                    self.assertLess(closure().item(), initial_value)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_param_group_with_lrscheduler_goes_right_direction(self, device, dtype, optim_info):
        optim_cls = optim_info.optim_cls
        for schedulers_c in optim_info.scheduler_inputs:
            weight = Parameter(torch.randn((10, 5), device=device, dtype=dtype))
            bias = Parameter(torch.randn(10, device=device, dtype=dtype))
            inpt = torch.randn(5, device=device, dtype=dtype)
            optimizer = optim_cls([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
            schedulers = [s(optimizer) for s in schedulers_c]
            closure = functools.partial(_linear_closure, optimizer, weight, bias, inpt)
            initial_value = closure().item()
            for _ in range(20):
                loss = optimizer.step(closure)
                _step_schedulers(schedulers, loss)
            self.assertLess(closure().item(), initial_value)

    @parametrize("num_dim", [0, 1, 2])
    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_tensor_lr(self, device, dtype, optim_info, num_dim):
        """A tensor lr (of 0, 1 or 2 dims, one element) steps as the float lr."""
        optim_cls = optim_info.optim_cls
        all_optim_inputs = _get_optim_inputs_including_global_cliquey_kwargs(
            device, dtype, optim_info, skip=("differentiable",))
        for optim_input in all_optim_inputs:
            weight = Parameter(torch.randn((10, 5), device=device, dtype=dtype))
            weight_c = weight.detach().clone().requires_grad_(True)
            bias = Parameter(torch.randn(10, device=device, dtype=dtype))
            bias_c = bias.detach().clone().requires_grad_(True)
            inpt = torch.randn(5, device=device, dtype=dtype)
            kwargs = optim_input.kwargs
            kwargs["lr"] = 1e-3
            optimizer_r = optim_cls([weight, bias], **kwargs)
            kwargs["lr"] = torch.tensor(1e-3).reshape([1] * num_dim).to(device)
            try:
                optimizer = optim_cls([weight_c, bias_c], **kwargs)
            except ValueError as e:
                self.assertRegex(str(e), ".*lr as a Tensor is not supported.*")
                continue
            for _ in range(5):
                _linear_closure(optimizer_r, weight, bias, inpt)
                _linear_closure(optimizer, weight_c, bias_c, inpt)
                optimizer_r.step()
                optimizer.step()
                self.assertEqual(weight, weight_c)
                self.assertEqual(bias, bias_c)

    @optims(TC_OPTIM_DB, dtypes=[torch.complex64])
    def test_complex(self, device, dtype, optim_info):
        """Complex params (mixed with a real one) step as their view_as_real."""
        optim_cls = optim_info.optim_cls
        all_optim_inputs = _get_optim_inputs_including_global_cliquey_kwargs(
            device, dtype, optim_info, skip=("differentiable", "fused"))
        for optim_input in all_optim_inputs:
            complex_params = [
                torch.randn(10, 5, device=device, dtype=dtype, requires_grad=True),
                torch.randn(10, device=device, dtype=dtype, requires_grad=True),
                torch.randn(10, 5, device=device, dtype=torch.float32, requires_grad=True)]
            real_params = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone()
                           .requires_grad_() for p in complex_params]
            complex_optimizer = optim_cls(complex_params, **optim_input.kwargs)
            real_optimizer = optim_cls(real_params, **optim_input.kwargs)
            real_steps, complex_steps = [], []
            for _ in range(3):
                for rp, cp in zip(real_params, complex_params):
                    grad = torch.randn_like(rp)
                    real_steps.append(rp.detach().clone())
                    complex_steps.append(torch.view_as_real_copy(cp.detach()) if cp.is_complex()
                                         else cp.detach().clone())
                    rp.grad = grad
                    cp.grad = torch.view_as_complex(grad.clone()) if cp.is_complex() \
                        else grad.clone()
                real_optimizer.step()
                complex_optimizer.step()
            self.assertEqual(real_params, [torch.view_as_real(p) if p.is_complex() else p
                                           for p in complex_params])
            self.assertEqual(complex_steps, real_steps)

    @optims(TC_OPTIM_DB, dtypes=[torch.complex64])
    def test_complex_2d(self, device, dtype, optim_info):
        """A complex param against its real and imaginary parts as two params,
        aligned at every step through TensorTracker."""
        optim_cls = optim_info.optim_cls
        all_optim_inputs = _get_optim_inputs_including_global_cliquey_kwargs(
            device, dtype, optim_info, skip=("differentiable", "fused"))
        for optim_input in all_optim_inputs:
            a1 = torch.randn(2, device=device, dtype=dtype, requires_grad=True)
            a1_real = a1.real.detach().clone().requires_grad_()
            a1_imag = a1.imag.detach().clone().requires_grad_()
            optim1 = optim_cls([a1], **optim_input.kwargs)
            optim2 = optim_cls([a1_real, a1_imag], **optim_input.kwargs)
            trackers = [TensorTracker() for _ in range(5)]
            reals, imags, grad_reals, grad_imags, losses = trackers

            def closure1():
                optim1.zero_grad()
                loss = rosenbrock(a1).abs()
                loss.backward()
                reals.add(a1.real)
                imags.add(a1.imag)
                grad_reals.add(a1.grad.real)
                grad_imags.add(a1.grad.imag)
                losses.add(loss)
                return loss

            def closure2():
                optim2.zero_grad()
                reals.pop_check_set(a1_real, self)
                imags.pop_check_set(a1_imag, self)
                loss = rosenbrock(torch.complex(a1_real, a1_imag)).abs()
                losses.pop_check_set(loss, self)
                loss.backward()
                grad_reals.pop_check_set(a1_real.grad, self)
                grad_imags.pop_check_set(a1_imag.grad, self)
                return loss

            for _ in range(3):
                closure1()
                closure2()
                optim1.step()
                optim2.step()
                self.assertEqual(a1.real, a1_real)
                self.assertEqual(a1.imag, a1_imag)
            self.assertTrue(all(t.all_popped() for t in trackers))

    def _compare_between(self, inputs, models, optimizers, assert_eq_kwargs=None):
        """Two model/optimizer pairs stepped 7 times side by side (a layer
        frozen for two steps, one step without grads): params and every state
        entry equal after each step."""
        tracker = TensorTracker(assert_eq_kwargs or {})
        inputs = inputs if isinstance(inputs, list) else [inputs, inputs]
        for i in range(7):
            states, updated = [], []
            for inpt, model, optimizer in zip(inputs, models, optimizers):
                optimizer.zero_grad()
                if i == 3:
                    model[2].requires_grad_(False)
                if i == 5:
                    model[2].requires_grad_(True)
                if i != 2:
                    model(inpt).sum().backward()
                optimizer.step()
                states.append(optimizer.state)
                updated.append(model.parameters())
            for og_p, new_p in zip(*updated):
                tracker.add(og_p)
                tracker.pop_check_set(new_p, self)
                for k in states[0][og_p]:
                    tracker.add(states[0][og_p][k])
                    tracker.pop_check_set(states[1][new_p][k], self)
        self.assertTrue(tracker.all_popped())

    def _test_derived_optimizers(self, device, dtype, optim_info, flag, reduced_precision=False):
        """flag=False against flag=True ('foreach' or 'fused'), with a 0-d
        param last, for every OptimizerInfo input."""
        assert_eq_kwargs = FP16_REDUCED_PRECISION if reduced_precision else {}
        optim_cls = optim_info.optim_cls
        for optim_input in optim_info.optim_inputs_func(device=device, dtype=dtype):
            kwargs = copy.deepcopy(optim_input.kwargs)
            if kwargs.get("capturable", False) and _get_device_type(device) == "cpu":
                continue  # capturable is not supported on CPU
            models, optimizers = [], []
            for flag_value in (False, True):
                kwargs[flag] = flag_value
                inpt = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype,
                                    device=device).reshape(3, 2)
                model = _small_model(dtype, device)
                empty_param = torch.empty((), device=device, dtype=dtype, requires_grad=True)
                empty_param.grad = torch.rand_like(empty_param)
                optimizers.append(optim_cls(list(model.parameters()) + [empty_param], **kwargs))
                models.append(model)
            self._compare_between(inpt, models, optimizers, assert_eq_kwargs)

    @optims([o for o in TC_OPTIM_DB if "foreach" in o.supported_impls], dtypes=[torch.float64])
    def test_foreach_matches_forloop(self, device, dtype, optim_info):
        self._test_derived_optimizers(device, dtype, optim_info, "foreach")

    @optims([o for o in TC_OPTIM_DB if "fused" in o.supported_impls],
            dtypes=floating_types_and(torch.bfloat16, torch.float16))
    def test_fused_matches_forloop(self, device, dtype, optim_info):
        if _get_device_type(device) not in optim_info.supports_fused_on:
            self.skipTest(f"{device} is not supported for fused on {optim_info.name}")
        self._test_derived_optimizers(device, dtype, optim_info, "fused")

    @optims([o for o in TC_OPTIM_DB if "fused" in o.supported_impls], dtypes=(torch.float32,))
    def test_fused_error_on_params_on_meta(self, device, dtype, optim_info):
        """fused=True with params on the meta device raises at the step, and
        the same optimizer steps once the params are materialized."""
        if _get_device_type(device) not in optim_info.supports_fused_on:
            self.skipTest(f"{device} is not supported for fused on {optim_info.name}")
        with torch.device("meta"):
            model = _small_model(dtype, "meta")
        optimizer = optim_info.optim_cls(model.parameters(), fused=True)
        with torch.device("meta"):
            for p in model.parameters():
                p.grad = torch.rand_like(p)
        with self.assertRaisesRegex(
                RuntimeError, "`fused=True` requires all the params to be floating point Tensors"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.to_empty(device=device)
        for p in model.parameters():
            p.grad = torch.rand_like(p)
        optimizer.step()

    @onlyNativeDeviceTypes
    @largeTensorTest("64GB")
    @optims([o for o in TC_OPTIM_DB if "fused" in o.supported_impls], dtypes=[torch.float16])
    def test_fused_large_tensor(self, device, dtype, optim_info):
        if _get_device_type(device) not in optim_info.supports_fused_on:
            self.skipTest(f"{device} is not supported for fused on {optim_info.name}")
        for optim_input in optim_info.optim_inputs_func(device=device):
            params = [torch.ones(2 ** 32, device=device, dtype=dtype)]
            params[0].grad = torch.zeros_like(params[0])
            optim_info.optim_cls(params, fused=True, **optim_input.kwargs).step()

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_param_groups_weight_decay(self, device, dtype, optim_info):
        optim_cls = optim_info.optim_cls
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            bias_kwargs = dict(copy.deepcopy(optim_input.kwargs), weight_decay=0.0)
            weight = Parameter(torch.randn((10, 5), device=device, dtype=dtype))
            bias = Parameter(torch.randn(10, device=device, dtype=dtype))
            inpt = torch.randn(5, device=device, dtype=dtype)
            optimizer = optim_cls([dict(params=[weight], **optim_input.kwargs),
                                   dict(params=[bias], **bias_kwargs)])
            initial_value = (weight.mv(inpt) + bias).pow(2).sum().item()
            for _ in range(20):
                loss = _linear_closure(optimizer, weight, bias, inpt)
                optimizer.step()
            if optim_input.kwargs.get("maximize", False):
                self.assertGreater(loss.item(), initial_value)
            else:
                self.assertLess(loss.item(), initial_value)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_param_groups_lr(self, device, dtype, optim_info):
        """A group's own lr is used; a group at the outer lr of 1e-28 stays put."""
        optim_cls = optim_info.optim_cls
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            if "lr" not in optim_input.kwargs or optim_input.kwargs["lr"] == 0:
                optim_input.kwargs["lr"] = 1e-3
            weight = Parameter(torch.randn((10, 5), device=device, dtype=dtype))
            bias = Parameter(torch.randn(10, device=device, dtype=dtype))
            irrelevant = Parameter(torch.randn(2, device=device, dtype=dtype))
            irrelevant_clone = irrelevant.clone()
            inpt = torch.randn(5, device=device, dtype=dtype)
            optimizer = optim_cls([dict(params=[weight, bias], **optim_input.kwargs),
                                   dict(params=[irrelevant])], lr=1e-28)
            initial_value = (weight.mv(inpt) + bias).pow(2).sum().item()
            for _ in range(20):
                loss = _linear_closure(optimizer, weight, bias, inpt)
                irrelevant.grad = torch.rand_like(irrelevant)
                optimizer.step()
            if optim_input.kwargs.get("maximize", False):
                self.assertGreater(loss.item(), initial_value)
            else:
                self.assertLess(loss.item(), initial_value)
            self.assertEqual(irrelevant, irrelevant_clone)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_step_is_noop_when_params_have_no_grad(self, device, dtype, optim_info):
        params = [torch.randn(2, 3, requires_grad=False, device=device, dtype=dtype)
                  for _ in range(2)]
        old_params = [p.detach().clone() for p in params]
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info):
            optimizer = optim_info.optim_cls(params, **optim_input.kwargs)
            optimizer.step(lambda: torch.tensor([1], device=device, dtype=dtype))
        self.assertEqual(params, old_params)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_step_is_noop_for_zero_grads(self, device, dtype, optim_info):
        optim_cls = optim_info.optim_cls
        param = torch.randn((5, 1), device=device, dtype=dtype, requires_grad=True)
        old_param = param.detach().clone()
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info):
            kwargs = optim_input.kwargs
            if kwargs.get("weight_decay", 0) != 0:
                continue  # params decay even with zero grads
            if optim_cls.__name__ == "AdamW":  # AdamW decays anyway: a small lr
                kwargs["lr"] = (torch.tensor(1e-5) if isinstance(kwargs.get("lr", 1e-5),
                                                                 torch.Tensor) else 1e-5)
            params = [param.clone()] if kwargs.get("differentiable", False) else [param]
            optimizer = optim_cls(params, **kwargs)
            params[0].grad = torch.zeros_like(params[0])
            optimizer.step(lambda: torch.tensor([1], device=device, dtype=dtype))
            self.assertEqual(old_param, params[0])

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_optimizer_can_be_printed(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2)]
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info):
            repr(optim_info.optim_cls(params, **optim_input.kwargs))

    @parametrize("is_named_optim0", [True, False])
    @parametrize("is_named_optim1", [True, False])
    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_state_dict_deterministic(self, device, dtype, optim_info, is_named_optim0,
                                      is_named_optim1):
        """A loaded copy steps identically, and its state dict equals the
        original's (param names aside) for equal but not identical params."""
        optim_cls = optim_info.optim_cls
        weight = Parameter(torch.randn(2, 3, device=device, dtype=dtype))
        bias = Parameter(torch.randn(2, device=device, dtype=dtype))
        inpt = torch.randn(3, requires_grad=True, device=device, dtype=dtype)

        def named(params, is_named):
            return [(f"name{i}", p) for i, p in enumerate(params)] if is_named else params

        def without_names(sd):
            sd = copy.deepcopy(sd)
            for pg in sd["param_groups"]:
                pg.pop("param_names", None)
            return sd

        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            optimizer = optim_cls(named([weight, bias], is_named_optim0), **optim_input.kwargs)
            closure = functools.partial(_linear_closure, optimizer, weight, bias, inpt)
            for _ in range(10):
                closure()
                optimizer.step()
            with torch.no_grad():
                weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
            optimizer_c = optim_cls(named([weight_c, bias_c], is_named_optim1),
                                    **optim_input.kwargs)
            closure_c = functools.partial(_linear_closure, optimizer_c, weight_c, bias_c, inpt)
            optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            for _ in range(10):
                closure()
                closure_c()
                optimizer.step()
                optimizer_c.step()
                self.assertEqual(weight, weight_c)
                self.assertEqual(bias, bias_c)
            self.assertEqual(without_names(optimizer.state_dict()),
                             without_names(optimizer_c.state_dict()))
            # repeated params have identical representations (pytorch issue 36831)
            optimizer_c.param_groups.extend(optimizer_c.param_groups)
            self.assertEqual(without_names(optimizer.state_dict())["param_groups"][-1],
                             without_names(optimizer_c.state_dict())["param_groups"][-1])

    def _prime(self, optimizer, model, inpt, steps=3):
        for _ in range(steps):
            optimizer.zero_grad()
            model(inpt).sum().backward()
            optimizer.step()

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_can_load_older_state_dict(self, device, dtype, optim_info):
        """A state dict without the flags added after the optimizer's first
        release (not_og_supported_flags) loads and steps."""
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            model = _conv_model(dtype, device)
            inpt = torch.rand(1, 4, 16, 16, device=device, dtype=dtype)
            optimizer = optim_info.optim_cls(model.parameters(), **optim_input.kwargs)
            self._prime(optimizer, model, inpt)
            old_state_dict = copy.deepcopy(optimizer.state_dict())
            for group in old_state_dict["param_groups"]:
                for flag in optim_info.not_og_supported_flags:
                    group.pop(flag, None)
            optimizer.load_state_dict(old_state_dict)
            self._prime(optimizer, model, inpt, steps=1)

    @parametrize("is_named_optim0", [True, False])
    @parametrize("is_named_optim1", [True, False])
    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_can_load_from_to_named_state_dict(self, device, dtype, optim_info,
                                               is_named_optim0, is_named_optim1):
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            model = _conv_model(dtype, device)
            inpt = torch.rand(1, 4, 16, 16, device=device, dtype=dtype)
            optimizer = optim_info.optim_cls(
                model.named_parameters() if is_named_optim0 else model.parameters(),
                **optim_input.kwargs)
            self._prime(optimizer, model, inpt)
            old_state_dict = copy.deepcopy(optimizer.state_dict())
            optimizer2 = optim_info.optim_cls(
                model.named_parameters() if is_named_optim1 else model.parameters(),
                **optim_input.kwargs)
            optimizer2.load_state_dict(old_state_dict)
            self._prime(optimizer2, model, inpt, steps=1)
            if is_named_optim0 or is_named_optim1:
                self.assertEqual(optimizer2.state_dict()["param_groups"][0]["param_names"],
                                 ["0.weight", "0.bias", "1.weight", "1.bias"])

    @parametrize("is_named_optim", [True, False])
    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_save_load_equality_with_weights_only(self, device, dtype, optim_info,
                                                  is_named_optim):
        weight = Parameter(torch.randn(2, 3, device=device, dtype=dtype))
        bias = Parameter(torch.randn(2, device=device, dtype=dtype))
        inpt = torch.randn(3, requires_grad=True, device=device, dtype=dtype)
        params = [("name0", weight), ("name1", bias)] if is_named_optim else [weight, bias]
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            optimizer = optim_info.optim_cls(params, **optim_input.kwargs)
            closure = functools.partial(_linear_closure, optimizer, weight, bias, inpt)
            for _ in range(3):
                optimizer.step(closure)
            sd = optimizer.state_dict()
            with tempfile.TemporaryFile() as f:
                torch.save(sd, f)
                f.seek(0)
                self.assertEqual(torch.load(f), sd)
                f.seek(0)
                self.assertEqual(torch.load(f, weights_only=True), sd)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_load_nontensor_step(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2)]
        for p in params:
            p.grad = torch.rand_like(p)
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            optimizer = optim_info.optim_cls(params, **optim_input.kwargs)
            for _ in range(3):
                optimizer.step()
            state_dict = copy.deepcopy(optimizer.state_dict())
            for p_state in state_dict["state"].values():
                if torch.is_tensor(p_state.get("step")):
                    p_state["step"] = p_state["step"].item()
            optimizer.load_state_dict(state_dict)
            optimizer.step()

    # -- state_dict and load_state_dict hooks --------------------------------

    @staticmethod
    def _state_dict_pre_hook(optimizer):
        optimizer.state["test"] = 1

    @staticmethod
    def _state_dict_post_hook(optimizer, state_dict):
        ran = "test" in state_dict["state"]
        state_dict["state"].pop("test", None)
        state_dict["ran_state_dict_pre_hook"] = ran
        return state_dict

    def _each_optimizer(self, device, dtype, optim_info):
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info):
            param = torch.rand(2, 3, device=device, dtype=dtype, requires_grad=True)
            yield optim_info.optim_cls([param], **optim_input.kwargs)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_state_dict_pre_hook(self, device, dtype, optim_info):
        for optim in self._each_optimizer(device, dtype, optim_info):
            optim.register_state_dict_pre_hook(type(self)._state_dict_pre_hook)
            self.assertEqual(optim.state_dict()["state"]["test"], 1)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_state_dict_post_hook(self, device, dtype, optim_info):
        for optim in self._each_optimizer(device, dtype, optim_info):
            optim.register_state_dict_post_hook(type(self)._state_dict_post_hook)
            self.assertFalse(optim.state_dict()["ran_state_dict_pre_hook"])

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_state_dict_pre_post_hook(self, device, dtype, optim_info):
        for optim in self._each_optimizer(device, dtype, optim_info):
            optim.register_state_dict_pre_hook(type(self)._state_dict_pre_hook)
            optim.register_state_dict_post_hook(type(self)._state_dict_post_hook)
            state_dict = optim.state_dict()
            self.assertFalse("test" in state_dict["state"])
            self.assertTrue(state_dict["ran_state_dict_pre_hook"])

    @staticmethod
    def _load_state_dict_pre_hook1(optimizer, state_dict):
        state_dict["param_groups"][0]["lr"] = 0.002

    @staticmethod
    def _load_state_dict_pre_hook2(optimizer, state_dict):
        # returns a new dict, which the load must then use
        my_state_dict = copy.deepcopy(state_dict)
        my_state_dict["param_groups"][0]["lr"] = 0.003
        return my_state_dict

    @staticmethod
    def _load_state_dict_post_hook(optimizer):
        optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
        optimizer.state["ran_load_state_dict_post_hook"] = True

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_load_state_dict_pre_hook_and_prepend(self, device, dtype, optim_info):
        for optim in self._each_optimizer(device, dtype, optim_info):
            state_dict = optim.state_dict()
            optim.register_load_state_dict_pre_hook(type(self)._load_state_dict_pre_hook1)
            optim.load_state_dict(state_dict)
            self.assertEqual(optim.param_groups[0]["lr"], 0.002)
            optim.register_load_state_dict_pre_hook(type(self)._load_state_dict_pre_hook2,
                                                    prepend=True)
            optim.load_state_dict(state_dict)
            # prepended: hook1 runs after hook2 and has the last word
            self.assertEqual(optim.param_groups[0]["lr"], 0.002)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_load_state_dict_post_hook(self, device, dtype, optim_info):
        for optim in self._each_optimizer(device, dtype, optim_info):
            optim.register_load_state_dict_post_hook(type(self)._load_state_dict_post_hook)
            optim.load_state_dict(optim.state_dict())
            self.assertFalse(optim.state["ran_load_state_dict_pre_hook2"])
            self.assertTrue(optim.state["ran_load_state_dict_post_hook"])

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_load_state_dict_pre_post_hook(self, device, dtype, optim_info):
        for optim in self._each_optimizer(device, dtype, optim_info):
            optim.register_load_state_dict_pre_hook(type(self)._load_state_dict_pre_hook2)
            optim.register_load_state_dict_post_hook(type(self)._load_state_dict_post_hook)
            optim.load_state_dict(optim.state_dict())
            self.assertTrue(optim.state["ran_load_state_dict_pre_hook2"])
            self.assertTrue(optim.state["ran_load_state_dict_post_hook"])

    # -- step hooks ------------------------------------------------------------

    def _each_hooked_optimizer(self, device, dtype, optim_info):
        params = [torch.tensor([1, 1], device=device, dtype=dtype)]
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info):
            yield optim_info.optim_cls(params, **optim_input.kwargs), params

    def _check_step_hook(self, device, dtype, optim_info, register_name, start):
        """A hook that adds 2 runs on each of two steps, then not once removed."""
        for optim, _ in self._each_hooked_optimizer(device, dtype, optim_info):
            data = [start]
            handle = getattr(optim, register_name)(lambda o, a, k: data.append(data.pop() + 2))
            optim.step()
            optim.step()
            self.assertEqual(data, [start + 4])
            handle.remove()
            optim.step()
            self.assertEqual(data, [start + 4])

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_step_post_hook(self, device, dtype, optim_info):
        self._check_step_hook(device, dtype, optim_info, "register_step_post_hook", 2)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_step_pre_hook(self, device, dtype, optim_info):
        self._check_step_hook(device, dtype, optim_info, "register_step_pre_hook", 5)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_step_all_hooks(self, device, dtype, optim_info):
        """Global hooks around local ones, for this optimizer and for SGD."""
        for optim, params in self._each_hooked_optimizer(device, dtype, optim_info):
            optim2 = SGD(params)
            data = []
            handles = [
                register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
                register_optimizer_step_post_hook(lambda o, a, k: data.append(5)),
                optim.register_step_pre_hook(lambda o, a, k: data.append(1)),
                optim.register_step_post_hook(lambda o, a, k: data.append(2)),
                optim2.register_step_pre_hook(lambda o, a, k: data.append(1)),
                optim2.register_step_post_hook(lambda o, a, k: data.append(2))]
            optim.step()
            self.assertListEqual(data, [0, 1, 2, 5])
            optim2.step()
            self.assertListEqual(data, [0, 1, 2, 5] * 2)
            optim.step()
            self.assertListEqual(data, [0, 1, 2, 5] * 3)
            for handle in handles:
                handle.remove()
            optim.step()
            optim2.step()
            self.assertListEqual(data, [0, 1, 2, 5] * 3)

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_deepcopy_copies_all_public_attrs(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2)]
        for p in params:
            p.grad = torch.rand_like(p)

        def public(obj):
            return {k for k in obj.__dict__ if not k.startswith("_")}

        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(
                device, dtype, optim_info, skip=("differentiable",)):
            optimizer = optim_info.optim_cls(params, **optim_input.kwargs)
            for _ in range(3):
                optimizer.step()
            self.assertEqual(public(optimizer), public(copy.deepcopy(optimizer)))

    @optims(TC_OPTIM_DB, dtypes=[torch.float32])
    def test_non_empty_state(self, device, dtype, optim_info):
        model = torch.nn.Linear(5, 5).to(dtype=dtype, device=device)
        inpt = torch.rand(2, 5, dtype=dtype, device=device)
        for optim_input in optim_info.optim_inputs_func(device=device):
            optim = optim_info.optim_cls(model.parameters(), **optim_input.kwargs)
            optim.zero_grad()
            model(inpt).sum().backward()
            optim.step()
            for state in optim.state.values():
                self.assertGreater(len(state), 0)

    def test_adamw_serialization(self, device):
        """decoupled_weight_decay survives loading: Adam takes AdamW's True,
        AdamW stays True whatever it loads (an Adam state, an old AdamW state
        without the key)."""
        Adam, AdamW = torchcast.optim.Adam, torchcast.optim.AdamW
        model = torch.nn.Linear(5, 5).to(device)
        loaded_dict = AdamW(model.parameters()).state_dict()
        new_optim = Adam(model.parameters())
        new_optim.load_state_dict(loaded_dict)
        self.assertTrue(new_optim.param_groups[0]["decoupled_weight_decay"])

        adam_state_dict = Adam(model.parameters()).state_dict()
        self.assertFalse(adam_state_dict["param_groups"][0]["decoupled_weight_decay"])
        new_optim = AdamW(model.parameters())
        new_optim.load_state_dict(adam_state_dict)
        self.assertTrue(new_optim.param_groups[0]["decoupled_weight_decay"])

        old_adamw_dict = copy.deepcopy(loaded_dict)
        del old_adamw_dict["param_groups"][0]["decoupled_weight_decay"]
        new_optim = AdamW(model.parameters())
        new_optim.load_state_dict(old_adamw_dict)
        self.assertTrue(new_optim.param_groups[0]["decoupled_weight_decay"])


instantiate_device_type_tests(TestOptimRenewed, globals(), only_for=("cpu",))
