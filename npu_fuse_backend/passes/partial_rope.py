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

Constraints: x 4-D (a 3-D ``[T, N, D]`` or 2-D ``[T, D]`` x is lifted), static head dim D <= 1024
and even, even slice length, one float dtype for x, cos, sin and the result (the op works in place, in
x's dtype), cos/sin broadcastable to ``x[..., s:e]``, no intermediate used outside. A subgraph that
breaks one is left to the full-RoPE pass, which fuses it (quietly, when it takes the same subgraph; a
near-miss of this pass otherwise says why the in-place op did not). The cos/sin layouts each SoC
accepts are the op's ``@soc_limits`` (lowering/ops/inplace_partial_rotary_mul.py), checked on every
rewrite (a near-miss of this pass; the full-RoPE pass then rotates the slice with rotary_mul).
"""

import operator
from typing import Optional

import torch
from torch.fx import Node

from .. import rotation
from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, register_fusion
from ..graph_utils import aten, broadcasts_to, describe, size_eq, static_int, users_outside, val
from ..lowering.ops.inplace_partial_rotary_mul import FLOAT_DTYPES, MAX_HEAD_DIM


# Unsqueezes that take x to BSND: [T, N, D] -> [1, T, N, D]; [T, D] -> [1, T, 1, D].
LIFT = {4: (), 3: (0,), 2: (0, 2)}


@register_fusion
class PartialRotaryFusion(FusionPass):
    """Interleave RoPE on part of the head dim, kept or written back -> one in-place op."""

    name = "partial_rope"
    family = "partial_rope"
    op = "inplace_partial_rotary_mul"
    role = "partial"
    runs_before = ("rope",)  # the full-RoPE pass would otherwise take the slice's rotation alone

    def anchors(self, ctx: PassContext):
        return [anchor for anchor, _ in rotation.analysis(ctx.graph, ctx.kind).decisions(self.role)]

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        analysis = rotation.analysis(ctx.graph, ctx.kind)
        found = dict(analysis.decisions(self.role)).get(anchor)
        if not isinstance(found, rotation.Rotation):
            return None
        refused = self._refused(found)
        if refused:
            if isinstance(dict(analysis.decisions("rotary_mul")).get(anchor), rotation.Rotation):
                return None  # the full-RoPE pass fuses this very subgraph: nothing to report
            raise NotFused(refused)
        x, start, end = found.x, found.start, found.end
        contiguous = val(x).is_contiguous()
        x_rank = val(x).dim()
        lift = LIFT[x_rank]

        def build(b: GraphBuilder) -> Node:
            xx = x if contiguous else b.call(aten.clone.default, x, memory_format=torch.contiguous_format)
            xx = b.lifted(xx, x_rank, lift)
            r1, r2 = (b.lifted(t.build(b), x_rank, lift) for t in found.tables)
            mutated = b.call(torch.ops.higher_order.auto_functionalized_v2,
                             torch.ops.npu_fuse.inplace_partial_rotary_mul.default, r1=r1, r2=r2,
                             rotary_mode="interleave", partial_slice=[start, end], _x_base_index=0, _all_bases=[xx])
            out = b.call(operator.getitem, mutated, 1)
            for dim in reversed(lift):
                out = b.call(aten.squeeze.dim, out, dim)
            return out

        return Rewrite(anchor, found.nodes, self.op, build, detail=f"slice=[{start}, {end}]")

    @staticmethod
    def _refused(rot: rotation.Rotation) -> Optional[str]:
        """Why the in-place op cannot take the subgraph, if it cannot."""
        try:
            PartialRotaryFusion._check(rot)
        except NotFused as why:
            return str(why)
        return None

    @staticmethod
    def _check(rot: rotation.Rotation) -> None:
        x, start, end, anchor = rot.x, rot.start, rot.end, rot.anchor
        xv = val(x)
        if xv.dim() not in LIFT:
            raise NotFused(f"x {x.name} is {xv.dim()}-D; inplace_partial_rotary_mul takes 4-D BSND x "
                           "(3-D [T, N, D] and 2-D [T, D] are lifted)")
        head_dim = static_int(xv.shape[-1])
        if size_eq(xv.numel(), 0):
            raise NotFused(f"x {x.name} of shape {list(xv.shape)} is empty; the op needs every dim > 0")
        if head_dim > MAX_HEAD_DIM or head_dim % 2:
            raise NotFused(f"head dim {head_dim} must be even and <= {MAX_HEAD_DIM}")
        dtypes = {xv.dtype, val(anchor).dtype, *(t.dtype for t in rot.tables)}
        if len(dtypes) != 1 or not dtypes <= set(FLOAT_DTYPES) or rot.x_rounds:
            raise NotFused(f"x, cos, sin and the result must share one float dtype, got {sorted(map(str, dtypes))}"
                           + (f" (x is rounded to {rot.x_rounds[-1]} first)" if rot.x_rounds else ""))
        slice_shape = list(xv.shape[:-1]) + [end - start]
        for name, table in zip(("cos", "sin"), rot.tables):
            shape = table.shape()
            if len(shape) > xv.dim() or not broadcasts_to(shape, slice_shape):
                raise NotFused(f"{name} shape {shape} is not broadcastable to x[..., {start}:{end}] shape "
                               f"{slice_shape}")
        leaked = users_outside(rot.nodes, [anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")
