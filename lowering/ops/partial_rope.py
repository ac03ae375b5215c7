"""npu_fuse::inplace_partial_rotary_mul — partial, in-place RoPE (spec section 2, seed 000).

Rotates ``x[..., start:end]`` (interleave pairs) and writes it back into x; the rest
of x keeps its value; ``start == end`` is a no-op. GE: custom op
``InplacePartialRotaryMul``; backward ``inplace_partial_rotary_mul_backward``.

A mutating custom op cannot carry a torch.library autograd formula, so training
goes through :func:`inplace_partial_rotary_mul`, the Python entry point seed 000
describes: an autograd.Function that marks x dirty and whose backward is the exact
adjoint, applied in place to a copy of the incoming gradient (r1/r2 get None).
"""

from typing import Optional, Sequence

import torch
from torch import Tensor

from npu_fuse_backend.soc import A2_A3, ASCEND950, fits_layout
from npu_fuse_backend.lowering.registry import decomposition, npu_kernel, refuse_autograd, soc_limits
from npu_fuse_backend.lowering.common import FLOAT_DTYPES, check_one_device, compute_dtype, rotate

__all__ = ["inplace_partial_rotary_mul"]  # public entry points (npu_fuse.ops)

MAX_HEAD_DIM = 1024
SCHEMA_TAIL = "Tensor r1, Tensor r2, *, str rotary_mode='interleave', int[2] partial_slice=[0, 0]) -> ()"


def check_inplace_partial_rotary_mul_args(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str,
                                          partial_slice: Sequence[int], name: str, x_name: str = "x") -> None:
    """Raise ValueError naming the op, the argument and the first rule of the contract it breaks
    (``x_name``: what the op calls the tensor it rotates in place, "grad" in the backward)."""
    if rotary_mode != "interleave":
        raise ValueError(f"{name}: only rotary_mode='interleave' is supported, got {rotary_mode!r}")
    if len(partial_slice) != 2:
        raise ValueError(f"{name}: partial_slice must be [start, end], got {list(partial_slice)}")
    check_one_device(name, {x_name: x, "r1": r1, "r2": r2})
    if x.dim() != 4:
        raise ValueError(f"{name}: {x_name} must be 4-D BSND, got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: {x_name} dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if any(size == 0 for size in x.shape):
        raise ValueError(f"{name}: every dim of {x_name} must be > 0, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: {x_name} must be contiguous, got strides {tuple(x.stride())}")
    head_dim = x.shape[-1]
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        raise ValueError(f"{name}: head dim D must be even and <= {MAX_HEAD_DIM} (last dim of {x_name}), "
                         f"got {head_dim}")
    start, end = partial_slice
    if not 0 <= start <= end <= head_dim:
        raise ValueError(f"{name}: partial_slice must satisfy 0 <= start <= end <= D={head_dim}, "
                         f"got [{start}, {end}]")
    if (end - start) % 2:
        raise ValueError(f"{name}: slice length end - start must be even, got {end - start}")
    if r1.dtype != r2.dtype or r1.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: r1 and r2 must share one float dtype (float16, bfloat16, float32), "
                         f"got r1 {r1.dtype} and r2 {r2.dtype}")
    for arg, r in (("r1", r1), ("r2", r2)):
        if r.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D, got {r.dim()}-D shape {tuple(r.shape)}")
        if r.shape[-1] != end - start:
            raise ValueError(f"{name}: last dim of {arg} must equal the slice length {end - start}, "
                             f"got {r.shape[-1]}")
        if end > start:
            for i in range(3):
                if r.shape[i] not in (1, x.shape[i]):
                    raise ValueError(f"{name}: {arg} shape {tuple(r.shape)} does not broadcast to "
                                     f"{x_name}[..., {start}:{end}] shape {tuple(x.shape[:3]) + (end - start,)}")


@torch.library.custom_op("npu_fuse::inplace_partial_rotary_mul", mutates_args=("x",),
                         schema="(Tensor(a!) x, " + SCHEMA_TAIL)
def _inplace_partial_rotary_mul_op(x, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)) -> None:
    check_inplace_partial_rotary_mul_args(x, r1, r2, rotary_mode, partial_slice, "npu_fuse.inplace_partial_rotary_mul")
    rotate_slice_in_place(x, r1, r2, partial_slice)


def rotate_slice_in_place(x: Tensor, r1: Tensor, r2: Tensor, partial_slice, adjoint: bool = False) -> None:
    start, end = partial_slice
    if start != end:
        x[..., start:end] = partial_rotary_reference(x[..., start:end], r1, r2, adjoint)


def partial_rotary_reference(x_slice: Tensor, r1: Tensor, r2: Tensor, adjoint: bool = False) -> Tensor:
    """x*r1 + R(x)*r2 (or its adjoint g*r1 - R(g*r2)) in fp32, rounded once."""
    dtype = compute_dtype(x_slice.dtype)
    xf, c, s = x_slice.to(dtype), r1.to(dtype), r2.to(dtype)
    out = xf * c - rotate(xf * s, "interleave") if adjoint else xf * c + rotate(xf, "interleave") * s
    return out.to(x_slice.dtype)


@_inplace_partial_rotary_mul_op.register_fake
def _(x, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    check_inplace_partial_rotary_mul_args(x, r1, r2, rotary_mode, partial_slice, "npu_fuse.inplace_partial_rotary_mul")


@torch.library.custom_op("npu_fuse::inplace_partial_rotary_mul_backward", mutates_args=("grad",),
                         schema="(Tensor(a!) grad, " + SCHEMA_TAIL)
def _inplace_partial_rotary_mul_backward_op(grad, r1, r2, *, rotary_mode="interleave",
                                            partial_slice=(0, 0)) -> None:
    check_inplace_partial_rotary_mul_args(grad, r1, r2, rotary_mode, partial_slice,
                                          "npu_fuse.inplace_partial_rotary_mul_backward", "grad")
    rotate_slice_in_place(grad, r1, r2, partial_slice, adjoint=True)


@_inplace_partial_rotary_mul_backward_op.register_fake
def _(grad, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    check_inplace_partial_rotary_mul_args(grad, r1, r2, rotary_mode, partial_slice,
                                          "npu_fuse.inplace_partial_rotary_mul_backward", "grad")


def _functional(x, r1, r2, rotary_mode="interleave", partial_slice=(0, 0)):
    """The op as a function of its inputs, what inductor lowers it to: (no outputs, new x)."""
    start, end = partial_slice
    if start == end:
        return (), (x.clone(),)
    rotated = partial_rotary_reference(x[..., start:end], r1, r2)
    return (), (torch.cat([x[..., :start], rotated, x[..., end:]], dim=-1),)


decomposition(torch.ops.npu_fuse.inplace_partial_rotary_mul.default)(_functional)
# cos/sin broadcast layouts against x[..., start:end] (BSND) each SoC's kernel takes
# (OT @ 116f7221 aclnnInplacePartialRotaryMul.md / @ 307cfaf2 aclnnInplacePartialRotaryMulGrad.md)
TABLE_LAYOUTS = {soc: ("BS1D", "B11D") for soc in A2_A3}
TABLE_LAYOUTS[ASCEND950] = ("BSND", "B1ND", "B11D", "111D")


def partial_rope_soc_limits(soc, x, r1, r2, partial_slice):
    if soc not in TABLE_LAYOUTS:
        return None
    start, end = partial_slice
    slice_shape = list(x.shape[:3]) + [end - start]
    for name, table in (("cos", r1), ("sin", r2)):
        if not any(fits_layout(table.shape, slice_shape, layout) for layout in TABLE_LAYOUTS[soc]):
            return (f"{name} layout {list(table.shape)} against x[..., {start}:{end}] {slice_shape} is not one of "
                    f"{', '.join(TABLE_LAYOUTS[soc])} that {soc} accepts")
    return None


@soc_limits(torch.ops.npu_fuse.inplace_partial_rotary_mul.default)
def _inplace_partial_rotary_mul_soc_limits(soc, x, r1, r2, rotary_mode="interleave", partial_slice=(0, 0)):
    return partial_rope_soc_limits(soc, x, r1, r2, partial_slice)


@soc_limits(torch.ops.npu_fuse.inplace_partial_rotary_mul_backward.default)
def _inplace_partial_rotary_mul_backward_soc_limits(soc, grad, r1, r2, rotary_mode="interleave",
                                                     partial_slice=(0, 0)):
    # Ascend950: InplacePartialRotaryMulGrad; A2/A3: InplacePartialRotaryMul (see the converter): same layouts
    return partial_rope_soc_limits(soc, grad, r1, r2, partial_slice)


# Eager NPU kernels: torch_npu 2.13 has no inplace_partial_rotary_mul(_backward) (cann-ops.md), so they
# are composed from aten ops, which run as NPU kernels: the rotation of the slice, written back.
# (torch_npu's npu_rotary_mul cannot stand in: on A2/A3 its interleave mode takes only 11SD/1S1D/S11D
# tables, not the BS1D/B11D ones this op takes.)
@npu_kernel(_inplace_partial_rotary_mul_op)
def _inplace_partial_rotary_mul_npu(x, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    check_inplace_partial_rotary_mul_args(x, r1, r2, rotary_mode, partial_slice, "npu_fuse.inplace_partial_rotary_mul")
    rotate_slice_in_place(x, r1, r2, partial_slice)


@npu_kernel(_inplace_partial_rotary_mul_backward_op)
def _inplace_partial_rotary_mul_backward_npu(grad, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    check_inplace_partial_rotary_mul_args(grad, r1, r2, rotary_mode, partial_slice,
                                          "npu_fuse.inplace_partial_rotary_mul_backward")
    rotate_slice_in_place(grad, r1, r2, partial_slice, adjoint=True)


refuse_autograd("inplace_partial_rotary_mul", "an input requires grad; call npu_fuse.ops.inplace_partial_rotary_mul, "
                "whose autograd.Function records the backward")
refuse_autograd("inplace_partial_rotary_mul_backward", "an input requires grad (no double backward)")


class _InplacePartialRotaryMul(torch.autograd.Function):
    """In place (x marked dirty), or on a copy of x that it returns (``in_place=False``)."""

    @staticmethod
    def forward(ctx, x, r1, r2, rotary_mode, partial_slice, in_place=True):
        if not in_place:
            x = x.clone(memory_format=torch.contiguous_format)
        torch.ops.npu_fuse.inplace_partial_rotary_mul(x, r1, r2, rotary_mode=rotary_mode,
                                                      partial_slice=partial_slice)
        if in_place:
            ctx.mark_dirty(x)
        ctx.save_for_backward(r1, r2)
        ctx.rotary_mode, ctx.partial_slice = rotary_mode, partial_slice
        return x

    @staticmethod
    def backward(ctx, grad):
        r1, r2 = ctx.saved_tensors
        grad = grad.clone(memory_format=torch.contiguous_format)  # never write into autograd's buffer
        torch.ops.npu_fuse.inplace_partial_rotary_mul_backward(grad, r1, r2, rotary_mode=ctx.rotary_mode,
                                                               partial_slice=ctx.partial_slice)
        return grad, None, None, None, None, None


def inplace_partial_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
                               partial_slice: Optional[Sequence[int]] = None) -> None:
    """Rotate ``x[..., start:end]`` in place (interleave RoPE); returns None like seed 000's API.

    x: 4-D [B, S, N, D] contiguous, float16/bfloat16/float32, D even and <= 1024. r1, r2: the cos
    and sin tables of the slice, 4-D, last dim ``end - start``, each other dim 1 or x's. The slice
    becomes ``s * r1 + rotate_every_two(s) * r2``; the rest of x keeps its value.
    ``partial_slice=None`` means ``[0, 0]`` (no-op). With autograd (x a non-leaf that requires
    grad), only x gets a gradient. On an NPU: aten ops on the slice (torch_npu has no such op).
    """
    partial_slice = [0, 0] if partial_slice is None else [int(v) for v in partial_slice]
    if torch.is_grad_enabled() and x.requires_grad:
        if x.is_leaf:
            raise RuntimeError("npu_fuse.inplace_partial_rotary_mul: a leaf Variable that requires grad "
                               "is being used in an in-place operation; rotate a copy (y = x * 1.0)")
        if torch.compiler.is_compiling():
            # Dynamo before torch 2.13 drops a mark_dirty output (the later ops read x as if never
            # rotated, and the backward skips the rotation): compute a copy, write it back
            x.copy_(_InplacePartialRotaryMul.apply(x, r1, r2, rotary_mode, partial_slice, False))
        else:
            _InplacePartialRotaryMul.apply(x, r1, r2, rotary_mode, partial_slice)
        return None
    torch.ops.npu_fuse.inplace_partial_rotary_mul(x, r1, r2, rotary_mode=rotary_mode, partial_slice=partial_slice)
    return None
