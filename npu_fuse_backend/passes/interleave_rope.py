"""DeepSeek's pairs-in / half-out RoPE -> ``npu_fuse::interleave_rope`` (and its backward).

The rotary pairs of x are interleaved, (x0, x1), (x2, x3), ...; the result is in half
order (all even lanes' outputs, then all odd lanes'). Real code writes it two ways:

* transformers 5.x DeepSeek-V3 (``rope_interleave=True``), cos/sin of half width::

      q1, q2 = q[..., 0::2], q[..., 1::2]
      cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)

  (lanes also by ``unbind``/``select`` of ``x.view(..., D/2, 2)``; operands in any order);
  the op's full-width tables are ``cat([cos, cos], -1)`` (each half's own table when the
  two halves use different ones: the op computes exactly that);
* DeepSeek's reference code (and transformers 4.x): de-interleave by
  ``x.view(..., D/2, 2).transpose(-1, -2).reshape(..., D)``, then ``x * cos + rotate_half(x) * sin``
  with full-width tables.

Backward graphs: the adjoint of each form, as autograd writes it: for the first, the two
lanes written back with ``slice_backward`` at step 2 (``dx_even = g0*cos + g1*sin``,
``dx_odd = g1*cos - g0*sin``, g0/g1 the halves of g); for the second, a half-mode RoPE
gradient re-interleaved by ``view(..., 2, D/2).transpose(-1, -2).reshape(..., D)``. Each
becomes ``interleave_rope_backward(g, cos, sin)``.

Constraints (near-misses): x 2-D to 4-D (``[T, D]`` and ``[T, N, D]`` are lifted to
``(B, N, S, D)`` with S = 1), static head dim, each half's table (forward 5.x: D/2 wide)
broadcastable to x's half, no intermediate used outside the subgraph, and the op's own argument
rules (``check_interleave_rope_args``: even head dim, float16/bfloat16/float32, full-width cos/sin
broadcastable to x), which the op checks on the call the rewrite builds; the per-SoC limits of
the op (A2/A3: float16/bfloat16, D = 64, cos/sin (B, 1, S or 1, D); no backward kernel there)
are checked by the pass manager.

Order (``fusion.PASS_ORDER``): before ``rope`` (which would take the half rotation of the
reference form alone), after ``mla_preprocess`` (which claims DeepSeek's RoPE inside a full prologue).
"""

from typing import Optional

import torch
from torch.fx import Node

from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, register_fusion
from ..graph_utils import VIEWS, aten, broadcasts_to, describe, rank, shape_eq, static_int, users_outside, val
from ..matchers import (PairsToHalfRope, deinterleaved, match_pairs_to_half_rope, match_pairs_to_half_rope_backward,
                        match_rope_grad_site, match_rope_site, quiet, reinterleaved)

# Unsqueezes that take x to (B, N, S, D): [T, N, D] -> [T, N, 1, D]; [T, D] -> [T, 1, 1, D].
LIFT = {4: (), 3: (2,), 2: (1, 2)}


@register_fusion
class InterleaveRopeFusion(FusionPass):
    """DeepSeek's interleaved-pairs RoPE (both written forms, forward and backward) -> one op."""

    name = "interleave_rope"
    anchor_targets = (aten.cat.default, aten.add.Tensor, *VIEWS)

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        if anchor.target == aten.cat.default:
            found = match_pairs_to_half_rope(anchor)
            if found is None:
                return None
            return self._rewrite(anchor, found.x, _full_width(found), found.nodes, backward=False,
                                 form="pairs-to-half")
        if anchor.target == aten.add.Tensor:
            found = match_pairs_to_half_rope_backward(anchor)
            if found is not None:
                return self._rewrite(anchor, found.x, _full_width(found), found.nodes, backward=True,
                                     form="pairs-to-half")
            site = quiet(match_rope_site, anchor)
            pairs = deinterleaved(site.x) if site is not None and site.rotation.mode == "half" else None
            if pairs is None:
                return None
            return self._rewrite(anchor, pairs.source, (_Table(site.cos), _Table(site.sin)),
                                 [*site.nodes, *pairs.nodes], backward=False, form="view-transpose de-interleave")
        found = match_pairs_to_half_rope_backward(anchor)  # the backward of unbind'ed lanes
        if found is not None:
            return self._rewrite(anchor, found.x, _full_width(found), found.nodes, backward=True, form="pairs-to-half")
        back = reinterleaved(anchor)
        site = quiet(match_rope_grad_site, back.source) if back is not None else None
        if site is None or site.rotation.mode != "half":
            return None
        return self._rewrite(anchor, site.x, (_Table(site.cos), _Table(site.sin)),
                             [back.source, *site.nodes, *back.nodes], backward=True,
                             form="view-transpose de-interleave")

    def _rewrite(self, anchor: Node, x: Node, tables: tuple, nodes: list, backward: bool, form: str) -> Rewrite:
        nodes = list(dict.fromkeys(n for n in nodes if n is not anchor))
        self._check(anchor, x, tables, nodes)
        x_rank, out_dtype = rank(x), val(anchor).dtype

        def build(b: GraphBuilder) -> Node:
            xx = b.lifted(b.cast(x, out_dtype), x_rank, LIFT[x_rank])
            cos, sin = (b.lifted(b.cast(t(b), out_dtype), x_rank, LIFT[x_rank]) for t in tables)
            op = torch.ops.npu_fuse.interleave_rope_backward if backward else torch.ops.npu_fuse.interleave_rope
            out = b.call(op.default, xx, cos, sin)
            for dim in reversed(LIFT[x_rank]):
                out = b.call(aten.squeeze.dim, out, dim)
            return out

        op = "interleave_rope_backward" if backward else "interleave_rope"
        return Rewrite(anchor, nodes, op, build, detail=form)

    @staticmethod
    def _check(anchor: Node, x: Node, tables: tuple, nodes: list) -> None:
        xv = val(x)
        if xv.dim() not in LIFT:
            raise NotFused(f"x {x.name} is {xv.dim()}-D; interleave_rope takes 4-D (B, N, S, D) x "
                           "(2-D [T, D] and 3-D [T, N, D] are lifted)")
        head_dim = static_int(xv.shape[-1])
        if head_dim is None:
            raise NotFused(f"head dim of {x.name} is symbolic ({xv.shape[-1]}); interleave_rope needs a static one")
        if not shape_eq(val(anchor).shape, xv.shape):
            raise NotFused(f"result shape {list(val(anchor).shape)} differs from x shape {list(xv.shape)}")
        for name, table in zip(("cos", "sin"), tables):
            if len(table.nodes) == 1:  # a full-width table: the op's to check
                continue
            width = head_dim // 2  # each half's table, concatenated into the op's
            for node in table.nodes:
                tv = val(node)
                shape = [*xv.shape[:-1], width]
                if tv.dim() > xv.dim() or not broadcasts_to(tv.shape, shape) or static_int(tv.shape[-1]) != width:
                    raise NotFused(f"{name} {node.name} shape {list(tv.shape)} does not broadcast to {shape} "
                                   f"(x {x.name} {list(xv.shape)})")
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")


class _Table:
    """A full-width table for the op: one node, or ``cat`` of the two halves' tables."""

    def __init__(self, *nodes: Node):
        self.nodes = nodes

    def __call__(self, b: GraphBuilder) -> Node:
        if len(self.nodes) == 1:
            return self.nodes[0]
        first, second = self.nodes
        if val(first).shape != val(second).shape:
            shape = list(torch.broadcast_shapes(val(first).shape, val(second).shape))
            first, second = (b.call(aten.expand.default, n, shape) for n in (first, second))
        return b.call(aten.cat.default, [first, second], -1)


def _full_width(found: PairsToHalfRope) -> tuple:
    return _Table(*found.cos), _Table(*found.sin)
