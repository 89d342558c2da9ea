"""torchcast.precision_plan: its numbers against torchao's own float8 casts
and torchcast.cast_with_stats recomputed in float64, the verdict on a model
with one outlier input, the filter torchao's converters take, the JSON round
trip and the errors."""
import copy
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import torchcast
from torchcast.plan import (DEFAULT_MAX_UNDERFLOW, DEFAULT_MIN_SQNR_DB, Measure, float8_measure,
                            recipe_measure)
from torchcast.stats import CastStats

torchao_float8 = pytest.importorskip("torchao.float8")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale  # noqa: E402

OUTLIER = 1e5


def outlier_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 96), nn.GELU(),
                         nn.Linear(96, 8))


def outlier_batch():
    torch.manual_seed(2)
    x = torch.randn(128, 64)
    x[:, 0] = OUTLIER
    return x


def step_of(model, x):
    def run():
        model(x).square().mean().backward()
    return run


@pytest.fixture(scope="module")
def captured():
    """The plan of the outlier model, and the tensors its layers saw."""
    model, x = outlier_model(), outlier_batch()
    seen = {}
    model[2].register_forward_pre_hook(lambda m, a: seen.__setitem__("input", a[0].detach()))

    def keep_grad(module, args, out):
        out.register_hook(lambda g: seen.__setitem__("grad_output", g.detach()))
    model[2].register_forward_hook(keep_grad)
    plan = torchcast.precision_plan(model, step_of(model, x))
    return plan, seen, model


def reference(x64: np.ndarray, y64: np.ndarray) -> Measure:
    """The Measure of a cast recomputed with numpy in float64."""
    err = x64 - y64
    return Measure(numel=x64.size, underflow=int(((x64 != 0) & (y64 == 0)).sum()),
                   sum_sq=float((x64 * x64).sum()), sum_sq_err=float((err * err).sum()))


def torchao_cast(x, dtype, granularity, dim, pow2):
    """torchao's own float8 cast of x, read back in float64."""
    scale = tensor_to_scale(x, dtype, scaling_granularity=granularity, axiswise_dim=dim,
                            round_scales_to_power_of_2=pow2)
    t = hp_tensor_and_scale_to_float8(x, scale, dtype, axiswise_dim=dim)
    return (t._data.double() / t._scale.double()).numpy()


def close(m: Measure, ref: Measure):
    assert m.numel == ref.numel and m.underflow == ref.underflow
    assert m.sum_sq == pytest.approx(ref.sum_sq, rel=1e-12)
    assert m.sum_sq_err == pytest.approx(ref.sum_sq_err, rel=1e-9)


@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_tensorwise_is_torchaos_cast(captured, role):
    x = captured[1][role]
    dtype = torch.float8_e4m3fn if role == "input" else torch.float8_e5m2
    y = torchao_cast(x, dtype, ScalingGranularity.TENSORWISE, None, False)
    close(recipe_measure(x, "tensorwise", role), reference(x.double().numpy(), y))


def test_tensorwise_matches_cast_with_stats():
    torch.manual_seed(3)
    x = torch.randn(64, 48) * torch.logspace(-3, 3, 48)
    scale = tensor_to_scale(x, torch.float8_e4m3fn)
    _, stats = torchcast.cast_with_stats(x, torch.float8_e4m3fn, scale=scale.reshape(1),
                                         saturate=True)
    s = CastStats.from_tensor(stats, x.dtype, torch.float8_e4m3fn)
    m = float8_measure(x, torch.float8_e4m3fn, None, False)
    assert (m.numel, m.underflow, m.saturated) == (s.numel, s.underflow, s.saturated)
    assert m.sqnr_db == pytest.approx(s.sqnr_db, abs=1e-6)


# A float32 amax whose float32 scale 448 / amax rounds up by an ulp:
# amax * scale is 448.00003 in float32, which rounds to 448 in e4m3.
AMAX_ROUNDED_UP = 81.685356


@pytest.mark.parametrize("rowwise", [False, True])
def test_a_scale_rounded_up_saturates_nothing(rowwise):
    """Issue 40 item 3: the plan counted an element saturated where
    |x * scale| > 448 in float32, so the amax of a small tensor whose scale
    rounds up by one ulp was 1 of 64 elements "saturated" (1.56% > 0.1%) and
    its Linear kept in bf16, while cast_with_stats with the same scale
    counts none. The count is now what the cast does."""
    torch.manual_seed(4)
    x = torch.randn(4, 16)
    x[1, 3] = AMAX_ROUNDED_UP
    if rowwise:
        x[:, 5] = AMAX_ROUNDED_UP  # every row's (and the column's) amax
    scale = (448.0 / x.abs().amax().double()).float()
    assert (x.abs().amax() * scale).item() > 448.0  # the float32 product past 448
    _, stats = torchcast.cast_with_stats(x, torch.float8_e4m3fn, scale=scale.reshape(1),
                                         saturate=True)
    assert CastStats.from_tensor(stats, x.dtype, torch.float8_e4m3fn).saturated == 0
    m = recipe_measure(x, "rowwise" if rowwise else "tensorwise", "input")
    assert m.saturated == 0 and m.overflow_fraction == 0

    model = nn.Sequential(nn.Linear(16, 8))
    plan = torchcast.precision_plan(model, lambda: model(x).sum().backward(),
                                    recipes=("tensorwise",))
    assert not any("saturated" in reason for _, reason in plan.keep_in_bf16("tensorwise"))


def test_rowwise_is_torchaos_two_casts(captured):
    x = captured[1]["input"]
    ref = Measure()
    for dim in (-1, 0):
        y = torchao_cast(x, torch.float8_e4m3fn, ScalingGranularity.AXISWISE, dim, True)
        ref = ref + reference(x.double().numpy(), y)
    close(recipe_measure(x, "rowwise", "input"), ref)


def test_block_recipes_are_block_cast_along_both_axes(captured):
    x = captured[1]["input"]
    for recipe, fmt, mode in (("mxfp8", "mxfp8_e4m3", "rceil"), ("nvfp4", "nvfp4", "amax")):
        ref = Measure()
        for axis in (-1, 0):
            y = torchcast.block_cast(x, fmt, axis=axis, scale_mode=mode).dequantize(
                torch.float64)
            ref = ref + reference(x.double().numpy(), y.numpy())
        close(recipe_measure(x, recipe, "input"), ref)


def test_plan_holds_the_measures_of_what_the_layer_saw(captured):
    plan, seen, model = captured
    for role in ("input", "grad_output"):
        close(plan.measures[("2", "rowwise", role)], recipe_measure(seen[role], "rowwise", role))
    close(plan.measures[("2", "mxfp8", "weight")],
          recipe_measure(model[2].weight, "mxfp8", "weight"))


def test_rejects_exactly_the_outlier_layer(captured):
    plan = captured[0]
    assert plan.layers == ["0", "2", "4"]
    for recipe in ("tensorwise", "rowwise"):
        kept = plan.keep_in_bf16(recipe)
        assert [layer for layer, _ in kept] == ["0"]
        assert kept[0][1].startswith("input: ") and "flushed to zero > 1%" in kept[0][1]
    # MXFP8's blocks of 32 confine the outlier to its own block: a third of
    # tensorwise's flushes here, where that block is half of each row.
    flushed = {r: plan.measures[("0", r, "input")].underflow_fraction
               for r in ("tensorwise", "mxfp8")}
    assert 0.01 < flushed["mxfp8"] < flushed["tensorwise"] / 3
    assert "keep bf16" in str(plan) and "convert" in str(plan)


def test_filter_converts_exactly_the_planned_layers(captured):
    plan = captured[0]
    model = outlier_model()
    torchao_float8.convert_to_float8_training(
        model, config=torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise"),
        module_filter_fn=plan.module_filter_fn("tensorwise"))
    assert [type(model[i]).__name__ for i in (0, 2, 4)] == ["Linear", "Float8Linear",
                                                          "Float8Linear"]
    model(outlier_batch()).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_filter_is_quantize_filter_fn_for_mxfp8(captured):
    # torchao's MXFP8 training (emulated kernels on a CPU) wraps the weights
    # of the modules filter_fn accepts; the tensorwise plan keeps layer 0 out.
    config = pytest.importorskip("torchao.prototype.moe_training.config")
    from torchao.quantization import quantize_
    model = outlier_model()
    mx = config.MXFP8TrainingOpConfig.from_recipe(config.MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantize_(model, mx, filter_fn=captured[0].module_filter_fn("tensorwise"))
    assert [type(model[i].weight).__name__ for i in (0, 2, 4)] == [
        "Parameter", "MXFP8TrainingWeightWrapperTensor", "MXFP8TrainingWeightWrapperTensor"]


def test_round_trip(captured):
    plan = captured[0]
    d = json.loads(json.dumps(plan.to_dict()))
    back = torchcast.PrecisionPlan.from_dict(d)
    assert back == plan
    assert d["verdicts"]["tensorwise"]["0"] == plan.reasons("0", "tensorwise")
    assert str(back) == str(plan)


def test_thresholds_are_applied_as_given(captured):
    model, x = outlier_model(), outlier_batch()
    lax = torchcast.precision_plan(model, step_of(model, x), recipes="tensorwise",
                                   max_underflow=0.5)
    assert lax.keep_in_bf16("tensorwise") == []
    strict = torchcast.precision_plan(model, step_of(model, x), recipes=["nvfp4"],
                                      min_sqnr_db={"nvfp4": 40.0})
    assert [layer for layer, _ in strict.keep_in_bf16("nvfp4")] == ["0", "2", "4"]
    assert all("SQNR" in why for _, why in strict.keep_in_bf16("nvfp4"))
    assert math.isclose(strict.min_sqnr_db["nvfp4"], 40.0)


def test_errors():
    model, x = outlier_model(), outlier_batch()
    with pytest.raises(ValueError, match="'tensorwise', 'rowwise', 'mxfp8', 'nvfp4'"):
        torchcast.precision_plan(model, step_of(model, x), recipes=["mxfp4"])
    with pytest.raises(ValueError, match="ReLU has no nn.Linear"):
        torchcast.precision_plan(nn.ReLU(), lambda: None)
    with pytest.raises(ValueError, match="called none of the model's 3 nn.Linear"):
        torchcast.precision_plan(model, lambda: None)

    def inference():
        with torch.no_grad():
            model(x)
    with pytest.raises(ValueError, match="no gradient reached 0, 2, 4"):
        torchcast.precision_plan(model, inference)
    plan = torchcast.precision_plan(model, step_of(model, x), recipes="mxfp8")
    with pytest.raises(ValueError, match="'nvfp4' was not measured; this plan has 'mxfp8'"):
        plan.module_filter_fn("nvfp4")
    # The hooks are gone afterwards.
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_plan_inside_track_records_none_of_its_casts():
    model, x = outlier_model(), outlier_batch()
    with torchcast.track(all_casts=True, policy="record") as report:
        torchcast.precision_plan(model, step_of(model, x), recipes="tensorwise")
    assert report.records == []


@pytest.mark.parametrize("recipe, role, sqnr, flushed", [
    ("tensorwise", "input", 31.6, 9.5e-6), ("tensorwise", "grad_output", 25.6, 0.0),
    ("rowwise", "input", 31.5, 8.6e-6), ("mxfp8", "input", 31.5, 7.6e-6),
    ("nvfp4", "input", 20.4, 0.068)])
def test_default_thresholds_sit_below_a_normal_tensor(recipe, role, sqnr, flushed):
    # The figures plan.py and docs/precision_plan.md derive the defaults from.
    torch.manual_seed(0)
    m = recipe_measure(torch.randn(1024, 512), recipe, role)
    assert m.sqnr_db == pytest.approx(sqnr, abs=0.05)
    assert m.underflow_fraction == pytest.approx(flushed, rel=0.02)
    assert m.sqnr_db - DEFAULT_MIN_SQNR_DB[recipe] >= 7.5
    assert m.underflow_fraction < DEFAULT_MAX_UNDERFLOW[recipe] * 0.7
