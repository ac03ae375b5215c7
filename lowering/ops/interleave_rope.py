"""npu_fuse::interleave_rope — DeepSeek's pairs-in / half-out RoPE, and its backward.

x holds its rotary pairs interleaved, (x0, x1), (x2, x3), ...; the op gathers the even
positions into the first half and the odd ones into the second (``deinterleave``) and
applies half-mode RoPE there: ``out = P(x) * cos + rotate_half(P(x)) * sin``, the result
staying in half order. cos/sin are full width (D): the first half multiplies the even
lanes' outputs, the second half the odd lanes'. This is DeepSeek-V2/V3's
``apply_rotary_pos_emb`` (and transformers 5.x's ``apply_rotary_pos_emb_interleave``).

GE: ``InterleaveRope`` on Atlas A2/A3 (float16/bfloat16, D = 64, inference kernel),
``RotaryPositionEmbedding(mode=3)`` on Ascend950; backward ``RotaryPositionEmbeddingGrad(mode=3)``
(Ascend950 only). torch_npu: ``npu_interleave_rope``.
"""

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..registry import decomposition, npu_kernel, soc_limits
from ..rope_math import check_one_device, compute_dtype, rotate
from ...soc import A2_A3, ASCEND950, GENERIC, resolve_soc

__all__ = ["interleave_rope", "interleave_rope_backward"]  # public entry points (npu_fuse.ops)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERLEAVE_ROPE_HEAD_DIM = 64  # A2/A3's InterleaveRope kernel
MAX_HEAD_DIM_950 = 1024  # RotaryPositionEmbedding on Ascend950


def deinterleave(x: Tensor) -> Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): the pairs' lanes as two halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def interleave(x: Tensor) -> Tensor:
    """The inverse of :func:`deinterleave`."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def check_interleave_rope_args(x: Tensor, cos: Tensor, sin: Tensor, name: str = "npu_fuse.interleave_rope") -> None:
    """Raise ValueError naming the first rule of the contract the arguments break."""
    check_one_device(name, {"x": x, "cos": cos, "sin": sin})
    if x.dim() != 4:
        raise ValueError(f"{name}: x must be 4-D (B, N, S, D), got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"{name}: cos, sin and x must share one dtype, got x {x.dtype}, cos {cos.dtype}, "
                         f"sin {sin.dtype}")
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"{name}: head dim (last dim of x) must be even, got {head_dim}")
    for arg, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D, got {table.dim()}-D shape {tuple(table.shape)}")
        if table.shape[-1] != head_dim:
            raise ValueError(f"{name}: last dim of {arg} must equal head dim {head_dim} (full width), "
                             f"got {table.shape[-1]}")
        for i in range(3):
            if table.shape[i] != 1 and table.shape[i] != x.shape[i]:
                raise ValueError(f"{name}: {arg} shape {tuple(table.shape)} does not broadcast to "
                                 f"x shape {tuple(x.shape)} (dim {i})")


@torch.library.custom_op("npu_fuse::interleave_rope", mutates_args=())
def interleave_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    check_interleave_rope_args(x, cos, sin)
    return interleave_rope_reference(x, cos, sin)


@decomposition(torch.ops.npu_fuse.interleave_rope.default)
def interleave_rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """fp16/bf16 compute in fp32 and round once; the result is contiguous, like the NPU kernel's."""
    dtype = compute_dtype(x.dtype)
    xp = deinterleave(x.to(dtype))
    out = xp * cos.to(dtype) + rotate(xp, "half") * sin.to(dtype)
    return out.to(x.dtype).contiguous()


@interleave_rope.register_fake
def _(x, cos, sin):
    check_interleave_rope_args(x, cos, sin)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("npu_fuse::interleave_rope_backward", mutates_args=())
def interleave_rope_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """dx of :func:`interleave_rope` (in x's interleaved order); it does not depend on x."""
    check_interleave_rope_args(grad, cos, sin, "npu_fuse.interleave_rope_backward")
    return interleave_rope_backward_reference(grad, cos, sin)


@decomposition(torch.ops.npu_fuse.interleave_rope_backward.default)
def interleave_rope_backward_reference(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # out = P(x)*c + R(P(x))*s, R^T = -R and P^T = interleave: dx = interleave(g*c - R(g*s))
    dtype = compute_dtype(grad.dtype)
    g, c, s = grad.to(dtype), cos.to(dtype), sin.to(dtype)
    return interleave(g * c - rotate(g * s, "half")).to(grad.dtype).contiguous()


@interleave_rope_backward.register_fake
def _(grad, cos, sin):
    check_interleave_rope_args(grad, cos, sin, "npu_fuse.interleave_rope_backward")
    return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)


def _setup_context(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.save_for_backward(x, cos, sin)


def _backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    need_x, need_cos, need_sin = ctx.needs_input_grad
    dx = torch.ops.npu_fuse.interleave_rope_backward(grad, cos, sin) if need_x else None
    dcos = dsin = None
    if need_cos or need_sin:
        dtype = compute_dtype(x.dtype)
        g, xp = grad.to(dtype), deinterleave(x.to(dtype))
        dcos = (g * xp).sum_to_size(cos.shape).to(cos.dtype) if need_cos else None
        dsin = (g * rotate(xp, "half")).sum_to_size(sin.shape).to(sin.dtype) if need_sin else None
    return dx, dcos, dsin


interleave_rope.register_autograd(_backward, setup_context=_setup_context)


# -- what the NPU kernels take, per SoC (checked on every call a fusion inserts) ------------
def _same(a, b) -> bool:
    """Known equal, without adding a guard on a symbolic size."""
    return bool(a == b) if isinstance(a, int) and isinstance(b, int) else statically_known_true(a == b)


# Ascend950's RotaryPositionEmbedding reads x as (B, S, N, D); the cos/sin layouts it takes,
# by which of the three leading dims are x's (letter) or 1.
LAYOUTS_950 = ("111", "BSN", "B1N", "BS1", "11N", "1S1", "B11")


def _layout(table: Tensor, x: Tensor) -> str:
    return "".join("1" if _same(t, 1) else letter if _same(t, s) else "?"
                   for t, s, letter in zip(table.shape[:3], x.shape[:3], "BSN"))


def interleave_rope_limits(soc: str, x: Tensor, cos: Tensor, sin: Tensor, op: str = "interleave_rope"):
    """Why the SoC's kernel cannot take these arguments, or None."""
    if soc == GENERIC:
        return None
    head_dim = x.shape[-1]
    if tuple(cos.shape) != tuple(sin.shape):
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape"
    if soc in A2_A3:
        if op != "interleave_rope":
            return ("A2/A3 have no InterleaveRope gradient kernel (InterleaveRope is inference-only and "
                    "RotaryPositionEmbeddingGrad takes modes 0 and 1 there)")
        if x.dtype not in (torch.float16, torch.bfloat16):
            return f"InterleaveRope takes float16 or bfloat16, got {x.dtype}"
        if not _same(head_dim, INTERLEAVE_ROPE_HEAD_DIM):
            return f"InterleaveRope needs head dim D = {INTERLEAVE_ROPE_HEAD_DIM}, got {head_dim}"
        b, n, s = cos.shape[:3]
        if not (_same(b, x.shape[0]) and _same(n, 1) and (_same(s, 1) or _same(s, x.shape[2]))):
            return (f"InterleaveRope takes cos/sin of shape (B, 1, S or 1, D) against x (B, N, S, D) "
                    f"{tuple(x.shape)}, got {tuple(cos.shape)}")
        return None
    if soc == ASCEND950:
        if head_dim % 2 or head_dim > MAX_HEAD_DIM_950:
            return f"RotaryPositionEmbedding needs an even head dim <= {MAX_HEAD_DIM_950}, got {head_dim}"
        layout = _layout(cos, x)
        if layout not in LAYOUTS_950:
            return (f"RotaryPositionEmbedding takes cos/sin layouts {', '.join(l + 'D' for l in LAYOUTS_950)} "
                    f"(x read as BSND), got {tuple(cos.shape)} against x {tuple(x.shape)}")
        return None
    return None


@soc_limits(torch.ops.npu_fuse.interleave_rope.default)
def _interleave_rope_limits(soc, x, cos, sin):
    return interleave_rope_limits(soc, x, cos, sin)


@soc_limits(torch.ops.npu_fuse.interleave_rope_backward.default)
def _interleave_rope_backward_limits(soc, grad, cos, sin):
    return interleave_rope_limits(soc, grad, cos, sin, op="interleave_rope_backward")


@npu_kernel(interleave_rope)
def _interleave_rope_npu(x, cos, sin):
    if interleave_rope_limits(resolve_soc(), x, cos, sin) is None and resolve_soc() != GENERIC:
        return torch.ops.npu.npu_interleave_rope(x.contiguous(), cos.contiguous(), sin.contiguous())
    return interleave_rope_reference(x, cos, sin)
