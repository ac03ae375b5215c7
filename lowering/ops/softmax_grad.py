"""npu_fuse::softmax_grad_ext — softmax backward with a scale (spec section 3).

``y = x2 * x1 * (grad - sum(grad * x1, axes, keepdim=True))``, x1 the softmax
output, x2 a scale (scalar-like or grad's shape). GE: ``SoftmaxGradExt``.
"""

import torch
from torch import Tensor

from npu_fuse_backend.soc import A2_A3
from npu_fuse_backend.lowering.registry import decomposition, npu_kernel, unavailable_on
from npu_fuse_backend.lowering.common import FLOAT_DTYPES, check_one_device, compute_dtype, like

__all__ = ["softmax_grad_ext"]  # public entry points (npu_fuse.ops)



def check_softmax_grad_ext_args(grad: Tensor, x1: Tensor, x2: Tensor, axes: list, keep_dims: bool) -> None:
    """Raise ValueError naming the op, the argument and the first rule of the contract it breaks."""
    name = "npu_fuse.softmax_grad_ext"
    check_one_device(name, {"grad": grad, "x1": x1, "x2": x2})
    if grad.shape != x1.shape:
        raise ValueError(f"{name}: grad and x1 must have equal shapes, got {tuple(grad.shape)} and "
                         f"{tuple(x1.shape)}")
    if not 1 <= grad.dim() <= 6:
        raise ValueError(f"{name}: grad and x1 must be 1-D to 6-D, got {grad.dim()}-D")
    if grad.numel() == 0:
        raise ValueError(f"{name}: empty tensors are not supported, got grad shape {tuple(grad.shape)}")
    for arg, t in (("grad", grad), ("x1", x1), ("x2", x2)):
        if t.dtype != grad.dtype or grad.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: grad, x1 and x2 must share one dtype of float16, bfloat16, float32; "
                             f"{arg} is {t.dtype}, grad {grad.dtype}")
    if not (x2.dim() == 0 or tuple(x2.shape) == (1,) or x2.shape == grad.shape):
        raise ValueError(f"{name}: x2 must be a scalar, shape (1,) or grad's shape {tuple(grad.shape)}, "
                         f"got {tuple(x2.shape)}")
    if len(axes) != 1 or axes[0] not in (-1, grad.dim() - 1):
        raise ValueError(f"{name}: axes must be the last dim ([-1] or [{grad.dim() - 1}]), got {list(axes)}")
    if not keep_dims:
        raise ValueError(f"{name}: keep_dims must be True")


@torch.library.custom_op(
    "npu_fuse::softmax_grad_ext", mutates_args=(),
    schema="(Tensor grad, Tensor x1, Tensor x2, int[] axes=[-1], bool keep_dims=True) -> Tensor")
def softmax_grad_ext(grad: Tensor, x1: Tensor, x2: Tensor, axes=(-1,), keep_dims: bool = True) -> Tensor:
    """Softmax backward times a scale: ``x2 * x1 * (grad - sum(grad * x1, axes, keepdim=True))``.

    grad: the gradient of the softmax output; x1: the softmax output (grad's shape, 1-D to 6-D);
    x2: the scale of the logits, a scalar tensor, shape (1,) or grad's shape; all one float dtype.
    axes: the softmax dim, the last ([-1]); keep_dims must be True. The result is the gradient of
    the softmax's scaled input. On an NPU: aten's softmax backward times x2 (GE: SoftmaxGradExt).
    """
    check_softmax_grad_ext_args(grad, x1, x2, axes, keep_dims)
    return softmax_grad_ext_reference(grad, x1, x2, axes, keep_dims)


@decomposition(torch.ops.npu_fuse.softmax_grad_ext.default)
def softmax_grad_ext_reference(grad, x1, x2, axes=(-1,), keep_dims=True):
    dtype = compute_dtype(grad.dtype)
    g, p, scale = grad.to(dtype), x1.to(dtype), x2.to(dtype)
    return like((scale * p * (g - (g * p).sum(-1, keepdim=True))).to(grad.dtype), grad)


@softmax_grad_ext.register_fake
def _(grad, x1, x2, axes=(-1,), keep_dims=True):
    check_softmax_grad_ext_args(grad, x1, x2, axes, keep_dims)
    return torch.empty_like(grad)  # laid out like grad



# ops-nn softmax_grad_ext_def.cpp has one AICore config, ascend950 (its fusion-pass doc: 950 only)
unavailable_on(torch.ops.npu_fuse.softmax_grad_ext.default, {
    soc: f"the SoftmaxGradExt GE op exists on Ascend950 only, not {soc} (ops-nn softmax_grad_ext op-def)"
    for soc in A2_A3})


@npu_kernel(softmax_grad_ext)
def _softmax_grad_ext_npu(grad, x1, x2, axes=(-1,), keep_dims=True):
    check_softmax_grad_ext_args(grad, x1, x2, axes, keep_dims)
    # torch_npu has no softmax_grad_ext; composed from aten's softmax backward (an NPU SoftmaxGrad)
    # and a multiply: x1 * (grad - sum(grad * x1)) is _softmax_backward_data(grad, x1).
    return torch.ops.aten._softmax_backward_data(grad, x1, axes[0], grad.dtype) * x2
