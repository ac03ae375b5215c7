"""npu_fuse::rotary_mul — full-width RoPE (spec section 1), and its backward.

``out = x * r1 + R(x) * r2`` with R the half or interleave rotation; on an NPU it
is torch_npu's ``npu_rotary_mul`` (GE ``RotaryMul`` / ``RotaryPositionEmbedding``).
"""

from typing import Optional

import torch
from torch import Tensor

from ..registry import decomposition, npu_kernel
from ..rope_math import ROTARY_MODES, check_one_device, compute_dtype, like, rotate

__all__ = ["rotary_mul", "rotary_mul_backward"]  # public entry points (npu_fuse.ops)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_rotary_mul_args(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str, op: str = "npu_fuse.rotary_mul",
                          x_name: str = "x") -> None:
    """Raise ValueError naming the op, the argument and the first rule of the contract it breaks
    (``x_name``: what the op calls the rotated tensor, "grad" in the backward)."""
    if rotary_mode not in ROTARY_MODES:
        raise ValueError(f"{op}: rotary_mode must be one of {ROTARY_MODES}, got {rotary_mode!r}")
    check_one_device(op, {x_name: x, "r1": r1, "r2": r2})
    if x.dim() != 4:
        raise ValueError(f"{op}: {x_name} must be 4-D (BSND or BNSD), got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {x_name} dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if r1.dtype != x.dtype or r2.dtype != x.dtype:
        raise ValueError(f"{op}: r1, r2 and {x_name} must share one dtype, got {x_name} {x.dtype}, "
                         f"r1 {r1.dtype}, r2 {r2.dtype}")
    head_dim = x.shape[-1]
    if head_dim % 2 != 0:
        raise ValueError(f"{op}: head dim (last dim of {x_name}) must be even, got {head_dim}")
    for arg, r in (("r1", r1), ("r2", r2)):
        if r.dim() != 4:
            raise ValueError(f"{op}: {arg} must be 4-D, got {r.dim()}-D shape {tuple(r.shape)}")
        if r.shape[-1] != head_dim:
            raise ValueError(f"{op}: last dim of {arg} must equal head dim {head_dim}, got {r.shape[-1]}")
        for i in range(4):
            if r.shape[i] != 1 and r.shape[i] != x.shape[i]:
                raise ValueError(f"{op}: {arg} shape {tuple(r.shape)} does not broadcast to "
                                 f"{x_name} shape {tuple(x.shape)} (dim {i})")


@torch.library.custom_op("npu_fuse::rotary_mul", mutates_args=())
def rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    check_rotary_mul_args(x, r1, r2, rotary_mode)
    return rotary_mul_reference(x, r1, r2, rotary_mode)


@decomposition(torch.ops.npu_fuse.rotary_mul.default)
def rotary_mul_reference(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    dtype = compute_dtype(x.dtype)
    xf, c, s = x.to(dtype), r1.to(dtype), r2.to(dtype)
    return like((xf * c + rotate(xf, rotary_mode) * s).to(x.dtype), x)


@rotary_mul.register_fake
def _(x, r1, r2, rotary_mode="half"):
    check_rotary_mul_args(x, r1, r2, rotary_mode)
    return torch.empty_like(x)  # the kernel keeps x's layout


def check_rotary_mul_backward_args(grad, x, r1, r2, rotary_mode, need_backward) -> None:
    op = "npu_fuse.rotary_mul_backward"
    check_rotary_mul_args(grad, r1, r2, rotary_mode, op, "grad")
    if x is None:
        if need_backward:
            raise ValueError(f"{op}: need_backward=True (dr1, dr2) needs x, got None")
        return
    check_one_device(op, {"grad": grad, "x": x})
    if x.shape != grad.shape:
        raise ValueError(f"{op}: x shape {tuple(x.shape)} must equal grad shape {tuple(grad.shape)}")
    if x.dtype != grad.dtype:
        raise ValueError(f"{op}: x dtype {x.dtype} must equal grad dtype {grad.dtype}")


@torch.library.custom_op("npu_fuse::rotary_mul_backward", mutates_args=())
def rotary_mul_backward(grad: Tensor, x: Optional[Tensor], r1: Tensor, r2: Tensor, rotary_mode: str = "half",
                        need_backward: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dr1, dr2). With ``need_backward`` False only dx is computed (dr1/dr2 are
    zeros) and x may be None: dx does not depend on x."""
    check_rotary_mul_backward_args(grad, x, r1, r2, rotary_mode, need_backward)
    return rotary_mul_backward_reference(grad, x, r1, r2, rotary_mode, need_backward)


@decomposition(torch.ops.npu_fuse.rotary_mul_backward.default)
def rotary_mul_backward_reference(grad, x, r1, r2, rotary_mode="half", need_backward=True):
    dtype = compute_dtype(grad.dtype)
    g, c, s = grad.to(dtype), r1.to(dtype), r2.to(dtype)
    # The adjoint of x -> x*c + R(x)*s is g -> g*c + R^T(g*s), and R^T = -R.
    dx = like((g * c - rotate(g * s, rotary_mode)).to(grad.dtype), grad)
    if not need_backward:
        return dx, torch.zeros_like(r1), torch.zeros_like(r2)
    xf = x.to(dtype)
    dr1 = like((g * xf).sum_to_size(r1.shape).to(r1.dtype), r1)
    dr2 = like((g * rotate(xf, rotary_mode)).sum_to_size(r2.shape).to(r2.dtype), r2)
    return dx, dr1, dr2


@rotary_mul_backward.register_fake
def _(grad, x, r1, r2, rotary_mode="half", need_backward=True):
    check_rotary_mul_backward_args(grad, x, r1, r2, rotary_mode, need_backward)
    return torch.empty_like(grad), torch.empty_like(r1), torch.empty_like(r2)  # each like its input


def _setup_context(ctx, inputs, output):
    x, r1, r2, rotary_mode = inputs
    ctx.save_for_backward(x, r1, r2)
    ctx.rotary_mode = rotary_mode


def _backward(ctx, grad):
    x, r1, r2 = ctx.saved_tensors
    need_x, need_r1, need_r2 = ctx.needs_input_grad[:3]
    dx, dr1, dr2 = torch.ops.npu_fuse.rotary_mul_backward(
        grad, x, r1, r2, ctx.rotary_mode, need_r1 or need_r2)
    return dx if need_x else None, dr1 if need_r1 else None, dr2 if need_r2 else None, None


rotary_mul.register_autograd(_backward, setup_context=_setup_context)


@npu_kernel(rotary_mul)
def _rotary_mul_npu(x, r1, r2, rotary_mode="half"):
    return torch.ops.npu.npu_rotary_mul(x, r1, r2, rotary_mode)


@npu_kernel(rotary_mul_backward)
def _rotary_mul_backward_npu(grad, x, r1, r2, rotary_mode="half", need_backward=True):
    return torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, rotary_mode)
