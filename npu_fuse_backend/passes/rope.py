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
from ..fusion import GraphBuilder, PassContext, Rewrite, register_fusion


@register_fusion
class RopeFusion(rotation.RotationPass):
    """Full-width (or sliced) RoPE, half or interleave, forward or backward -> one rotary_mul."""

    name = "rope"
    op = "rotary_mul"
    role = "rotary_mul"

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        rot = self.decision(ctx, anchor)
        if rot is None:
            return None
        self.check_site(rot, "rotary_mul takes 4-D BSND/BNSD x (3-D [T, N, D] and 2-D [T, D] are lifted)")

        def build(b: GraphBuilder) -> Node:
            source, xx, r1, r2 = self.op_inputs(b, rot)
            if rot.backward:
                grads = b.call(torch.ops.npu_fuse.rotary_mul_backward.default, xx, None, r1, r2, rot.mode, False)
                out = b.call(operator.getitem, grads, 0)
            else:
                out = b.call(torch.ops.npu_fuse.rotary_mul.default, xx, r1, r2, rot.mode)
            return rotation.finish(b, rot, source, b.cast(self.unlifted(b, rot, out), rot.out_dtype))

        op = "rotary_mul_backward" if rot.backward else self.op
        detail = f"mode={rot.mode}" + (", complex form" if rot.complex_form else "") + \
            ("" if (rot.start, rot.end) == (0, rot.head_dim) else f", lanes [{rot.start}:{rot.end}] of {rot.x.name}")
        return Rewrite(anchor, rot.nodes, op, build, detail=detail)
