"""RoPE, full rotation -> ``npu_fuse::rotary_mul`` (spec section 1).

Pattern. Two shapes of subgraph in aten graphs after AOTAutograd:

* ``add(mul(x, cos), mul(R(x), sin))``, operands of each ``mul``/``add`` in any
  order, where R is recognised by :func:`match_rotation`:
  - half: ``cat([neg(x[..., D/2:]), x[..., :D/2]], -1)``, halves taken by
    ``slice`` or by ``split``/``chunk`` (``getitem`` of a split);
  - interleave: ``stack([neg(x[..., 1::2]), x[..., ::2]], -1).flatten(-2)``
    (``stack`` or ``cat`` of ``unsqueeze``s; ``flatten`` as a view), the pairs
    taken by strided ``slice`` or by ``select``/``unbind`` of ``x.view(..., D/2, 2)``.
* Meta's complex form ``view_as_real(view_as_complex(x.view(..., D/2, 2)) * freqs_cis)``;
  cos/sin are rebuilt from ``freqs_cis`` in the graph, each value repeated per pair.

Constraints (each failure is a near-miss with its reason): x is 4-D (a 3-D
``[T, N, D]`` or 2-D ``[T, D]`` x is lifted to 4-D and back), static even head dim, cos/sin
broadcast to x with last dim D, float16/bfloat16/float32, no intermediate used
outside the subgraph, and the rotated tensor is the one multiplied by cos.

Replacement: one ``rotary_mul(x, cos, sin, mode)``, with casts to the dtype eager
would compute in (type promotion) and unsqueezes to make cos/sin 4-D.

Backward graphs. AOTAutograd partitions before our passes run, so the backward of
a RoPE site reaches us decomposed: ``dx = g * cos + R^T(g * sin)``, R^T built by
autograd from ``slice_backward``/``slice_scatter`` (or ``cat``/``stack`` of the
grad's pieces). :func:`match_rotation_transpose` recognises it and the site becomes
``rotary_mul_backward(g, None, cos, sin, mode, need_backward=False)[0]``.
"""

import dataclasses
import operator
from typing import Optional, Union

import torch
from torch.fx import Node

from ..lowering.ops.rotary_mul import FLOAT_DTYPES

from ..fusion import FusionPass, GraphBuilder, PassContext, Rewrite, register_fusion
from ..report import NearMiss
from .graph_utils import (
    INT_MAX, VIEWS, aten, broadcasts_to, describe, is_call, norm_dim, rank, same_value, shape_eq, size_eq,
    skip_noop_slices, slice_args, slice_scatter_args, static_int, users_outside, val,
)



@dataclasses.dataclass
class Rotation:
    """R(source) found in the graph: its mode and the nodes that compute it."""

    source: Node
    mode: str
    nodes: list


def _negated(node) -> Optional[Node]:
    """``y`` when node is ``-y`` (``neg`` or a multiply by -1)."""
    if is_call(node, aten.neg.default):
        return node.args[0]
    if is_call(node, aten.mul.Tensor):
        a, b = node.args[:2]
        if b == -1 and isinstance(a, Node):
            return a
        if a == -1 and isinstance(b, Node):
            return b
    return None


def _last_dim_piece(node) -> Optional[tuple]:
    """(source, start, end, step, nodes) when node is a last-dim slice of source."""
    if is_call(node, aten.slice.Tensor):
        src = node.args[0]
        dim, start, end, step = slice_args(node)
        ndim = rank(src)
        if ndim is None or norm_dim(dim, ndim) != ndim - 1:
            return None
        start, end, step = static_int(start), static_int(end), static_int(step)
        size = static_int(val(src).shape[-1])
        if None in (start, end, step) or (size is None and end != INT_MAX):
            return None
        return skip_noop_slices(src), start, end if size is None else min(end, size), step, [node]
    if is_call(node, operator.getitem) and is_call(
            node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split, index = node.args
        src = split.args[0]
        ndim = rank(src)
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        size = static_int(val(src).shape[-1]) if ndim else None
        if ndim is None or norm_dim(dim, ndim) != ndim - 1 or size is None:
            return None
        if split.target == aten.split.Tensor:
            chunk = static_int(split.args[1])
            if chunk is None:
                return None
            start, end = index * chunk, min((index + 1) * chunk, size)
        else:
            sizes = [static_int(s) for s in split.args[1]]
            if None in sizes:
                return None
            start = sum(sizes[:index])
            end = start + sizes[index]
        return skip_noop_slices(src), start, end, 1, [node, split]
    return None


def _is_last_dim_cut(node) -> bool:
    """node slices or splits the last dim of a tensor, with any (even symbolic) bounds."""
    if is_call(node, operator.getitem) and is_call(node.args[0], aten.split.Tensor,
                                                   aten.split_with_sizes.default):
        node, dim = node.args[0], (node.args[0].args + (0, 0))[2]
    elif is_call(node, aten.slice.Tensor):
        dim = slice_args(node)[0]
    else:
        return False
    ndim = rank(node.args[0])
    return ndim is not None and norm_dim(dim, ndim) == ndim - 1


def _pair_lane(node) -> Optional[tuple]:
    """(source, lane, nodes) when node is lane 0 or 1 of the (even, odd) pairs of source."""
    piece = _last_dim_piece(node)
    if piece is not None:
        src, start, end, step, nodes = piece
        size = static_int(val(src).shape[-1])
        if step == 2 and start in (0, 1) and (end == INT_MAX or (size is not None and end >= size - 1)):
            return src, start, nodes
        return None
    # x.view(..., D/2, 2).unbind(-1) / [..., 0]: select on the pair dim of a view
    if is_call(node, operator.getitem) and is_call(node.args[0], aten.unbind.int):
        unbind, lane = node.args
        view, dim = unbind.args[0], unbind.args[1] if len(unbind.args) > 1 else 0
        extra = [node, unbind]
    elif is_call(node, aten.select.int):
        view, dim, lane = node.args
        extra = [node]
    else:
        return None
    ndim = rank(view)
    if ndim is None or norm_dim(dim, ndim) != ndim - 1 or not is_call(view, *VIEWS):
        return None
    src = view.args[0]
    vs, ss = val(view).shape, val(src).shape
    if len(vs) != len(ss) + 1 or not size_eq(vs[-1], 2) or not shape_eq(vs[:-2], ss[:-1]):
        return None
    return skip_noop_slices(src), static_int(lane), extra + [view]


def _stacked_pair(node) -> Optional[tuple]:
    """(first, second, nodes) when node stacks two tensors on a new last dim."""
    if is_call(node, aten.stack.default):
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if len(tensors) == 2 and rank(tensors[0]) is not None and \
                norm_dim(dim, rank(tensors[0]) + 1) == rank(tensors[0]):
            return tensors[0], tensors[1], [node]
        return None
    if is_call(node, aten.cat.default):
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if len(tensors) != 2 or not all(is_call(t, aten.unsqueeze.default) for t in tensors):
            return None
        out_rank = rank(node)
        if norm_dim(dim, out_rank) != out_rank - 1:
            return None
        if any(norm_dim(t.args[1], out_rank) != out_rank - 1 for t in tensors):
            return None
        return tensors[0].args[0], tensors[1].args[0], [node, *tensors]
    return None


def match_rotation(node) -> Union[Rotation, str, None]:
    """R(x) rooted at node, a reason string for a rotation that breaks a rule, or None."""
    if not rank(node):  # not a tensor node, or 0-d
        return None
    if is_call(node, aten.cat.default) and len(node.args[0]) == 2:
        cat_rank = rank(node)
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        first, second = node.args[0]
        neg_in = _negated(first)
        if cat_rank is not None and norm_dim(dim, cat_rank) == cat_rank - 1 and neg_in is not None:
            head_dim = val(node).shape[-1]
            if static_int(head_dim) is None and _is_last_dim_cut(neg_in) and _is_last_dim_cut(second):
                return f"head dim of {node.name} is symbolic ({head_dim}); rotary_mul needs a static one"
            hi, lo = _last_dim_piece(neg_in), _last_dim_piece(second)
            if hi and lo and hi[0] is lo[0] and hi[3] == lo[3] == 1:
                src = hi[0]
                size = static_int(val(src).shape[-1])
                if lo[1] == 0 and hi[2] == size and lo[2] == hi[1]:
                    if lo[2] * 2 != size:
                        return (f"halves [0:{lo[2]}] and [{hi[1]}:{size}] of {src.name} are unequal: "
                                f"head dim {size} is odd or not split in the middle")
                    return Rotation(src, "half", [node, first, *hi[4], *lo[4]])
    if is_call(node, *VIEWS):
        return _interleaved_pairs(node, transposed=False)
    return None


def _is_zeros(node) -> bool:
    return is_call(node, aten.zeros.default) or (is_call(node, aten.full.default) and node.args[1] == 0)


def _placed(node) -> Optional[tuple]:
    """(t, start, end, step, nodes) when node writes t into zeros at a last-dim slice."""
    if is_call(node, aten.slice_backward.default):
        t, _, dim, start, end, step = node.args
        nodes = [node]
    elif is_call(node, aten.slice_scatter.default) and _is_zeros(node.args[0]):
        t = node.args[1]
        dim, start, end, step = slice_scatter_args(node)
        nodes = [node, node.args[0]]
    else:
        return None
    ndim = rank(node)
    size = static_int(val(node).shape[-1])
    start, end, step = static_int(start), static_int(end), static_int(step)
    if norm_dim(dim, ndim) != ndim - 1 or None in (start, end, step, size):
        return None
    return t, start, min(end, size), step, nodes


def match_rotation_transpose(node) -> Optional[Rotation]:
    """R^T(y) rooted at node, as autograd writes it; Rotation.source is y."""
    if not rank(node):  # not a tensor node, or 0-d
        return None
    if is_call(node, aten.cat.default) and len(node.args[0]) == 2:  # backward of split + cat
        dim = node.args[1] if len(node.args) > 1 else 0
        first, second = node.args[0]
        neg_in = _negated(second)
        if norm_dim(dim, rank(node)) == rank(node) - 1 and neg_in is not None:
            hi, lo = _last_dim_piece(first), _last_dim_piece(neg_in)
            size = static_int(val(node).shape[-1])
            if hi and lo and hi[0] is lo[0] and lo[1] == 0 and hi[1] == lo[2] and \
                    size is not None and hi[2] == size == 2 * lo[2]:
                return Rotation(hi[0], "half", [node, second, *hi[4], *lo[4]])
        return None
    if is_call(node, aten.add.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        size = static_int(val(node).shape[-1])
        for a, b in (node.args, node.args[::-1]):
            pa, pb = _placed(a), _placed(b)
            if not (pa and pb) or size is None:
                continue
            neg_in = _negated(pa[0])
            if neg_in is None:
                continue
            half = size // 2
            if pa[1:4] == (half, size, 1) and pb[1:4] == (0, half, 1) and size % 2 == 0:
                hi, lo = _last_dim_piece(pb[0]), _last_dim_piece(neg_in)
                if hi and lo and hi[0] is lo[0] and (lo[1], lo[2], hi[1], hi[2]) == (0, half, half, size):
                    return Rotation(hi[0], "half", [node, pa[0], *pa[4], *pb[4], *hi[4], *lo[4]])
            if pa[1] == 1 and pb[1] == 0 and pa[3] == pb[3] == 2:
                even, odd = _pair_lane(neg_in), _pair_lane(pb[0])
                if even and odd and even[0] is odd[0] and even[1] == 0 and odd[1] == 1:
                    nodes = [node, pa[0], *pa[4], *pb[4], *even[2], *odd[2]]
                    return Rotation(even[0], "interleave", list(dict.fromkeys(nodes)))
        return None
    if is_call(node, *VIEWS):  # backward of unbind + stack
        return _interleaved_pairs(node, transposed=True)
    return None


def _interleaved_pairs(view: Node, transposed: bool) -> Optional[Rotation]:
    """view = flatten(stack([a, b], -1)) with (a, b) = (-odd, even) lanes of a source: R,
    or (odd, -even): R^T."""
    stacked = _stacked_pair(view.args[0])
    if stacked is None:
        return None
    first, second, stack_nodes = stacked
    ss, vs = val(view.args[0]).shape, val(view).shape
    if len(vs) != len(ss) - 1 or not shape_eq(vs[:-1], ss[:-2]):
        return None
    negated = second if transposed else first
    neg_in = _negated(negated)
    if neg_in is None:
        return None
    odd, even = (_pair_lane(first), _pair_lane(neg_in)) if transposed else (_pair_lane(neg_in), _pair_lane(second))
    if odd and even and odd[0] is even[0] and odd[1] == 1 and even[1] == 0:
        nodes = [view, negated, *stack_nodes, *odd[2], *even[2]]
        return Rotation(odd[0], "interleave", list(dict.fromkeys(nodes)))
    return None


@dataclasses.dataclass
class RopeSite:
    """``x * cos + R(x) * sin`` found at an add: its inputs and the nodes computing it."""

    x: Node
    cos: Node
    sin: Node
    rotation: Rotation
    terms: list  # the two multiplies

    @property
    def nodes(self) -> list:
        # the rotated tensor is x itself, or a second identical slice of x's source (then ours)
        own_source = [self.rotation.source] if self.rotation.source is not self.x else []
        return list(dict.fromkeys([*self.terms, *self.rotation.nodes, *own_source]))


def match_rope_site(add: Node) -> Union[RopeSite, str, None]:
    """The forward RoPE rooted at add, a reason string for a near-miss, or None."""
    if not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    terms = add.args
    if not all(is_call(t, aten.mul.Tensor) and all(isinstance(a, Node) for a in t.args[:2]) for t in terms):
        return None
    reason = None
    for cos_term, sin_term in (terms, terms[::-1]):
        for i in (0, 1):
            rot = match_rotation(sin_term.args[i])
            if isinstance(rot, str):
                reason = reason or rot
                continue
            if rot is None:
                continue
            for j in (0, 1):
                if same_value(cos_term.args[j], rot.source):
                    return RopeSite(cos_term.args[j], cos_term.args[1 - j], sin_term.args[1 - i], rot,
                                    [cos_term, sin_term])
            reason = reason or (
                f"the tensor multiplied by cos ({cos_term.args[0].name} or {cos_term.args[1].name}) "
                f"is not the rotated tensor {rot.source.name}")
    return reason


@register_fusion
class RotaryMulFusion(FusionPass):
    """Full-width RoPE on q or k, half or interleave, -> one rotary_mul."""

    name = "rope"
    family = "rope"
    op = "rotary_mul"

    def find(self, ctx: PassContext):
        for node in ctx.graph.nodes:
            if is_call(node, aten.add.Tensor):
                found = self._match_add(node)
            elif is_call(node, aten.view_as_real.default):
                found = self._match_complex(node)
            else:
                continue
            if found is not None:
                yield found

    # -- x * cos + R(x) * sin ---------------------------------------------------------
    def _match_add(self, add: Node) -> Union[Rewrite, NearMiss, None]:
        site = match_rope_site(add)
        if isinstance(site, RopeSite):
            return self._rewrite(add, site.rotation, x=site.x, cos=site.cos, sin=site.sin, extra=site.nodes)
        if isinstance(site, str):
            return self.near_miss(add, site)
        if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
            return None
        return self._match_backward(add, add.args)

    def _match_backward(self, add: Node, terms) -> Union[Rewrite, NearMiss, None]:
        """dx = g * cos + R^T(g * sin), in a backward graph."""
        for cos_term, rt_node in (terms, terms[::-1]):
            rt = match_rotation_transpose(rt_node)
            if rt is None:
                continue
            if not (is_call(rt.source, aten.mul.Tensor) and is_call(cos_term, aten.mul.Tensor)):
                return None
            sin_term = rt.source
            for i, j in ((0, 0), (0, 1), (1, 0), (1, 1)):
                if sin_term.args[i] is cos_term.args[j]:
                    grad, sin, cos = sin_term.args[i], sin_term.args[1 - i], cos_term.args[1 - j]
                    nodes = list(dict.fromkeys([cos_term, rt_node, sin_term, *rt.nodes]))
                    return self._rewrite(add, rt, x=grad, cos=cos, sin=sin, extra=nodes, backward=True)
            return self.near_miss(add, "the gradient multiplied by cos is not the one multiplied by sin")
        return None

    def _rewrite(self, anchor: Node, rot: Rotation, x: Node, cos: Node, sin: Node,
                 extra: list, backward: bool = False) -> Union[Rewrite, NearMiss]:
        nodes = list(dict.fromkeys([*extra, *rot.nodes]))
        problem = self._check(anchor, x, cos, sin, nodes)
        if problem:
            return self.near_miss(anchor, problem)
        out_dtype = val(anchor).dtype
        x_rank = rank(x)

        def build(b: GraphBuilder) -> Node:
            xx, cc, ss = (_lift(b, _cast(b, t, out_dtype), x_rank) for t in (x, cos, sin))
            if backward:
                grads = b.call(torch.ops.npu_fuse.rotary_mul_backward.default, xx, None, cc, ss, rot.mode, False)
                out = b.call(operator.getitem, grads, 0)
            else:
                out = b.call(torch.ops.npu_fuse.rotary_mul.default, xx, cc, ss, rot.mode)
            for dim in reversed(LIFT[x_rank]):
                out = b.call(aten.squeeze.dim, out, dim)
            return out

        op = "rotary_mul_backward" if backward else self.op
        return Rewrite(anchor, nodes, op, build, detail=f"mode={rot.mode}")

    def _check(self, anchor: Node, x: Node, cos: Node, sin: Node, nodes: list) -> Optional[str]:
        xv, cv, sv = val(x), val(cos), val(sin)
        if xv.dim() not in LIFT:
            return f"x {x.name} is {xv.dim()}-D; rotary_mul takes 4-D BSND/BNSD x (3-D [T, N, D] and 2-D [T, D] are lifted)"
        head_dim = static_int(xv.shape[-1])
        if head_dim is None:
            return f"head dim of {x.name} is symbolic ({xv.shape[-1]}); rotary_mul needs a static one"
        if head_dim % 2:
            return f"head dim {head_dim} is odd"
        for tensor, dtype in ((x, xv.dtype), (cos, cv.dtype), (sin, sv.dtype), (anchor, val(anchor).dtype)):
            if dtype not in FLOAT_DTYPES:
                return f"{tensor.name} has dtype {dtype}; rotary_mul takes float16, bfloat16 or float32"
        for name, t, v in (("cos", cos, cv), ("sin", sin, sv)):
            if v.dim() > xv.dim() or not broadcasts_to(v.shape, xv.shape):
                return (f"{name} shape {list(v.shape)} ({t.name}) is not broadcastable to "
                        f"x shape {list(xv.shape)}")
            if not size_eq(v.shape[-1], head_dim):
                return f"{name} last dim {v.shape[-1]} != head dim {head_dim}"
        if not shape_eq(val(anchor).shape, xv.shape):
            return f"result shape {list(val(anchor).shape)} differs from x shape {list(xv.shape)}"
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            return f"intermediate {describe(leaked)} is used outside the subgraph"
        return None

    # -- Meta's complex form ----------------------------------------------------------
    def _match_complex(self, as_real: Node) -> Union[Rewrite, NearMiss, None]:
        prod = as_real.args[0]
        if not is_call(prod, aten.mul.Tensor) or not all(isinstance(a, Node) for a in prod.args[:2]):
            return None
        for i in (0, 1):
            as_complex, freqs = prod.args[i], prod.args[1 - i]
            if not is_call(as_complex, aten.view_as_complex.default):
                continue
            pairs = as_complex.args[0]
            if not is_call(pairs, *VIEWS):
                return self.near_miss(as_real, f"{pairs.name} is not a view of x as (..., D/2, 2) pairs")
            x = pairs.args[0]
            ps, xs = val(pairs).shape, val(x).shape
            if len(ps) != len(xs) + 1 or not size_eq(ps[-1], 2) or not shape_eq(ps[:-2], xs[:-1]):
                return self.near_miss(as_real, f"{pairs.name} does not split the last dim of {x.name} in pairs")
            if val(freqs).dtype != torch.complex64:
                return self.near_miss(as_real, f"freqs_cis {freqs.name} has dtype {val(freqs).dtype}, "
                                               "expected complex64")
            return self._rewrite_complex(as_real, x, freqs, [prod, as_complex, pairs])
        return None

    def _rewrite_complex(self, anchor: Node, x: Node, freqs: Node, nodes: list) -> Union[Rewrite, NearMiss]:
        xv, fv = val(x), val(freqs)
        if xv.dim() not in (3, 4):
            return self.near_miss(anchor, f"x {x.name} is {xv.dim()}-D; rotary_mul takes 4-D (or 3-D) x")
        if xv.dtype != torch.float32:
            return self.near_miss(anchor, f"x {x.name} has dtype {xv.dtype}; view_as_complex needs float32")
        complex_shape = val(anchor.args[0]).shape
        if fv.dim() > len(complex_shape) or not broadcasts_to(fv.shape, complex_shape) or \
                not shape_eq(complex_shape, val(nodes[1]).shape):
            return self.near_miss(anchor, f"freqs_cis shape {list(fv.shape)} is not broadcastable to "
                                          f"x pairs shape {list(val(nodes[1]).shape)}")
        head_dim = static_int(xv.shape[-1])
        if head_dim is None:
            return self.near_miss(anchor, f"head dim of {x.name} is symbolic; rotary_mul needs a static one")
        if not size_eq(fv.shape[-1], head_dim // 2):
            return self.near_miss(anchor, f"freqs_cis last dim {fv.shape[-1]} != head dim / 2 = {head_dim // 2}")
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            return self.near_miss(anchor, f"intermediate {describe(leaked)} is used outside the subgraph")
        lift = xv.dim() == 3

        def build(b: GraphBuilder) -> Node:
            parts = b.call(aten.view_as_real.default, freqs)  # (..., D/2, 2): cos, sin
            cos, sin = (_repeat_pairs(b, b.call(aten.select.int, parts, -1, lane)) for lane in (0, 1))
            xx = b.call(aten.unsqueeze.default, x, 0) if lift else x
            out = b.call(torch.ops.npu_fuse.rotary_mul.default, xx, _to_rank4(b, cos), _to_rank4(b, sin),
                         "interleave")
            if lift:
                out = b.call(aten.squeeze.dim, out, 0)
            return b.call(aten.view.default, out, _sizes(b, out, keep=xv.dim() - 1) + [head_dim // 2, 2])

        return Rewrite(anchor, nodes, self.op, build, detail="mode=interleave, complex form")


def _cast(b: GraphBuilder, node: Node, dtype: torch.dtype) -> Node:
    if val(node).dtype == dtype:
        return node
    return b.call(aten._to_copy.default, node, dtype=dtype)


# Unsqueezes that take x to BSND: [T, N, D] -> [1, T, N, D]; [T, D] -> [1, T, 1, D].
LIFT = {4: (), 3: (0,), 2: (0, 2)}


def _lift(b: GraphBuilder, node: Node, x_rank: int) -> Node:
    """x, or a table broadcast against x (right-aligned), lifted as LIFT lifts x."""
    while rank(node) < x_rank:
        node = b.call(aten.unsqueeze.default, node, 0)
    for dim in LIFT[x_rank]:
        node = b.call(aten.unsqueeze.default, node, dim)
    return node


def _to_rank4(b: GraphBuilder, node: Node) -> Node:
    while rank(node) < 4:
        node = b.call(aten.unsqueeze.default, node, 0)
    return node


def _sizes(b: GraphBuilder, node: Node, keep: int) -> list:
    """The first ``keep`` sizes of node as graph arguments (sym_size nodes where symbolic)."""
    sizes = []
    for i, size in enumerate(val(node).shape[:keep]):
        size_int = static_int(size)
        sizes.append(size_int if size_int is not None else b.call(aten.sym_size.int, node, i))
    return sizes


def _repeat_pairs(b: GraphBuilder, half: Node) -> Node:
    """[..., D/2] -> [..., D] with each value twice, as the interleave pairs need."""
    pair = b.call(aten.stack.default, [half, half], -1)
    return b.call(aten.view.default, pair, _sizes(b, half, keep=rank(half) - 1) + [2 * val(half).shape[-1]])
