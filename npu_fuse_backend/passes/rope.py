"""RoPE, full rotation -> ``npu_fuse::rotary_mul`` (spec section 1).

Pattern: whatever :mod:`~npu_fuse_backend.rotation` recognises as ``x * r1 + R(x) * r2`` with R the
half or interleave rotation, in any spelling (rotate_half by slices, chunk or split; the sign on
either half or on the add; GPT-J's pairs by strided slices, ``unbind`` or ``stack``; half-width
tables on contiguous halves, vLLM's native form; Meta's complex form ``view_as_real(
view_as_complex(x) * freqs_cis)``), on all of x's last dim or a slice of it (GPT-NeoX's partial
rotary: the other lanes are copied, as the subgraph did), forward or backward (autograd's
``g * cos + R^T(g * sin)`` becomes ``rotary_mul_backward``, whose tables it reads as they are).
DeepSeek's de-interleave-then-rotate-halves form with its de-interleaved x in the graph becomes
rotary_mul of that x when the interleave_rope pass does not take it.

Constraints (each failure is a near-miss with its reason): x is 4-D (a 3-D ``[T, N, D]`` or 2-D
``[T, D]`` x is lifted to 4-D and back), not empty, no intermediate used outside the subgraph; the
recognizer's own (static head dim, tables that do not vary with x and broadcast to it, signs of a
rotation, no rounding in the middle coarser than the result); and the op's own argument rules
(``check_rotary_mul_args``: even head dim, cos/sin broadcast to x with last dim D,
float16/bfloat16/float32), which the op checks on the call the rewrite builds.

Replacement: ``rotary_mul(x, r1, r2, mode)`` (or ``rotary_mul_backward(g, None, r1, r2, mode,
need_backward=False)[0]``) in the promotion of x's, the tables' and the result's dtypes (the op
computes in fp32 and rounds once), cast to the result's dtype; the tables rebuilt in the graph.
"""

import operator
from typing import Optional

import torch
from torch.fx import Node

from .. import rotation
from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, register_fusion
from ..graph_utils import aten, describe, size_eq, users_outside, val


@register_fusion
class RopeFusion(FusionPass):
    """Full-width (or sliced) RoPE, half or interleave, forward or backward -> one rotary_mul."""

    name = "rope"
    op = "rotary_mul"
    role = "rotary_mul"

    def anchors(self, ctx: PassContext):
        return [anchor for anchor, _ in rotation.analysis(ctx).decisions(self.role)]

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        found = dict(rotation.analysis(ctx).decisions(self.role)).get(anchor)
        if found is None:
            return None
        if isinstance(found, rotation.Refusal):
            raise NotFused(found.reason)
        return self._rewrite(found)

    def _rewrite(self, rot: rotation.Rotation) -> Rewrite:
        anchor, x = rot.anchor, rot.x
        self._check(anchor, x, rot.nodes)
        x_rank = val(x).dim()
        lift = rotation.BSND_LIFT[x_rank]

        def build(b: GraphBuilder) -> Node:
            source = x
            for dtype in rot.x_rounds:  # eager rounds x first (a cast before the rotation)
                source = b.cast(source, dtype)
            piece = source if (rot.start, rot.end) == (0, rot.head_dim) else \
                b.call(aten.slice.Tensor, source, -1, rot.start, rot.end)
            xx = b.lifted(b.cast(piece, rot.op_dtype), x_rank, lift)
            r1, r2 = (b.lifted(b.cast(t.build(b), rot.op_dtype), x_rank, lift) for t in rot.tables)
            if rot.backward:
                grads = b.call(torch.ops.npu_fuse.rotary_mul_backward.default, xx, None, r1, r2, rot.mode, False)
                out = b.call(operator.getitem, grads, 0)
            else:
                out = b.call(torch.ops.npu_fuse.rotary_mul.default, xx, r1, r2, rot.mode)
            for dim in reversed(lift):
                out = b.call(aten.squeeze.dim, out, dim)
            return rotation.finish(b, rot, source, b.cast(out, rot.out_dtype))

        op = "rotary_mul_backward" if rot.backward else self.op
        detail = f"mode={rot.mode}" + (", complex form" if rot.complex_form else "") + \
            ("" if (rot.start, rot.end) == (0, rot.head_dim) else f", lanes [{rot.start}:{rot.end}] of {x.name}")
        return Rewrite(anchor, rot.nodes, op, build, detail=detail)

    @staticmethod
    def _check(anchor: Node, x: Node, nodes: list) -> None:
        xv = val(x)
        if xv.dim() not in rotation.BSND_LIFT:
            raise NotFused(f"x {x.name} is {xv.dim()}-D; rotary_mul takes 4-D BSND/BNSD x "
                           "(3-D [T, N, D] and 2-D [T, D] are lifted)")
        if size_eq(xv.numel(), 0):
            raise NotFused(f"x {x.name} of shape {list(xv.shape)} is empty; nothing to fuse")
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")
