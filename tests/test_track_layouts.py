"""Tracking never changes the program: casts of tensors the kernels cannot
read (sparse, nested) pass through as PyTorch makes them and are recorded as
not measured; a model whose modules return such tensors runs under
track(health=True) as it runs without it."""
import threading
import warnings

import pytest
import torch

import torchcast
from torchcast import _ops

warnings.filterwarnings("ignore", message=".*(beta|prototype).*", category=UserWarning)


def dense(t):
    return t.to_padded_tensor(0) if t.is_nested else t.to_dense()


LAYOUTS = {
    "coo": lambda x: x.to_sparse(),
    "csr": lambda x: x.to_sparse_csr(),
    "csc": lambda x: x.to_sparse_csc(),
    "nested": lambda x: torch.nested.nested_tensor([x[:2], x[2:]]),
}


@pytest.mark.parametrize("policy", ["record", "warn", "raise"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_casts_of_sparse_and_nested_tensors_pass_through(layout, policy):
    x = LAYOUTS[layout](torch.tensor([[1.0, 0.0, 1e-9], [0.0, 70000.0, 3.0], [1.0, 2.0, 3.0],
                                      [0.5, 0.0, 0.0]]))
    want_half, want_double = x.half(), x.to(torch.float64)
    with torchcast.track(all_casts=True, policy=policy) as report:
        got_half, got_double = x.half(), x.to(torch.float64)
    for got, want in ((got_half, want_half), (got_double, want_double)):
        assert got.layout == want.layout and got.dtype == want.dtype
        assert got.is_nested == want.is_nested
        assert torch.equal(dense(got), dense(want))
    records = report.records
    assert [(r.src_dtype, r.dtype, r.measured) for r in records] == \
        [(torch.float32, torch.float16, False), (torch.float32, torch.float64, False)]


def test_casts_in_another_thread_pass_through():
    x = torch.ones(3, 3).to_sparse()
    out = {}
    with torchcast.track(all_casts=True, policy="raise") as report:
        t = threading.Thread(target=lambda: out.setdefault("y", x.half()))
        t.start()
        t.join()
    assert out["y"].layout == torch.sparse_coo and torch.equal(out["y"].to_dense(), x.to_dense().half())
    # (the build without the extension does not see other threads' casts, and says so)
    assert [r.measured for r in report.records] == ([False] if _ops.WITH_EXTENSION else [])


class Sparsify(torch.nn.Module):
    def forward(self, x):
        return (x * 2).to_sparse()


def test_health_skips_sparse_outputs_and_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Sparsify())
    x = torch.randn(4, 3)
    want = model(x)
    with pytest.warns(RuntimeWarning, match="sparse_coo tensor, which tensor_health cannot read"):
        with torchcast.track(health=True, all_casts=True) as report:
            got = model(x)
    assert got.layout == torch.sparse_coo and torch.equal(got.to_dense(), want.to_dense())
    modules = {row.module for row in report.health}
    assert "0" in modules and "1" not in modules
