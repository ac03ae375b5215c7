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

from npu_fuse_backend.lowering.registry import decomposition, npu_kernel, soc_limits, unavailable_on
from npu_fuse_backend.graph_utils import size_eq
from npu_fuse_backend.lowering.common import HALF_DTYPES, check_rotation_args, compute_dtype, rotate
from npu_fuse_backend.lowering.ops.rope import rotary_position_embedding_950_limits
from npu_fuse_backend.soc import A2_A3, ASCEND950, GENERIC, resolve_soc

__all__ = ["interleave_rope", "interleave_rope_backward"]  # public entry points (npu_fuse.ops)

INTERLEAVE_ROPE_HEAD_DIM = 64  # A2/A3's InterleaveRope kernel


def deinterleave(x: Tensor) -> Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): the pairs' lanes as two halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def interleave(x: Tensor) -> Tensor:
    """The inverse of :func:`deinterleave`."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def check_interleave_rope_args(x: Tensor, cos: Tensor, sin: Tensor, name: str = "npu_fuse.interleave_rope") -> None:
    """Raise ValueError naming the first rule of the contract the arguments break (full-width cos/sin)."""
    check_rotation_args(name, x, {"cos": cos, "sin": sin}, layout="B, N, S, D")


@torch.library.custom_op("npu_fuse::interleave_rope", mutates_args=())
def interleave_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's RoPE: x's interleaved pairs de-interleaved into halves, then rotated as halves.

    ``out = P(x) * cos + rotate_half(P(x)) * sin`` with ``P(x) = cat(x[..., 0::2], x[..., 1::2])``:
    pairs in, halves out (transformers' DeepSeek-V3 ``apply_rotary_pos_emb_interleave``). x: 4-D
    [B, N, S, D]; cos, sin: x's dtype, last dim D, broadcast to x. On an NPU: torch_npu's
    ``npu_interleave_rope`` where its limits hold; differentiable.
    """
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
    """dx of :func:`interleave_rope` for the incoming ``grad``, in x's interleaved order:
    ``interleave(grad * cos - rotate_half(grad * sin))``; it does not depend on x."""
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
def interleave_rope_limits(soc: str, x: Tensor, cos: Tensor, sin: Tensor):
    """Why the SoC's kernel cannot take these arguments, or None."""
    if soc == GENERIC:
        return None
    head_dim = x.shape[-1]
    if tuple(cos.shape) != tuple(sin.shape):
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape"
    if soc in A2_A3:
        if x.dtype not in HALF_DTYPES:
            return f"InterleaveRope takes float16 or bfloat16, got {x.dtype}"
        if not size_eq(head_dim, INTERLEAVE_ROPE_HEAD_DIM):
            return f"InterleaveRope needs head dim D = {INTERLEAVE_ROPE_HEAD_DIM}, got {head_dim}"
        b, n, s = cos.shape[:3]
        if not (size_eq(b, x.shape[0]) and size_eq(n, 1) and (size_eq(s, 1) or size_eq(s, x.shape[2]))):
            return (f"InterleaveRope takes cos/sin of shape (B, 1, S or 1, D) against x (B, N, S, D) "
                    f"{tuple(x.shape)}, got {tuple(cos.shape)}")
        return None
    if soc == ASCEND950:  # RotaryPositionEmbedding mode 3, x read as (B, S, N, D) as in every mode
        return rotary_position_embedding_950_limits(x, (cos, sin))
    return None


@soc_limits(torch.ops.npu_fuse.interleave_rope.default)
def _interleave_rope_limits(soc, x, cos, sin):
    return interleave_rope_limits(soc, x, cos, sin)


@soc_limits(torch.ops.npu_fuse.interleave_rope_backward.default)
def _interleave_rope_backward_limits(soc, grad, cos, sin):
    return interleave_rope_limits(soc, grad, cos, sin)


unavailable_on(torch.ops.npu_fuse.interleave_rope_backward.default, {
    soc: f"{soc} has no InterleaveRope gradient kernel (InterleaveRope is inference-only and "
         "RotaryPositionEmbeddingGrad takes modes 0 and 1 there)" for soc in A2_A3})


@npu_kernel(interleave_rope)
def _interleave_rope_npu(x, cos, sin):
    if interleave_rope_limits(resolve_soc(), x, cos, sin) is None and resolve_soc() != GENERIC:
        return torch.ops.npu.npu_interleave_rope(x.contiguous(), cos.contiguous(), sin.contiguous())
    return interleave_rope_reference(x, cos, sin)
