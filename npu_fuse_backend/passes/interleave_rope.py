"""DeepSeek's pairs-in / half-out RoPE -> ``npu_fuse::interleave_rope`` (and its backward).

The rotary pairs of x are interleaved, (x0, x1), (x2, x3), ...; the result is in half order (all
even lanes' outputs, then all odd lanes'): ``out[j] = cos[j] * x[D(j)] + sin[j] * R(x)[D(j)]``
with D the de-interleave. :mod:`~npu_fuse_backend.rotation` recognises it however it is written:
transformers 5.x DeepSeek-V3 (``cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])`` of the strided or
unbind'ed lanes, half-width tables: the op's tables are ``cat([cos, cos])``, or each half's own),
DeepSeek's reference code (de-interleave by ``view(..., D/2, 2).transpose(-1, -2).reshape``, then
rotate_half with full-width tables), and, in backward graphs, the adjoint of either as autograd
writes it; each becomes ``interleave_rope`` or ``interleave_rope_backward``.

Constraints (near-misses): x 2-D to 4-D (``[T, D]`` and ``[T, N, D]`` are lifted to ``(B, N, S,
D)`` with S = 1), not empty, no intermediate used outside the subgraph; the recognizer's own (static
head dim, tables that do not vary with x, signs of a rotation, no rounding coarser than the result in
the middle); and the op's own argument rules (``check_interleave_rope_args``: even head dim,
float16/bfloat16/float32, full-width cos/sin broadcastable to x), which the op checks on the call the
rewrite builds; the per-SoC limits of the op (A2/A3: float16/bfloat16, D = 64, cos/sin (B, 1, S or 1,
D); no backward kernel there) are checked by the pass manager.

Order (``fusion.PASS_ORDER``): before ``rope`` (which would take the half rotation of the reference
form alone), after ``mla_preprocess`` (which claims DeepSeek's RoPE inside a full prologue).
"""

from typing import Optional

import torch
from torch.fx import Node

from .. import rotation
from ..fusion import GraphBuilder, PassContext, Rewrite, register_fusion

# Unsqueezes that take x to (B, N, S, D): [T, N, D] -> [T, N, 1, D]; [T, D] -> [T, 1, 1, D].
LIFT = {4: (), 3: (2,), 2: (1, 2)}


@register_fusion
class InterleaveRopeFusion(rotation.RotationPass):
    """DeepSeek's interleaved-pairs RoPE (every written form, forward and backward) -> one op."""

    name = "interleave_rope"
    role = "interleave"
    lifts = LIFT

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        rot = self.decision(ctx, anchor)
        if rot is None:
            return None
        self.check_site(rot, "interleave_rope takes 4-D (B, N, S, D) x (2-D [T, D] and 3-D [T, N, D] are lifted)")

        def build(b: GraphBuilder) -> Node:
            source, xx, cos, sin = self.op_inputs(b, rot)
            op = torch.ops.npu_fuse.interleave_rope_backward if rot.backward else torch.ops.npu_fuse.interleave_rope
            out = b.call(op.default, xx, cos, sin)
            return rotation.finish(b, rot, source, b.cast(self.unlifted(b, rot, out), rot.out_dtype))

        op = "interleave_rope_backward" if rot.backward else "interleave_rope"
        detail = "halves-to-pairs adjoint" if rot.backward else "pairs-to-half"
        return Rewrite(anchor, rot.nodes, op, build, detail=detail)
