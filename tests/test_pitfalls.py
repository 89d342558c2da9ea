"""The claims of the two articles the project grew from (named in
docs/pitfalls.md), tested against the installed PyTorch one by one;
docs/pitfalls.md names each test. A claim that no test can check (a survey
figure, a paper, an old version) is marked unverifiable in the document and
has no test here."""
import io
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchcast


@pytest.fixture
def default_dtype():
    """Restores the global default dtype a test changes."""
    saved = torch.get_default_dtype()
    yield
    torch.set_default_dtype(saved)


# --- "x.float() / x.type() cut the graph" ---------------------------------------------

class FaultyLayer(torch.nn.Module):
    """The article's "faulty" layer, verbatim."""

    def forward(self, x):
        x = x.float() if x.dtype == torch.float64 else x
        return x * 2


def test_faulty_layer_gradient_is_not_none():
    x = torch.randn(3, requires_grad=True, dtype=torch.float64)
    y = FaultyLayer()(x)
    y.sum().backward()
    assert x.grad is not None
    assert x.grad.dtype == torch.float64  # back in x's dtype
    assert torch.equal(x.grad, torch.full((3,), 2.0, dtype=torch.float64))


@pytest.mark.parametrize("cast", [
    lambda x: x.float(), lambda x: x.to(torch.float32), lambda x: x.type(torch.float),
    lambda x: x.type("torch.FloatTensor"), lambda x: x.half(), lambda x: x.bfloat16(),
], ids=["float", "to", "type_dtype", "type_str", "half", "bfloat16"])
def test_floating_casts_keep_the_graph(cast):
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = cast(x)
    assert y.requires_grad and type(y.grad_fn).__name__ == "ToCopyBackward0"
    (y.float() * torch.arange(4.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(4.0, dtype=torch.float64))


def test_autocast_keeps_the_graph():
    w = torch.randn(3, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.mm(torch.randn(2, 3), w)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


def test_what_really_cuts_the_graph():
    x = torch.randn(4, requires_grad=True)
    assert (x * 3).long().grad_fn is None and not (x * 3).long().requires_grad  # integer dtype
    assert (x > 0).grad_fn is None                                              # bool
    assert x.detach().grad_fn is None and not x.detach().requires_grad
    with torch.no_grad():
        assert not x.double().requires_grad
    with pytest.raises(RuntimeError, match="requires grad"):
        x.numpy()
    assert isinstance(x.sum().item(), float) and isinstance(x.tolist(), list)  # plain Python
    # torchcast says so where it happens
    with torchcast.track(all_casts=True, policy="record") as report:
        (x * 3).long()
    assert report.records[0].graph_cuts == 1


# --- precision of float32 ---------------------------------------------------------------

def test_float32_has_about_7_digits_float64_about_16():
    assert torch.finfo(torch.float32).eps == 2.0 ** -23
    assert torch.finfo(torch.float64).eps == 2.0 ** -52
    assert 7 < 24 * math.log10(2) < 7.3 and 15.9 < 53 * math.log10(2) < 16


def test_first_row_float32_value_and_its_error():
    x = torch.tensor([1.23456789012345, 2.34567890123456], dtype=torch.float64)
    y = x.float()
    assert f"{y[0].item():.8g}" == "1.2345679"  # the article's value
    rel = ((y.double() - x) / x).abs()
    assert 0 < rel.max() < 2.0 ** -24  # not 0%: one rounding, at most half an ulp
    assert rel.tolist() == pytest.approx([7.7e-9, 4.0e-8], rel=0.02)
    with torchcast.track(all_casts=True, policy="record") as report:
        x.float()
    s = report.records[0].stats
    assert s.inexact == 2 and s.max_rel_err == rel.max().item()


def test_hundred_square_roots_reach_exactly_one():
    """The article's float64 1.00002146969117 after 100 square roots is false:
    1.2345...^(2^-100) = 1 + 1.7e-31, which is 1.0 in both formats."""
    x64 = torch.tensor(1.23456789012345, dtype=torch.float64)
    x32 = x64.float()
    for _ in range(100):
        x64, x32 = x64.sqrt(), x32.sqrt()
    assert x64.item() == 1.0 and x32.item() == 1.0
    assert math.log(1.23456789012345) * 2.0 ** -100 == pytest.approx(1.7e-31, rel=0.02)
    assert 1.7e-31 < 2.0 ** -53  # far below float64's resolution at 1


def test_e_row_is_just_e_rounded():
    e32 = torch.tensor(math.e, dtype=torch.float32)
    assert f"{e32.item():.8g}" == "2.7182817"
    rel = abs(e32.double().item() - math.e) / math.e
    assert 3.0e-8 < rel < 3.1e-8  # 0.000003%, not the article's 0.000004%


def test_float32_accumulated_error_depends_on_the_algorithm():
    """No fixed "1% after 1000 iterations": a running float32 sum can lose
    everything (each +1 rounds away at 2^24), torch's reductions almost
    nothing."""
    x = np.ones(1_000_001, dtype=np.float32)
    x[0] = 2.0 ** 24
    exact = 2.0 ** 24 + 1_000_000
    running = float(np.add.accumulate(x)[-1])  # sequential, in float32
    assert running == 2.0 ** 24 and (exact - running) / exact > 0.05
    t = torch.from_numpy(x)
    assert abs(torch.sum(t).item() - exact) / exact < 1e-5   # blocked/pairwise reduction
    assert torch.cumsum(t, 0)[-1].item() == exact            # CPU cumsum accumulates in double


def test_float16_gradients_underflow_bfloat16_do_not():
    g = torch.tensor([1e-8, 3e-6])
    assert g.half()[0] == 0 and g.half()[1] != 0
    smallest = torch.tensor([2.0 ** -24, 2.0 ** -26]).half()  # the smallest float16: 6e-8
    assert smallest[0] == 2.0 ** -24 and smallest[1] == 0
    assert (g.bfloat16() != 0).all()                       # bfloat16 has float32's range
    with torchcast.track(all_casts=True, policy="record") as report:
        g.half()
    assert report.records[0].stats.underflow == 1 and report.records[0].violations()


def test_double_rounding_of_float64_to_float16_and_bfloat16():
    """torch casts float64 to float16/bfloat16 through float32: two roundings.
    numpy (float16) and torchcast.safe_to round once."""
    x = torch.tensor([1 + 2.0 ** -11 + 2.0 ** -40], dtype=torch.float64)
    assert x.half().item() == 1.0                                 # through float32: a tie, to even
    assert float(np.float16(x.item())) == 1 + 2.0 ** -10           # one rounding
    assert torchcast.safe_to(x, torch.float16, policy="ignore").item() == 1 + 2.0 ** -10
    xb = torch.tensor([1 + 2.0 ** -8 + 2.0 ** -40], dtype=torch.float64)
    assert xb.bfloat16().item() == 1.0
    assert torchcast.safe_to(xb, torch.bfloat16, policy="ignore").item() == 1 + 2.0 ** -7
    # and the second rounding can overflow: 65519.99999999999 is below the
    # float16 overflow threshold 65520, but rounds to it in float32
    big = torch.tensor([65519.99999999999], dtype=torch.float64)
    assert torch.isinf(big.half()).item()
    assert torchcast.safe_to(big, torch.float16, policy="ignore").item() == 65504.0
    with torchcast.track(all_casts=True, policy="record") as report:
        big.half()
    assert report.records[0].stats.overflow == 1 and report.records[0].double_rounded == 1


def test_dtypes_are_not_ordered():
    """The article's validate_precision compares dtypes with <."""
    with pytest.raises(TypeError):
        torch.float32 < torch.float64
    assert torch.finfo(torch.float32).bits < torch.finfo(torch.float64).bits
    assert torch.promote_types(torch.float32, torch.float64) == torch.float64


# --- mixed precision ----------------------------------------------------------------------

def test_manual_float_inside_autocast_does_not_disable_autocast():
    w = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(2, 4).float()
        assert x.dtype == torch.float32
        assert torch.mm(x, w).dtype == torch.bfloat16  # the op is still autocast
        assert (x * 2).dtype == torch.float32           # ops outside autocast's lists keep float32


def test_no_grad_float_is_float32_and_cuts_because_of_no_grad():
    @torch.no_grad()
    def custom_op(x):
        return x.float()

    x = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert custom_op(x).dtype == torch.float32 and x.float().dtype == torch.float32
        assert not custom_op(x).requires_grad and x.float().requires_grad


def test_is_autocast_enabled_without_device_ignores_cpu_autocast():
    """The article's smart_cast tests torch.is_autocast_enabled() with no
    argument: that is CUDA's autocast; under CPU autocast it is False."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled() is False
        assert torch.is_autocast_enabled("cpu") is True


def test_cuda_amp_spellings_are_deprecated():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.amp.autocast()
        torch.cuda.amp.GradScaler()
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert any("torch.amp.autocast('cuda'" in m for m in future)
    assert any("torch.amp.GradScaler('cuda'" in m for m in future)


def test_float_class_targets_break_cross_entropy():
    """The article's TypeSafeTrainingSystem casts every target to float32."""
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    F.cross_entropy(logits, labels)
    with pytest.raises(RuntimeError, match="Long"):
        F.cross_entropy(logits, labels.to(torch.float32))
    with pytest.raises(RuntimeError, match="Long"):
        F.cross_entropy(logits, labels.to(torch.int32))


def test_buffer_follows_model_to_dtype():
    """The article's SafeTypeLayer: a floating buffer follows model.double()."""
    class SafeTypeLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("dtype_flag", torch.tensor(0, dtype=torch.float32))

        def forward(self, x):
            return x.to(self.dtype_flag.dtype)

    layer = SafeTypeLayer().double()
    x = torch.randn(2, requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.float64 and y.requires_grad


# --- the Adam article ---------------------------------------------------------------------

def test_float64_input_into_float32_linear_raises():
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype, but got "
                                           "Double and Float"):
        torch.nn.Linear(3, 2)(torch.randn(4, 3, dtype=torch.float64))


def test_invalid_value_warning_is_numpys():
    with pytest.warns(RuntimeWarning, match="invalid value encountered in multiply"):
        np.multiply(np.array([np.inf]), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.isnan(torch.tensor([math.inf]) * 0).all()  # torch: NaN, no warning


def test_default_dtype_is_float32_numpy_is_float64():
    assert torch.get_default_dtype() == torch.float32
    assert torch.tensor([0.5]).dtype == torch.float32
    assert torch.from_numpy(np.random.rand(3)).dtype == torch.float64
    assert torch.as_tensor(np.random.rand(3)).dtype == torch.float64
    assert (torch.ones(2) + torch.ones(2, dtype=torch.float64)).dtype == torch.float64  # promotes
    assert (torch.ones(2) * torch.tensor(0.1, dtype=torch.float64)).dtype == torch.float32  # 0-d


def test_set_default_dtype_does_not_convert_numpy_or_loaded_data(default_dtype):
    before = torch.nn.Linear(2, 2)
    buf = io.BytesIO()
    torch.save(torch.randn(3, dtype=torch.float64), buf)
    torch.set_default_dtype(torch.float32)
    assert torch.from_numpy(np.random.rand(3)).dtype == torch.float64
    assert torch.as_tensor(np.random.rand(3)).dtype == torch.float64
    buf.seek(0)
    assert torch.load(buf).dtype == torch.float64
    torch.set_default_dtype(torch.float64)
    assert before.weight.dtype == torch.float32  # made before: unchanged
    assert torch.nn.Linear(2, 2).weight.dtype == torch.float64  # made after
    assert torch.tensor([0.5]).dtype == torch.float64  # Python numbers follow
    assert torch.from_numpy(np.random.rand(3).astype(np.float32)).dtype == torch.float32


def test_set_default_tensor_type_is_deprecated(default_dtype):
    with pytest.warns(UserWarning, match=r"set_default_tensor_type\(\) is deprecated.*"
                                         r"set_default_dtype\(\) and torch.set_default_device"):
        torch.set_default_tensor_type(torch.FloatTensor)


def test_torch_load_has_no_dtype_argument():
    buf = io.BytesIO()
    torch.save(torch.randn(2, dtype=torch.float64), buf)
    buf.seek(0)
    with pytest.raises(TypeError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "pickle_load_args only works if weights_only=False"
        torch.load(buf, dtype=torch.float32)
    buf.seek(0)
    assert torch.load(buf).to(torch.float32).dtype == torch.float32  # what works


def test_no_adamv2_and_no_auto_type():
    assert not hasattr(torch.optim, "AdamV2")
    with pytest.raises(TypeError, match="auto_type"):
        torch.optim.Adam([torch.nn.Parameter(torch.randn(2))], auto_type=True)


def test_gradients_come_in_the_parameters_dtype():
    p = torch.nn.Parameter(torch.randn(3))
    (p.double() * torch.randn(3, dtype=torch.float64)).sum().backward()
    assert p.grad.dtype == torch.float32
    q = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(RuntimeError, match="dtype"):
        q.grad = torch.randn(3, dtype=torch.float64)


def test_adam_fails_on_states_of_another_dtype_and_audit_finds_it():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    model.double()
    model(torch.randn(1, 2, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError):
        opt.step()
    report = torchcast.audit(model, torch.randn(1, 2, dtype=torch.float64), opt)
    assert len(report.of_kind("optimizer_state")) == 4


def test_element_sizes():
    assert torch.empty(0, dtype=torch.float32).element_size() == 4
    assert torch.empty(0, dtype=torch.float64).element_size() == 8


def test_model_to_float32_after_construction_works():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).double()
    model.to(torch.float32)
    assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} == \
        {torch.float32}
    model(torch.randn(4, 3)).sum().backward()
    assert torchcast.audit(model, torch.randn(4, 3)).ok


def test_converting_the_data_once_is_the_fix():
    data = np.random.default_rng(0).normal(size=(4, 3))
    model = torch.nn.Linear(3, 1)
    model(torch.as_tensor(data, dtype=torch.float32))
    model(torch.from_numpy(data).float())
    report = torchcast.audit(model, torch.from_numpy(data))
    assert report.of_kind("input_dtype")


def test_python_int_label_breaks_cross_entropy():
    """The article's template iterates a dataset of (tensor, int) and passes
    the int label to cross_entropy."""
    with pytest.raises(TypeError, match="must be Tensor, not int"):
        F.cross_entropy(torch.randn(1, 10), 3)
