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

Constraints (near-misses): x 4-D, static head dim D <= 1024 and even, even slice
length, one float dtype, cos/sin broadcastable to ``x[..., s:e]`` with last dim
``e - s``, no intermediate used outside, and under a named SoC the cos/sin layouts it
accepts (A2/A3: BS1D, B11D; Ascend950: BSND, B1ND, B11D, 111D).
"""

import operator
from typing import Optional, Union

import torch
from torch.fx import Node

from ..lowering.ops.inplace_partial_rotary_mul import FLOAT_DTYPES, MAX_HEAD_DIM

from ..fusion import FusionPass, GraphBuilder, PassContext, Rewrite, register_fusion
from ..report import NearMiss
from ..soc import A2_A3, ASCEND950, GENERIC
from .graph_utils import (
    aten, broadcasts_to, describe, is_call, norm_dim, rank, shape_eq, slice_scatter_args, static_int, users_outside,
    val,
)
from .rope import RopeSite, _last_dim_piece, _to_rank4, match_rope_site

LAYOUTS = {name: ("BS1D", "B11D") for name in A2_A3}
LAYOUTS[ASCEND950] = ("BSND", "B1ND", "B11D", "111D")


def layout_matches(r_shape, x_shape, layout: str) -> bool:
    """Does a [., ., ., d] table fit a layout name like "BS1D" against x (BSND)?"""
    return all(size_eq_int(r, 1) if letter == "1" else size_eq_int(r, x)
               for r, x, letter in zip(r_shape[:3], x_shape[:3], layout[:3]))


def size_eq_int(a, b) -> bool:
    return static_int(a) is not None and static_int(a) == static_int(b)


def _same_tensor(a: Node, b: Node) -> bool:
    """a and b hold the same values: one node, or equal views of one source."""
    if a is b:
        return True
    views = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
    return (is_call(a, *views) and is_call(b, *views) and a.args[0] is b.args[0]
            and shape_eq(val(a).shape, val(b).shape))


@register_fusion
class PartialRotaryFusion(FusionPass):
    """Interleave RoPE on part of the head dim, kept or written back -> one in-place op."""

    name = "partial_rope"
    family = "partial_rope"
    op = "inplace_partial_rotary_mul"
    order = 10  # before "rope", which would otherwise take the slice's rotation alone

    def find(self, ctx: PassContext):
        for node in ctx.graph.nodes:
            if is_call(node, aten.cat.default):
                found = self._match_cat(ctx, node)
            elif is_call(node, aten.slice_scatter.default):
                found = self._match_scatter(ctx, node)
            else:
                continue
            if found is not None:
                yield found

    def _rope_on_slice(self, node) -> Optional[tuple]:
        """(site, x, start, end, slice_nodes) when node is RoPE of a last-dim slice of x."""
        site = match_rope_site(node) if isinstance(node, Node) else None
        if not isinstance(site, RopeSite) or site.rotation.mode != "interleave":
            return None
        piece = _last_dim_piece(site.x)
        if piece is None or piece[3] != 1 or len(piece[4]) != 1:
            return None
        x, start, end = piece[:3]
        return site, x, start, end, [site.x, site.rotation.source]

    def _match_cat(self, ctx: PassContext, cat: Node) -> Union[Rewrite, NearMiss, None]:
        tensors = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        out_rank = rank(cat)
        if out_rank is None or norm_dim(dim, out_rank) != out_rank - 1 or len(tensors) < 2:
            return None
        for i, piece in enumerate(tensors):
            found = self._rope_on_slice(piece)
            if found is None:
                continue
            site, x, start, end, x_slices = found
            covered, extra = 0, [piece, *x_slices]
            for j, other in enumerate(tensors):
                if j == i:
                    lo, hi = start, end
                else:
                    kept = _last_dim_piece(other)
                    if kept is None or kept[0] is not x or kept[3] != 1:
                        return None
                    lo, hi = kept[1], kept[2]
                    extra += kept[4]
                if lo != covered:
                    return None
                covered = hi
            if covered != static_int(val(x).shape[-1]):
                return None
            return self._rewrite(ctx, cat, site, x, start, end, [*site.nodes, *extra])
        return None

    def _match_scatter(self, ctx: PassContext, scatter: Node) -> Union[Rewrite, NearMiss, None]:
        base, src = scatter.args[:2]
        written = [src]
        if is_call(src, aten.copy.default) and shape_eq(val(src).shape, val(src.args[1]).shape) \
                and val(src).dtype == val(src.args[1]).dtype:
            # x[..., s:e] = rope is functionalized as slice_scatter(x, copy(x[..., s:e], rope))
            written, src = [src, src.args[0]], src.args[1]
        found = self._rope_on_slice(src)
        if found is None:
            return None
        site, x, start, end, x_slices = found
        dim, s_start, s_end, step = slice_scatter_args(scatter)
        head_dim = static_int(val(base).shape[-1])
        if (norm_dim(dim, rank(base)) != rank(base) - 1 or static_int(step) != 1 or
                static_int(s_start) != start or min(static_int(s_end) or -1, head_dim or 0) != end):
            return None
        if not _same_tensor(x, base):
            return self.near_miss(scatter, f"the rotated slice is read from {x.name} but written into {base.name}")
        return self._rewrite(ctx, scatter, site, base, start, end, [*site.nodes, src, *written, *x_slices])

    def _rewrite(self, ctx: PassContext, anchor: Node, site: RopeSite, x: Node, start: int, end: int,
                 nodes: list) -> Union[Rewrite, NearMiss]:
        nodes = list(dict.fromkeys(nodes))
        problem = self._check(ctx, anchor, site, x, start, end, nodes)
        if problem:
            return self.near_miss(anchor, problem)
        contiguous = val(x).is_contiguous()

        def build(b: GraphBuilder) -> Node:
            xx = x if contiguous else b.call(aten.clone.default, x, memory_format=torch.contiguous_format)
            mutated = b.call(torch.ops.higher_order.auto_functionalized_v2,
                             torch.ops.npu_fuse.inplace_partial_rotary_mul.default,
                             r1=_to_rank4(b, site.cos), r2=_to_rank4(b, site.sin), rotary_mode="interleave",
                             partial_slice=[start, end], _x_base_index=0, _all_bases=[xx])
            return b.call(operator.getitem, mutated, 1)

        return Rewrite(anchor, nodes, self.op, build, detail=f"slice=[{start}, {end}]")

    def _check(self, ctx, anchor, site, x, start, end, nodes) -> Optional[str]:
        xv = val(x)
        if xv.dim() != 4:
            return f"x {x.name} is {xv.dim()}-D; inplace_partial_rotary_mul takes 4-D BSND x"
        head_dim = static_int(xv.shape[-1])
        if head_dim is None:
            return f"head dim of {x.name} is symbolic; the op needs a static one"
        if head_dim > MAX_HEAD_DIM or head_dim % 2:
            return f"head dim {head_dim} must be even and <= {MAX_HEAD_DIM}"
        if (end - start) % 2:
            return f"slice [{start}:{end}] has odd length {end - start}"
        dtypes = {val(n).dtype for n in (x, site.cos, site.sin, anchor)}
        if len(dtypes) != 1 or not dtypes <= set(FLOAT_DTYPES):
            return f"x, cos, sin and the result must share one float dtype, got {sorted(map(str, dtypes))}"
        slice_shape = list(xv.shape[:3]) + [end - start]
        for name, t in (("cos", site.cos), ("sin", site.sin)):
            shape = list(val(t).shape)
            if len(shape) > 4 or not broadcasts_to(shape, slice_shape) or not size_eq_int(shape[-1], end - start):
                return f"{name} shape {shape} is not broadcastable to x[..., {start}:{end}] shape {slice_shape}"
            shape4 = [1] * (4 - len(shape)) + shape
            if ctx.soc != GENERIC and ctx.soc in LAYOUTS and \
                    not any(layout_matches(shape4, slice_shape, lay) for lay in LAYOUTS[ctx.soc]):
                return (f"{name} layout {shape4} against x {list(xv.shape)} is not one of "
                        f"{', '.join(LAYOUTS[ctx.soc])} that {ctx.soc} accepts")
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            return f"intermediate {describe(leaked)} is used outside the subgraph"
        return None
