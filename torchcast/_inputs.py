"""The check, shared by safe_to, cast_with_stats and kahan_sum/kahan_mean, that
x is a tensor kind the ops can take: a dense strided tensor, a subclass
without __torch_dispatch__ (such as nn.Parameter), or a traceable wrapper
subclass (``__tensor_flatten__``, as torch.compile requires of subclasses),
whose own __torch_dispatch__ runs the op on its inner tensors."""
import torch
from torch._C import _functorch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._ops import plain_tensor as _plain_tensor

_STRIDED = torch.strided
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
# The tensors the trackers measure as they are: other subclasses (FakeTensor,
# FunctionalTensor, DTensor) pass through them, their own dispatch reaching
# the plain tensors inside.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def dense_strided(t: torch.Tensor) -> bool:
    """Whether the kernels can read ``t`` as it is: strided and not nested
    (a sparse, mkldnn or nested tensor is cast by PyTorch alone)."""
    return t.layout is _STRIDED and not t.is_nested


def plain_dense(x: torch.Tensor) -> bool:
    """Whether the kernels may read x's data as it is: a torch.Tensor or
    nn.Parameter (exactly), dense and strided, neither quantized nor nested,
    outside every torch.func transform and functionalization. One call into
    C++ where compiled (csrc/ops.cpp's plain_tensor), the same questions in
    Python in the build without it."""
    if _plain_tensor is not None:
        return _plain_tensor(x)
    return (type(x) in PLAIN_TENSOR_TYPES and dense_strided(x) and not x.is_quantized
            and not _functorch.is_functorch_wrapped_tensor(x)
            and not torch._is_functional_tensor(x))


_LAYOUT_ADVICE = {
    torch.sparse_coo: "call .to_dense() first",
    torch.sparse_csr: "call .to_dense() first",
    torch.sparse_csc: "call .to_dense() first",
    torch.sparse_bsr: "call .to_dense() first",
    torch.sparse_bsc: "call .to_dense() first",
    torch._mkldnn: "call .to_dense() first",
    torch.jagged: "apply it to each component of .unbind()",
}


def check_input(x: torch.Tensor, fn: str, *, vmap: bool = True) -> None:
    """TypeError, naming the kind and the fix, if x is not a dense strided
    tensor (sparse, mkldnn, quantized, nested, a __torch_dispatch__ subclass
    other than the fake/functional tensors of torch.compile, or with
    ``vmap=False`` a tensor inside torch.vmap/torch.func). ``fn`` names the
    caller in the message. x must already be known to be a Tensor.

    The common case costs one call into C++: safe_to's per-call time is
    measured."""
    # is_compiling() first: Dynamo cannot trace the C++ query.
    if _plain_tensor is not None and not torch.compiler.is_compiling() and _plain_tensor(x):
        return
    if type(x) is torch.Tensor:
        if x.layout is _STRIDED and not (x.is_quantized or x.is_nested):
            # is_compiling() first: Dynamo cannot trace the functorch query.
            if vmap or torch.compiler.is_compiling() \
                    or not _functorch.is_functorch_wrapped_tensor(x):
                return
    elif torch.compiler.is_compiling():
        return  # Dynamo traces FakeTensors/FunctionalTensors through the op's fake kernel
    _reject(x, fn, vmap)


def _reject(x, fn, vmap):
    layout = x.layout
    if layout is not _STRIDED:
        name = str(layout).replace("torch.", "").lstrip("_")
        if layout is torch.jagged:
            name = "nested (jagged)"
        advice = _LAYOUT_ADVICE.get(layout, "convert it to a dense strided tensor first")
        raise TypeError(f"{fn}: x is a {name} tensor; torchcast takes dense strided tensors "
                        f"only: {advice}")
    if x.is_quantized:
        raise TypeError(f"{fn}: x is a quantized tensor ({x.dtype}); torchcast takes floating "
                        "tensors: call .dequantize() first")
    if x.is_nested:
        raise TypeError(f"{fn}: x is a nested tensor; torchcast takes dense strided tensors "
                        "only: apply it to each component of .unbind()")
    cls = type(x)
    if (cls.__torch_dispatch__ is not _PLAIN_DISPATCH and not _is_tracing_tensor(x)
            and not is_traceable_wrapper_subclass(x)):
        raise TypeError(
            f"{fn}: x is a {cls.__qualname__}, a tensor subclass with __torch_dispatch__ but no "
            "__tensor_flatten__, so torchcast cannot reach the tensors it wraps; pass its plain "
            "data, or use x.to(dtype) for an unmeasured cast")
    if not vmap and _functorch.is_functorch_wrapped_tensor(x):
        raise TypeError(
            f"{fn}: x is a tensor inside torch.vmap or another torch.func transform, whose "
            "stats cannot leave the transform; call it outside the transform, or use "
            "torchcast.cast_with_stats inside it (vmap gives per-example stats)")


def _is_tracing_tensor(x):
    """FakeTensor and FunctionalTensor: torch.compile's own subclasses, which
    run the ops' fake kernels."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(x, (FakeTensor, FunctionalTensor))
