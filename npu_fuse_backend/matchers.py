"""Building blocks two or more fusion families share: each recognises one piece of model code
in an aten graph and returns a typed record of what it found, or None. A family's own
matchers live in its pass module; RoPE is not matched here: :mod:`~npu_fuse_backend.rotation`
recognises what a subgraph computes.

A building block that finds its piece but sees a broken rule raises
:class:`~npu_fuse_backend.fusion.NotFused` with the reason; a caller that tries
alternatives catches it, and a pass that looks at a site another family owns reads it with
:func:`quiet` (that family reports the near-miss). The graph is canonicalized first
(``canonicalize.py``), so no-op slices, views and casts, and duplicate views of one tensor,
are already gone.

- pieces of the last dim: :func:`last_dim_piece`; casts: :func:`uncast`, :func:`widens`; operands: :func:`binary_operands`;
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
from .graph_utils import INT_MAX, aten, call_arg, draws_random, is_call, norm_dim, rank, slice_args, static_int, val

# the ops that change only a tensor's dtype (what ``uncast`` looks through), and the keywords such a
# call may carry and still be just a cast
DTYPE_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
CAST_KWARGS = frozenset({"dtype", "layout", "device", "memory_format"})
# the factories of a tensor of zeros
ZERO_FILLS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


def widens(source: torch.dtype, target: torch.dtype) -> bool:
    """Casting source to target is exact (target holds every source value) and changes the dtype."""
    wider = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    return target in wider.get(source, ())


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
        if not _is_last_dim(call_arg(split, 2, "dim", 0), src) or size is None:
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
    dims, keepdim = call_arg(node, 1, "dim"), call_arg(node, 2, "keepdim", False)
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


def _widened(node, source) -> bool:
    """node is source cast only to wider float dtypes (an exact copy of its values)."""
    stripped = uncast(node)
    if stripped.node is not source or not stripped.casts:
        return False
    dtypes = [val(n).dtype for n in [source, *reversed(stripped.casts)]]
    return all(widens(a, b) for a, b in zip(dtypes, dtypes[1:]))


def _same_value(a: Node, b: Node) -> bool:
    """a and b compute one value: the same deterministic op of the same arguments."""
    if not (isinstance(a, Node) and isinstance(b, Node) and a.op == b.op == "call_function"):
        return False
    return not draws_random(a.target) and a.target == b.target and a.args == b.args and a.kwargs == b.kwargs


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
