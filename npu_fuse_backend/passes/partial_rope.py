"""Partial RoPE -> ``npu_fuse::inplace_partial_rotary_mul`` (spec section 2, seed 000).

Pattern: RoPE on a last-dim slice ``x[..., s:e]`` of x (a :class:`RopeSite` of the
full-RoPE pass, on the slice), with the result

* concatenated back with the untouched slices: ``cat([x[..., :s], rope, x[..., e:]], -1)``
  (GPT-J ``rotary_dim``, GPT-NeoX ``rotary_pct``, Phi, StableLM, GLM); or
* written back in place, ``x[..., s:e] = rope`` / ``copy_``, which functionalization
  turns into ``slice_scatter(x, rope, -1, s, e)`` (plus a final ``copy_`` when x is a
  graph input: that copy stays, so the graph mutates exactly what the user's did).

Replacement: ``auto_functionalized_v2(inplace_partial_rotary_mul, x, ...)`` and its
new x, the form AOTAutograd itself gives a mutating op (torchair converts it; inductor
gets the op's functional decomposition).

Decision: only interleave partial RoPE becomes the in-place op, since the NPU op has
only that mode. Half-mode partial RoPE (GPT-NeoX) is left to the full-RoPE pass,
which fuses the rotation of the slice into ``rotary_mul`` on the slice and keeps the
cat: the rotation is the costly part and rotary_mul takes any layout.

Constraints (near-misses): static head dim, x and the result of one dtype (the op writes
x's dtype), no intermediate used outside, and the op's own argument rules
(``check_inplace_partial_rotary_mul_args``: x 4-D, D <= 1024 and even, even slice length, float
dtypes, cos/sin broadcastable to ``x[..., s:e]`` with last dim ``e - s``), which the op checks on
the call the rewrite builds. The cos/sin layouts each SoC accepts are the op's ``@soc_limits``
(lowering/ops/partial_rope.py), checked on every rewrite.
"""

import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Node

from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, register_fusion
from ..graph_utils import aten, describe, is_call, norm_dim, rank, shape_eq, slice_scatter_args, static_int, \
    users_outside, val
from ..matchers import RopeSite, last_dim_cat, last_dim_piece, match_rope_site, quiet


@dataclasses.dataclass
class SliceRope:
    """RoPE of ``x[..., start:end]``: the site and the slice nodes it reads x through."""

    site: RopeSite
    x: Node
    start: int
    end: int
    slice_nodes: list


def rope_on_slice(node) -> Optional[SliceRope]:
    """Interleave RoPE of a step-1 last-dim slice of some x, rooted at node."""
    site = quiet(match_rope_site, node) if isinstance(node, Node) else None  # rope reports its near-miss
    if site is None or site.rotation.mode != "interleave":
        return None
    piece = last_dim_piece(site.x)
    if piece is None or piece.step != 1 or len(piece.nodes) != 1:
        return None
    return SliceRope(site, piece.source, piece.start, piece.end, [site.x])


@register_fusion
class PartialRopeFusion(FusionPass):
    """Interleave RoPE on part of the head dim, kept or written back -> one in-place op."""

    name = "partial_rope"
    op = "inplace_partial_rotary_mul"
    anchor_targets = (aten.cat.default, aten.slice_scatter.default)

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        if anchor.target == aten.cat.default:
            return self._match_cat(ctx, anchor)
        return self._match_scatter(ctx, anchor)

    def _match_cat(self, ctx: PassContext, cat: Node) -> Optional[Rewrite]:
        tensors = last_dim_cat(cat)
        if tensors is None or len(tensors) < 2:
            return None
        for i, piece in enumerate(tensors):
            found = rope_on_slice(piece)
            if found is None:
                continue
            covered, extra = 0, [piece, *found.slice_nodes]
            for j, other in enumerate(tensors):
                if j == i:
                    lo, hi = found.start, found.end
                else:
                    kept = last_dim_piece(other)
                    if kept is None or kept.source is not found.x or kept.step != 1:
                        return None
                    lo, hi = kept.start, kept.end
                    extra += kept.nodes
                if lo != covered:
                    return None
                covered = hi
            if covered != static_int(val(found.x).shape[-1]):
                return None
            return self._rewrite(ctx, cat, found, found.x, [*found.site.nodes, *extra])
        return None

    def _match_scatter(self, ctx: PassContext, scatter: Node) -> Optional[Rewrite]:
        base, src = scatter.args[:2]
        written = [src]
        if is_copy_of_same_layout(src):
            # x[..., s:e] = rope is functionalized as slice_scatter(x, copy(x[..., s:e], rope))
            written, src = [src, src.args[0]], src.args[1]
        found = rope_on_slice(src)
        if found is None:
            return None
        dim, s_start, s_end, step = slice_scatter_args(scatter)
        head_dim = static_int(val(base).shape[-1])
        if (norm_dim(dim, rank(base)) != rank(base) - 1 or static_int(step) != 1 or
                static_int(s_start) != found.start or min(static_int(s_end) or -1, head_dim or 0) != found.end):
            return None
        if found.x is not base:
            raise NotFused(f"the rotated slice is read from {found.x.name} but written into {base.name}")
        return self._rewrite(ctx, scatter, found, base, [*found.site.nodes, src, *written, *found.slice_nodes])

    def _rewrite(self, ctx: PassContext, anchor: Node, found: SliceRope, x: Node, nodes: list) -> Rewrite:
        nodes = list(dict.fromkeys(nodes))
        self._check(ctx, anchor, found, x, nodes)
        site, start, end = found.site, found.start, found.end
        contiguous = val(x).is_contiguous()

        def build(b: GraphBuilder) -> Node:
            xx = x if contiguous else b.call(aten.clone.default, x, memory_format=torch.contiguous_format)
            mutated = b.call(torch.ops.higher_order.auto_functionalized_v2,
                             torch.ops.npu_fuse.inplace_partial_rotary_mul.default,
                             r1=b.unsqueeze_to(site.cos, 4), r2=b.unsqueeze_to(site.sin, 4),
                             rotary_mode="interleave", partial_slice=[start, end], _x_base_index=0, _all_bases=[xx])
            return b.call(operator.getitem, mutated, 1)

        return Rewrite(anchor, nodes, self.op, build, detail=f"slice=[{start}, {end}]")

    @staticmethod
    def _check(ctx, anchor, found: SliceRope, x, nodes) -> None:
        xv = val(x)
        if xv.dim() and static_int(xv.shape[-1]) is None:
            raise NotFused(f"head dim of {x.name} is symbolic; the op needs a static one")
        if val(anchor).dtype != xv.dtype:
            raise NotFused(f"the result is {val(anchor).dtype}, x {xv.dtype}: the op writes the rotated slice "
                           "into x, in x's dtype")
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")


def is_copy_of_same_layout(node) -> bool:
    """``copy(dst, src)`` with src of dst's shape and dtype: the value is src's."""
    return is_call(node, aten.copy.default) and shape_eq(val(node).shape, val(node.args[1]).shape) \
        and val(node).dtype == val(node.args[1]).dtype
