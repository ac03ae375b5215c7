"""Building blocks the fusion passes share: each recognises one piece of model code in an
aten graph and returns a typed record of what it found, or None.

The graph is canonicalized first (``canonicalize.py``), so no-op slices, views and casts,
and duplicate views of one tensor, are already gone.

- pieces of the last dim: :func:`last_dim_piece`, :func:`pieces_of`; casts: :func:`uncast`;
- normalisation and projections: :func:`match_rms_norm`, :func:`match_quantize`, :func:`match_linear`;
- layout: :func:`transposed`, :func:`swaps_01`.

RoPE is not matched here: :mod:`~npu_fuse_backend.rotation` recognises what a subgraph computes.
"""

import dataclasses
import operator
from typing import Any, NamedTuple, Optional

import torch
from torch.fx import Node

from .graph_utils import INT_MAX, VIEWS, aten, is_call, norm_dim, rank, shape_eq, slice_args, static_int, val

CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


# -- pieces of the last dim, casts ---------------------------------------------------
class Piece(NamedTuple):
    """``source[..., start:end:step]``: a last-dim slice, or one part of a last-dim split."""

    source: Node
    start: int
    end: int
    step: int
    nodes: list  # the slice (or getitem and split) computing it


class Stripped(NamedTuple):
    """A value without the dtype casts around it."""

    node: Any
    casts: list


def uncast(node) -> Stripped:
    casts = []
    while is_call(node, *CASTS) and set(node.kwargs) <= {"dtype", "layout", "device"}:
        casts.append(node)
        node = node.args[0]
    return Stripped(node, casts)


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


class PieceUse(NamedTuple):
    """A user of a tensor that takes one last-dim piece of it."""

    node: Node
    nodes: list


def pieces_of(node: Node) -> dict:
    """{(start, end): PieceUse} for the step-1 last-dim slices and split parts taken of node."""
    candidates = []
    for user in node.users:
        if is_call(user, aten.split.Tensor, aten.split_with_sizes.default):
            candidates += list(user.users)
        else:
            candidates.append(user)
    found = {}
    for candidate in candidates:
        piece = last_dim_piece(candidate)
        if piece is not None and piece.source is node and piece.step == 1:
            found.setdefault((piece.start, piece.end), PieceUse(candidate, piece.nodes))
    return found


# -- normalisation and projections ------------------------------------------------------------
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
    out, nodes = uncast(node)
    nodes, beta = list(nodes), None
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
    out, casts = uncast(out)
    nodes += casts
    product = binary_operands(out, aten.mul.Tensor)
    if product is None:
        return None
    for gamma_side, normed_side in (product, product[::-1]):
        gamma, normed = uncast(gamma_side), uncast(normed_side)
        if not (isinstance(gamma.node, Node) and rank(gamma.node) == 1):
            continue
        found = _normalized(normed.node)
        if found is not None:
            return RmsNorm(found.x, gamma.node, beta, found.eps,
                           [*nodes, out, *gamma.casts, *normed.casts, *found.nodes])
    return None


class _Normalized(NamedTuple):
    x: Node
    eps: Any
    nodes: list


def _normalized(node) -> Optional[_Normalized]:
    """xf * rsqrt(mean(xf^2, -1, keepdim=True) + eps), xf = float(x): a per-row RMS over the last dim."""
    product = binary_operands(node, aten.mul.Tensor)
    if product is None:
        return None
    for xf, scale in (product, product[::-1]):
        if not is_call(scale, aten.rsqrt.default):
            continue
        total = binary_operands(scale.args[0], aten.add.Tensor)
        if total is None or not is_call(total[0], aten.mean.dim):
            continue
        mean = total[0]
        square = mean.args[0]
        if not (is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2 and square.args[0] is xf):
            continue
        dims = list(mean.args[1]) if len(mean.args) > 1 else mean.kwargs.get("dim")
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        if not (keepdim and dims is not None and len(dims) == 1 and _is_last_dim(dims[0], square)):
            continue
        x, casts = uncast(xf)
        return _Normalized(x, total[1], [node, scale, scale.args[0], mean, square, *casts])
    return None


def transposed(node) -> Optional[Node]:
    """w for ``w.t()`` (``t``, or ``permute(w, [1, 0])`` after inductor's decompositions)."""
    if is_call(node, aten.t.default) or (is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        return node.args[0]
    return None


@dataclasses.dataclass
class Quantize:
    """``int8(clamp(round(y / scale + offset), -128, 127))``: static per-tensor asymmetric quant."""

    y: Node
    scale: Node
    offset: Node
    nodes: list


def _int8_clamped(node) -> Optional[Stripped]:
    """clamp(inner, -128, 127), or clamp_max(clamp_min(inner, -128), 127)."""
    if is_call(node, aten.clamp.default) and tuple(node.args[1:3]) == (-128, 127):
        return Stripped(node.args[0], [node])
    if is_call(node, aten.clamp_max.default) and node.args[1] == 127 and \
            is_call(node.args[0], aten.clamp_min.default) and node.args[0].args[1] == -128:
        return Stripped(node.args[0].args[0], [node, node.args[0]])
    return None


def match_quantize(node) -> Optional[Quantize]:
    clamp, casts = uncast(node)
    clamped = _int8_clamped(clamp)
    if not (casts and val(node).dtype == torch.int8 and clamped and is_call(clamped.node, aten.round.default)):
        return None
    rounded = clamped.node
    shifted = binary_operands(rounded.args[0], aten.add.Tensor)
    divided = binary_operands(shifted[0], aten.div.Tensor) if shifted else None
    if divided is None:
        return None
    offset, scale, y = uncast(shifted[1]), uncast(divided[1]), uncast(divided[0])
    return Quantize(y.node, scale.node, offset.node,
                    [*casts, *clamped.casts, rounded, rounded.args[0], shifted[0], *offset.casts, *scale.casts,
                     *y.casts])


@dataclasses.dataclass
class QuantLinear:
    """The w8a8 parts of a projection: the activation's quantize and the int32 bias + dequant scale."""

    quantize: Quantize
    bias: Node
    descale: Node


@dataclasses.dataclass
class Linear:
    """A projection: ``x @ w^T`` (nn.Linear, w stored [out, in]) or ``x @ w`` (w stored
    [in, out]), or the w8a8 form ``dequant(int_mm(quant(x), w^T or w) + bias)``."""

    x: Node
    w: Node  # the weight as the graph holds it
    quant: Optional[QuantLinear]
    nodes: list
    in_out: bool = False  # w is stored [in, out] (``x @ w``), not [out, in]


def _weight(node) -> Optional[tuple]:
    """(w, in_out, nodes) for the right operand of a 2-D matmul: ``w.t()`` or a plain 2-D w."""
    if transposed(node) is not None:
        return transposed(node), False, [node]
    if rank(node) == 2:
        return node, True, []
    return None


def match_linear(node) -> Optional[Linear]:
    out, casts = uncast(node)
    if is_call(out, aten.mm.default):
        weight = _weight(out.args[1])
        if weight is None:
            return None
        w, in_out, w_nodes = weight
        return Linear(out.args[0], w, None, [*casts, out, *w_nodes], in_out)
    scaled = binary_operands(out, aten.mul.Tensor)
    if scaled is None:
        return None
    for acc_side, descale in (scaled, scaled[::-1]):
        acc = uncast(acc_side)
        biased = binary_operands(acc.node, aten.add.Tensor)
        if biased is None or not is_call(biased[0], aten._int_mm.default):
            continue
        int_mm, bias = biased
        weight = _weight(int_mm.args[1])
        quant = match_quantize(int_mm.args[0])
        if weight is None or quant is None:
            return None
        w, in_out, w_nodes = weight
        return Linear(quant.y, w, QuantLinear(quant, bias, descale),
                      [*casts, out, *acc.casts, acc.node, int_mm, *w_nodes, *quant.nodes], in_out)
    return None


# -- layout ---------------------------------------------------------------------------------------
def swaps_01(node) -> bool:
    """x.transpose(0, 1) of a 3-D x (``permute(x, [1, 0, 2])`` after inductor's decompositions)."""
    if rank(node) != 3:
        return False
    if is_call(node, aten.transpose.int):
        return sorted(d % 3 for d in node.args[1:3]) == [0, 1]
    return is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0, 2]


# -- layout-only ops ----------------------------------------------------------------------------
FRESH_BUFFERS = (aten.empty.memory_format, aten.new_empty.default, aten.new_empty_strided.default,
                 aten.empty_like.default, aten.empty_strided.default)


class LayoutPath(NamedTuple):
    """``node`` computed from ``source`` by ops that only lay the same values out anew
    (row-major order kept): its value is ``source.reshape(node's shape)``."""

    source: Any
    nodes: list  # the layout ops, and the fresh buffers values were copied into


def copied_into_fresh_buffer(node) -> Optional[Node]:
    """src for ``copy(empty(...), src)`` of src's shape and dtype (``x.new_empty(...).copy_(src)``
    after functionalization)."""
    if not (is_call(node, aten.copy.default) and is_call(node.args[0], *FRESH_BUFFERS) and len(node.args) == 2):
        return None
    src = node.args[1]
    if not (isinstance(src, Node) and shape_eq(val(node).shape, val(src).shape) and val(node).dtype == val(src).dtype):
        return None
    return src


def through_layout(node) -> LayoutPath:
    """Walk back from node over view/reshape/_unsafe_view, clone and copies into fresh buffers.
    Each keeps the values in row-major order, so a replacement computing ``source`` gives node's
    value as a view of its contiguous result."""
    nodes = []
    while True:
        if is_call(node, *VIEWS, aten.clone.default) and isinstance(node.args[0], Node):
            if is_call(node, aten.clone.default) and set(node.kwargs) - {"memory_format"}:
                break
            nodes.append(node)
            node = node.args[0]
            continue
        src = copied_into_fresh_buffer(node)
        if src is None:
            break
        nodes += [node, node.args[0]]
        node = src
    return LayoutPath(node, nodes)


def scalar_like(node) -> Any:
    """The one-element tensor (or number) behind ``expand``/views of it, else node itself."""
    while is_call(node, aten.expand.default, *VIEWS) and isinstance(node.args[0], Node) \
            and val(node.args[0]).numel() == 1:
        node = node.args[0]
    return node


def written_back(node: Node, layout: LayoutPath) -> list:
    """``copy(dst, node)`` users whose dst is one of layout's nodes and has node's shape, dtype and
    strides: each equals node's value (the functional form of an in-place op on a view,
    ``scores /= s``)."""
    copies = []
    for user in node.users:
        if is_call(user, aten.copy.default) and user.args[1] is node and user.args[0] in layout.nodes:
            dst, value = val(user.args[0]), val(node)
            if shape_eq(dst.shape, value.shape) and shape_eq(dst.stride(), value.stride()) \
                    and dst.dtype == value.dtype:
                copies.append(user)
    return copies
