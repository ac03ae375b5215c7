"""Partial RoPE -> ``npu_fuse::inplace_partial_rotary_mul`` (spec section 2, seed 000).

Pattern: what :mod:`~npu_fuse_backend.rotation` recognises as x with the interleave RoPE of a
last-dim slice ``x[..., s:e]`` and its other lanes copied, however it is written:

* concatenated back with the untouched slices, ``cat([x[..., :s], rope, x[..., e:]], -1)``
  (GPT-J ``rotary_dim``, GLM), in any split of the kept lanes; or
* written back in place, ``x[..., s:e] = rope`` / ``copy_``, which functionalization turns into
  ``slice_scatter(x, rope, -1, s, e)`` (plus a final ``copy_`` when x is a graph input: that copy
  stays, so the graph mutates exactly what the user's did).

Replacement: ``auto_functionalized_v2(inplace_partial_rotary_mul, x, ...)`` and its new x, the
form AOTAutograd itself gives a mutating op (torchair converts it; inductor gets the op's
functional decomposition).

Decision: only interleave partial RoPE in the forward becomes the in-place op, since the NPU op has
only that mode. Half-mode partial RoPE (GPT-NeoX) and the backward of either are left to the
full-RoPE pass, which rotates the slice with rotary_mul and copies the other lanes: the rotation is
the costly part and rotary_mul takes any layout.

Constraints (near-misses): x 4-D (a 3-D ``[T, N, D]`` or 2-D ``[T, D]`` x is lifted), x not rounded
before the rotation and of the result's dtype (the op works in place, in x's dtype), no intermediate
used outside, and the op's own argument rules (``check_inplace_partial_rotary_mul_args``: D <= 1024
and even, even slice length, float dtypes, cos/sin broadcastable to ``x[..., s:e]``), asked at match
time. A subgraph that breaks one is left to the full-RoPE pass, which fuses it (quietly, when it
takes the same subgraph; a near-miss of this pass otherwise says why the in-place op did not). The
cos/sin layouts each SoC accepts are the op's ``@soc_limits`` (lowering/ops/partial_rope.py), checked
on every rewrite (a near-miss of this pass; the full-RoPE pass then rotates the slice with rotary_mul).
"""

import operator
from typing import Optional

import torch
from torch.fx import Node

from .. import rotation
from ..fusion import FakeValues, GraphBuilder, NotFused, PassContext, Rewrite, check_op_args, \
    register_fusion
from ..graph_utils import aten, describe, users_outside, val
from npu_fuse_backend.lowering.ops.partial_rope import check_inplace_partial_rotary_mul_args


@register_fusion
class PartialRopeFusion(rotation.RotationPass):
    """Interleave RoPE on part of the head dim, kept or written back -> one in-place op."""

    name = "partial_rope"
    op = "inplace_partial_rotary_mul"
    role = "partial"

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        analysis = rotation.analysis(ctx)
        found = analysis.decision(self.role, anchor)
        if not isinstance(found, rotation.Rotation):
            return None
        try:
            self._check(ctx, found)
        except NotFused:
            if isinstance(analysis.decision("rotary_mul", anchor), rotation.Rotation):
                return None  # the full-RoPE pass fuses this very subgraph: nothing to report
            raise

        def build(b: GraphBuilder) -> Node:
            xx, r1, r2 = _arguments(b, found)
            mutated = b.call(torch.ops.higher_order.auto_functionalized_v2,
                             torch.ops.npu_fuse.inplace_partial_rotary_mul.default, r1=r1, r2=r2,
                             rotary_mode="interleave", partial_slice=[found.start, found.end], _x_base_index=0,
                             _all_bases=[xx])
            return self.unlifted(b, found, b.call(operator.getitem, mutated, 1))

        return Rewrite(anchor, found.nodes, self.op, build, detail=f"slice=[{found.start}, {found.end}]")

    @staticmethod
    def _check(ctx: PassContext, rot: rotation.Rotation) -> None:
        x, anchor = rot.x, rot.anchor
        xv = val(x)
        if xv.dim() not in rotation.BSND_LIFT:
            raise NotFused(f"x {x.name} is {xv.dim()}-D; inplace_partial_rotary_mul takes 4-D BSND x "
                           "(3-D [T, N, D] and 2-D [T, D] are lifted)")
        if rot.x_rounds:
            raise NotFused(f"x {x.name} is rounded to {rot.x_rounds[-1]} before the rotation; the op rotates x "
                           "in place, in x's dtype")
        if val(anchor).dtype != xv.dtype:
            raise NotFused(f"the result is {val(anchor).dtype}, x {xv.dtype}: the op writes the rotated slice "
                           "into x, in x's dtype")
        leaked = users_outside(rot.nodes, [anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")
        # (an argument the builder would not touch is the graph's node itself: its value)
        xx, r1, r2 = torch.fx.map_arg(_arguments(FakeValues(ctx.fake_mode), rot), lambda n: n.meta["val"])
        check_op_args(check_inplace_partial_rotary_mul_args, xx, r1, r2, "interleave", [rot.start, rot.end],
                      "npu_fuse.inplace_partial_rotary_mul")


def _arguments(b, rot: rotation.Rotation) -> tuple:
    """The op's x, r1 and r2 (lifted to BSND, x contiguous), built by ``b`` (a GraphBuilder, or FakeValues
    at match time)."""
    x_rank, lift = val(rot.x).dim(), rotation.BSND_LIFT[val(rot.x).dim()]
    xx = rot.x if val(rot.x).is_contiguous() else b.call(aten.clone.default, rot.x, memory_format=torch.contiguous_format)
    return (b.lifted(xx, x_rank, lift), *(b.lifted(t.build(b), x_rank, lift) for t in rot.tables))
