"""The semantic RoPE recognizer: what a subgraph computes, not how it is spelled.

Every RoPE, forward or backward, in any spelling, computes per lane ``j`` of its result's last
dim ``out[j] = A[j] * x[a(j)] + B[j] * x[b(j)]``: two lanes of one tensor x, each times a table
that does not depend on x. The recognizer finds that form by abstract interpretation. From an
anchor (an add, sub, cat, stack, view or view_as_real that lane moves lead to) it evaluates
the subgraph on symbolic values: each value is, per lane of its trailing dims, a short sum of
terms ``sign * x[i] * t1[l1] * ...``, the t's being *atoms* (nodes that do not depend on x,
kept whole: the tables). Slices, selects, splits/chunks/unbinds, cats, stacks, pair views
(``view(..., D/2, 2)``, flatten), lane transposes, negations, add/sub/mul, clones, expands of
lane dims, casts, ``copy``, ``slice_backward``/``slice_scatter`` and complex views
(``view_as_complex(...) * freqs``, ``view_as_real``) move, sign and combine lanes; anything else
is an atom, and an atom that depends on x is recorded with why it could not be followed.

The rotated tensor x is found from the leaves the walk from the anchor reaches through lane moves:
of the nodes every path from such a leaf to the anchor goes through, the last one before x's lanes
first move or mix (a dequantized projection before its split, a sum of gradients, ``x * 1.0``); a
view that may split either pairs or heads (``[T, 2 * D] -> [T, 2, D]``) is read both ways, heads
preferred. The result then maps to the op that computes
exactly it (:class:`Rotation`): ``a`` the identity and ``b`` the half or interleave pairing
(rotary_mul, or rotary_mul_backward when its tables are the simpler: autograd's R^T(g * sin)),
DeepSeek's pairs-in/halves-out permutation and its adjoint (interleave_rope and its backward),
on all of x's last dim, on a slice of it, or on a slice with the other lanes copied from x
(a partial RoPE kept by ``cat`` or written back). The tables are rebuilt in the graph from the
atoms and the lanes each term reads (``cat((c, c))`` for half-width tables, the pairs of a
complex ``freqs_cis``), with the signs the op's R needs.

What is not such a rotation, but is rotation-like (every lane a sum of at most two terms, and
as many lanes of x read as the result has lanes), is a :class:`Refusal` naming why: a term that
does not read x, a table that depends on x, a permutation no GE mode computes (or one that is not
an involution), a sign error (a reflection), a slice written elsewhere than it was read, a
rounding in the middle of the computation that the op's single rounding cannot reproduce.

Precision. The fused op computes in float32 and rounds once. Each node's dtype is where eager
rounds: casts of x's lanes before any multiply are reproduced on x; a rounding of the products
or of their sum is harmless when its dtype is at least as precise as the result's (autocast's
bf16 ``g * cos``, a bf16 model's bf16 products); one that is coarser than the result's dtype is
refused. The op runs in the promotion of x's, the tables' and the result's dtypes.

Cost: anchors are only sums of two tensors a few lane ops after a lane move, and the lane ops a few
steps after them; the outermost are evaluated first and those inside a rotation only on demand; every
value is computed once per (x, node); an anchor whose signature (its cone's ops, constants, meta and
wiring, and which of its nodes depend on which) matches an evaluated one's reuses that result with its
nodes mapped (the layers of a model: one evaluation per distinct site). All of it is kept per graph
until the graph changes.
"""

import dataclasses
import functools
import operator
from typing import Any, Optional, Union

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx import Graph, Node

from .canonicalize import PERMUTES
from .fusion import FusionPass, NotFused, PassContext
from .graph_utils import VIEWS, aten, attribute, call_arg, calls_of, describe, dtype_name, is_call, norm_dim, \
    pure_aten_op, shape_eq, size_eq, slice_args, slice_scatter_args, static_int, uninitialized, users_outside, val
from .matchers import CAST_KWARGS, DTYPE_CASTS, ZERO_FILLS

SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
SAME = (aten.clone.default, aten.alias.default, aten.resolve_conj.default, aten.lift_fresh_copy.default)
ANCHORS = (aten.add.Tensor, aten.sub.Tensor, aten.cat.default, aten.stack.default, aten.view_as_real.default,
           aten.slice_scatter.default, aten.select_scatter.default, *VIEWS)

MAX_TERMS = 4  # terms per lane: more is not a RoPE
MAX_LANES = 8192  # lanes of one value
MAX_MATRIX = 256  # the side of a matrix that may move lanes (``x @ R``): read as a constant of up to 256 * 256 values
MAX_REGION = 96  # interpreted nodes per anchor
CONSTANT_DEPTH = 8  # ops between a constant table and the attributes and factories it is computed from
DEPENDENCE_BUDGET = 256  # nodes visited to prove a table independent of x
NEAR = 8  # an anchor is at most this many lane ops from a lane move
HALF, INTERLEAVE, PAIRS_TO_HALF, HALF_TO_PAIRS = "half", "interleave", "pairs_to_half", "half_to_pairs"


# -- dtypes -------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def covers(finer: torch.dtype, coarser: torch.dtype) -> bool:
    """Every value of ``coarser`` is one of ``finer`` (a rounding to ``finer`` changes nothing a
    rounding to ``coarser`` would not change more)."""
    finer, coarser = finer.to_real(), coarser.to_real()
    if finer == coarser:
        return True
    if not (finer.is_floating_point and coarser.is_floating_point):
        return False
    fi, ci = torch.finfo(finer), torch.finfo(coarser)
    return fi.eps <= ci.eps and fi.max >= ci.max and fi.tiny <= ci.tiny


# -- lane values ----------------------------------------------------------------------------------------
# A term is (sign, x lane or -1, x's roundings before any multiply, table factors); a factor is
# (atom, component or -1, k, lane): lane ``lane`` of the atom's last k dims (component 0/1: the real or
# imaginary part of a complex atom).
NO_X = -1


class Lanes:
    """The symbolic value of a node: per lane of its last ``k`` dims, a sum of terms; with ``perm``,
    those terms' value with its leading dims permuted so (``torch.vmap`` permutes each term of a sum)."""

    __slots__ = ("node", "k", "cplx", "polys", "rounds", "region", "perm")

    def __init__(self, node: Node, k: int, cplx: bool, polys: tuple, rounds: frozenset, region: frozenset,
                 perm: tuple = ()):
        self.node, self.k, self.cplx, self.polys, self.rounds, self.region = node, k, cplx, polys, rounds, region
        self.perm = perm

    @property
    def lane_shape(self) -> tuple:
        return tuple(val(self.node).shape[-self.k:]) if self.k else ()


class _Opaque(Exception):
    """A node the interpretation cannot follow (it becomes an atom)."""


def _static_shape(shape) -> Optional[tuple]:
    out = tuple(static_int(s) for s in shape)
    return None if None in out else out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _strides(shape: tuple) -> list:
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    return strides


def _gather(dims: list) -> list:
    """Flat source indices, in row-major order of the result, for per-result-dim (stride, coords)."""
    idx = [0]
    for stride, coords in dims:
        idx = [i + c * stride for i in idx for c in coords]
    return idx


@functools.lru_cache(maxsize=4096)
def _broadcast_map(out_shape: tuple, in_shape: tuple) -> Optional[tuple]:
    """For each lane of ``out_shape``, the lane of ``in_shape`` (right-aligned, size-1 dims broadcast)."""
    if len(in_shape) > len(out_shape):
        if any(s != 1 for s in in_shape[:len(in_shape) - len(out_shape)]):
            return None
        in_shape = in_shape[len(in_shape) - len(out_shape):]
    padded = (1,) * (len(out_shape) - len(in_shape)) + in_shape
    strides = _strides(padded)
    dims = []
    for size, own, stride in zip(out_shape, padded, strides):
        if own == size:
            dims.append((stride, range(size)))
        elif own == 1:
            dims.append((0, range(size)))
        else:
            return None
    return tuple(_gather(dims))


def _neg(poly: tuple) -> tuple:
    return tuple((-s, lane, r, f) for s, lane, r, f in poly)


def _product(p: tuple, q: tuple) -> tuple:
    out = []
    for s1, l1, r1, f1 in p:
        for s2, l2, r2, f2 in q:
            if l1 != NO_X and l2 != NO_X:
                raise _Opaque("multiplies x by itself")
            out.append((s1 * s2, l1 if l1 != NO_X else l2, r1 if l1 != NO_X else r2, tuple(sorted(f1 + f2, key=_fkey))))
    if len(out) > MAX_TERMS:
        raise _Opaque(f"more than {MAX_TERMS} terms per lane")
    return tuple(out)


def _fkey(factor) -> tuple:
    return id(factor[0]), factor[1], factor[3]


# -- which ops move or keep lanes (a cheap, shape-only look at a node) -----------------------------------
def _is_pairs_view(src_shape, out_shape, sizes=None) -> bool:
    """out splits src's last dim in (L/2, 2) or (2, L/2), or merges such two last dims into one.
    ``sizes``: the view's size argument, whose literal 2 is the pair where out's shape has a symbolic
    expression for it (``unflatten(-1, (-1, 2))`` of a symbolic head dim s: ``s // (s // 2)``)."""
    if len(out_shape) == len(src_shape) + 1:
        big, small = src_shape, out_shape
    elif len(src_shape) == len(out_shape) + 1:
        big, small = out_shape, src_shape
    else:
        return False
    a, b = small[-2], small[-1]  # (a symbolic head dim too: its interpretation then says it is symbolic)
    named = sizes[-2:] if small is out_shape and isinstance(sizes, (list, tuple)) and len(sizes) == len(small) \
        else (a, b)
    if 2 not in (*map(static_int, (a, b)), *map(static_int, named)) or not shape_eq(small[:-2], big[:-1]):
        return False
    # a view keeps the element count, so with the leading dims equal the last ones are one: shown for
    # static sizes; of a symbolic head dim s, (s // 2, 2) is not provably s, but the traced view says so
    return size_eq(a * b, big[-1]) or not all(type(d) is int for d in (a, b, big[-1]))


def _lane_dim(dim, ndim: int, lane_dims: int = 1) -> bool:
    return isinstance(dim, int) and ndim > 0 and norm_dim(dim, ndim) >= ndim - lane_dims


def lane_op(node: Node) -> Optional[bool]:
    """None: not an op the recognizer follows; True: it moves lanes (slices, cats, pair views...);
    False: it keeps them (arithmetic, casts, clones). Shape-only: the interpretation checks the rest."""
    rule = _LANE_RULES.get(id(node.target)) if node.op == "call_function" else None  # (OpOverloads hash slowly)
    return rule(node) if rule is not None else None


def _tensor_args(node: Node) -> Optional[tuple]:
    """(input, output) fake tensors of a one-input op, or None."""
    src = node.args[0] if node.args else None
    if not isinstance(src, Node):
        return None
    sv, nv = val(src), val(node)
    return (sv, nv) if isinstance(sv, torch.Tensor) and isinstance(nv, torch.Tensor) else None


def _rule_arith(node: Node) -> Optional[bool]:
    numbers = [a for a in node.args[:2] if not isinstance(a, Node)]
    if node.target is aten.mul.Tensor:
        return False if all(n in (1, -1) for n in numbers) else None
    return False if all(n == 0 for n in numbers) and node.kwargs.get("alpha", 1) in (1, -1) else None


def _rule_cast(node: Node) -> Optional[bool]:
    return False if set(node.kwargs) <= CAST_KWARGS else None


def _rule_cat(node: Node) -> Optional[bool]:
    tensors = node.args[0]
    if not tensors or not isinstance(tensors[0], Node) or not isinstance(val(tensors[0]), torch.Tensor):
        return None
    extra = 1 if node.target is aten.stack.default else 0
    return True if _lane_dim(call_arg(node, 1, "dim", 0), val(tensors[0]).dim() + extra, 1 + extra) else None


def _rule_getitem(node: Node) -> Optional[bool]:
    src = node.args[0]
    return True if is_call(src, *SPLITS) and _split_on_lanes(src) else None


def _shaped(check):
    """A rule that needs the input and output tensors: check(node, input, output)."""
    def rule(node: Node) -> Optional[bool]:
        tensors = _tensor_args(node)
        return (True if check(node, *tensors) else None) if tensors is not None else None
    return rule


def _rule_permute(node: Node) -> Optional[bool]:
    """False for the identity or a permutation of the leading dims of a lane op's result, True for a
    swap of the last two dims, one of them pairs; else None."""
    tensors = _tensor_args(node)
    if tensors is None:
        return None
    sv = tensors[0]
    nd = sv.dim()
    moved = [d for d, p in enumerate(_permutation(node, nd)) if d != p]
    if not moved:
        return False
    if max(moved) < nd - 1:  # the leading dims: followed only through lane ops (vmap's permuted terms)
        return False if lane_op(node.args[0]) is not None else None
    return True if min(moved) >= nd - 2 and 2 in [static_int(sv.shape[d]) for d in moved] else None


def _squeezes_lanes(node: Node, sv, nv) -> bool:
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    return all(norm_dim(d, sv.dim()) >= sv.dim() - 2 for d in dims)


def _expands_lanes(node: Node, sv, nv) -> bool:
    return nv.dim() == sv.dim() and shape_eq(sv.shape[:-1], nv.shape[:-1])


LANE_MATMULS = (aten.mm.default, aten.bmm.default)


def _shared_matrix(m: Node) -> Optional[Node]:
    """The 2-D matrix a matmul's operand is: m itself, or for a bmm the matrix it repeats over the batch
    (``view(expand(R, [.., D, D]), [B, D, D])``, as aten's matmul passes a 2-D R); else None."""
    v = val(m)
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        return None
    if v.dim() == 2:
        return m
    src = m.args[0] if is_call(m, aten.expand.default, aten.unsqueeze.default, *VIEWS) else None
    sv = val(src)
    if not isinstance(sv, torch.Tensor) or sv.dim() < 2 or not shape_eq(sv.shape[-2:], v.shape[-2:]) or \
            (is_call(m, aten.expand.default) and any(static_int(d) != 1 for d in sv.shape[:-2])):
        return None
    return _shared_matrix(src)


def _lane_matrix(mm: Node) -> bool:
    """``mm(a, m)`` (or ``bmm`` by one matrix for the batch) by a static [D, D] matrix on a's D lanes (D at most
    MAX_MATRIX): lanes moved where it is a signed permutation (``x @ R``, rotate_half as a matrix). The
    interpretation reads the matrix; here, its shape, and that it may be a constant or that the product reads
    as a rotation's (a square projection, its weight a graph input, is no lane move: residual sums after one
    would be anchors)."""
    a, m = mm.args[:2]
    av = val(a)
    if not isinstance(a, Node) or not isinstance(m, Node) or not isinstance(av, torch.Tensor) or \
            av.dim() != (2 if mm.target is aten.mm.default else 3):
        return False
    r = _shared_matrix(m)
    d = static_int(av.shape[-1])
    return r is not None and d is not None and d <= MAX_MATRIX and \
        static_int(val(r).shape[0]) == d == static_int(val(r).shape[1]) and \
        (_of_constants(r) or _reads_as_rotation(mm))


def _of_constants(node: Node) -> bool:
    """node is computed from no graph input (attributes and factories alone, at most CONSTANT_DEPTH ops deep)."""
    seen, stack = {node}, [(node, 0)]
    while stack:
        n, depth = stack.pop()
        if n.op == "placeholder" or depth > CONSTANT_DEPTH:
            return False
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append((a, depth + 1))
    return True


def _reads_as_rotation(mm: Node) -> bool:
    """The product is the ``(x @ M) * S`` or the ``(x * S) @ M`` of a rotation: its result (viewed back)
    multiplied, or its input (viewed flat) a product."""
    a = mm.args[0].args[0] if is_call(mm.args[0], *VIEWS) else mm.args[0]
    outs = [v for u in mm.users for v in (u.users if is_call(u, *VIEWS) else (u,))]
    return is_call(a, aten.mul.Tensor) or any(is_call(u, aten.mul.Tensor) for u in outs)


def _matmul_of(view: Node) -> Optional[tuple]:
    """(s, the matrix, the view of s, the mm) for a view that gives ``mm(view(s, [.., D]), m)`` s's shape back
    (aten's ``s @ m`` of an s of more than 2 dims, a bmm where s is not contiguous), else None."""
    mm = view.args[0] if view.args else None
    if not is_call(mm, *LANE_MATMULS) or not _lane_matrix(mm):
        return None
    flat = mm.args[0]
    s = flat.args[0] if is_call(flat, *VIEWS) else None
    sv, v = val(s), val(view)
    if not isinstance(sv, torch.Tensor) or not isinstance(v, torch.Tensor) or not shape_eq(v.shape, sv.shape) or \
            not size_eq(val(flat).shape[-1], sv.shape[-1]):
        return None
    return s, _shared_matrix(mm.args[1]), flat, mm


def _rule_view(node: Node) -> Optional[bool]:
    """True for a pairs view and for the view back after a lane matrix's mm; False for the view that flattens the
    leading dims for it (its lanes kept); else None."""
    tensors = _tensor_args(node)
    if tensors is None:
        return None
    sv, nv = tensors
    if _is_pairs_view(sv.shape, nv.shape, call_arg(node, 1, "size")) or _matmul_of(node) is not None:
        return True
    if nv.dim() in (2, 3) and nv.dim() <= sv.dim() and size_eq(nv.shape[-1], sv.shape[-1]) and node.users and \
            all(is_call(u, *LANE_MATMULS) and u.args[0] is node and _lane_matrix(u) for u in node.users):
        return False
    return None


_LANE_RULES_BY_TARGET = {
    **{t: _rule_arith for t in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)},
    **{t: (lambda node: False) for t in (aten.neg.default, aten.copy.default, *SAME)},
    **{t: _rule_cast for t in DTYPE_CASTS},
    **{t: _rule_cat for t in (aten.cat.default, aten.stack.default)},
    **{t: (lambda node: True if _split_on_lanes(node) else None) for t in SPLITS},
    operator.getitem: _rule_getitem,
    **{t: _rule_view for t in VIEWS},
    **{t: (lambda node: True if _lane_matrix(node) else None) for t in LANE_MATMULS},
    aten.slice.Tensor: _shaped(lambda node, sv, nv: _lane_dim(slice_args(node)[0], sv.dim())),
    aten.select.int: _shaped(lambda node, sv, nv: _lane_dim(node.args[1], sv.dim(), 2)),
    **{t: _rule_permute for t in PERMUTES},
    aten.unsqueeze.default: _shaped(lambda node, sv, nv: norm_dim(node.args[1], sv.dim() + 1) == sv.dim()),
    **{t: _shaped(_squeezes_lanes) for t in (aten.squeeze.dim, aten.squeeze.dims)},
    aten.expand.default: _shaped(_expands_lanes),
    **{t: _shaped(lambda node, sv, nv: True) for t in (aten.view_as_complex.default, aten.view_as_real.default,
                                                         aten._conj.default)},
    **{t: _shaped(lambda node, sv, nv: all(_flips_lanes(d, sv) for d in node.args[1]))
       for t in (aten.flip.default, torch.ops.prims.rev.default)},  # (rev: inductor's flip)
    **{t: (lambda node: _rule_index(node)) for t in (aten.index.Tensor, aten.index_put.default)},
    **{t: _shaped(lambda node, sv, nv: _lane_dim(node.args[1], sv.dim()) and val(node.args[2]).dim() == 1)
       for t in (aten.index_select.default, aten.index_add.default)},  # (index_add: index_select's adjoint)
    aten.roll.default: _shaped(lambda node, sv, nv: _rolls(node) is not None and
                               all(_lane_dim(d, sv.dim()) for d, _ in _rolls(node))),
    aten.slice_backward.default: _shaped(lambda node, sv, nv: _lane_dim(node.args[2], nv.dim())),
    aten.select_backward.default: _shaped(lambda node, sv, nv: _lane_dim(node.args[2], nv.dim(), 2)),
    aten.select_scatter.default: _shaped(lambda node, sv, nv: _lane_dim(node.args[2], sv.dim(), 2)),
    aten.slice_scatter.default: _shaped(lambda node, sv, nv: _lane_dim(slice_scatter_args(node)[0], sv.dim())),
}
_LANE_RULES = {id(t): rule for t, rule in _LANE_RULES_BY_TARGET.items()}


def _flips_lanes(dim, sv) -> bool:
    """flip of the last dim, or of the one before it in a layout of pairs (``view(..., 2, D/2).flip(-2)``
    swaps the halves)."""
    return _lane_dim(dim, sv.dim()) or (_lane_dim(dim, sv.dim(), 2) and 2 in map(static_int, sv.shape[-2:]))


def _rule_index(node: Node) -> Optional[bool]:
    """``x[..., idx]``: a gather of the last dim by one 1-D index (inductor's ``roll`` and ``flip``), or
    its adjoint ``index_put(zeros, [..., idx], g)``; whether the index is a constant the interpretation
    finds out."""
    src, indices = node.args[0], node.args[1] if len(node.args) > 1 else None
    if not isinstance(src, Node) or not isinstance(indices, (list, tuple)) or not isinstance(val(src), torch.Tensor):
        return None
    if len(indices) != val(src).dim() or any(i is not None for i in indices[:-1]) or not isinstance(indices[-1], Node):
        return None
    index = val(indices[-1])
    ok = isinstance(index, torch.Tensor) and index.dim() == 1 and index.dtype in (torch.int64, torch.int32)
    return True if ok else None


def _rolls(node: Node) -> Optional[list]:
    """(dim, static shift) of each dim ``roll(x, shifts, dims)`` rolls; None for a roll of the flattened
    tensor (no dims) or a symbolic shift."""
    shifts, dims = call_arg(node, 1, "shifts"), call_arg(node, 2, "dims", [])
    shifts = [static_int(v) for v in (shifts if isinstance(shifts, (list, tuple)) else [shifts])]
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if not dims or len(dims) != len(shifts) or None in shifts or not all(isinstance(d, int) for d in dims):
        return None
    return list(zip(dims, shifts))


def _split_on_lanes(split: Node) -> bool:
    src = split.args[0]
    dim = call_arg(split, 2 if split.target is not aten.unbind.int else 1, "dim", 0)
    return isinstance(src, Node) and _lane_dim(dim, val(src).dim(), 2 if split.target is aten.unbind.int else 1)


def _permutation(node: Node, nd: int) -> list:
    if node.target is aten.t.default:
        return [1, 0] if nd == 2 else list(range(nd))
    if node.target is aten.transpose.int:
        perm = list(range(nd))
        a, b = norm_dim(node.args[1], nd), norm_dim(node.args[2], nd)
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return [norm_dim(d, nd) for d in node.args[1]]


def _attribute_tensor(node: Node) -> Optional[torch.Tensor]:
    """The real tensor a ``get_attr`` node reads where it is a literal the trace captured
    (``_tensor_constant<N>``, never a module's buffer, which may change); None for a fake one, or none."""
    if not str(node.target).split(".")[-1].startswith("_tensor_constant"):
        return None
    value = attribute(node)
    if not isinstance(value, torch.Tensor) or is_fake(value) or value.device.type != "cpu":
        return None
    return value


def _sign_parts(analysis: "Analysis", atom: Node, k: int) -> Optional[tuple]:
    """(the table left or None, the sign of each of its lanes) for a table over its last k dims that is a
    sign vector (a constant of 1s and -1s), or a product of a table and one; None for any other table."""
    v = val(atom)
    lanes = _static_shape(v.shape[max(v.dim() - k, 0):])
    if lanes is None:
        return None
    values = analysis.signs(atom)
    if values is not None:
        return (None, values) if len(values) == _numel(lanes) else None
    if not is_call(atom, aten.mul.Tensor) or not all(isinstance(a, Node) for a in atom.args[:2]):
        return None
    for table, sign in (atom.args[:2], atom.args[1::-1]):
        tv, sv = val(table), val(sign)
        if tv.shape != v.shape or tv.dtype != v.dtype or any(d != 1 for d in sv.shape[:max(sv.dim() - k, 0)]):
            continue
        values = analysis.signs(sign)
        index = _broadcast_map(lanes, tuple(sv.shape[max(sv.dim() - k, 0):])) if values is not None else None
        if index is None:
            continue
        inner = _sign_parts(analysis, table, k) or (table, (1,) * len(index))
        return inner[0], tuple(s * values[i] for s, i in zip(inner[1], index))
    return None


def _signs_folded(analysis: "Analysis", polys: tuple) -> tuple:
    """polys with every sign vector among the tables (a constant of 1s and -1s, or a table times one) read
    as the signs of the terms: ``P(x) * (sin * signs)`` is ``±P(x) * sin`` lane by lane."""
    parts: dict = {}
    for p in polys:
        for t in p:
            for atom, comp, k, _ in t[3]:
                if (atom, k) not in parts:
                    parts[atom, k] = _sign_parts(analysis, atom, k) if comp == -1 else None
    if not any(parts.values()):
        return polys
    out = []
    for p in polys:
        terms = []
        for sign, lane, rounds, factors in p:
            kept = []
            for factor in factors:
                found = parts[factor[0], factor[2]] if factor[1] == -1 else None
                if found is None:
                    kept.append(factor)
                    continue
                sign *= found[1][factor[3]]
                if found[0] is not None:
                    kept.append((found[0], -1, factor[2], factor[3]))
            terms.append((sign, lane, rounds, tuple(sorted(kept, key=_fkey))))
        out.append(tuple(terms))
    return tuple(out)


# -- the interpretation for one x --------------------------------------------------------------------------
class _Interpretation:
    """Values of nodes as lanes of x (one per rotated-tensor candidate x)."""

    def __init__(self, analysis: "Analysis", x: Node):
        self.analysis, self.x = analysis, x
        self.memo: dict = {}
        self.why: dict = {}  # x-dependent atoms -> why they could not be followed
        xv = val(x)
        self.x_width = static_int(xv.shape[-1]) if isinstance(xv, torch.Tensor) and xv.dim() else None
        self.x_dtype = xv.dtype if isinstance(xv, torch.Tensor) else None
        self.depth = 0  # of the evaluation under way (bounded: chains of residual adds are long)
        self.ambiguous: list = []  # views of x read as lanes that may be leading dims instead
        self.permuted: list = []  # permutes of x's leading dims
        self.matrices: dict = {}  # products of x's lanes by a matrix they cannot follow -> (why, x times tables)
        self.witnesses: dict = {}  # products by a signed permutation matrix -> the value the matrix multiplies

    # values
    def value(self, node: Any) -> Any:
        """Lanes, or the node itself (an atom), or a Python number."""
        if not isinstance(node, Node):
            return node
        found = self.memo.get(node)
        if found is not None:
            return found
        if node is self.x or not self.analysis.depends(node, self.x):
            result = node
        else:
            self.depth += 1
            try:
                if self.depth > MAX_REGION:
                    raise _Opaque(f"more than {MAX_REGION} lane ops from x")
                result = self._transfer(node)
            except _Opaque as why:
                self.why[node] = str(why)
                result = node
            finally:
                self.depth -= 1
        self.memo[node] = result
        return result

    def atom_polys(self, node: Node, k: int, cplx: bool) -> tuple:
        """The lanes of an atom's last k dims (a complex atom: each lane's real and imaginary part)."""
        v = val(node)
        if not isinstance(v, torch.Tensor):
            raise _Opaque(f"{node.name} is not a tensor")
        if v.is_complex() != cplx:
            raise _Opaque("mixes real and complex values")
        shape = _static_shape(v.shape[v.dim() - k:]) if k <= v.dim() else None
        if shape is None:
            raise _Opaque(self._symbolic(node))
        n = _numel(shape)
        if n > MAX_LANES:
            raise _Opaque(f"{n} lanes")
        if node is self.x:
            if k != 1 or cplx:
                raise _Opaque(f"{node.name} is read across its last dim")
            return tuple(((1, j, (), ()),) for j in range(n))
        if is_call(node, *ZERO_FILLS) or (is_call(node, aten.full.default) and node.args[1] == 0) or \
                (is_call(node, aten.full_like.default) and node.args[1] == 0):
            return ((),) * (2 * n if cplx else n)
        if cplx:
            return tuple(((1, NO_X, (), ((node, c, k, j),)),) for j in range(n) for c in (0, 1))
        return tuple(((1, NO_X, (), ((node, -1, k, j),)),) for j in range(n))

    def _symbolic(self, node: Node) -> str:
        return f"head dim of {node.name} is symbolic ({val(node).shape[-1]}); rotary_mul needs a static one"

    def operand(self, arg: Any, k: int, cplx: bool) -> tuple:
        """(polys, lane shape) of a tensor operand as lanes of its last k dims."""
        v = self.value(arg)
        if isinstance(v, Lanes):
            if v.k != k or v.cplx != cplx:
                raise _Opaque("combines values of different lane layouts")
            return v.polys, v.lane_shape
        own = min(k, val(arg).dim())
        return self.atom_polys(arg, own, cplx), _static_shape(val(arg).shape[val(arg).dim() - own:])

    def _k_of(self, *args) -> int:
        ks = {self.value(a).k for a in args if isinstance(self.value(a), Lanes)}
        if len(ks) > 1:
            raise _Opaque("combines values of different lane layouts")
        return ks.pop() if ks else 1

    def _cplx_of(self, *args) -> bool:
        return any(isinstance(a, Node) and isinstance(val(a), torch.Tensor) and val(a).is_complex() for a in args)

    def lanes(self, node: Node, k: int, cplx: bool, polys: list, sources: list, extra=(), perm: tuple = ()) -> Lanes:
        """The value of node: its polys materialized in node's dtype (a rounding where it is coarser);
        ``perm``: its leading dims permuted (only the ops that pass it on say so)."""
        if not perm and any(isinstance(s, Lanes) and s.perm for s in sources):
            raise _Opaque(f"{node.name} reads a value whose leading dims are permuted")
        v = val(node)
        dtype = v.dtype.to_real()
        rounds = frozenset().union(*(s.rounds for s in sources if isinstance(s, Lanes)))
        region = frozenset((node, *extra)).union(*(s.region for s in sources if isinstance(s, Lanes)))
        mixed = False
        out = []
        signs: dict = {}  # atom -> a sign vector: a lane of x times its signs rounds as the lane alone

        def signed_lane(factors: tuple) -> bool:
            for atom, comp, _, _ in factors:
                if atom not in signs:
                    signs[atom] = comp == -1 and self.analysis.signs(atom) is not None
                if not signs[atom]:
                    return False
            return True

        for poly in polys:
            if len(poly) == 1 and poly[0][1] != NO_X and (not poly[0][3] or signed_lane(poly[0][3])):
                s, lane, r, f = poly[0]
                if not covers(dtype, r[-1] if r else self.x_dtype):
                    poly = ((s, lane, r + (dtype,), f),)
            elif len(poly) == 1 and poly[0][1] == NO_X and len(poly[0][3]) == 1 and \
                    covers(dtype, val(poly[0][3][0][0]).dtype):
                pass  # a table's own value, held exactly (the lanes of an empty tensor not yet written over)
            elif poly:
                mixed = True
            out.append(poly)
        if mixed and dtype != torch.float64:
            rounds = rounds | {(dtype, node)}
        if len(region) > MAX_REGION:
            raise _Opaque(f"more than {MAX_REGION} nodes from x")
        return Lanes(node, k, cplx, tuple(out), rounds, region, perm)

    # transfer functions
    def _transfer(self, node: Node) -> Any:
        v = val(node)
        if not isinstance(v, torch.Tensor):
            if node.target in SPLITS:
                return self._split_marker(node)
            raise _Opaque(f"{node.name} is not a tensor")
        if v.dim() == 0:
            raise _Opaque(f"{node.name} is 0-d")
        t = node.target
        handler = _TRANSFER_IDS.get(id(t))
        if handler is None:
            raise _Opaque(f"{getattr(t, '__name__', t)} is not a lane operation")
        return handler(self, node)

    def _split_marker(self, node: Node) -> Any:
        src = self.value(node.args[0])
        if not isinstance(src, (Lanes, Node)):
            raise _Opaque("split of a number")
        return ("split", node)

    def unary_like(self, node: Node, arg: Node, fn=None) -> Any:
        """node keeps its argument's lanes (``fn`` applied to each: a negation)."""
        src = _lanes_of(self, arg)
        if not shape_eq(val(node).shape, val(arg).shape):
            raise _Opaque("changes the shape of its lanes")
        polys = src.polys if fn is None else [fn(p) for p in src.polys]
        return self.lanes(node, src.k, src.cplx, list(polys), [src], perm=src.perm)


def _linear(self: _Interpretation, node: Node) -> Any:
    a, b = node.args[:2]
    alpha = node.kwargs.get("alpha", 1)
    sign = -alpha if node.target is aten.sub.Tensor else alpha
    if sign not in (1, -1):
        raise _Opaque(f"adds {alpha} times a value")
    if not isinstance(b, Node) or not isinstance(a, Node):
        other = b if not isinstance(b, Node) else a
        if other != 0:
            raise _Opaque("adds a constant")
        return self.unary_like(node, a if isinstance(a, Node) else b, None if isinstance(a, Node) or sign == 1
                               else _neg)
    va, vb = self.value(a), self.value(b)
    perms = {v.perm for v in (va, vb) if isinstance(v, Lanes)}
    if perms - {()}:  # permute(u, p) + permute(v, p): the permute of u + v
        if len(perms) != 1 or not all(isinstance(v, Lanes) for v in (va, vb)):
            raise _Opaque("adds values whose leading dims are permuted differently")
        return _binary(self, node, a, b, lambda p, q: p + (q if sign == 1 else _neg(q)), perm=perms.pop())
    return _binary(self, node, a, b, lambda p, q: p + (q if sign == 1 else _neg(q)))


def _binary(self: _Interpretation, node: Node, a: Node, b: Node, combine, perm: tuple = ()) -> Any:
    k, cplx = self._k_of(a, b), self._cplx_of(node)
    out_shape = _static_shape(val(node).shape[val(node).dim() - k:])
    if out_shape is None:
        raise _Opaque(self._symbolic(node))
    sources, mapped = [], []
    for arg in (a, b):
        polys, shape = self.operand(arg, k, cplx)
        if shape is None:
            raise _Opaque(self._symbolic(arg))
        store_out, store_in = (out_shape + (2,), shape + (2,)) if cplx else (out_shape, shape)
        index = _broadcast_map(store_out, store_in)
        if index is None:
            raise _Opaque("does not broadcast its lanes")
        mapped.append([polys[i] for i in index])
        sources.append(self.value(arg))
    polys = [combine(p, q) for p, q in zip(*mapped)]
    if any(len(p) > MAX_TERMS for p in polys):
        raise _Opaque(f"more than {MAX_TERMS} terms per lane")
    return self.lanes(node, k, cplx, polys, sources, perm=perm)


def _mul(self: _Interpretation, node: Node) -> Any:
    a, b = node.args[:2]
    if not isinstance(a, Node) or not isinstance(b, Node):
        tensor, number = (a, b) if isinstance(a, Node) else (b, a)
        if number not in (1, -1):
            raise _Opaque(f"scales by {number}")
        return self.unary_like(node, tensor, None if number == 1 else _neg)
    if self._cplx_of(node):
        return _complex_mul(self, node, a, b)
    return _binary(self, node, a, b, _product)


def _complex_mul(self: _Interpretation, node: Node, a: Node, b: Node) -> Any:
    if not (self._cplx_of(a) and self._cplx_of(b)):
        raise _Opaque("multiplies a complex value by a real one")

    def combine(pairs_a, pairs_b):
        (ar, ai), (br, bi) = pairs_a, pairs_b
        return _product(ar, br) + _neg(_product(ai, bi)), _product(ar, bi) + _product(ai, br)

    k = self._k_of(a, b)
    out_shape = _static_shape(val(node).shape[val(node).dim() - k:])
    if out_shape is None:
        raise _Opaque(self._symbolic(node))
    mapped, sources = [], []
    for arg in (a, b):
        polys, shape = self.operand(arg, k, True)
        index = _broadcast_map(out_shape, shape)
        if index is None:
            raise _Opaque("does not broadcast its lanes")
        mapped.append([(polys[2 * i], polys[2 * i + 1]) for i in index])
        sources.append(self.value(arg))
    polys = []
    for pa, pb in zip(*mapped):
        re, im = combine(pa, pb)
        if len(re) > MAX_TERMS or len(im) > MAX_TERMS:
            raise _Opaque(f"more than {MAX_TERMS} terms per lane")
        polys += [re, im]
    return self.lanes(node, k, True, polys, sources)


def _neg_node(self: _Interpretation, node: Node) -> Any:
    return self.unary_like(node, node.args[0], _neg)


def _same(self: _Interpretation, node: Node) -> Any:
    if node.target is aten.clone.default and set(node.kwargs) - {"memory_format"}:
        raise _Opaque("a clone with options")
    return self.unary_like(node, node.args[0])


def _cast(self: _Interpretation, node: Node) -> Any:
    if set(node.kwargs) - CAST_KWARGS:
        raise _Opaque("a cast with options")
    if val(node).is_complex() != val(node.args[0]).is_complex():
        raise _Opaque("casts between real and complex")
    return self.unary_like(node, node.args[0])


def _copy(self: _Interpretation, node: Node) -> Any:
    dst, src = node.args[:2]
    if len(node.args) > 2 and node.args[2]:
        raise _Opaque("a non-blocking copy")
    if not isinstance(src, Node) or not shape_eq(val(dst).shape, val(src).shape):
        raise _Opaque("copies a value of another shape")
    value = self.unary_like(node, src)
    if isinstance(dst, Node) and self.analysis.depends(dst, self.x):  # (``out[..., h:] = x1`` after
        value.region = value.region | {dst}  # ``out[..., :h] = -x2``: the view written is of the region,
    return value  # and only its shape is read)


def _lanes_of(self: _Interpretation, arg: Node, k_atom: int = 1) -> Lanes:
    """arg's value as Lanes (an atom laned over its last ``k_atom`` dims)."""
    v = self.value(arg)
    if isinstance(v, Lanes):
        return v
    if not isinstance(v, Node):
        raise _Opaque("not a tensor")
    cplx = val(v).is_complex()
    polys = self.atom_polys(v, k_atom, cplx)
    return Lanes(v, k_atom, cplx, polys, frozenset(), frozenset())


def _reshape_view(self: _Interpretation, node: Node) -> Any:
    matmul = _matmul_of(node)
    if matmul is not None:
        s, matrix, flat, mm = matmul
        return _matmul(self, node, s, matrix, (flat, mm))
    src = _lanes_of(self, node.args[0])
    in_shape, out_shape = val(node.args[0]).shape, val(node).shape
    lead = in_shape[:len(in_shape) - src.k]
    if len(out_shape) <= len(lead) or not shape_eq(out_shape[:len(lead)], lead):
        raise _Opaque(f"{node.name} reshapes the leading dims of x")
    out_lanes = _static_shape(out_shape[len(lead):])
    if out_lanes is None:
        raise _Opaque(self._symbolic(node))
    if not _pairs_reshape(src.lane_shape, out_lanes):
        raise _Opaque(f"{node.name} regroups the lanes {list(src.lane_shape)} as {list(out_lanes)}")
    if len(out_lanes) == 2 and out_lanes[0] == 2 < out_lanes[1] and src.k == 1 and \
            all(len(p) == 1 and not p[0][3] for p in src.polys):
        self.ambiguous.append(node)  # [.., L] -> [.., 2, L/2]: pairs of halves, or two heads: try both
    return self.lanes(node, len(out_lanes), src.cplx, list(src.polys), [src])


def _pairs_reshape(in_lanes: tuple, out_lanes) -> bool:
    """A regrouping of lane dims that splits or merges a factor 2 (pairs), or keeps them."""
    out_lanes = tuple(static_int(s) for s in out_lanes)
    if tuple(in_lanes) == out_lanes:
        return True
    a, b = (list(in_lanes), list(out_lanes)) if len(in_lanes) < len(out_lanes) else (list(out_lanes), list(in_lanes))
    if len(b) != len(a) + 1:
        return False
    for i in range(len(a)):  # b splits a[i] into (b[i], b[i + 1])
        if b[:i] == a[:i] and b[i + 2:] == a[i + 1:] and b[i] * b[i + 1] == a[i] and 2 in (b[i], b[i + 1]):
            return True
    return False


def _expand(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0])
    in_shape, out_shape = val(node.args[0]).shape, val(node).shape
    k = src.k
    if len(out_shape) != len(in_shape) or not shape_eq(out_shape[:len(out_shape) - k], in_shape[:len(in_shape) - k]):
        raise _Opaque(f"{node.name} expands the leading dims of x")
    out_lanes = _static_shape(out_shape[len(out_shape) - k:])
    if out_lanes is None:
        raise _Opaque(self._symbolic(node))
    index = _broadcast_map(out_lanes + ((2,) if src.cplx else ()), src.lane_shape + ((2,) if src.cplx else ()))
    if index is None:
        raise _Opaque("does not broadcast its lanes")
    return self.lanes(node, k, src.cplx, [src.polys[i] for i in index], [src])


def _unsqueeze(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0])
    nd = val(node).dim()
    dim = norm_dim(node.args[1], nd)
    if dim < nd - src.k - 1:
        raise _Opaque(f"{node.name} inserts a leading dim")
    return self.lanes(node, src.k + 1, src.cplx, list(src.polys), [src])


def _squeeze(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0])
    nd = val(node.args[0]).dim()
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    dims = {norm_dim(d, nd) for d in dims if static_int(val(node.args[0]).shape[norm_dim(d, nd)]) == 1}
    if any(d < nd - src.k for d in dims) or src.k - len(dims) < 1:
        raise _Opaque(f"{node.name} squeezes a leading dim")
    return self.lanes(node, src.k - len(dims), src.cplx, list(src.polys), [src])


def _permute(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0])
    nd = val(node.args[0]).dim()
    perm = _permutation(node, nd)
    lead = nd - src.k
    if any(perm[d] != d for d in range(lead)):
        if not isinstance(self.value(node.args[0]), Lanes) or any(perm[d] != d for d in range(lead, nd)) or src.cplx:
            raise _Opaque(f"{node.name} permutes the leading dims of x")
        composed = tuple(src.perm[p] for p in perm[:lead]) if src.perm else tuple(perm[:lead])
        self.permuted.append(node)  # if what reads it cannot take a permuted value, x may be node itself
        return self.lanes(node, src.k, src.cplx, list(src.polys), [src], perm=composed)
    store = src.lane_shape + ((2,) if src.cplx else ())
    strides = _strides(store)
    order = [p - lead for p in perm[lead:]] + ([src.k] if src.cplx else [])
    index = _gather([(strides[d], range(store[d])) for d in order])
    return self.lanes(node, src.k, src.cplx, [src.polys[i] for i in index], [src])


def _select_lanes(self: _Interpretation, node: Node, src_node: Node, dim, coords, drop: bool, extra=()) -> Lanes:
    """src's lanes at ``coords`` along lane dim ``dim`` (dropping that dim when ``drop``)."""
    k_atom = 2 if drop else 1
    src = _lanes_of(self, src_node, k_atom)
    nd = val(src_node).dim()
    dim = norm_dim(dim, nd)
    lead = nd - src.k
    if dim < lead:
        raise _Opaque(f"{node.name} cuts a leading dim of x")
    if drop and src.k < 2:
        raise _Opaque(f"{node.name} selects across the lanes")
    store = src.lane_shape + ((2,) if src.cplx else ())
    strides = _strides(store)
    dims = [(strides[d], coords if d == dim - lead else range(store[d])) for d in range(len(store))]
    index = _gather(dims)
    return self.lanes(node, src.k - 1 if drop else src.k, src.cplx, [src.polys[i] for i in index], [src], extra)


def _slice(self: _Interpretation, node: Node) -> Any:
    dim, start, end, step = slice_args(node)
    src = node.args[0]
    size = static_int(val(src).shape[norm_dim(dim, val(src).dim())])
    start, end, step = static_int(start), static_int(end), static_int(step)
    if None in (size, start, end, step):
        raise _Opaque(self._symbolic(src))
    return _select_lanes(self, node, src, dim, range(*slice(start, end, step).indices(size)), False)


def _flip(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0])
    nd = val(node.args[0]).dim()
    lead = nd - src.k
    flipped = {norm_dim(d, nd) - lead for d in node.args[1]}
    if min(flipped) < 0:
        raise _Opaque(f"{node.name} flips a leading dim")
    store = src.lane_shape + ((2,) if src.cplx else ())
    strides = _strides(store)
    index = _gather([(strides[d], range(store[d] - 1, -1, -1) if d in flipped else range(store[d]))
                     for d in range(len(store))])
    return self.lanes(node, src.k, src.cplx, [src.polys[i] for i in index], [src])


def _roll(self: _Interpretation, node: Node) -> Any:
    """``roll(x, s, -1)``: lane t of the result is lane (t - s) mod L of x (``rotate_half`` without its sign,
    the sign then in a table)."""
    src = _lanes_of(self, node.args[0])
    nd = val(node.args[0]).dim()
    lead = nd - src.k
    by_dim: dict = {}
    for d, shift in _rolls(node):
        d = norm_dim(d, nd) - lead
        if d < 0:
            raise _Opaque(f"{node.name} rolls a leading dim")
        by_dim[d] = by_dim.get(d, 0) + shift
    store = src.lane_shape + ((2,) if src.cplx else ())
    strides = _strides(store)
    index = _gather([(strides[d], [(t - by_dim[d]) % store[d] for t in range(store[d])] if d in by_dim
                      else range(store[d])) for d in range(len(store))])
    return self.lanes(node, src.k, src.cplx, [src.polys[i] for i in index], [src])


def _constant_index(self: _Interpretation, node: Node, verb: str, n: int) -> list:
    """The lanes (0 <= i < n) an ``index``/``index_put`` (or ``index_select``/``index_add``) of the last
    dim takes by its constant index."""
    by_dim = node.target in (aten.index_select.default, aten.index_add.default)
    index = self.analysis.constant(node.args[2] if by_dim else node.args[1][-1])
    if index is None:
        raise _Opaque(f"{node.name} {verb} lanes by an index that is not a constant")
    with unset_fake_temporarily():
        taken = [int(i) for i in index.tolist()]
    if any(not -n <= i < n for i in taken):
        raise _Opaque(f"{node.name} {verb} a lane out of range")
    return [i % n for i in taken]


def _index(self: _Interpretation, node: Node) -> Any:
    """``x[..., idx]`` (or ``index_select(x, -1, idx)``) with idx a constant: lane t of the result is lane
    idx[t] of x."""
    src = _lanes_of(self, node.args[0])
    if src.cplx:
        raise _Opaque(f"{node.name} gathers lanes of a complex value")
    store = src.lane_shape
    n = store[-1]
    taken = _constant_index(self, node, "gathers", n)
    strides = _strides(store)
    order = _gather([(strides[d], taken if d == len(store) - 1 else range(store[d]))
                     for d in range(len(store))])
    return self.lanes(node, src.k, False, [src.polys[i] for i in order], [src])


def _index_put(self: _Interpretation, node: Node) -> Any:
    """``index_put(base, [..., idx], v, accumulate)`` with idx a constant: lane idx[t] of the result is
    v's lane t, added to base's where ``accumulate`` (autograd's adjoint of a gather); ``index_add(base,
    -1, idx, v)`` accumulates so (the adjoint of ``index_select``)."""
    added = node.target is aten.index_add.default
    if added and node.kwargs.get("alpha", 1) != 1:
        raise _Opaque(f"{node.name} scales what it adds")
    base, v = _lanes_of(self, node.args[0]), _lanes_of(self, node.args[3 if added else 2])
    accumulate = added or call_arg(node, 3, "accumulate", False)
    if base.cplx or v.cplx or base.k != v.k or base.perm or v.perm:
        raise _Opaque(f"{node.name} writes lanes of another layout")
    store, written = base.lane_shape, v.lane_shape
    n = store[-1]
    taken = _constant_index(self, node, "writes", n)
    if written != store[:-1] + (len(taken),) or (not accumulate and len(set(taken)) != len(taken)):
        raise _Opaque(f"{node.name} writes lanes repeatedly or of another shape")
    polys = list(base.polys)
    rows = _numel(store[:-1])
    for row in range(rows):
        for t, i in enumerate(taken):
            j = row * n + i
            written_poly = v.polys[row * len(taken) + t]
            polys[j] = polys[j] + written_poly if accumulate else written_poly
    if any(len(p) > MAX_TERMS for p in polys):
        raise _Opaque(f"more than {MAX_TERMS} terms per lane")
    return self.lanes(node, base.k, False, polys, [base, v])


def _mm(self: _Interpretation, node: Node) -> Any:
    if not _lane_matrix(node):
        raise _Opaque(f"{node.name} is a matmul, not by a [D, D] matrix on the lanes")
    return _matmul(self, node, node.args[0], _shared_matrix(node.args[1]))


def _matmul(self: _Interpretation, node: Node, src_node: Node, matrix: Node, extra=()) -> Any:
    """``src @ matrix`` with the matrix a constant signed permutation: lane j of the result is ``±src[..., i]``,
    ``matrix[i, j]`` the one nonzero of its column. A matrix of values unknown here, or any other matrix (a
    general linear map), is no lane move: the product is an atom, and where x's lanes (times tables) are its
    input, one of the region, its reason kept for the rotation-like sum that reads it."""
    src = _lanes_of(self, src_node)
    if src.k != 1 or src.cplx or len(src.polys) != static_int(val(matrix).shape[0]):
        raise _Opaque(f"{node.name} multiplies lanes of another layout by a matrix")
    if self.analysis.depends(matrix, self.x):
        raise _Opaque(f"{node.name} multiplies {self.x.name} by a matrix computed from it")
    found = self.analysis.constant(matrix)
    columns = _signed_permutation(found) if found is not None else _unknown_matrix(self.analysis, matrix)
    if isinstance(columns, str) and found is not None:
        columns = (f"the matrix {matrix.name} is no signed permutation ({columns}): {node.name} is a linear map of "
                   f"the lanes of {src_node.name}, not a rotation")
    if isinstance(columns, str):
        if not all(len(p) == 1 and p[0][1] != NO_X and not any(f[0] in self.why for f in p[0][3]) for p in src.polys):
            raise _Opaque(columns)
        # x's lanes (times tables) by an unknown matrix: an atom that depends on x, of the region that reads x
        self.matrices[node] = (columns, all(p[0][3] for p in src.polys))
        self.why[node] = columns
        return Lanes(node, 1, False, self.atom_polys(node, 1, False), src.rounds, src.region | {node, *extra})
    polys = [src.polys[i] if sign > 0 else _neg(src.polys[i]) for i, sign in columns]
    while is_call(src_node, *SAME, aten.expand.default) and shape_eq(val(src_node.args[0]).shape, val(src_node).shape):
        src_node = src_node.args[0]  # (the value itself: its NaNs are the copy's)
    self.witnesses[node] = src_node
    return self.lanes(node, 1, False, polys, [src], extra)


def _unknown_matrix(analysis: "Analysis", matrix: Node) -> str:
    """Why a matrix's values are not known at compile time (a graph input: a buffer, an argument, or in a
    backward graph what the forward saved)."""
    origin = matrix
    while is_call(origin, *PERMUTES, *SAME) and isinstance(origin.args[0], Node):
        origin = origin.args[0]
    if origin.op != "placeholder":
        return f"the matrix {describe(matrix)} is not a constant the compile can compute, so its lanes cannot be followed"
    if analysis.kind == "backward" and not origin.name.startswith(("primals", "tangents")):
        return (f"the matrix {origin.name} is a graph input of the backward (the forward computed and saved it): its "
                "values are not known in the backward graph, so the lanes it moves cannot be followed")
    return (f"the matrix {origin.name} is a graph input (a buffer or an argument): its values are not known at "
            "compile time, so the lanes it moves cannot be followed")


def _signed_permutation(matrix: torch.Tensor) -> Union[list, str]:
    """Per column j of a constant matrix, (i, sign) with ``matrix[i, j] = sign`` its one nonzero entry; or why
    it is not a signed permutation matrix."""
    with unset_fake_temporarily(), torch.no_grad():
        if matrix.is_complex() or matrix.dtype == torch.bool:
            return f"it is {dtype_name(matrix.dtype)}"
        nonzero = matrix != 0
        other = nonzero & (matrix != 1) & (matrix != -1)
        if bool(other.any()):
            i, j = (int(v) for v in other.nonzero()[0])
            return f"[{i}, {j}] is {float(matrix[i, j])!r}, not 0, 1 or -1"
        for dim, name in ((0, "column"), (1, "row")):
            counts = nonzero.sum(dim)
            if bool((counts != 1).any()):
                k = int((counts != 1).nonzero()[0])
                return f"{name} {k} has {int(counts[k])} nonzero entries"
        rows = nonzero.to(torch.uint8).argmax(0)
        signs = matrix[rows, torch.arange(matrix.shape[1])]
        return list(zip(rows.tolist(), (int(v) for v in signs.tolist())))


def _select(self: _Interpretation, node: Node) -> Any:
    src, dim, index = node.args[:3]
    size = static_int(val(src).shape[norm_dim(dim, val(src).dim())])
    if size is None:
        raise _Opaque(self._symbolic(src))
    return _select_lanes(self, node, src, dim, [index % size], True)


def _getitem(self: _Interpretation, node: Node) -> Any:
    split, index = node.args
    if not is_call(split, *SPLITS) or not isinstance(index, int):
        raise _Opaque("getitem of a non-split")
    src = split.args[0]
    if split.target is aten.unbind.int:
        dim = call_arg(split, 1, "dim", 0)
        size = static_int(val(src).shape[norm_dim(dim, val(src).dim())])
        if size is None:
            raise _Opaque(self._symbolic(src))
        return _select_lanes(self, node, src, dim, [index % size], True, (split,))
    dim = call_arg(split, 2, "dim", 0)
    size = static_int(val(src).shape[norm_dim(dim, val(src).dim())])
    if size is None:
        raise _Opaque(self._symbolic(src))
    if split.target is aten.split.Tensor:
        chunk = static_int(split.args[1])
        if chunk is None:
            raise _Opaque(self._symbolic(src))
        start, end = index * chunk, min((index + 1) * chunk, size)
    else:
        sizes = [static_int(s) for s in split.args[1]]
        if None in sizes:
            raise _Opaque(self._symbolic(src))
        start = sum(sizes[:index])
        end = start + sizes[index]
    return _select_lanes(self, node, src, dim, range(start, end), False, (split,))


def _cat(self: _Interpretation, node: Node, stack: bool = False) -> Any:
    """cat along a lane dim; stack: a new lane dim (each part unsqueezed there)."""
    nd = val(node).dim()
    dim = norm_dim(call_arg(node, 1, "dim", 0), nd)
    parts = []
    for t in node.args[0]:
        src = _lanes_of(self, t)
        k = src.k + 1 if stack else src.k
        ld = dim - (nd - k)
        if ld < 0:
            raise _Opaque(f"{node.name} {'stacks' if stack else 'concatenates'} along a leading dim")
        shape = src.lane_shape[:ld] + (1,) + src.lane_shape[ld:] if stack else src.lane_shape
        parts.append((src, _static_shape(shape), k))
    if len({k for _, _, k in parts}) != 1 or len({p.cplx for p, _, _ in parts}) != 1:
        raise _Opaque(f"{node.name} concatenates values of different lane layouts")
    k, cplx = parts[0][2], parts[0][0].cplx
    out_lanes = _static_shape(val(node).shape[nd - k:])
    if out_lanes is None or any(shape is None for _, shape, _ in parts):
        raise _Opaque(self._symbolic(node))
    store = out_lanes + ((2,) if cplx else ())
    strides = _strides(store)
    ld = dim - (nd - k)
    polys: list = [None] * _numel(store)
    offset = 0
    for src, shape, _ in parts:
        if any(s != o for i, (s, o) in enumerate(zip(shape, out_lanes)) if i != ld):
            raise _Opaque(f"{node.name} concatenates values of different lane shapes")
        own = shape + ((2,) if cplx else ())
        dims = [(strides[d], range(offset, offset + own[d]) if d == ld else range(own[d])) for d in range(len(store))]
        for position, poly in zip(_gather(dims), src.polys):
            polys[position] = poly
        offset += shape[ld]
    if offset != out_lanes[ld]:
        raise _Opaque(f"{node.name}: lanes left unset")
    return self.lanes(node, k, cplx, polys, [p for p, _, _ in parts])


def _stack(self: _Interpretation, node: Node) -> Any:
    return _cat(self, node, stack=True)


def _place(self: _Interpretation, node: Node, base: Optional[Node], src_node: Node, dim, start, end, step) -> Any:
    out_shape = val(node).shape
    nd = len(out_shape)
    dim = norm_dim(dim, nd)
    size = static_int(out_shape[dim])
    start, end, step = static_int(start), static_int(end), static_int(step)
    if None in (size, start, end, step):
        raise _Opaque(self._symbolic(node))
    src = _lanes_of(self, src_node)
    if base is not None:
        base_v = _lanes_of(self, base)
        if base_v.k != src.k:
            raise _Opaque("writes a value of another lane layout")
        k, cplx, polys = src.k, src.cplx, list(base_v.polys)
        sources = [base_v, src]
    else:
        k, cplx = src.k, src.cplx
        sources = [src]
        polys = None
    if dim < nd - k:
        raise _Opaque(f"{node.name} writes along a leading dim")
    out_lanes = _static_shape(out_shape[nd - k:])
    if out_lanes is None:
        raise _Opaque(self._symbolic(node))
    store = out_lanes + ((2,) if cplx else ())
    if polys is None:
        polys = [()] * _numel(store)
    if len(polys) != _numel(store):
        raise _Opaque("writes into a broadcast value")
    strides = _strides(store)
    ld = dim - (nd - k)
    coords = range(*slice(start, end, step).indices(size))
    dims = [(strides[d], coords if d == ld else range(store[d])) for d in range(len(store))]
    positions = _gather(dims)
    if len(positions) != len(src.polys):
        raise _Opaque("writes a broadcast value")
    for position, poly in zip(positions, src.polys):
        polys[position] = poly
    return self.lanes(node, k, cplx, polys, sources)


def _place_selected(self: _Interpretation, node: Node, base: Optional[Node], src_node: Node, dim, index) -> Any:
    """base (or zeros) with src written at ``index`` of lane dim ``dim`` (select_backward / select_scatter)."""
    out_shape = val(node).shape
    nd = len(out_shape)
    dim = norm_dim(dim, nd)
    src = _lanes_of(self, src_node)
    k = src.k + 1
    if dim < nd - k:
        raise _Opaque(f"{node.name} writes along a leading dim")
    out_lanes = _static_shape(out_shape[nd - k:])
    if out_lanes is None:
        raise _Opaque(self._symbolic(node))
    store = out_lanes + ((2,) if src.cplx else ())
    sources = [src]
    if base is not None:
        base_v = _lanes_of(self, base, k)
        if base_v.k != k or base_v.cplx != src.cplx:
            raise _Opaque("writes a value of another lane layout")
        polys, sources = list(base_v.polys), [base_v, src]
    else:
        polys = [()] * _numel(store)
    strides = _strides(store)
    ld = dim - (nd - k)
    dims = [(strides[d], [index % store[d]] if d == ld else range(store[d])) for d in range(len(store))]
    positions = _gather(dims)
    if len(positions) != len(src.polys) or len(polys) != _numel(store):
        raise _Opaque("writes a broadcast value")
    for position, poly in zip(positions, src.polys):
        polys[position] = poly
    return self.lanes(node, k, src.cplx, polys, sources)


def _select_backward(self: _Interpretation, node: Node) -> Any:
    grad, _, dim, index = node.args
    return _place_selected(self, node, None, grad, dim, index)


def _select_scatter(self: _Interpretation, node: Node) -> Any:
    base, src, dim, index = node.args[:4]
    return _place_selected(self, node, base, src, dim, index)


def _slice_backward(self: _Interpretation, node: Node) -> Any:
    grad, _, dim, start, end, step = node.args
    return _place(self, node, None, grad, dim, start, end, step)


def _slice_scatter(self: _Interpretation, node: Node) -> Any:
    dim, start, end, step = slice_scatter_args(node)
    return _place(self, node, node.args[0], node.args[1], dim, start, end, step)


def _view_as_complex(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0], 2)
    if src.perm:
        raise _Opaque(f"{node.name} reads a value whose leading dims are permuted")
    if src.cplx or src.k < 2 or src.lane_shape[-1] != 2:
        raise _Opaque(f"{node.name} views lanes that are not pairs")
    return Lanes(node, src.k - 1, True, src.polys, src.rounds, src.region | {node})


def _view_as_real(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0])
    if src.perm:
        raise _Opaque(f"{node.name} reads a value whose leading dims are permuted")
    if not src.cplx:
        raise _Opaque("view_as_real of a real value")
    return Lanes(node, src.k + 1, False, src.polys, src.rounds, src.region | {node})


def _conj(self: _Interpretation, node: Node) -> Any:
    src = _lanes_of(self, node.args[0])
    if src.perm:
        raise _Opaque(f"{node.name} reads a value whose leading dims are permuted")
    if not src.cplx:
        raise _Opaque("conj of a real value")
    polys = [p if i % 2 == 0 else _neg(p) for i, p in enumerate(src.polys)]
    return Lanes(node, src.k, True, tuple(polys), src.rounds, src.region | {node})


def _zeros_like(self: _Interpretation, node: Node) -> Any:
    """Zeros shaped like a value computed from x (autograd's gradient of a lane written over): they read
    only its shape, so they belong to the region that computes it."""
    if node.target is aten.full_like.default and node.args[1] != 0:
        raise _Opaque(f"{node.name} fills {node.args[1]}")
    width = static_int(val(node).shape[-1])
    if width is None:
        raise _Opaque(self._symbolic(node))
    cplx = val(node).is_complex()
    return self.lanes(node, 1, cplx, [()] * (2 * width if cplx else width), [])


_TRANSFERS = {
    aten.add.Tensor: _linear, aten.sub.Tensor: _linear, aten.mul.Tensor: _mul, aten.neg.default: _neg_node,
    **{t: _same for t in SAME}, **{t: _cast for t in DTYPE_CASTS}, aten.copy.default: _copy,
    **{t: _reshape_view for t in VIEWS}, aten.expand.default: _expand, aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze, **{t: _permute for t in PERMUTES}, aten.slice.Tensor: _slice,
    aten.select.int: _select, operator.getitem: _getitem, aten.cat.default: _cat, aten.stack.default: _stack,
    aten.slice_backward.default: _slice_backward, aten.slice_scatter.default: _slice_scatter,
    aten.select_backward.default: _select_backward, aten.select_scatter.default: _select_scatter,
    aten.squeeze.dims: _squeeze, aten.flip.default: _flip, torch.ops.prims.rev.default: _flip,
    aten.roll.default: _roll, aten.index.Tensor: _index, aten.index_select.default: _index,
    aten.index_put.default: _index_put, aten.index_add.default: _index_put,
    aten.view_as_complex.default: _view_as_complex, aten.view_as_real.default: _view_as_real,
    aten._conj.default: _conj, **{t: _mm for t in LANE_MATMULS},
    **{t: _zeros_like for t in (aten.zeros_like.default, aten.full_like.default, aten.new_zeros.default)},
}
_TRANSFER_IDS = {id(t): f for t, f in _TRANSFERS.items()}
MIXING = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)  # the ops whose lanes can have two terms
_CUTS = (aten.slice.Tensor, aten.select.int, operator.getitem)  # (a RoPE's walk to its leaves takes one)


# -- tables: rebuilt in the graph from the atoms the terms read ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class Segment:
    """Lanes [t, t + length) of a table: ``sign * atom[..., first + (t' - t) // rep]`` over the atom's last k
    dims (its real or imaginary part for ``comp`` 0 / 1); rep 0: lane ``first`` for every t'. With ``zipped``
    (rep 2, an even length): the odd lanes read ``zipped[..., zipped_first + (t' - t) // 2]`` instead, an atom
    of the same shape (a backward reading two saved copies of one table: ChatGLM's cos per pair)."""

    sign: int
    atom: Node
    comp: int
    k: int
    first: int
    rep: int
    length: int
    zipped: Optional[Node] = None
    zipped_first: int = 0

    @property
    def count(self) -> int:
        """How many lanes of the atom it reads."""
        return self.length if self.rep == 1 else (self.length + 1) // 2 if self.rep == 2 else 1

    @property
    def lead(self) -> tuple:
        v = val(self.atom)
        return tuple(v.shape[:v.dim() - self.k])

    def cost(self) -> int:
        width = _numel(_static_shape(val(self.atom).shape[val(self.atom).dim() - self.k:]) or (0,))
        n = (2 + bool(val(self.atom).is_conj())) if self.comp >= 0 else 0
        n += self.k != 1
        n += not (self.first == 0 and self.count == width)
        n += {1: 0, 2: 2 + (self.length % 2), 0: 1}[self.rep]
        if self.zipped is not None:  # (the other atom's lanes taken alike)
            n += n - 2
        return n + (self.sign < 0)


def _segments(entries: list) -> list:
    """Greedy runs of (sign, atom, comp, k, lane) entries: consecutive lanes, pairs, or one lane repeated."""
    segments, t, n = [], 0, len(entries)
    while t < n:
        sign, atom, comp, k, first = entries[t]
        best = (1, 1)
        for rep in (1, 2, 0):
            length = 1
            while t + length < n:
                s2, a2, c2, k2, lane = entries[t + length]
                if (s2, c2, k2) != (sign, comp, k) or a2 is not atom or lane != first + (length // rep if rep else 0):
                    break
                length += 1
            if length > best[0]:
                best = (length, rep)
        zipped = _zipped_run(entries, t)
        if zipped is not None and zipped[0] > best[0]:
            length, other, other_first = zipped
            segments.append(Segment(sign, atom, comp, k, first, 2, length, other, other_first))
        else:
            segments.append(Segment(sign, atom, comp, k, first, best[1], best[0]))
        t += segments[-1].length
    return segments


def _zipped_run(entries: list, t: int) -> Optional[tuple]:
    """(length, the other atom, its first lane) of the run from t whose lanes alternate between two atoms
    of one shape, each read lane by lane (an even length of at least 4), or None."""
    if t + 1 >= len(entries):
        return None
    sign, atom, comp, k, first = entries[t]
    s2, other, c2, k2, other_first = entries[t + 1]
    if other is atom or (s2, c2, k2) != (sign, comp, k) or not shape_eq(val(other).shape, val(atom).shape) or \
            val(other).dtype != val(atom).dtype:
        return None
    length = 0
    while t + length + 1 < len(entries) and \
            entries[t + length] == (sign, atom, comp, k, first + length // 2) and \
            entries[t + length + 1] == (sign, other, comp, k, other_first + length // 2):
        length += 2
    return (length, other, other_first) if length >= 4 else None


@dataclasses.dataclass
class Table:
    """A table of the fused op, as the product of ``factors`` (each a list of segments cat'ed on the
    last dim; the sign is on the first factor's segments)."""

    factors: list
    width: int

    def cost(self) -> int:
        return sum(sum(s.cost() for s in f) + (len(f) > 1) + (len(f) > 1 and _leads_differ(f)) for f in self.factors) \
            + len(self.factors) - 1

    @property
    def atoms(self) -> list:
        return list(dict.fromkeys(a for f in self.factors for s in f for a in (s.atom, s.zipped) if a is not None))

    def leaf(self) -> Optional[Node]:
        """The atom itself, when the table is exactly one atom (as MLA's stage checks need)."""
        if len(self.factors) == 1 and len(self.factors[0]) == 1:
            s = self.factors[0][0]
            if s.sign == 1 and s.comp < 0 and s.k == 1 and s.rep == 1 and s.zipped is None and s.first == 0 and \
                    static_int(val(s.atom).shape[-1]) == s.length:
                return s.atom
        return None

    @property
    def dtype(self) -> torch.dtype:
        dtype = None
        for atom in self.atoms:
            d = val(atom).dtype.to_real()
            dtype = d if dtype is None else torch.promote_types(dtype, d)
        return dtype

    def build(self, b) -> Node:
        out = None
        for f in self.factors:
            parts = [_build_segment(b, s) for s in f]
            if len(parts) > 1:
                lead = ()
                for s in f:
                    lead = _broadcast_lead(lead, s.lead)
                parts = [_expand_lead(b, p, lead) for p in parts]
                node = b.call(aten.cat.default, parts, -1)
            else:
                node = parts[0]
            out = node if out is None else b.call(aten.mul.Tensor, out, node)
        return out


def _broadcast_lead(a: tuple, b: tuple) -> tuple:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    return tuple(y if size_eq(x, 1) else x for x, y in zip(a, b))


def _leads_differ(segments: list) -> bool:
    leads = {len(s.lead) for s in segments}
    return len(leads) > 1 or len({tuple(map(str, s.lead)) for s in segments}) > 1


def _expand_lead(b, node: Node, lead: tuple) -> Node:
    shape = val(node).shape
    own = tuple(shape[:-1])
    if len(own) == len(lead) and shape_eq(own, lead):
        return node
    node = b.unsqueeze_to(node, len(lead) + 1)
    sizes = []
    for have, want in zip(val(node).shape[:-1], lead):
        if size_eq(have, want):
            sizes.append(-1)
        elif static_int(want) is not None:
            sizes.append(static_int(want))
        else:
            raise ValueError("a table piece with a symbolic broadcast dim")
    return b.call(aten.expand.default, node, [*sizes, -1])


def _build_segment(b, s: Segment) -> Node:
    if s.zipped is not None:  # (the two atoms' lanes, each a segment of its own, interleaved)
        half = s.length // 2
        lanes = [_build_segment(b, dataclasses.replace(s, atom=atom, first=first, rep=1, length=half, zipped=None))
                 for atom, first in ((s.atom, s.first), (s.zipped, s.zipped_first))]
        stacked = b.call(aten.stack.default, lanes, -1)
        return b.call(aten.reshape.default, stacked, [*_sizes(b, stacked, val(stacked).dim() - 2), s.length])
    node = s.atom
    if s.comp >= 0:
        if val(node).is_conj():  # a conjugate view (the backward's conj(freqs)) has no real view until resolved
            node = b.call(aten.resolve_conj.default, node)
        node = b.call(aten.select.int, b.call(aten.view_as_real.default, node), -1, s.comp)
    if s.k != 1:
        v = val(node)
        lead = v.shape[:v.dim() - s.k]
        if s.k == 0:
            node = b.call(aten.unsqueeze.default, node, -1)
        else:
            node = b.call(aten.reshape.default, node, [*_sizes(b, node, len(lead)), -1])
    width = static_int(val(node).shape[-1])
    if not (s.first == 0 and s.count == width):
        node = b.call(aten.slice.Tensor, node, -1, s.first, s.first + s.count)
    if s.rep == 2:
        stacked = b.call(aten.stack.default, [node, node], -1)
        node = b.call(aten.reshape.default, stacked, [*_sizes(b, stacked, val(stacked).dim() - 2), 2 * s.count])
        if s.length % 2:
            node = b.call(aten.slice.Tensor, node, -1, 0, s.length)
    elif s.rep == 0:
        node = b.call(aten.expand.default, node, [-1] * (val(node).dim() - 1) + [s.length])
    if s.sign < 0:
        node = b.call(aten.neg.default, node)
    return node


def _sizes(b, node: Node, keep: int) -> list:
    """The first ``keep`` sizes of node as graph arguments (sym_size nodes where symbolic)."""
    sizes = []
    for i, size in enumerate(val(node).shape[:keep]):
        size_int = static_int(size)
        sizes.append(size_int if size_int is not None else b.call(aten.sym_size.int, node, i))
    return sizes


def _negation_of(atom: Node) -> Optional[Node]:
    """t for a table ``-t`` (``neg``, ``t * -1``) of t's shape and dtype."""
    inner = atom.args[0] if is_call(atom, aten.neg.default) else \
        atom.args[0] if is_call(atom, aten.mul.Tensor) and atom.args[1] == -1 else None
    if isinstance(inner, Node) and shape_eq(val(inner).shape, val(atom).shape) and val(inner).dtype == val(atom).dtype:
        return inner
    return None


def _unnegated(entries: list) -> list:
    """Per-lane (sign, factors) with a table that is a negation read as its input (and the sign flipped)."""
    inner = {}
    for _, factors in entries:
        for f in factors:
            if f[0] not in inner:
                inner[f[0]] = _negation_of(f[0])
    if not any(inner.values()):
        return entries
    out = []
    for sign, factors in entries:
        fs = []
        for atom, comp, k, lane in factors:
            if inner[atom] is not None:
                atom, sign = inner[atom], -sign
            fs.append((atom, comp, k, lane))
        out.append((sign, tuple(fs)))
    return out


def _table(entries: list, width: int) -> Union[Table, str]:
    """A Table for per-lane (sign, factors) entries, or why there is none."""
    counts = {len(f) for _, f in entries}
    if counts != {len(entries[0][1])} or not entries[0][1]:
        return "a term multiplies x by no table" if 0 in counts else "the terms multiply x by different tables"
    entries = _unnegated(entries)
    factors = []
    for i in range(len(entries[0][1])):
        column = [((sign if i == 0 else 1), *f[i]) for sign, f in entries]
        factors.append(_segments(column))
    return Table(factors, width)


# -- what a rotation-like value maps to -----------------------------------------------------------------
ROTARY_FORMS = (HALF, INTERLEAVE)
PAIRS_FORMS = (PAIRS_TO_HALF, HALF_TO_PAIRS)


@functools.lru_cache(maxsize=256)
def _maps(form: str, w: int) -> tuple:
    """(a, b, partner) for a form of width w: lane t reads x[a(t)] (the cos term) and x[b(t)] (the sin
    term); t and partner(t) are the two lanes of one 2x2 rotation."""
    h = w // 2
    ts = range(w)
    if form == HALF:
        b = tuple((t + h) % w for t in ts)
        return tuple(ts), b, b
    if form == INTERLEAVE:
        b = tuple(t ^ 1 for t in ts)
        return tuple(ts), b, b
    if form == PAIRS_TO_HALF:  # out = D(x) * cos + rotate_half(D(x)) * sin, D the de-interleave
        return (tuple(2 * t if t < h else 2 * (t - h) + 1 for t in ts),
                tuple(2 * t + 1 if t < h else 2 * (t - h) for t in ts), tuple((t + h) % w for t in ts))
    # HALF_TO_PAIRS, the adjoint: dx[i] = A[i] * g[D^-1(i)] + B[i] * g[P^-1(i)]
    return (tuple(t // 2 if t % 2 == 0 else t // 2 + h for t in ts),
            tuple(t // 2 + h if t % 2 == 0 else t // 2 for t in ts), tuple(t ^ 1 for t in ts))


def _rho(form: str, w: int) -> tuple:
    """The signs of the op's R (half: cat(-x2, x1); interleave: (-x1, x0) per pair) at each lane."""
    if form in (HALF, PAIRS_TO_HALF, HALF_TO_PAIRS):
        return tuple(-1 if t < w // 2 else 1 for t in range(w))
    return tuple(-1 if t % 2 == 0 else 1 for t in range(w))


@dataclasses.dataclass
class Rotation:
    """A subgraph that is exactly one fused RoPE: x[..., start:end] rotated (``form``) with tables r1/r2
    (cos/sin), its result at lanes [out_start, out_start + width) of the anchor's; with ``passthrough``
    the anchor is all of x, its other lanes copied."""

    anchor: Node
    x: Node
    start: int
    end: int
    out_start: int
    passthrough: bool
    form: str
    backward: bool  # the tables are those of the *_backward op
    tables: tuple
    x_rounds: tuple  # dtypes x is rounded to first
    op_dtype: torch.dtype
    out_dtype: torch.dtype
    region: frozenset
    nodes: list
    complex_form: bool
    chain: tuple = ()  # the nodes x goes through, unmixed, before the rotation (other sources to try)
    doubtful: bool = False  # reads [.., 2 * D] -> [.., 2, D] as pairs of halves; it may be two heads
    lead_perm: tuple = ()  # the result is the rotation with its leading dims permuted so
    witnesses: tuple = ()  # values multiplied by a lane matrix: a NaN or inf in one of their rows is NaN in all
    # the row's lanes of the result (``0 * inf`` in the matrix product), as eager computes it

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def mode(self) -> str:
        return "interleave" if self.form == INTERLEAVE else "half"

    @property
    def head_dim(self) -> int:
        return static_int(val(self.x).shape[-1])


@dataclasses.dataclass
class Refusal:
    """A rotation-like subgraph that no fused op computes, and why."""

    anchor: Node
    reason: str
    family: str  # the role of the pass that reports it (see Analysis.decisions)
    region: frozenset


def _piece(x: Node, start: int, end: int) -> str:
    width = static_int(val(x).shape[-1])
    return x.name if (start, end) == (0, width) else f"{x.name}[..., {start}:{end}]"


def _term_text(term) -> str:
    names = [f[0].name + ("" if f[1] < 0 else (".real" if f[1] == 0 else ".imag")) for f in term[3]]
    return ("-" if term[0] < 0 else "") + " * ".join(names or ["1"])


def _runs(lanes: list) -> str:
    lanes = sorted(lanes)
    runs, start = [], lanes[0]
    for prev, cur in zip(lanes, lanes[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}:{prev + 1}")
            start = cur
    return "[" + ", ".join(runs) + "]"


def classify(interp: _Interpretation, anchor: Node, value: Any, kind: str) -> Union[Rotation, Refusal, None]:
    """The fused op that computes ``value`` (the anchor's), a Refusal when it is rotation-like but no op
    computes it, or None when it is not rotation-like."""
    if not isinstance(value, Lanes) or value.cplx:
        return None
    x, polys = interp.x, _signs_folded(interp.analysis, value.polys)
    n = len(polys)
    if not n or max(len(p) for p in polys) > 2 or all(len(p) < 2 for p in polys):
        return None
    matrix = _unfollowed_matrix(interp, polys)
    if matrix is not None:
        return Refusal(anchor, matrix, "rotary_mul", value.region)
    for p in (p for p in polys if len(p) == 2):  # x's lanes gathered by an index this graph does not know
        for atom in (f[0] for t in p for f in t[3]):  # (one the forward saved)
            if atom in interp.why and is_call(atom, aten.index.Tensor, aten.index_put.default,
                                              aten.index_select.default, aten.index_add.default):
                return Refusal(anchor, f"{interp.why[atom]}, so the lanes it moves cannot be followed", "rotary_mul",
                               value.region)
    if len({t[1] for p in polys for t in p if t[1] != NO_X}) != n:
        return None
    mixes = any(len(p) == 2 and p[0][1] != NO_X and p[1][1] != NO_X for p in polys)
    if not mixes and not (n == interp.x_width and any(t[1] not in (NO_X, j) for j, p in enumerate(polys) for t in p)):
        return None  # no lane combines two lanes of x, and x's lanes are not moved either
    region = value.region

    def refuse(reason: str, family: str = "rotary_mul") -> Refusal:
        return Refusal(anchor, reason, family, region)

    for p in polys:
        for t in p:
            for f in t[3]:
                if f[0] in interp.why and uninitialized(f[0]):
                    lanes = [j for j, q in enumerate(polys) if any(g[0] is f[0] for u in q for g in u[3])]
                    return refuse(f"lanes {_runs(lanes)} of the result read {describe(f[0])}, memory nothing wrote "
                                  "(a part of the tensor left unwritten)")
                if f[0] in interp.why:
                    return refuse(f"table {f[0].name} depends on {x.name} ({interp.why[f[0]]}); RoPE tables must "
                                  "not vary with x")
    for p in polys:
        for t in p:
            if t[1] == NO_X:
                return refuse(f"the term {_term_text(t)} reads no lane of {x.name}: its tensor is not the rotated "
                              f"tensor {x.name}")
    width = interp.x_width
    rotated = []
    for j, p in enumerate(polys):
        if len(p) == 2:
            if p[0][1] == p[1][1]:
                return refuse(f"lane {j} of the result reads {x.name}[..., {p[0][1]}] twice")
            rotated.append(j)
        elif len(p) == 1:
            if p[0][3] or p[0][0] != 1:
                return refuse(f"lane {j} of the result is {x.name}[..., {p[0][1]}] times a table, not rotated "
                              "with a partner lane")
        else:
            return refuse(f"lane {j} of the result is zero")
    o_s, o_e = rotated[0], rotated[-1] + 1
    if len(rotated) != o_e - o_s:
        return refuse(f"the rotated lanes {_runs(rotated)} of the result are not one slice")
    w = o_e - o_s
    read = sorted({t[1] for j in rotated for t in polys[j]})
    s_off = read[0]
    if read != list(range(s_off, s_off + w)):
        return refuse(f"lanes [{o_s}:{o_e}] of the result read lanes {_runs(read)} of {x.name}, not one slice of it")
    passthrough = w < n
    if passthrough:
        if n != width:
            return refuse(f"the result's {n} lanes are not {x.name}'s {width}")
        for j, p in enumerate(polys):
            if len(p) == 1 and p[0][1] != j:
                return refuse(f"lane {j} of the result copies {x.name}[..., {p[0][1]}]: the lanes around the "
                              "rotation are moved")
        if s_off != o_s:
            return refuse(f"the rotation of {_piece(x, s_off, s_off + w)} is written at lanes [{o_s}:{o_e}]")
    piece = _piece(x, s_off, s_off + w)
    if w % 2:
        return refuse(f"head dim {w} is odd ({piece}): halves [0:{w // 2}] and [{w // 2}:{w}] are unequal, no "
                      "rotation pairs every lane")
    local = [polys[o_s + t] for t in range(w)]
    lanes = [(p[0][1] - s_off, p[1][1] - s_off) for p in local]
    form = None
    for candidate in (HALF, INTERLEAVE, PAIRS_TO_HALF, HALF_TO_PAIRS):
        a, b, _ = _maps(candidate, w)
        if all({a[t], b[t]} == set(lanes[t]) for t in range(w)):
            form = candidate
            break
    if form is None:
        return refuse(_no_form(lanes, piece, w))
    family = "interleave" if form in PAIRS_FORMS else "rotary_mul"  # (the role of the pass that reports it)
    a, b, partner = _maps(form, w)
    terms_a = [p[0] if p[0][1] - s_off == a[t] else p[1] for t, p in enumerate(local)]
    terms_b = [p[1] if p[0][1] - s_off == a[t] else p[0] for t, p in enumerate(local)]
    for t in range(w):
        u = partner[t]
        if t < u:
            lanes_text = f"lanes {o_s + t} and {o_s + u} of the result (rotating {piece})"
            if terms_b[t][0] * terms_b[u][0] != -1:
                return refuse(f"sign error: {lanes_text} add their partners with the same sign ("
                              f"{_signed(terms_b[t])} and {_signed(terms_b[u])}): a reflection, not a rotation"
                              f"{_unless_saved(kind, terms_b[t], terms_b[u])}", family)
            if terms_a[t][0] * terms_a[u][0] != 1:
                return refuse(f"sign error: {lanes_text} take their own lanes with opposite signs ("
                              f"{_signed(terms_a[t])} and {_signed(terms_a[u])}): not a rotation"
                              f"{_unless_saved(kind, terms_a[t], terms_a[u])}", family)
    # precision
    out_dtype = val(anchor).dtype
    rounds = {t[2] for t in terms_a + terms_b}
    if len(rounds) != 1:
        return refuse(f"{x.name} is rounded differently for the two terms ({' vs '.join(map(_rounds_text, rounds))}) "
                      "before the rotation: one cast of x cannot reproduce both")
    x_rounds = rounds.pop()
    for j, p in enumerate(polys):
        if len(p) == 1 and p[0][2] not in (x_rounds, x_rounds + (out_dtype.to_real(),)):
            return refuse(f"lane {j} copies {x.name} rounded to {_rounds_text(p[0][2])}, the rotated lanes read it "
                          f"rounded to {_rounds_text(x_rounds)}")
    for dtype, node in sorted(value.rounds, key=lambda r: interp.analysis.position.get(r[1], 0)):
        if not covers(dtype, out_dtype):
            return refuse(f"{node.name} rounds to {dtype_name(dtype)} in the middle of the computation and the result is "
                          f"{dtype_name(out_dtype)}: the fused op rounds once, at the end", family)
    # tables
    rho = _rho(form, w)
    if form == HALF_TO_PAIRS:
        q, p_map, _ = _maps(PAIRS_TO_HALF, w)
        cos_entries = [(terms_a[q[j]][0], terms_a[q[j]][3]) for j in range(w)]
        sin_entries = [(rho[j] * terms_b[p_map[j]][0], terms_b[p_map[j]][3]) for j in range(w)]
        options = [(True, cos_entries, sin_entries)]
    else:
        cos_entries = [(terms_a[t][0], terms_a[t][3]) for t in range(w)]
        forward = [(terms_b[t][0] * rho[t], terms_b[t][3]) for t in range(w)]
        options = [(False, cos_entries, forward)]
        if form in ROTARY_FORMS:
            options.append((True, cos_entries, [(rho[t] * terms_b[b[t]][0], terms_b[b[t]][3]) for t in range(w)]))
    built = []
    for backward, c_entries, s_entries in options:
        r1, r2 = _table(c_entries, w), _table(s_entries, w)
        for name, table in (("cos", r1), ("sin", r2)):
            if isinstance(table, str):
                return refuse(f"{table} ({name} of {piece})", family)
        built.append((r1.cost() + r2.cost(), backward, r1, r2))
    # the simpler tables (autograd's own R^T(g * sin) reads them as they are); a tie: the graph's own kind
    built.sort(key=lambda c: (c[0], c[1] != (kind == "backward")))
    _, backward, r1, r2 = built[0]
    for name, table in (("cos", r1), ("sin", r2)):
        reason = _table_fits(table, name, x, piece, w)
        if reason:
            return refuse(reason, family)
    lead = val(anchor).shape[:val(anchor).dim() - value.k]
    x_lead = [val(x).shape[:-1][d] for d in value.perm] if value.perm else val(x).shape[:-1]
    if value.perm and passthrough:
        return refuse(f"the leading dims of the result are a permutation of {x.name}'s, its other lanes copied")
    if not shape_eq(lead, x_lead):
        shapes = " / ".join(str(list(val(a).shape)) for t in (r1, r2) for a in t.atoms)
        return refuse(f"result shape {list(val(anchor).shape)} differs from x shape {list(val(x).shape)}: cos/sin "
                      f"{shapes} ({', '.join(a.name for t in (r1, r2) for a in t.atoms)}) are not broadcastable to x",
                      family)
    x_dtype = x_rounds[-1] if x_rounds else val(x).dtype
    op_dtype = functools.reduce(torch.promote_types, [x_dtype, r1.dtype, r2.dtype, out_dtype.to_real()])
    complex_form = any(is_call(n, aten.view_as_complex.default) for n in region)
    witnesses = tuple(dict.fromkeys(src for n, src in interp.witnesses.items() if n in region))
    for src in witnesses:
        if val(src).dim() != val(x).dim() or not shape_eq(val(src).shape[:-1], val(x).shape[:-1]):
            return refuse(f"{src.name} is multiplied by a lane matrix, whose product spreads a NaN or inf of a row "
                          f"to all its lanes, and its rows {list(val(src).shape[:-1])} are not {x.name}'s", family)
    return Rotation(anchor, x, s_off, s_off + w, o_s, passthrough, form, backward, (r1, r2), x_rounds, op_dtype,
                    out_dtype, region, [], complex_form, lead_perm=value.perm, witnesses=witnesses)


def _unfollowed_matrix(interp: _Interpretation, polys: tuple) -> Optional[str]:
    """Why x's lanes times a matrix cannot be followed, where the sum reads as ``x * C + (x @ M) * S`` or its
    adjoint ``x * C + (x * S) @ M`` (a lane of x times a table, plus a product by M of x's lanes with a table on
    either side): rotation-like, were M a signed permutation. Else None (any other matmul stays silent)."""
    for j, p in enumerate(polys):
        if len(p) != 2:
            continue
        for own, other in (p, p[::-1]):
            if own[1] != j or not own[3] or other[1] != NO_X:
                continue
            for f in other[3]:
                found = interp.matrices.get(f[0])
                if found is not None and (found[1] or len(other[3]) > 1):
                    return found[0]
    return None


def _unless_saved(kind: str, *terms) -> str:
    """In a backward graph, the tables that are its inputs (what the forward saved): a sign vector the
    forward multiplied into one is not visible here."""
    saved = sorted({f[0].name for t in terms for f in t[3] if f[0].op == "placeholder"
                    and not f[0].name.startswith(("primals", "tangents"))})
    if kind != "backward" or not saved:
        return ""
    return (f", unless a sign is in {', '.join(saved)}: the forward computed and saved it, and its values are "
            "not known in the backward graph")


def _signed(term) -> str:
    text = _term_text(term)
    return text if text.startswith("-") else "+" + text


def _rounds_text(rounds: tuple) -> str:
    return " then ".join(map(dtype_name, rounds)) if rounds else "nothing"


def _table_fits(table: Table, name: str, x: Node, piece: str, w: int) -> Optional[str]:
    """A single table broadcast from one lane (last dim 1) is not a table of the op."""
    if len(table.factors) == 1 and len(table.factors[0]) == 1 and table.factors[0][0].rep == 0:
        s = table.factors[0][0]
        shape = list(val(s.atom).shape)
        return (f"{name} shape {shape} ({s.atom.name}) is one value broadcast over the lanes of {piece} shape "
                f"{[*val(x).shape[:-1], w]}: last dim {shape[-1] if shape else 1} != the {w} lanes rotated, and the fused "
                "ops' tables are full width (one value per lane)")
    pieces = sum(len(f) for f in table.factors)
    if pieces > 8:
        return f"{name} of {piece} would be rebuilt from {pieces} pieces of {len(table.atoms)} tables"
    return None


def _no_form(lanes: list, piece: str, w: int) -> str:
    own = [next((i for i in pair if i == t), None) for t, pair in enumerate(lanes)]
    if all(o is not None for o in own):
        partner = [pair[0] if pair[1] == t else pair[1] for t, pair in enumerate(lanes)]
        for t in range(w):
            if partner[partner[t]] != t:
                return (f"lane {t} of {piece} is rotated with lane {partner[t]}, but lane {partner[t]} with lane "
                        f"{partner[partner[t]]}: the lane permutation is not an involution, so not a rotation")
        pairs = ", ".join(f"({t}, {partner[t]})" for t in range(w) if t < partner[t])
        return (f"the rotation pairs lanes {pairs} of {piece}: no GE RoPE mode pairs lanes so (half pairs (j, j + "
                f"{w // 2}), interleave (2k, 2k + 1))")
    t = next(t for t, o in enumerate(own) if o is None)
    return (f"lane {t} of the result reads lanes {lanes[t][0]} and {lanes[t][1]} of {piece}, neither its own: a lane "
            "permutation no fused op computes (only DeepSeek's pairs-to-halves has one)")


# -- building a rotation's result ----------------------------------------------------------------------
# Unsqueezes that take x to BSND, as rotary_mul and inplace_partial_rotary_mul need it:
# [T, N, D] -> [1, T, N, D]; [T, D] -> [1, T, 1, D].
BSND_LIFT = {4: (), 3: (0,), 2: (0, 2)}


def finish(b, rot: Rotation, source: Node, out: Node) -> Node:
    """The fused op's output as the anchor's value: with the lanes around it copied from x
    (a partial RoPE), its leading dims permuted as the subgraph's were, in the anchor's shape; NaN in a row
    where a lane matrix's product made it so (``0 * inf``: x * 0 is 0 where x is finite)."""
    for src in rot.witnesses:
        nan = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, src, 0), [-1], True)
        out = b.call(aten.add.Tensor, out, b.cast(nan, rot.out_dtype))
    if rot.passthrough:
        head_dim = rot.head_dim
        parts = [b.cast(b.call(aten.slice.Tensor, source, -1, lo, hi), rot.out_dtype)
                 for lo, hi in ((0, rot.start), (rot.end, head_dim)) if hi > lo]
        out = b.call(aten.cat.default, [*parts[:1], out, *parts[1:]] if rot.start else [out, *parts], -1)
    if rot.lead_perm:  # the subgraph rotated x, then permuted its leading dims
        out = b.call(aten.permute.default, out, [*rot.lead_perm, len(rot.lead_perm)])
    shape = val(rot.anchor).shape
    if len(shape) != val(out).dim():
        out = b.call(aten.view.default, out, _sizes(b, rot.anchor, len(shape)))
    if val(rot.anchor).is_contiguous() and not val(out).is_contiguous():  # a cat's result is contiguous
        out = b.call(aten.clone.default, out, memory_format=torch.contiguous_format)
    return out


# -- one graph's rotations ----------------------------------------------------------------------------------
class Analysis:
    """Every anchor of one graph evaluated: a Rotation, a Refusal, or nothing; and which pass fuses
    (or reports) each. A Rotation inside a larger one is left to it; a Refusal is reported only where
    it is the outermost rotation-like subgraph and holds no Rotation."""

    def __init__(self, graph: Graph, kind: str):
        self.graph, self.kind = graph, kind
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self._independent: dict = {}  # x -> nodes known not to depend on x
        self._interpretations: dict = {}
        self._lane_ops: dict = {}
        self._templates: dict = {}  # signature -> a result with nodes as indices (see _signature)
        self._descriptions: dict = {}
        self._distances: dict = {}
        self._leaves_of: dict = {}  # anchor -> _leaves(anchor) (a signature and an evaluation both read it)
        self._constants: dict = {}  # node -> its values where computed from constants alone (else None)
        self._signs: dict = {}  # node -> its values where it is a sign vector (else None)
        self.results: dict = {}  # anchor -> Rotation | Refusal
        self._deferred: set = set()  # anchors inside a rotary_mul Rotation: no pass would take them
        holders: dict = {}
        for anchor in reversed(self._anchors()):  # the outermost first
            holder = holders.get(anchor)
            if holder is not None and holder.form in ROTARY_FORMS and not holder.doubtful:
                self._deferred.add(anchor)
                continue
            result = self._evaluate_alike(anchor)
            if result is not None:
                self.results[anchor] = result
                if isinstance(result, Rotation):
                    for n in result.region:
                        holders.setdefault(n, result)
        self._reported = self._outermost_refusals()
        self._decisions: dict = {}
        self._decision_at: dict = {}  # role -> {anchor: its decision}
        self._on_demand: dict = {}

    # reading the graph
    def depends(self, node: Node, x: Node) -> bool:
        """node's value is computed from x (conservatively True past a search budget)."""
        if node is x:
            return True
        known = self._independent.setdefault(x, set())
        if node in known:
            return False
        px = self.position.get(x, -1)
        seen, stack = {node}, [node]
        while stack:
            n = stack.pop()
            for a in n._input_nodes:
                if a is x:
                    return True
                if a in seen or a in known or self.position.get(a, px + 1) < px:
                    continue
                seen.add(a)
                if len(seen) > DEPENDENCE_BUDGET:
                    return True
                stack.append(a)
        known.update(seen)
        return False

    def lane_op(self, node: Node) -> Optional[bool]:
        """:func:`lane_op`, once per node."""
        try:
            return self._lane_ops[node]
        except KeyError:
            found = self._lane_ops[node] = lane_op(node)
            return found

    def interpretation(self, x: Node) -> _Interpretation:
        found = self._interpretations.get(x)
        if found is None:
            found = self._interpretations[x] = _Interpretation(self, x)
        return found

    def constant(self, node: Node, depth: int = 0, limit: int = 0) -> Optional[torch.Tensor]:
        """A small tensor's values where they are computed from constants alone (a literal
        ``torch.tensor([-1., 1.])``, ``cat((-ones(h), ones(h)))``, ``zeros(d, d)`` with entries put in):
        deterministic aten ops of attributes and factories, run on the CPU; else None. Small: at most
        ``limit`` values, by default MAX_LANES, or a lane matrix's (a square one of side MAX_MATRIX at most)."""
        if node in self._constants:
            return self._constants[node]
        v = val(node)
        if isinstance(v, torch.Tensor) and not v._has_symbolic_sizes_strides:
            limit = limit or (MAX_MATRIX ** 2 if v.dim() == 2 and v.shape[0] == v.shape[1] <= MAX_MATRIX else MAX_LANES)
            if v.numel() > limit:  # (not kept: a matrix computed from it may ask with a larger limit)
                return None
        self._constants[node] = None
        if not isinstance(v, torch.Tensor) or v._has_symbolic_sizes_strides or depth > CONSTANT_DEPTH:
            return None
        found = None
        if node.op == "get_attr":
            found = _attribute_tensor(node)
        elif node.op == "call_function" and pure_aten_op(node.target):
            inputs = {}
            for a in node.all_input_nodes:
                inputs[a] = self.constant(a, depth + 1, limit)
                if inputs[a] is None:
                    return None
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), inputs.__getitem__)
            if "device" in kwargs:
                kwargs = {**kwargs, "device": torch.device("cpu")}
            try:
                with unset_fake_temporarily(), torch.no_grad():
                    found = node.target(*args, **kwargs)
            except Exception:  # (a constant that cannot be computed here is not known)
                found = None
        if not isinstance(found, torch.Tensor) or found.device.type != "cpu" or tuple(found.shape) != tuple(v.shape):
            return None
        self._constants[node] = found
        return found

    def constant_key(self, node: Node) -> Optional[tuple]:
        """A constant's dtype and values (their bytes), hashable (in a signature: its values decide lanes and signs;
        a matrix's are many)."""
        found = self.constant(node)
        if found is None:
            return None
        with unset_fake_temporarily():
            flat = found.resolve_conj().resolve_neg().reshape(-1).contiguous()
            return found.dtype, flat.view(torch.uint8).numpy().tobytes()

    def signs(self, node: Node) -> Optional[tuple]:
        """A table's values, flat, where every one of them is 1 or -1 (a sign vector in a constant)."""
        if node not in self._signs:
            found, signs = self.constant(node), None
            if found is not None and not found.is_complex() and found.dtype != torch.bool:
                with unset_fake_temporarily(), torch.no_grad():
                    flat = found.reshape(-1)
                    if bool(((flat == 1) | (flat == -1)).all()):
                        signs = tuple(int(v) for v in flat.tolist())
            self._signs[node] = signs
        return self._signs[node]

    def _anchors(self) -> list:
        """Anchor candidates: the sums of two tensors (and complex products) at most NEAR lane ops
        after a lane move, and the anchor ops at most NEAR lane ops after one of them (no lane of
        anything else has two terms)."""
        found = set()
        for n in calls_of(self.graph, MIXING):
            if len(n._input_nodes) != 2 or \
                    (n.target is aten.mul.Tensor and not val(n).is_complex()) or self.lane_op(n) is None:
                continue
            if not self._after_a_move(n):
                continue
            frontier, hops = [n], 0
            while frontier and hops <= NEAR:  # n and the lane ops that take it further
                nxt = []
                for m in frontier:
                    if m in found:
                        continue
                    found.add(m)
                    nxt += [u for u in m.users if self.lane_op(u) is not None]
                frontier, hops = nxt, hops + 1
        position = self.position
        return sorted((m for m in found if m.target in ANCHORS), key=lambda m: position.get(m, 0))

    def _after_a_move(self, node: Node) -> bool:
        """A lane move at most NEAR lane ops before node."""
        return self._move_distance(node) <= NEAR

    def _move_distance(self, node: Node) -> int:
        """How many lane ops after a lane move node is (NEAR + 1: farther, or none), once per node."""
        found = self._distances.get(node)
        if found is not None:
            return found
        stack = [node]  # (iterative: chains of residual adds are long)
        while stack:
            n = stack[-1]
            if n in self._distances:
                stack.pop()
                continue
            kind = self.lane_op(n)
            if kind is None or kind:
                self._distances[n] = NEAR + 1 if kind is None else 0
                stack.pop()
                continue
            todo = [a for a in n._input_nodes if a not in self._distances]
            if todo:
                stack.extend(todo)
                continue
            self._distances[n] = min([NEAR + 1, *(self._distances[a] + 1 for a in n._input_nodes)])
            stack.pop()
        return self._distances[node]

    def _leaves(self, anchor: Node) -> tuple:
        """(x candidates, whether the walk looks like a RoPE): the non-lane-op nodes reached from the
        anchor through lane ops with a lane move on the way, shapes like the anchor's first."""
        if anchor not in self._leaves_of:
            self._leaves_of[anchor] = self._walk_to_leaves(anchor)
        return self._leaves_of[anchor]

    def _walk_to_leaves(self, anchor: Node) -> tuple:
        moved, stack, muls, cuts = {}, [(anchor, False)], 0, 0
        while stack and len(moved) < 4 * MAX_REGION:
            node, m = stack.pop()
            if node in moved and (moved[node] or not m):
                continue
            first = node not in moved
            moved[node] = m
            kind = self.lane_op(node)
            if kind is None:
                continue
            if first:
                muls += node.target is aten.mul.Tensor
                cuts += node.target in _CUTS
            for a in node._input_nodes:
                stack.append((a, m or kind))
        return self._leaves_found(anchor, moved, muls, cuts)

    def _leaves_in_cone(self, anchor: Node, cone: list) -> tuple:
        """:meth:`_walk_to_leaves`' result from the nodes a signature collected (every node that walk
        reaches, in a DAG: each is visited once, after its users, instead of again per lane move found)."""
        moved, muls, cuts = {anchor: False}, 0, 0
        position = self.position
        for node in sorted(cone, key=lambda n: -position.get(n, 0)):  # users first
            m = moved.get(node)
            kind = self.lane_op(node) if m is not None else None
            if kind is None:
                continue
            muls += node.target is aten.mul.Tensor
            cuts += node.target in _CUTS
            m = m or kind
            for a in node._input_nodes:
                moved[a] = moved.get(a, False) or m
        return self._leaves_found(anchor, moved, muls, cuts)

    def _leaves_found(self, anchor: Node, moved: dict, muls: int, cuts: int) -> tuple:
        """:meth:`_leaves` of the nodes a walk reached (whether a lane move is on the way to each)."""
        leaves = [n for n, m in moved.items() if m and self.lane_op(n) is None and isinstance(val(n), torch.Tensor)
                  and val(n).dim() and val(n).is_floating_point() and
                  not is_call(n, *ZERO_FILLS, aten.full.default, aten.full_like.default)]
        shape = val(anchor).shape
        leaves.sort(key=lambda n: (not shape_eq(val(n).shape, shape), -self.position.get(n, 0)))
        return leaves, muls >= 2 and cuts >= 1

    def _evaluate_alike(self, anchor: Node) -> Union[Rotation, Refusal, None]:
        """:meth:`_evaluate`, reusing the result of an anchor with the same signature (the layers of a
        model): the same structure gives the same result, up to which nodes play each part."""
        signed = self._signature(anchor)
        if signed is None:
            return self._evaluate(anchor)
        signature, order = signed
        template = self._templates.get(signature, _MISSING)
        if template is _MISSING:
            result = self._evaluate(anchor)
            self._templates[signature] = _template(result, order)
            return result
        if template is None:
            return None
        if template == "again":  # a refusal: its reason names this anchor's nodes
            return self._evaluate(anchor)
        return self._instantiate(template, order)

    def _signature(self, anchor: Node) -> Optional[tuple]:
        """(signature, nodes): every node the evaluation of anchor can read (the lane ops reached from
        it and the nodes they read), each by its op, constant arguments, meta and inputs (by index), the
        order of the leaves in the graph, and which nodes each leaf depends on; or None past a bound."""
        order, index, follows, stack = [], {}, [], [anchor]  # follows[i]: order[i] is a lane op (or the anchor)
        lane_op = self.lane_op
        while stack:
            n = stack.pop()
            if n in index:
                continue
            index[n] = len(order)
            order.append(n)
            if len(order) > 2 * MAX_REGION:
                return None
            follows.append(n is anchor or lane_op(n) is not None)
            if follows[-1]:
                stack.extend(reversed(n._input_nodes))  # (FX's dict of a node's inputs, in argument order)
        if anchor not in self._leaves_of:
            self._leaves_of[anchor] = self._leaves_in_cone(anchor, order)
        candidates = set(self._leaves_of[anchor][0])  # what may be taken as x: these leaves, or lane ops
        entries, leaves = [], []
        for i, n in enumerate(order):
            leaf = bool(i) and not follows[i]
            if leaf:
                leaves.append(i)
            desc, inputs = self._describe(n, leaf)
            entries.append((desc, tuple(map(index.__getitem__, inputs))))
        at = [self.position.get(n, 0) for n in order]
        ranks = tuple(sorted(leaves, key=at.__getitem__))
        xs = [j for j, n in enumerate(order) if (j and follows[j]) or n in candidates]
        depends = tuple((i, j) for i in leaves for j in xs
                        if at[i] > at[j] and self.depends(order[i], order[j]))
        return (tuple(entries), ranks, depends), order

    def _describe(self, node: Node, leaf: bool) -> tuple:
        """(what the evaluation reads of node, node's inputs in argument order), once per node."""
        key = (node, leaf)
        found = self._descriptions.get(key)
        if found is None:
            v = val(node)
            if isinstance(v, torch.Tensor):
                shape = tuple(v.shape)
                if v._has_symbolic_sizes_strides:
                    shape = tuple(map(str, shape))
                meta = shape, v.dtype, v.is_complex() and v.is_conj()
            else:
                meta = type(v).__name__
            if leaf:
                zeros = node.target if is_call(node, *ZERO_FILLS, aten.full.default, aten.full_like.default) else None
                found = ("leaf", meta, zeros, node.args[1] if zeros in (aten.full.default, aten.full_like.default)
                         else None, self.constant_key(node)), ()
            else:
                inputs: list = []
                kwargs = _encoded(node.kwargs, inputs) if node.kwargs else ()  # (most have none)
                matrix = self.constant_key(_shared_matrix(node.args[1])) \
                    if node.target in LANE_MATMULS and _lane_matrix(node) else None  # (its values decide lanes)
                found = (node.target, _encoded(node.args, inputs), kwargs, meta, matrix), tuple(inputs)
            self._descriptions[key] = found
        return found

    def _instantiate(self, template: dict, order: list) -> Rotation:
        node = order.__getitem__
        r = Rotation(**{**template["fields"], "anchor": order[0], "x": order[template["x"]],
                        "tables": _mapped_tables(template["tables"], node),
                        "region": frozenset(map(node, template["region"])), "chain": tuple(map(node, template["chain"])),
                        "witnesses": tuple(map(node, template["witnesses"])), "nodes": []})
        r.nodes = self._rewrite_nodes(r)
        return r

    def _evaluate(self, anchor: Node) -> Union[Rotation, Refusal, None]:
        leaves, ropeish = self._leaves(anchor)
        refusal, doubtful, tried, queue = None, False, set(), leaves[:4]
        while queue:
            leaf = queue.pop(0)
            if leaf in tried or len(tried) >= 6:
                continue
            tried.add(leaf)
            interp = self.interpretation(leaf)
            value = interp.value(anchor)
            chain: tuple = ()
            # then: x read through an ambiguous view as the view itself; a node the reading stopped at
            queue[:0] = [p for p in interp.permuted if p not in tried]  # (a permuted x read by a table product)
            if isinstance(value, Lanes):
                queue += [v for v in interp.ambiguous if v in value.region]
                queue += [a for n in value.region for a in n.all_input_nodes if a in interp.why]
                source, chain = self._source(interp, anchor, value)
                if source is not leaf:
                    interp = self.interpretation(source)
                    value = interp.value(anchor)
                    if isinstance(value, Lanes):
                        queue += [v for v in interp.ambiguous if v in value.region]
            elif ropeish and anchor.target in (aten.add.Tensor, aten.sub.Tensor) and \
                    "is symbolic" in interp.why.get(anchor, ""):
                region = frozenset(n for n in interp.memo if isinstance(n, Node) and n in interp.why)
                refusal = refusal or Refusal(anchor, interp.why[anchor], "rotary_mul", region)
                continue
            result = classify(interp, anchor, value, self.kind)
            if isinstance(result, Rotation):
                result.chain = tuple(c for c in chain if c is not result.x and c in result.region)
                result.nodes = self._rewrite_nodes(result)
                result.doubtful = any(view in result.region for view in interp.ambiguous)
                for view in interp.ambiguous:  # [T, 2 * D] -> [T, 2, D]: two heads, rather than pairs of halves
                    if view in result.region and view not in tried:
                        tried.add(view)
                        other = self.interpretation(view)
                        heads = classify(other, anchor, other.value(anchor), self.kind)
                        if isinstance(heads, Rotation) and heads.width < result.width:
                            heads.nodes = self._rewrite_nodes(heads)
                            return heads
                return result
            if isinstance(result, Refusal) and (refusal is None or doubtful):
                # a refusal of lanes read through an ambiguous view yields to the other reading's
                refusal, doubtful = result, any(v in result.region for v in interp.ambiguous)
        return refusal

    def _source(self, interp: _Interpretation, anchor: Node, value: Lanes) -> tuple:
        """(the rotated tensor, the nodes it goes through unmixed): of the nodes every path from the leaf
        to the anchor goes through, the last one before x's lanes first move or mix (a dequantization, a
        sum of gradients, ``x * 1.0``), else the leaf."""
        leaf, region = interp.x, value.region
        order = sorted(region, key=lambda n: self.position.get(n, 0))
        inputs = {n: [a for a in n.all_input_nodes if a is leaf or a in region] for n in order}
        paths_from = {leaf: 1}
        for n in order:
            paths_from[n] = sum(paths_from.get(a, 0) for a in inputs[n])
        paths_to = {anchor: 1}
        for n in reversed(order):
            for a in inputs[n]:
                paths_to[a] = paths_to.get(a, 0) + paths_to.get(n, 0)
        total = paths_from.get(anchor, 0)
        if not total:  # the leaf reaches the anchor only through atoms
            return leaf, (leaf,)
        dominators = [n for n in order if n is not anchor and isinstance(val(n), torch.Tensor)
                      and paths_from.get(n, 0) * paths_to.get(n, 0) == total]
        source = leaf
        for n in dominators:
            v = interp.memo.get(n)
            if not isinstance(v, Lanes) or v.cplx or self.lane_op(n) is True or \
                    any(sum(t[1] != NO_X for t in p) > 1 for p in v.polys):
                break  # x's lanes move, or mix, from here on
            source = n
        chain = [source]
        for n in dominators[dominators.index(source) + 1 if source in dominators else 0:]:
            v = interp.memo.get(n)
            if not isinstance(v, Lanes) or v.cplx or any(len(p) != 1 for p in v.polys):
                break
            chain.append(n)
        return source, tuple(chain)

    def _rewrite_nodes(self, rotation: Rotation) -> list:
        """The region without the anchor, and without the unmixed views of x that other nodes read too
        (they stay for them)."""
        region = rotation.region
        keep = set()
        for n in (*rotation.chain, *(n for n in region if n.target in SPLITS)):
            if n in region and any(u not in region for u in n.users):
                keep.add(n)
        changed = True
        while changed:  # the views a kept view reads from x stay too
            changed = False
            for n in list(keep):
                for a in n.all_input_nodes:
                    if a in region and a not in keep and (a in rotation.chain or a.target in SPLITS):
                        keep.add(a)
                        changed = True
        stack = [w for w in rotation.witnesses if w in region]
        while stack:  # a witness the result reads stays, with what it is computed from
            n = stack.pop()
            if n not in keep:
                keep.add(n)
                stack += [a for a in n.all_input_nodes if a in region]
        nodes = [n for n in region if n is not rotation.anchor and n not in keep]
        return sorted(nodes, key=lambda n: -self.position.get(n, 0))

    def _outermost_refusals(self) -> list:
        successes = [r for r in self.results.values() if isinstance(r, Rotation)]
        anchors = {r.anchor for r in successes}
        covered = set().union(*(r.region for r in successes)) if successes else set()
        refusals = [f for f in self.results.values() if isinstance(f, Refusal)
                    and f.anchor not in covered and not (f.region & anchors)]

        def encloses(g: Refusal, f: Refusal) -> bool:  # (of two holding each other's anchor: the later one)
            return f.anchor in g.region and (g.anchor not in f.region or self.position[g.anchor] > self.position[f.anchor])

        return [f for f in refusals if not any(encloses(g, f) for g in refusals if g is not f)]

    # what each pass takes
    def decisions(self, role: str) -> list:
        """(anchor, Rotation or Refusal) for the pass with ``role``, in graph order: the largest
        Rotations it can fuse, and the Refusals it reports."""
        found = self._decisions.get(role)
        if found is not None:
            return found
        eligible = [r for r in map(lambda r: self._for_role(r, role), self.rotations(self.results.values()))
                    if r is not None]
        # one whose intermediates other nodes read (a saved activation) yields to the rotations inside it
        leaky = {id(r) for r in eligible if users_outside(r.nodes, [r.anchor]) is not None}
        if leaky:
            inner = [self.rotation_at(a) for a in self._deferred
                     if any(a in r.region for r in eligible if id(r) in leaky)]
            eligible += [r for r in map(lambda r: self._for_role(r, role), self.rotations(inner)) if r is not None]
            leaky = {id(r) for r in eligible if users_outside(r.nodes, [r.anchor]) is not None}

        def inside(r, o):
            return r is not o and r.anchor in o.region

        chosen = []
        for r in eligible:  # the largest; but a doubtful or leaky one yields to those inside it
            if any(inside(r, o) for o in eligible if not o.doubtful and id(o) not in leaky):
                continue
            if (r.doubtful or id(r) in leaky) and any(inside(o, r) for o in eligible if id(o) not in leaky):
                continue
            chosen.append(r)
        chosen += [f for f in self._reported if f.family == role]
        found = sorted(((r.anchor, r) for r in chosen), key=lambda ar: self.position.get(ar[0], 0))
        self._decisions[role] = found
        self._decision_at[role] = dict(found)
        return found

    def decision(self, role: str, anchor: Node) -> Union[Rotation, Refusal, None]:
        """The pass with ``role``'s decision at anchor (see :meth:`decisions`), or None."""
        if role not in self._decision_at:
            self.decisions(role)
        return self._decision_at[role].get(anchor)

    def _for_role(self, r: Rotation, role: str) -> Optional[Rotation]:
        if role == "partial":  # (the in-place op has no result to spread a matrix product's NaNs over)
            return r if r.passthrough and r.form == INTERLEAVE and not r.backward and not r.witnesses else None
        if role == "interleave":
            return r if r.form in PAIRS_FORMS and not r.passthrough else None
        if r.form in ROTARY_FORMS:
            return r
        if r.form == PAIRS_TO_HALF:  # de-interleaved x in the graph (DeepSeek's reference form): rotate it alone
            for node in reversed(r.chain):
                if node is r.x or not shape_eq(val(node).shape, val(r.x).shape[:-1] + (r.width,)):
                    continue
                interp = self.interpretation(node)
                alternate = classify(interp, r.anchor, interp.value(r.anchor), self.kind)
                if isinstance(alternate, Rotation) and alternate.form in ROTARY_FORMS:
                    alternate.nodes = self._rewrite_nodes(alternate)
                    return alternate
        return None

    def rotation_at(self, anchor: Node) -> Optional[Rotation]:
        """The Rotation rooted at anchor, whether or not a pass takes it (evaluated on demand)."""
        found = self.results.get(anchor)
        if found is None and anchor in self._deferred:
            if anchor not in self._on_demand:
                self._on_demand[anchor] = self._evaluate(anchor)
            found = self._on_demand[anchor]
        return found if isinstance(found, Rotation) else None

    def rotations(self, results=None) -> list:
        """The Rotations among results (default: every one found, those inside a larger one too)."""
        if results is None:
            for anchor in self._deferred:
                self.rotation_at(anchor)
            results = [*self.results.values(), *self._on_demand.values()]
        return [r for r in results if isinstance(r, Rotation)]


_MISSING = object()


def _encoded(arg, inputs: list):
    """arg as a hashable constant, each node replaced by a marker and appended to inputs."""
    kind = type(arg)
    if kind is Node:  # (the common arguments first: every node of every signature)
        inputs.append(arg)
        return _NODE
    if kind in _PLAIN_CONSTANTS:
        return arg
    if isinstance(arg, (list, tuple)):  # (sizes: their plain ints kept without a call each)
        return tuple([a if type(a) in _PLAIN_CONSTANTS else _encoded(a, inputs) for a in arg])
    if isinstance(arg, dict):
        return tuple(sorted((k, _encoded(v, inputs)) for k, v in arg.items()))
    if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(arg)
    return arg


_NODE = object()  # a node argument, in a signature
_PLAIN_CONSTANTS = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device))


def _template(result: Union[Rotation, Refusal, None], order: list) -> Any:
    """result with its nodes as indices into order (None stays None; a refusal is evaluated again)."""
    if result is None:
        return None
    if isinstance(result, Refusal):
        return "again"
    index = {n: i for i, n in enumerate(order)}
    atoms = [a for t in result.tables for f in t.factors for seg in f for a in (seg.atom, seg.zipped) if a is not None]
    if not all(n in index for n in (result.x, *atoms, *result.region, *result.chain, *result.witnesses)):
        return "again"
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(Rotation)
              if f.name not in ("anchor", "x", "tables", "region", "chain", "nodes", "witnesses")}
    return {"fields": fields, "x": index[result.x], "tables": _mapped_tables(result.tables, index.__getitem__),
            "region": [index[n] for n in result.region], "chain": [index[n] for n in result.chain],
            "witnesses": [index[n] for n in result.witnesses]}


def _mapped_tables(tables: tuple, mapped) -> tuple:
    """tables with each segment's atoms replaced by ``mapped(atom)`` (nodes to a template's indices, and back;
    every other field kept: ``dataclasses.replace`` is slower, and once per segment of every layer's RoPE)."""
    return tuple(Table([[Segment(**{**vars(seg), "atom": mapped(seg.atom),
                                    "zipped": None if seg.zipped is None else mapped(seg.zipped)}) for seg in f]
                        for f in t.factors], t.width) for t in tables)


def analysis(ctx: PassContext) -> Analysis:
    """The graph's Analysis for the passes of one run (``ctx.memo``, which goes with the run),
    computed again when the graph changed (any node created or erased)."""
    graph = ctx.graph
    created = getattr(getattr(graph, "_graph_namespace", None), "_used_names", None)  # grows with every new node
    key = (len(graph.nodes), len(created) if created is not None else tuple(map(id, graph.nodes)), ctx.kind)
    cached = ctx.memo.get(__name__)
    if cached is not None and cached[0] == key:
        return cached[1]
    found = Analysis(graph, ctx.kind)
    ctx.memo[__name__] = (key, found)
    return found


# -- what the RoPE passes share ----------------------------------------------------------------------------
class RotationPass(FusionPass):
    """A RoPE family's pass: its sites are the recognizer's decisions for ``role``; an op that takes
    4-D x gets a lower-rank x lifted by ``lifts`` and its result squeezed back."""

    role = ""
    lifts = BSND_LIFT  # x's rank -> the unsqueezes that take x to the op's 4-D layout

    def anchors(self, ctx: PassContext):
        return [anchor for anchor, _ in analysis(ctx).decisions(self.role)]

    def decision(self, ctx: PassContext, anchor: Node) -> Optional[Rotation]:
        """The Rotation this pass fuses at anchor, or None; NotFused with the recognizer's reason for
        a Refusal."""
        found = analysis(ctx).decision(self.role, anchor)
        if isinstance(found, Refusal):
            raise NotFused(found.reason)
        return found

    def check_site(self, rot: Rotation, takes: str) -> None:
        """x of a rank the op takes (``takes`` says what it takes), not empty; no intermediate read
        outside the subgraph."""
        x, xv = rot.x, val(rot.x)
        if xv.dim() not in self.lifts:
            raise NotFused(f"x {x.name} is {xv.dim()}-D; {takes}")
        if size_eq(xv.numel(), 0):
            raise NotFused(f"x {x.name} of shape {list(xv.shape)} is empty; nothing to fuse")
        leaked = users_outside(rot.nodes, [rot.anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")

    def op_inputs(self, b, rot: Rotation) -> tuple:
        """(source, x, table1, table2) for the op: source is x rounded as eager rounds it first; x its
        rotated lanes, and the tables rebuilt, each in the op's dtype and lifted."""
        x_rank = val(rot.x).dim()
        lift = self.lifts[x_rank]
        source = rot.x
        for dtype in rot.x_rounds:  # eager rounds x first (a cast before the rotation)
            source = b.cast(source, dtype)
        piece = source if (rot.start, rot.end) == (0, rot.head_dim) else \
            b.call(aten.slice.Tensor, source, -1, rot.start, rot.end)
        xx = b.lifted(b.cast(piece, rot.op_dtype), x_rank, lift)
        t1, t2 = (b.lifted(b.cast(t.build(b), rot.op_dtype), x_rank, lift) for t in rot.tables)
        return source, xx, t1, t2

    def unlifted(self, b, rot: Rotation, out: Node) -> Node:
        """The op's 4-D result back in x's rank."""
        for dim in reversed(self.lifts[val(rot.x).dim()]):
            out = b.call(aten.squeeze.dim, out, dim)
        return out
