"""npu_fuse::rotary_mul — full-width RoPE (spec section 1), and its backward.

``out = x * r1 + R(x) * r2`` with R the half or interleave rotation; on an NPU it
is torch_npu's ``npu_rotary_mul`` (GE ``RotaryMul`` / ``RotaryPositionEmbedding``).
"""

from typing import Optional

import torch
from torch import Tensor

from npu_fuse_backend.graph_utils import static_int
from npu_fuse_backend.soc import A2_A3, ASCEND950, fits_layout
from npu_fuse_backend.lowering.registry import decomposition, npu_kernel, soc_limits
from npu_fuse_backend.lowering.common import ROTARY_MODES, check_one_device, check_rotation_args, compute_dtype, \
    like, rotate

__all__ = ["rotary_mul", "rotary_mul_backward"]  # public entry points (npu_fuse.ops)



def check_rotary_mul_args(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str, op: str = "npu_fuse.rotary_mul",
                          x_name: str = "x") -> None:
    """Raise ValueError naming the op, the argument and the first rule of the contract it breaks
    (``x_name``: what the op calls the rotated tensor, "grad" in the backward)."""
    if rotary_mode not in ROTARY_MODES:
        raise ValueError(f"{op}: rotary_mode must be one of {ROTARY_MODES}, got {rotary_mode!r}")
    check_rotation_args(op, x, {"r1": r1, "r2": r2}, x_name)


@torch.library.custom_op("npu_fuse::rotary_mul", mutates_args=())
def rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    """Rotary position embedding over the whole head dim: ``x * r1 + rotate(x) * r2``.

    x: 4-D, [B, S, N, D] or [B, N, S, D], float16/bfloat16/float32, D even. r1, r2: the cos and
    sin tables, 4-D, x's dtype, last dim D, each other dim 1 or x's (broadcast). rotary_mode:
    "half" (``rotate_half``: ``cat(-x2, x1)`` of the two halves) or "interleave" (pairs
    ``(x0, x1) -> (-x1, x0)``, GPT-J's ``rotate_every_two``). Returns a tensor like x.
    fp16/bf16 are computed in fp32 and rounded once. On an NPU: torch_npu's ``npu_rotary_mul``;
    differentiable (:func:`rotary_mul_backward`).
    """
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
    """The gradients of :func:`rotary_mul`: ``(dx, dr1, dr2)`` for the incoming ``grad`` (x's shape).

    ``dx = grad * r1 - rotate(grad * r2)``; dr1, dr2 are reduced to r1's and r2's shapes. With
    ``need_backward`` False only dx is computed (dr1, dr2 are zeros) and x may be None: dx does
    not depend on x. On an NPU: torch_npu's ``npu_rotary_mul_backward``.
    """
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


# -- SoC limits of the GE ops (RotaryMul / RotaryPositionEmbedding(+Grad)) --------------------------
# Atlas A2/A3 (W torch_npu/_op_plugin_docs.py:3523-3560, npu_rotary_mul; OT @ c29bc106
# aclnnRotaryPositionEmbedding.md): x BNSD, BSND or SBND, D < 896 and even; half mode: B, N < 1000
# and cos/sin in the layouts below; interleave mode: B * N < 1000 and cos/sin 11SD / 1S1D / S11D only.
A2_A3_MAX_HEAD_DIM = 896  # exclusive
A2_A3_MAX_BN = 1000  # exclusive: B and N (half), B * N (interleave)
A2_A3_TABLE_LAYOUTS = {  # x layout -> rotary_mode -> cos/sin layouts
    "BNSD": {"half": ("11SD", "B1SD", "BNSD"), "interleave": ("11SD",)},
    "BSND": {"half": ("1S1D", "BS1D", "BSND"), "interleave": ("1S1D",)},
    "SBND": {"half": ("S11D", "SB1D", "SBND"), "interleave": ("S11D",)},
}
# Ascend950 (same doc): x read as B, S, N, D; D <= 1024; cos/sin in these layouts, every mode.
A950_MAX_HEAD_DIM = 1024
A950_TABLE_LAYOUTS = ("111D", "BSND", "B1ND", "BS1D", "11ND", "1S1D", "B11D")


def rotary_position_embedding_950_limits(x: Tensor, tables) -> Optional[str]:
    """Why Ascend950's RotaryPositionEmbedding(Grad), in any mode, cannot take x with these cos/sin."""
    head_dim = static_int(x.shape[-1])
    if head_dim is None or head_dim > A950_MAX_HEAD_DIM:
        return f"head dim {x.shape[-1]} must be static and <= {A950_MAX_HEAD_DIM} (RotaryPositionEmbedding)"
    if not all(any(fits_layout(t.shape, x.shape, lay) for lay in A950_TABLE_LAYOUTS) for t in tables):
        shapes = " / ".join(str(list(t.shape)) for t in tables)
        return (f"cos/sin {shapes} against x {list(x.shape)} (read as BSND) is not one of the layouts "
                f"{', '.join(A950_TABLE_LAYOUTS)} (RotaryPositionEmbedding)")
    return None


def rope_soc_limits(soc: str, x: Tensor, tables, rotary_mode: str) -> Optional[str]:
    """Why the RoPE GE op of ``soc`` cannot take x with these cos/sin tables, or None."""
    if soc == ASCEND950:
        return rotary_position_embedding_950_limits(x, tables)
    if soc in A2_A3:
        head_dim = static_int(x.shape[-1])
        if head_dim is None or head_dim >= A2_A3_MAX_HEAD_DIM:
            return (f"head dim {x.shape[-1]} must be static and < {A2_A3_MAX_HEAD_DIM} "
                    "(RotaryMul/RotaryPositionEmbedding)")
        for x_layout, per_mode in A2_A3_TABLE_LAYOUTS.items():
            if all(any(fits_layout(t.shape, x.shape, lay) for lay in per_mode[rotary_mode]) for t in tables):
                b, n = (static_int(x.shape[x_layout.index(c)]) for c in "BN")
                if b is None or n is None:
                    continue
                if (b * n if rotary_mode == "interleave" else max(b, n)) < A2_A3_MAX_BN:
                    return None
        which = "B * N" if rotary_mode == "interleave" else "B and N"
        layouts = "; ".join(f"x {xl}: cos/sin {', '.join(m[rotary_mode])}" for xl, m in A2_A3_TABLE_LAYOUTS.items())
        shapes = " / ".join(str(list(t.shape)) for t in tables)
        return (f"cos/sin {shapes} against x {list(x.shape)}: {rotary_mode} mode takes {layouts}, "
                f"with static {which} < {A2_A3_MAX_BN}")
    return None  # (generic: the fallback lowerings take any RoPE)


@soc_limits(torch.ops.npu_fuse.rotary_mul.default)
def _rotary_mul_soc_limits(soc, x, r1, r2, rotary_mode="half"):
    return rope_soc_limits(soc, x, (r1, r2), rotary_mode)


@soc_limits(torch.ops.npu_fuse.rotary_mul_backward.default)
def _rotary_mul_backward_soc_limits(soc, grad, x, r1, r2, rotary_mode="half", need_backward=True):
    return rope_soc_limits(soc, grad, (r1, r2), rotary_mode)


# -- eager NPU kernels: torch_npu's ops (schemas: W torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml)
@npu_kernel(rotary_mul)
def _rotary_mul_npu(x, r1, r2, rotary_mode="half"):
    check_rotary_mul_args(x, r1, r2, rotary_mode)
    # npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None)
    return torch.ops.npu.npu_rotary_mul(x, r1, r2, rotary_mode)


@npu_kernel(rotary_mul_backward)
def _rotary_mul_backward_npu(grad, x, r1, r2, rotary_mode="half", need_backward=True):
    check_rotary_mul_backward_args(grad, x, r1, r2, rotary_mode, need_backward)
    # npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half'):
    # its self (x) is required. Without x only dx is asked for, and dx does not depend on x: it
    # is the adjoint rotation, composed from aten ops (torch_npu has no x-free backward).
    if x is None:
        return rotary_mul_backward_reference(grad, None, r1, r2, rotary_mode, need_backward=False)
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, rotary_mode)
    if not need_backward:
        return dx, torch.zeros_like(r1), torch.zeros_like(r2)
    return dx, dr1, dr2
