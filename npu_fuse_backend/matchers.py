"""Building blocks two or more fusion families share: each recognises one piece of model code
in an aten graph and returns a typed record of what it found, or None. A family's own
matchers live in its pass module.

A building block that finds its piece but sees a broken rule raises
:class:`~npu_fuse_backend.fusion.NotFused` with the reason; a caller that tries
alternatives catches it, and a pass that looks at a site another family owns reads it with
:func:`quiet` (that family reports the near-miss). The graph is canonicalized first
(``canonicalize.py``), so no-op slices, views and casts, and duplicate views of one tensor,
are already gone.

- pieces of the last dim: :func:`last_dim_piece`, :func:`last_dim_cat`, :func:`new_last_dim_stack`;
  casts and signs: :func:`uncast`, :func:`negated`; operands: :func:`binary_operands`;
- rotations (the RoPE families and the MLA prologue): :func:`match_rotation` (R(x), half or
  interleave), :func:`match_rotation_transpose` (R^T as autograd writes it), :func:`match_rope_site`
  (``x * cos + R(x) * sin``), :func:`match_rope_grad_site`, DeepSeek's pairs-in / half-out forms
  and :func:`deinterleaved` / :func:`reinterleaved`;
- normalisation (the MLA prologue and rms_norm): :func:`match_rms_core` (the RMS in every spelling),
  :func:`match_rms_norm` (with its weight and bias).
"""

import dataclasses
import math
import operator
from typing import Any, Optional

import torch
from torch.fx import Node

from .fusion import NotFused
from .graph_utils import INT_MAX, VIEWS, aten, is_call, norm_dim, rank, shape_eq, size_eq, slice_args, \
    slice_scatter_args, static_int, val

# the ops that change only a tensor's dtype (what ``uncast`` looks through)
DTYPE_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def quiet(matcher, *args):
    """``matcher(*args)``, None where it raises NotFused: a site another family's pass owns, whose
    near-miss that pass reports."""
    try:
        return matcher(*args)
    except NotFused:
        return None


# -- pieces of the last dim, casts, signs ---------------------------------------------------
@dataclasses.dataclass
class Piece:
    """``source[..., start:end:step]``: a last-dim slice, or one part of a last-dim split."""

    source: Node
    start: int
    end: int
    step: int
    nodes: list  # the slice (or getitem and split) computing it


@dataclasses.dataclass
class Stripped:
    """A value without the dtype casts around it."""

    node: Any
    casts: list


def uncast(node) -> Stripped:
    casts = []
    while is_call(node, *DTYPE_CASTS) and set(node.kwargs) <= {"dtype", "layout", "device"}:
        casts.append(node)
        node = node.args[0]
    return Stripped(node, casts)


def negated(node) -> Optional[Node]:
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


def _dim_arg(node: Node, position: int, default: int = 0) -> Any:
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)


def _is_last_dim(dim, node: Node) -> bool:
    ndim = rank(node)
    return ndim is not None and isinstance(dim, int) and norm_dim(dim, ndim) == ndim - 1


def _python_index(index: int, size: int) -> int:
    """A slice bound as aten.slice reads it: negative counts from the end, clamped to [0, size]."""
    if index < 0:
        index += size
    return min(max(index, 0), size)


def last_dim_piece(node) -> Optional[Piece]:
    if is_call(node, aten.slice.Tensor):
        src = node.args[0]
        dim, start, end, step = slice_args(node)
        if not _is_last_dim(dim, src):
            return None
        start, end, step = static_int(start), static_int(end), static_int(step)
        size = static_int(val(src).shape[-1])
        if None in (start, end, step):
            return None
        if size is None:  # a symbolic head dim: only [start:] with a non-negative start is known
            if end != INT_MAX or start < 0:
                return None
            return Piece(src, start, end, step, [node])
        return Piece(src, _python_index(start, size), _python_index(end, size), step, [node])
    if is_call(node, operator.getitem) and is_call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split, index = node.args
        src = split.args[0]
        size = static_int(val(src).shape[-1]) if rank(src) else None
        if not _is_last_dim(_dim_arg(split, 2), src) or size is None:
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
        return Piece(src, start, end, 1, [node, split])
    return None


def is_last_dim_cut(node) -> bool:
    """node slices or splits the last dim of a tensor, with any (even symbolic) bounds."""
    if is_call(node, operator.getitem) and is_call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split = node.args[0]
        return _is_last_dim(_dim_arg(split, 2), split.args[0])
    if is_call(node, aten.slice.Tensor):
        return _is_last_dim(slice_args(node)[0], node.args[0])
    return False


def last_dim_cat(node) -> Optional[list]:
    """The tensors of ``cat(tensors, -1)``, or None."""
    if not is_call(node, aten.cat.default):
        return None
    return list(node.args[0]) if _is_last_dim(_dim_arg(node, 1), node) else None


@dataclasses.dataclass
class StackedPair:
    """``stack([first, second], -1)``, or ``cat`` of the two unsqueezed on a new last dim."""

    first: Any
    second: Any
    nodes: list


def new_last_dim_stack(node) -> Optional[StackedPair]:
    if is_call(node, aten.stack.default):
        tensors = node.args[0]
        if len(tensors) == 2 and rank(tensors[0]) is not None and \
                norm_dim(_dim_arg(node, 1), rank(tensors[0]) + 1) == rank(tensors[0]):
            return StackedPair(tensors[0], tensors[1], [node])
        return None
    tensors = last_dim_cat(node)
    if tensors is None or len(tensors) != 2 or not all(is_call(t, aten.unsqueeze.default) for t in tensors):
        return None
    if not all(_is_last_dim(t.args[1], node) for t in tensors):
        return None
    return StackedPair(tensors[0].args[0], tensors[1].args[0], [node, *tensors])


# -- rotations --------------------------------------------------------------------------------
@dataclasses.dataclass
class Rotation:
    """R(source) (or R^T(source)) found in the graph: its mode and the nodes that compute it."""

    source: Node
    mode: str  # "half" or "interleave"
    nodes: list


@dataclasses.dataclass
class PairLane:
    """Lane 0 (even positions) or 1 (odd positions) of the interleaved pairs of source."""

    source: Node
    lane: int
    nodes: list


def pair_lane(node) -> Optional[PairLane]:
    piece = last_dim_piece(node)
    if piece is not None:
        size = static_int(val(piece.source).shape[-1])
        if piece.step == 2 and piece.start in (0, 1) and \
                (piece.end == INT_MAX or (size is not None and piece.end >= size - 1)):
            return PairLane(piece.source, piece.start, piece.nodes)
        return None
    # x.view(..., D/2, 2).unbind(-1) / [..., 0]: select on the pair dim of a view
    if is_call(node, operator.getitem) and is_call(node.args[0], aten.unbind.int):
        unbind, lane = node.args
        view, dim, extra = unbind.args[0], _dim_arg(unbind, 1), [node, unbind]
    elif is_call(node, aten.select.int):
        view, dim, lane = node.args
        extra = [node]
    else:
        return None
    if not _is_last_dim(dim, view) or not is_call(view, *VIEWS):
        return None
    src = view.args[0]
    vs, ss = val(view).shape, val(src).shape
    if len(vs) != len(ss) + 1 or not size_eq(vs[-1], 2) or not shape_eq(vs[:-2], ss[:-1]):
        return None
    return PairLane(src, static_int(lane), extra + [view])


def match_rotation(node) -> Optional[Rotation]:
    """R(x) rooted at node: ``cat([-x2, x1], -1)`` of the two halves (half), or the
    interleave form ``stack([-odd, even], -1).flatten(-2)``. Raises NotFused for a
    rotation whose halves cannot be those of a rotary_mul."""
    if not rank(node):  # not a tensor node, or 0-d
        return None
    parts = last_dim_cat(node)
    if parts is not None and len(parts) == 2:
        first, second = parts
        neg_in = negated(first)
        if neg_in is None:
            return None
        head_dim = val(node).shape[-1]
        if static_int(head_dim) is None and is_last_dim_cut(neg_in) and is_last_dim_cut(second):
            raise NotFused(f"head dim of {node.name} is symbolic ({head_dim}); rotary_mul needs a static one")
        hi, lo = last_dim_piece(neg_in), last_dim_piece(second)
        if not (hi and lo and hi.source is lo.source and hi.step == lo.step == 1):
            return None
        size = static_int(val(hi.source).shape[-1])
        if lo.start == 0 and hi.end == size and lo.end == hi.start:
            if lo.end * 2 != size:
                raise NotFused(f"halves [0:{lo.end}] and [{hi.start}:{size}] of {hi.source.name} are unequal: "
                               f"head dim {size} is odd or not split in the middle")
            return Rotation(hi.source, "half", [node, first, *hi.nodes, *lo.nodes])
        return None
    if is_call(node, *VIEWS):
        return interleaved_pairs(node, transposed=False)
    return None


def interleaved_pairs(view: Node, transposed: bool) -> Optional[Rotation]:
    """view = flatten(stack([a, b], -1)) with (a, b) = (-odd, even) lanes of a source: R,
    or (odd, -even): R^T."""
    stacked = new_last_dim_stack(view.args[0])
    if stacked is None:
        return None
    ss, vs = val(view.args[0]).shape, val(view).shape
    if len(vs) != len(ss) - 1 or not shape_eq(vs[:-1], ss[:-2]):
        return None
    negated_node = stacked.second if transposed else stacked.first
    neg_in = negated(negated_node)
    if neg_in is None:
        return None
    if transposed:
        odd, even = pair_lane(stacked.first), pair_lane(neg_in)
    else:
        odd, even = pair_lane(neg_in), pair_lane(stacked.second)
    if odd and even and odd.source is even.source and odd.lane == 1 and even.lane == 0:
        nodes = [view, negated_node, *stacked.nodes, *odd.nodes, *even.nodes]
        return Rotation(odd.source, "interleave", list(dict.fromkeys(nodes)))
    return None


@dataclasses.dataclass
class Placed:
    """``value`` written into zeros at a last-dim slice (autograd's backward of a slice)."""

    value: Node
    start: int
    end: int
    step: int
    nodes: list
    zeros: Optional[Node]  # the zeros written into, when a node of the graph


def _is_zeros(node) -> bool:
    return is_call(node, aten.zeros.default) or (is_call(node, aten.full.default) and node.args[1] == 0)


def placed(node) -> Optional[Placed]:
    if is_call(node, aten.slice_backward.default):
        value, _, dim, start, end, step = node.args
        zeros = None
    elif is_call(node, aten.slice_scatter.default) and _is_zeros(node.args[0]):
        value, zeros = node.args[1], node.args[0]
        dim, start, end, step = slice_scatter_args(node)
    else:
        return None
    size = static_int(val(node).shape[-1])
    start, end, step = static_int(start), static_int(end), static_int(step)
    if not _is_last_dim(dim, node) or None in (start, end, step, size):
        return None
    return Placed(value, _python_index(start, size), _python_index(end, size), step, [node], zeros)


def _with_own_constants(nodes: list, places: tuple) -> list:
    """nodes plus the zeros the places write into, where only nodes use them: a constant that
    inductor shares between several sites (one zeros for every layer) is an input of each."""
    inside = set(nodes)
    owned = [p.zeros for p in places if p.zeros is not None and set(p.zeros.users) <= inside]
    return list(dict.fromkeys([*nodes, *owned]))


def match_rotation_transpose(node) -> Optional[Rotation]:
    """R^T(y) rooted at node, as autograd writes it; Rotation.source is y."""
    if not rank(node):  # not a tensor node, or 0-d
        return None
    parts = last_dim_cat(node)
    if parts is not None and len(parts) == 2:  # backward of split + cat
        first, second = parts
        neg_in = negated(second)
        if neg_in is None:
            return None
        hi, lo = last_dim_piece(first), last_dim_piece(neg_in)
        size = static_int(val(node).shape[-1])
        if hi and lo and hi.source is lo.source and lo.start == 0 and hi.start == lo.end and \
                size is not None and hi.end == size == 2 * lo.end:
            return Rotation(hi.source, "half", [node, second, *hi.nodes, *lo.nodes])
        return None
    if is_call(node, aten.add.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        size = static_int(val(node).shape[-1])
        if size is None:
            return None
        for a, b in (node.args, node.args[::-1]):
            pa, pb = placed(a), placed(b)
            if not (pa and pb):
                continue
            neg_in = negated(pa.value)
            if neg_in is None:
                continue
            half = size // 2
            if (pa.start, pa.end, pa.step) == (half, size, 1) and (pb.start, pb.end, pb.step) == (0, half, 1) \
                    and size % 2 == 0:
                hi, lo = last_dim_piece(pb.value), last_dim_piece(neg_in)
                if hi and lo and hi.source is lo.source and \
                        (lo.start, lo.end, hi.start, hi.end) == (0, half, half, size):
                    nodes = [node, pa.value, *pa.nodes, *pb.nodes, *hi.nodes, *lo.nodes]
                    return Rotation(hi.source, "half", _with_own_constants(nodes, (pa, pb)))
            if pa.start == 1 and pb.start == 0 and pa.step == pb.step == 2:
                even, odd = pair_lane(neg_in), pair_lane(pb.value)
                if even and odd and even.source is odd.source and even.lane == 0 and odd.lane == 1:
                    nodes = [node, pa.value, *pa.nodes, *pb.nodes, *even.nodes, *odd.nodes]
                    return Rotation(even.source, "interleave", _with_own_constants(nodes, (pa, pb)))
        return None
    if is_call(node, *VIEWS):  # backward of unbind + stack
        return interleaved_pairs(node, transposed=True)
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
        return list(dict.fromkeys([*self.terms, *self.rotation.nodes]))


def match_rope_site(add: Node) -> Optional[RopeSite]:
    """The forward RoPE rooted at add (operands of the add and of each mul in any order).
    Raises NotFused for the pattern with a broken rule."""
    if not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    terms = add.args
    if not all(is_call(t, aten.mul.Tensor) and all(isinstance(a, Node) for a in t.args[:2]) for t in terms):
        return None
    reason = None
    for cos_term, sin_term in (terms, terms[::-1]):
        for i in (0, 1):
            try:
                rot = match_rotation(sin_term.args[i])
            except NotFused as miss:
                reason = reason or str(miss)
                continue
            if rot is None:
                continue
            for j in (0, 1):
                if cos_term.args[j] is rot.source:
                    return RopeSite(rot.source, cos_term.args[1 - j], sin_term.args[1 - i], rot,
                                    [cos_term, sin_term])
            reason = reason or (
                f"the tensor multiplied by cos ({cos_term.args[0].name} or {cos_term.args[1].name}) "
                f"is not the rotated tensor {rot.source.name}")
    if reason:
        raise NotFused(reason)
    return None


# -- operands, normalisation ------------------------------------------------------------------
def binary_operands(node, target) -> Optional[tuple]:
    """(a, b) when node is ``target(a, b)`` with no other arguments."""
    return tuple(node.args[:2]) if is_call(node, target) and len(node.args) == 2 and not node.kwargs else None


@dataclasses.dataclass
class RmsNorm:
    """``x * rsqrt(mean(x^2, -1, keepdim) + eps) * gamma [+ beta]``, with the casts around it."""

    x: Node
    gamma: Node
    beta: Optional[Node]
    eps: Any  # a float, or a node when dynamo made it a graph input
    nodes: list


def match_rms_norm(node) -> Optional[RmsNorm]:
    stripped = uncast(node)
    out, nodes, beta = stripped.node, list(stripped.casts), None
    added = binary_operands(out, aten.add.Tensor)
    if added is not None:
        for a, b in (added, added[::-1]):
            b_root = uncast(b)
            if isinstance(b_root.node, Node) and rank(b_root.node) == 1:
                beta, nodes = b_root.node, [*nodes, out, *b_root.casts]
                out = a
                break
        else:
            return None
    stripped = uncast(out)
    out = stripped.node
    nodes += stripped.casts
    product = binary_operands(out, aten.mul.Tensor)
    if product is None:
        return None
    for gamma_side, normed_side in (product, product[::-1]):
        gamma, normed = uncast(gamma_side), uncast(normed_side)
        if not (isinstance(gamma.node, Node) and rank(gamma.node) == 1):
            continue
        found = quiet(match_rms_core, normed.node)
        if found is not None:
            duplicate = [found.duplicate] if found.duplicate is not None else []
            return RmsNorm(found.x, gamma.node, beta, found.eps,
                           [*nodes, out, *gamma.casts, *normed.casts, *found.nodes, *found.casts, *duplicate])
    return None


@dataclasses.dataclass
class RmsCore:
    """``xf * rsqrt(mean(xf^2, -1, keepdim=True) + eps)``: a per-row RMS normalisation over the last
    dim, in any spelling (see :func:`match_rms_core`). ``x`` is xf without the dtype casts that made it."""

    x: Node
    xf: Node
    casts: list  # the casts from x to xf (empty when xf is x)
    eps: Any  # a number, or a node when dynamo made it a graph input
    rstd: Optional[Node]  # the node holding rsqrt(mean(xf^2) + eps) (None where x is divided by the sqrt)
    nodes: list  # the normalisation, from the square to ``node`` (the casts not included)
    duplicate: Optional[Node] = None  # a second computation of xf, the one squared


def _sqrt_of(node) -> Optional[tuple]:
    """(v, nodes) for ``rsqrt(v)``, ``reciprocal(sqrt(v))`` or ``1 / sqrt(v)`` (a reciprocal times 1)."""
    if is_call(node, aten.rsqrt.default):
        return node.args[0], [node]
    extra = []
    ones = binary_operands(node, aten.mul.Tensor)
    if ones is not None and 1 in ones:
        extra, node = [node], ones[1] if ones[0] == 1 else ones[0]
    if is_call(node, aten.reciprocal.default) and is_call(node.args[0], aten.sqrt.default):
        return node.args[0].args[0], [*extra, node, node.args[0]]
    return None


def _reduce_args(node: Node) -> tuple:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return list(dims) if dims is not None else None, keepdim


def _mean_of_squares(node) -> Optional[tuple]:
    """(squared tensor, mean node, nodes) for ``mean(q, dims, keepdim)`` or ``sum(q, ...) / D`` with q
    ``t^2`` or ``t * t``; NotFused for a reduction of squares that is not a last-dim mean."""
    nodes, mean = [], node
    divided = binary_operands(node, aten.div.Tensor)
    scaled = binary_operands(node, aten.mul.Tensor)
    if divided is not None and is_call(divided[0], aten.sum.dim_IntList):
        mean, nodes, count = divided[0], [node], divided[1]
    elif scaled is not None and any(is_call(t, aten.sum.dim_IntList) for t in scaled):
        mean = scaled[0] if is_call(scaled[0], aten.sum.dim_IntList) else scaled[1]
        other = scaled[1] if mean is scaled[0] else scaled[0]
        nodes, count = [node], 1 / other if isinstance(other, (int, float)) and other else None
    elif is_call(node, aten.sum.dim_IntList):
        count = None
    elif is_call(node, aten.mean.dim):
        count = "mean"
    else:
        return None
    square = mean.args[0]
    if is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2:
        base = square.args[0]
    elif is_call(square, aten.mul.Tensor) and len(square.args) == 2 and square.args[0] is square.args[1]:
        base = square.args[0]
    else:
        return None
    dims, keepdim = _reduce_args(mean)
    if not (dims is not None and len(dims) == 1 and _is_last_dim(dims[0], square)):
        raise NotFused(f"{mean.name} averages the squares over dims {dims}, not over the last dim only")
    if not keepdim:
        raise NotFused(f"{mean.name} drops the reduced dim (an RMS norm keeps it to broadcast over the row)")
    if count != "mean":
        size = static_int(val(square).shape[-1])
        if count is None or size is None or not math.isclose(float(count), size):
            raise NotFused(f"{node.name} sums the squares over the last dim without dividing by its size: "
                           "not their mean")
    return base, mean, [*nodes, mean, square]


_FLOAT_WIDTH = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}


def _widened(node, source) -> bool:
    """node is source cast only to wider float dtypes (an exact copy of its values)."""
    stripped = uncast(node)
    if stripped.node is not source or not stripped.casts:
        return False
    widths = [_FLOAT_WIDTH.get(val(n).dtype) for n in [source, *reversed(stripped.casts)]]
    return None not in widths and all(a < b for a, b in zip(widths, widths[1:]))


def _same_value(a: Node, b: Node) -> bool:
    """a and b compute one value: the same deterministic op of the same arguments."""
    if not (isinstance(a, Node) and isinstance(b, Node) and a.op == b.op == "call_function"):
        return False
    random = isinstance(a.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in a.target.tags
    return not random and a.target == b.target and a.args == b.args and a.kwargs == b.kwargs


def match_rms_core(node) -> Optional[RmsCore]:
    """The RMS normalisation rooted at node: ``xf * r`` or ``xf / sqrt(v)``, r = ``rsqrt(v)`` or
    ``1 / sqrt(v)``, v = ``m + eps``, m = ``mean(xf^2, -1, keepdim=True)`` (or ``xf * xf``, or the
    sum divided by the last dim's size). NotFused for the same shape with a broken rule: no eps, another
    reduction, or the RMS of another tensor."""
    if is_call(node, aten.div.Tensor) and len(node.args) == 2 and is_call(node.args[1], aten.sqrt.default):
        candidates = [(node.args[0], node.args[1].args[0], [node, node.args[1]], None)]
    else:
        product = binary_operands(node, aten.mul.Tensor)
        if product is None:
            return None
        candidates = []
        for xf, scale in (product, product[::-1]):
            inside = _sqrt_of(scale)
            if inside is not None:
                candidates.append((xf, inside[0], [node, *inside[1]], scale))
    for xf, total, nodes, rstd in candidates:
        if not isinstance(xf, Node):
            continue
        eps, found = None, None
        if is_call(total, aten.add.Tensor, aten.add.Scalar) and len(total.args) == 2 and not total.kwargs:
            for m, e in (total.args, total.args[::-1]):
                found = _mean_of_squares(m) if isinstance(m, Node) else None
                if found is not None:
                    eps = e
                    break
        else:
            found = _mean_of_squares(total) if isinstance(total, Node) else None
            if found is not None:
                raise NotFused(f"{node.name} divides by the root of the mean of squares with no epsilon added: "
                               "not RMSNorm's rsqrt(mean(x^2) + epsilon)")
        if found is None:
            continue
        base, _, reduce_nodes = found
        if base is not xf and _widened(base, xf):  # T5: the RMS of x cast up, times x (promoted exactly)
            xf = base
        if base is not xf and not _same_value(base, xf):
            raise NotFused(f"{node.name} scales {xf.name} by the RMS of another tensor, {base.name}")
        x = uncast(xf)
        add = [total] if eps is not None else []
        duplicate = base if base is not xf else None  # the same value computed twice (Cohere's x - mean)
        return RmsCore(x.node, xf, x.casts, eps, rstd, [*nodes, *add, *reduce_nodes], duplicate)
    return None


# -- DeepSeek's de-interleave --------------------------------------------------------------------
def swaps_last_two(node) -> bool:
    """x.transpose(-1, -2) (``permute`` swapping the last two dims after inductor's decompositions)."""
    n = rank(node)
    if not n or n < 2:
        return False
    if is_call(node, aten.transpose.int):
        return {node.args[1] % n, node.args[2] % n} == {n - 1, n - 2}
    return is_call(node, aten.permute.default) and list(node.args[1]) == [*range(n - 2), n - 1, n - 2]


@dataclasses.dataclass
class Deinterleave:
    """``x.view(..., D/2, 2).transpose(-1, -2).reshape(..., D)``: the pairs (2k, 2k+1) of x put
    in half layout (all even positions, then all odd), as DeepSeek's reference RoPE does."""

    source: Node
    nodes: list


def deinterleaved(node) -> Optional[Deinterleave]:
    if not is_call(node, *VIEWS):
        return None
    inner, nodes = node.args[0], [node]
    if is_call(inner, aten.clone.default):
        nodes.append(inner)
        inner = inner.args[0]
    if not swaps_last_two(inner):
        return None
    pairs = inner.args[0]
    if not (is_call(pairs, *VIEWS) and size_eq(val(pairs).shape[-1], 2)):
        return None
    source = pairs.args[0]
    if not (shape_eq(val(source).shape, val(node).shape)
            and shape_eq(val(pairs).shape[:-1], [*val(source).shape[:-1], val(source).shape[-1] // 2])):
        return None
    return Deinterleave(source, [*nodes, inner, pairs])


# -- DeepSeek's pairs-in / half-out RoPE ------------------------------------------------------
@dataclasses.dataclass
class LaneTerm:
    """``sign * piece * table``: one product of a pairs-to-half RoPE, its piece being an
    interleaved lane (forward: 0 even, 1 odd) or a half of the gradient (backward: 0 first, 1 second)."""

    sign: int
    source: Node
    part: int
    table: Node
    nodes: list


def _half_part(node) -> Optional[PairLane]:
    """node = source[..., :D/2] (part 0) or source[..., D/2:] (part 1)."""
    piece = last_dim_piece(node)
    if piece is None or piece.step != 1:
        return None
    size = static_int(val(piece.source).shape[-1])
    if size is None or size % 2:
        return None
    part = {(0, size // 2): 0, (size // 2, size): 1}.get((piece.start, piece.end))
    return None if part is None else PairLane(piece.source, part, piece.nodes)


def _signed_product(node, find_part) -> Optional[LaneTerm]:
    """[-]piece * table in any operand order, the minus on the piece or on the product."""
    sign, nodes = 1, []
    inner = negated(node)
    if inner is not None:
        sign, nodes, node = -1, [node], inner
    ops = binary_operands(node, aten.mul.Tensor)
    if ops is None:
        return None
    for a, b in (ops, ops[::-1]):
        piece_sign, extra = sign, []
        if negated(a) is not None:
            piece_sign, extra, a = -sign, [a], negated(a)
        part = find_part(a)
        if part is not None and isinstance(b, Node):
            return LaneTerm(piece_sign, part.source, part.lane, b, [*nodes, node, *extra, *part.nodes])
    return None


def _signed_sum(node, find_part) -> Optional[list]:
    """The two signed products of ``a + b`` or ``a - b``, or None."""
    for target, second_sign in ((aten.add.Tensor, 1), (aten.sub.Tensor, -1)):
        ops = binary_operands(node, target)
        if ops is None:
            continue
        terms = [_signed_product(ops[0], find_part), _signed_product(ops[1], find_part)]
        if None in terms:
            return None
        second = terms[1]
        return [terms[0], dataclasses.replace(second, sign=second.sign * second_sign)]
    return None


@dataclasses.dataclass
class PairsToHalfRope:
    """``P(x) * cat(cos) + rotate_half(P(x)) * cat(sin)``, P the de-interleave, found as its
    two halves (forward), or its adjoint (backward). ``cos``/``sin`` are the tables of the
    first and of the second half of the result: the fused op's cos is ``cat(cos, -1)``."""

    x: Node
    cos: tuple
    sin: tuple
    nodes: list


def _terms_key(terms) -> dict:
    return {(t.sign, t.part): t for t in terms}


def _tables(halves: list, signature: tuple, describe_form: str) -> Optional[tuple]:
    """Check each half's signed terms against ``signature`` ({(sign, part): table role}) and
    return the tables by role; raise NotFused for the same pieces in another arrangement."""
    found = {}
    for terms, wanted in zip(halves, signature):
        keyed = _terms_key(terms)
        if set(keyed) != set(wanted):
            got = " and ".join(f"{'+' if t.sign > 0 else '-'}part{t.part}*{t.table.name}" for t in terms)
            raise NotFused(f"the halves combine the pieces as {got}: not {describe_form}")
        for key, role in wanted.items():
            found[role] = keyed[key].table
    return found


# forward: cat([even*A - odd*B, odd*C + even*E]) -> cos = (A, C), sin = (B, E)
_FORWARD_SIGNATURE = ({(1, 0): "cos0", (-1, 1): "sin0"}, {(1, 1): "cos1", (1, 0): "sin1"})
# backward: dx_even = g0*A + g1*E, dx_odd = g1*C - g0*B
_BACKWARD_SIGNATURE = ({(1, 0): "cos0", (1, 1): "sin1"}, {(1, 1): "cos1", (-1, 0): "sin0"})


def match_pairs_to_half_rope(node) -> Optional[PairsToHalfRope]:
    """``cat([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], -1)`` rooted at the cat
    (transformers 5.x DeepSeek-V3 ``apply_rotary_pos_emb_interleave``; cos/sin of half width,
    lanes by strided slices or by ``unbind``/``select`` of the pairs)."""
    parts = last_dim_cat(node)
    if parts is None or len(parts) != 2:
        return None
    halves = [_signed_sum(p, pair_lane) for p in parts]
    if None in halves or len({t.source for half in halves for t in half}) != 1:
        return None
    tables = _tables(halves, _FORWARD_SIGNATURE, "cat([even*cos - odd*sin, odd*cos + even*sin])")
    nodes = [node, *parts, *(n for half in halves for t in half for n in t.nodes)]
    return PairsToHalfRope(halves[0][0].source, (tables["cos0"], tables["cos1"]), (tables["sin0"], tables["sin1"]),
                           list(dict.fromkeys(nodes)))


def match_pairs_to_half_rope_backward(node) -> Optional[PairsToHalfRope]:
    """The adjoint of :func:`match_pairs_to_half_rope` as autograd writes it, rooted at the add
    of the two lanes written back (``slice_backward``/``slice_scatter`` at step 2):
    ``dx_even = g0 * cos + g1 * sin'``, ``dx_odd = g1 * cos' - g0 * sin``, g0/g1 the halves of g."""
    lanes = _lanes_written_back(node)
    if lanes is None:
        return None
    halves = [_signed_sum(lanes[lane][0], _half_part) for lane in (0, 1)]
    if None in halves or len({t.source for half in halves for t in half}) != 1:
        return None
    tables = _tables(halves, _BACKWARD_SIGNATURE, "the adjoint of DeepSeek's pairs-to-half rotation")
    nodes = [node, *(n for lane in (0, 1) for n in (lanes[lane][0], *lanes[lane][1])),
             *(n for half in halves for t in half for n in t.nodes)]
    return PairsToHalfRope(halves[0][0].source, (tables["cos0"], tables["cos1"]), (tables["sin0"], tables["sin1"]),
                           list(dict.fromkeys(nodes)))


def _lanes_written_back(node) -> Optional[dict]:
    """{lane: (value, nodes)} for ``slice_backward(even, 0::2) + slice_backward(odd, 1::2)``
    (the backward of strided slices) or ``stack([even, odd], -1).view(..., D)`` (of ``unbind``)."""
    if is_call(node, aten.add.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        lanes = {}
        for arg in node.args:
            put = placed(arg)
            if put is None or put.step != 2 or put.start not in (0, 1) or put.start in lanes:
                return None
            lanes[put.start] = (put.value, put.nodes)
        return lanes
    if is_call(node, *VIEWS):
        stacked = new_last_dim_stack(node.args[0])
        if stacked is None or not rank(node):
            return None
        ss, vs = val(node.args[0]).shape, val(node).shape
        if len(vs) != len(ss) - 1 or not size_eq(ss[-1], 2) or not shape_eq(vs[:-1], ss[:-2]):
            return None
        return {0: (stacked.first, stacked.nodes), 1: (stacked.second, [])}
    return None


def reinterleaved(node) -> Optional[Deinterleave]:
    """``y.view(..., 2, D/2).transpose(-1, -2).reshape(..., D)``: the inverse of
    :func:`deinterleaved` (autograd's backward of it); Deinterleave.source is y."""
    if not is_call(node, *VIEWS):
        return None
    inner, nodes = node.args[0], [node]
    if is_call(inner, aten.clone.default):
        nodes.append(inner)
        inner = inner.args[0]
    if not swaps_last_two(inner):
        return None
    halves = inner.args[0]
    if not (is_call(halves, *VIEWS) and rank(halves) and rank(halves) >= 2 and size_eq(val(halves).shape[-2], 2)):
        return None
    source = halves.args[0]
    ss = val(source).shape
    if not (shape_eq(ss, val(node).shape) and shape_eq(val(halves).shape, [*ss[:-1], 2, ss[-1] // 2])):
        return None
    return Deinterleave(source, [*nodes, inner, halves])


def match_rope_grad_site(add: Node) -> Optional[RopeSite]:
    """``g * cos + R^T(g * sin)`` rooted at add: the backward of a RoPE site as autograd
    writes it (RopeSite.x is g). Raises NotFused when the two gradients differ."""
    if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    for cos_term, rt_node in (add.args, add.args[::-1]):
        rt = match_rotation_transpose(rt_node)
        if rt is None:
            continue
        if not (is_call(rt.source, aten.mul.Tensor) and is_call(cos_term, aten.mul.Tensor)):
            return None
        sin_term = rt.source
        for i, j in ((0, 0), (0, 1), (1, 0), (1, 1)):
            if sin_term.args[i] is cos_term.args[j]:
                return RopeSite(sin_term.args[i], cos_term.args[1 - j], sin_term.args[1 - i], rt,
                                [cos_term, rt_node, sin_term])
        raise NotFused("the gradient multiplied by cos is not the one multiplied by sin")
    return None
