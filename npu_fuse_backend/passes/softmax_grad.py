"""Softmax backward with a scale -> ``npu_fuse::softmax_grad_ext`` (spec section 3, seed 004).

Pattern, anchored at the final multiply ``y`` (operands of every commutative op in
any order; ``x2`` a Python scalar, a scalar-like tensor, or a tensor of grad's shape):

* v1: ``y = (x2 * x1) * sub``            with ``sub = grad - sum(grad * x1, -1, keepdim)``
* v2: ``y = (x1 * sub) * x2``
* decomposed ``_softmax_backward_data``: ``y = (m0 - x1 * sum(m0, -1, keepdim)) * x2``, ``m0 = grad * x1``,
  or with ``fma(-x1, sum(m0), m0)`` for the Sub, as inductor's decompositions write it
* training graphs: ``y = _softmax_backward_data(grad, x1, -1, dtype) * x2``.
* any of these divided by a Python number instead (``softmax(logits / T)``): x2 = 1/T.
* any of these with layout-only ops (views, clones, copies into a fresh buffer) between the
  chain and its scale, as Falcon's in-place ``scores /= sqrt(d)`` leaves them in the backward
  graph (with the copies that write ``y`` back into the view); the result is viewed back to
  ``y``'s shape, which must be contiguous. A scale expanded from one element is that element.
* a scalar scale behind a *linear region*: ops ``f`` with ``f(s * v) = s * f(v)`` between the
  softmax backward and its scale: dtype casts (``softmax(..., dtype=float32).to(bf16)``, autocast),
  slices, views, negations, sums, adds of two such values and scatters of one into zeros. The
  region is computed again on the fused op's (scaled) result, so the scale moves to the front:
  attention sinks (``cat([logits, sink])``, softmax, ``[..., :-1]``: the softmax backward of the
  whole row, the weights' slice scaled, the sink column's gradient and the gradient of a
  subtracted row max read off the same row) and two softmax backwards summed before one
  scale. A region value also read elsewhere unscaled (the sink's gradient) is given back as the
  scaled value times 1/s, where that costs fewer elements than the multiply the fusion removes.
  A matmul is linear in the one operand computed from the softmax backward (``mm``, ``bmm``; the
  other must not be): ``baddbmm(bias, q, k^T, alpha=s)`` (Bloom) leaves both matmuls of the softmax
  backward, ``ds @ k`` and ``q^T @ ds``, each times s; the scale moves in front of both, and a region
  value read only by multiplies by the same scale gives them its scaled value (a view it reads after
  the scale's multiply is made again before it).

Precision: the fused op computes in the softmax backward's own dtype (float32 for
``softmax(..., dtype=float32)`` and autocast), the casts after it stay outside it and are
applied to its result. A cast that rounds before the scale while the scale's result is wider
(bf16 widened to float32, then scaled in float32) cannot be reproduced by one rounding: refused,
naming the cast.

Constraints (each failure is a near-miss with its reason): the op's own argument rules
(``check_softmax_grad_ext_args``: reduction over the last dim with keepdim, grad and x1 of
equal shape, rank 1..6, not empty, one float dtype, x2 scalar-like or grad's shape), asked
of the op on the arguments the replacement gives it; static shapes; a number scale that stays
a normal number in grad's dtype; a divisor that is a number (1/T of a tensor T is not eager's
division for every T); the first Mul and the Sub share grad and both Muls share x1 (by
construction of the match; ``sum - grad`` is different math and never matches); no intermediate
used outside the chain, except one elementwise op of the chain's inputs (``neg(x1)``, ``grad * x1``,
which inductor shares between two softmax backwards of one softmax): it stays in the graph for
its other users and the fused op computes its value itself; no rewrite that would make the fused
op depend on its own output. The SoC limit (the GE op exists on Ascend950 only) is the op's
``unavailable_on``.

No silent site: every softmax backward (``_softmax_backward_data`` and the decomposed chains
above) that no scale multiply takes is a near-miss saying where its result goes; on inductor, an
attention that inductor's own joint-graph pattern turned into scaled_dot_product_attention is a
near-miss saying so (the backward graph then holds an SDPA backward no user code called). A softmax
written by hand (``exp(s - max) / sum(exp(s - max))``) leaves no softmax backward at all: autograd's
chain through the division, the sum and the max reads the exp's output and the sum (two saved values,
or a recomputed exp beside the saved forward softmax), which the backward graph does not show to be
one softmax; its heart, the quotient's gradient ``g / Z + sum(-g * e / Z / Z)``, is a near-miss saying
so (``by_division``).
"""

import dataclasses
import math
from typing import Any, Optional

import torch
from torch.fx import Node

from ..fusion import (FakeValues, FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, check_op_args,
                      register_fusion, same_significant_strides)
from ..graph_utils import (SHAREABLE_VIEWS, VIEWS, aten, call_arg, calls_of, describe, dtype_name, is_call, shape_eq,
                           static_int, users_outside, val)
from ..matchers import CAST_KWARGS, DTYPE_CASTS, ZERO_FILLS, binary_operands, widens
from npu_fuse_backend.lowering.ops.softmax_grad import check_softmax_grad_ext_args

Scalar = (int, float)
SOFTMAX_GRAD_EXT = torch.ops.npu_fuse.softmax_grad_ext.default
FMA = torch.ops.prims.fma.default


def _other(pair, item) -> Optional[object]:
    """The operand of pair that is not item (None when item is not in pair)."""
    if pair[0] is item:
        return pair[1]
    if pair[1] is item:
        return pair[0]
    return None


def _plain_sub(node) -> bool:
    return binary_operands(node, aten.sub.Tensor) is not None


@dataclasses.dataclass
class ReducedProduct:
    """``sum(a * b, dims, keepdim)``; ``sum(a * b, d).unsqueeze(d)`` is the kept sum (``inner``: its sum)."""

    product: Node
    dims: list
    keepdim: bool
    inner: tuple = ()


def sum_of_product(node) -> Optional[ReducedProduct]:
    if is_call(node, aten.unsqueeze.default):
        kept = sum_of_product(node.args[0])
        dim = call_arg(node, 1, "dim")
        if kept is None or kept.keepdim or len(kept.dims) != 1 or not isinstance(dim, int):
            return None
        rank = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else None
        if rank is None or kept.dims[0] % rank != dim % rank:
            return None  # another dim restored: not the row sum broadcast back
        return ReducedProduct(kept.product, kept.dims, True, (node.args[0],))
    if not is_call(node, aten.sum.dim_IntList) or node.kwargs.get("dtype") is not None:
        return None
    product = node.args[0]
    if binary_operands(product, aten.mul.Tensor) is None or not all(isinstance(a, Node) for a in product.args):
        return None
    dims, keepdim = call_arg(node, 1, "dim"), call_arg(node, 2, "keepdim", False)
    return ReducedProduct(product, list(dims or []), keepdim)


# -- layout-only ops between the chain and its scale -------------------------------------------
FRESH_BUFFERS = (aten.empty.memory_format, aten.new_empty.default, aten.new_empty_strided.default,
                 aten.empty_like.default, aten.empty_strided.default)


@dataclasses.dataclass
class LayoutPath:
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


def _scale_value(x2, inverted: bool) -> float:
    return 1.0 / x2 if inverted else float(x2)


def _check_scalar_scale(x2, inverted: bool, dtype: torch.dtype) -> None:
    """A Python-number scale becomes a [1] tensor of grad's dtype: it must be a normal number
    there (eager multiplies by it in float32; a rounding to inf, 0 or a subnormal changes the result)."""
    if inverted and x2 == 0:
        raise NotFused("the chain divides by 0")
    value = _scale_value(x2, inverted)
    info = torch.finfo(dtype)
    if not math.isfinite(value) or (value != 0 and not info.tiny <= abs(value) <= info.max):
        raise NotFused(f"scale {value:g} is outside {dtype}'s normal range [{info.tiny:g}, {info.max:g}]: "
                       f"softmax_grad_ext takes it as a {dtype} tensor, eager multiplies in float32")


def _check_static(*named: tuple) -> None:
    """SoftmaxGradExt takes static shapes only: the first symbolic dim of the (name, tensor) pairs."""
    for name, t in named:
        symbolic = [s for s in t.shape if static_int(s) is None]
        if symbolic:
            raise NotFused(f"{name} has symbolic dim {symbolic[0]}: SoftmaxGradExt needs static shapes")


def _check_divisor(x2, inverted: bool) -> None:
    if inverted and isinstance(x2, torch.Tensor):
        raise NotFused("the chain is divided by a tensor: softmax_grad_ext multiplies by x2, and x2 = 1/T "
                       "equals eager's division only where 1/T is a normal number (a subnormal T gives "
                       "inf, 0/T gives 0 but 0*inf NaN), which the compile cannot know of a tensor; a "
                       "Python-number divisor or a multiply by a tensor scale fuses")


def _leading_ones_of(shape, base) -> bool:
    """shape is base with zero or more leading 1s (what a one-element x2 of higher rank makes)."""
    extra = len(shape) - len(base)
    return extra >= 0 and list(shape[extra:]) == list(base) and all(s == 1 for s in shape[:extra])


def _shape_of(x2) -> str:
    return str(list(x2.shape)) if isinstance(x2, torch.Tensor) else "a number"


def _numel(node) -> Optional[int]:
    """The static element count of node's value (None when symbolic)."""
    sizes = [static_int(s) for s in val(node).shape]
    return None if None in sizes else math.prod(sizes)


@dataclasses.dataclass
class SoftmaxBackward:
    """A matched chain: ``x2 * x1 * (grad - sum(grad * x1, dims, keepdim))``."""

    grad: Node
    x1: Node
    x2: Any  # a node, or a Python scalar (None for an unscaled core)
    nodes: list
    dims: list
    keepdim: bool
    scale_inverted: bool = False  # y = softmax_backward / x2
    form: str = "decomposed chain"
    layout: Optional[LayoutPath] = None  # layout-only ops between the chain and the scale

    def __post_init__(self):
        self.nodes = list(dict.fromkeys(self.nodes))


# -- one elementwise op of a chain's inputs, shared with another chain ------------------------------
SHAREABLE_ELEMENTWISE = (aten.neg.default, aten.mul.Tensor)


def _shareable(node: Node, inside: set) -> bool:
    """node is one elementwise op computed from values outside the subgraph (``neg(x1)``, ``grad * x1``):
    the fused op computes that value itself, so node can stay in the graph for its other users."""
    return is_call(node, *SHAREABLE_ELEMENTWISE) and all(i not in inside for i in node.all_input_nodes)


def _without_shared(nodes: list, outputs: list) -> list:
    """nodes less those a user outside them reads that may stay for it (see :func:`_shareable`)."""
    inside = set(nodes) | set(outputs)
    return [n for n in nodes if n in outputs or not (_shareable(n, inside) and any(u not in inside for u in n.users))]


def _leak_reason(leaked: Node) -> str:
    return (f"intermediate {describe(leaked)} is used outside the subgraph (it reads the chain's own values, "
            "so it cannot stay for its other users as one elementwise op of the chain's inputs could)")


# -- linear regions: ops f with f(s * v) = s * f(v) ------------------------------------------------
UNARY_LINEAR = (*VIEWS, aten.clone.default, aten.slice.Tensor, aten.select.int, aten.permute.default,
                aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
                aten.squeeze.dims, aten.alias.default, aten.expand.default, aten.neg.default, aten.sum.dim_IntList,
                aten.slice_backward.default, aten.select_backward.default)
ZERO_FILLS_WITH_VALUE = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}
REGION_LIMIT = 32  # nodes a region walk visits before it gives up (keeps matching linear in graph size)


def is_zero_fill(node) -> bool:
    """A tensor of zeros (``zeros``, ``new_zeros``, ``full(..., 0)``...): linear in anything."""
    if is_call(node, *ZERO_FILLS):
        return True
    position = ZERO_FILLS_WITH_VALUE.get(node.target) if isinstance(node, Node) else None
    return position is not None and is_call(node, node.target) and len(node.args) > position \
        and node.args[position] == 0 and not isinstance(node.args[position], bool)


def _float_cast(node: Node) -> bool:
    if not is_call(node, *DTYPE_CASTS) or set(node.kwargs) - CAST_KWARGS:
        return False
    if node.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    source, result = val(node.args[0]), val(node)
    return source.is_floating_point() and result.is_floating_point() and source.device == result.device


MATMULS = (aten.bmm.default, aten.mm.default)
LINEAR_TARGETS = frozenset((*UNARY_LINEAR, *DTYPE_CASTS, *MATMULS, aten.add.Tensor, aten.sub.Tensor,
                            aten.scatter.src, aten.scatter_add.default, aten.slice_scatter.default, aten.cat.default,
                            aten.copy.default, aten.masked_fill.Scalar, aten.where.self))
_SITE_TARGETS = (aten._softmax_backward_data.default, FMA, aten.sub.Tensor,
                 aten.add.Tensor)  # what _site and by_division read
CORE_TARGETS = frozenset((aten._softmax_backward_data.default, FMA, aten.sub.Tensor, aten.mul.Tensor))


def linear_operands(node) -> Optional[list]:
    """[(operand, role)] when node is linear in its "linear" operands (each a linear value or zeros)
    and computed with "free" ones that must not depend on them ("layout": only the layout is read,
    a linear value or a fill; "either": a matmul, linear in the one of its operands that is linear,
    the other free: see ``resolved``); None for any other op."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target not in LINEAR_TARGETS \
            or not isinstance(val(node), torch.Tensor):
        return None
    args = node.args
    if is_call(node, *UNARY_LINEAR) and isinstance(args[0], Node):
        if is_call(node, aten.sum.dim_IntList) and node.kwargs.get("dtype") is not None:
            return None
        if is_call(node, aten.clone.default) and set(node.kwargs) - {"memory_format"}:
            return None
        return [(args[0], "linear"), *((a, "free") for a in args[1:] if isinstance(a, Node))]
    if _float_cast(node):
        return [(args[0], "linear")]
    if is_call(node, aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 and all(isinstance(a, Node) for a in args) \
            and set(node.kwargs) <= {"alpha"} and not isinstance(node.kwargs.get("alpha", 1), Node):
        return [(args[0], "linear"), (args[1], "linear")]
    if is_call(node, aten.scatter.src, aten.scatter_add.default) and len(args) == 4 and not node.kwargs \
            and all(isinstance(a, Node) for a in (args[0], args[2], args[3])):
        return [(args[0], "linear"), (args[2], "free"), (args[3], "linear")]
    if is_call(node, aten.slice_scatter.default) and all(isinstance(a, Node) for a in args[:2]):
        return [(args[0], "linear"), (args[1], "linear")]
    if is_call(node, aten.cat.default) and all(isinstance(a, Node) for a in args[0]):
        return [(a, "linear") for a in args[0]]
    if is_call(node, aten.masked_fill.Scalar) and len(args) == 3 and all(isinstance(a, Node) for a in args[:2]) \
            and type(args[2]) in (int, float) and args[2] == 0 and not node.kwargs:
        # zeros where the mask is set (the backward of a masked_fill of the scores, nanoGPT's causal mask)
        return [(args[0], "linear"), (args[1], "free")]
    if is_call(node, aten.where.self) and len(args) == 3 and all(isinstance(a, Node) for a in args):
        return [(args[0], "free"), (args[1], "linear"), (args[2], "linear")]  # (one side zeros: the same mask)
    if is_call(node, *MATMULS) and len(args) == 2 and all(isinstance(a, Node) for a in args) and not node.kwargs:
        return [(args[0], "either"), (args[1], "either")]
    if is_call(node, aten.copy.default) and len(args) == 2 and all(isinstance(a, Node) for a in args) \
            and not node.kwargs and val(args[1]).is_floating_point():
        # functional copy_: src's values (cast to dst's dtype) in dst's layout; dst's values are overwritten
        return [(args[0], "layout"), (args[1], "linear")]
    return None


def resolved(spec: Optional[list], linear) -> Optional[list]:
    """spec with a matmul's roles decided by ``linear(operand)``: the linear operand linear, the
    other free; None where both are (a product of two scaled values is scaled twice) or neither."""
    if not spec or spec[0][1] != "either":
        return spec
    flags = [bool(linear(op)) for op, _ in spec]
    if flags.count(True) != 1:
        return None
    return [(op, "linear" if flag else "free") for (op, _), flag in zip(spec, flags)]


def same_scale_multiply(node: Node, value: Node, scale, inverted: bool) -> bool:
    """node is ``value * scale`` (``value / scale``) for the region's scale, at value's shape."""
    if inverted:
        other = node.args[1] if is_call(node, aten.div.Tensor) and len(node.args) == 2 and node.args[0] is value \
            else None
    else:
        operands = binary_operands(node, aten.mul.Tensor)
        other = _other(operands, value) if operands is not None else None
    if other is None or not shape_eq(val(node).shape, val(value).shape):
        return False
    if isinstance(scale, Node) or isinstance(other, Node):
        return other is scale
    return isinstance(other, Scalar) and isinstance(scale, Scalar) and not isinstance(other, bool) \
        and not isinstance(scale, bool) and other == scale


def is_fill(node, role: str) -> bool:
    """A value a region may read whatever it is scaled by: zeros, or (as the destination of a copy,
    whose values are overwritten) a fresh buffer."""
    return is_zero_fill(node) or (role == "layout" and is_call(node, *FRESH_BUFFERS))


@dataclasses.dataclass
class Region:
    """The values between one or more softmax backwards (``cores``) and a scalar scale."""

    cores: dict  # core node -> its SoftmaxBackward (x2 None)
    nodes: list  # the region's ops in graph order (the cores excluded)
    operand: Node  # the value the scale multiplies
    exits: list = dataclasses.field(default_factory=list)  # region values read elsewhere, unscaled
    scale: Any = None  # y's other operand
    copies: list = dataclasses.field(default_factory=list)  # copy(region view, y): each equals y
    inverted: bool = False  # y divides by scale
    rescaled: dict = dataclasses.field(default_factory=dict)  # region value -> its multiplies by the scale
    remade: list = dataclasses.field(default_factory=list)  # views read after y, made again before it

    def core_nodes(self) -> list:
        return [n for core in self.cores.values() for n in core.nodes]


_COVERED, _WALK = (__name__, "covered"), (__name__, "walk")  # keys of this pass's state in ctx.memo


@register_fusion
class SoftmaxGradFusion(FusionPass):
    """Mul -> ReduceSum -> Sub -> Mul -> Mul, or softmax backward * scale -> softmax_grad_ext."""

    name = "softmax_grad"
    op = "softmax_grad_ext"
    anchor_targets = (aten.mul.Tensor, aten.div.Tensor)

    # -- anchors: scale multiplies first, then the softmax backwards none of them took ------------
    def anchors(self, ctx: PassContext):
        graph = ctx.graph
        sdpa = [n for n in calls_of(graph, SDPA_BACKWARD) if made_by_compiler(n)] if ctx.kind == "backward" else []
        ctx.memo[_COVERED] = (ctx, set())  # softmax backwards a scale anchor took, fused or not
        # every form of a softmax backward has one of these at its heart; an inference graph has none
        if not graph.find_nodes(op="call_function", target=aten._softmax_backward_data.default, sort=False) and \
                not any(sum_of_product(n) is not None
                        for n in graph.find_nodes(op="call_function", target=aten.sum.dim_IntList, sort=False)):
            return sdpa
        return [*calls_of(graph, self.anchor_targets), *calls_of(graph, _SITE_TARGETS), *sdpa]

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        if anchor.target in SDPA_BACKWARD:
            raise NotFused(_sdpa_reason(anchor), near=_traced_neighbours(anchor))
        if anchor.target not in self.anchor_targets:
            return self._silent_site(ctx, anchor)
        if len(anchor.args) != 2 or self._covered_by_another(ctx, anchor):
            return None
        chain = self._match_softmax_backward_data(anchor) or self._match_decomposed(anchor) or \
            self._match_through_layout(anchor)
        if chain is not None:
            self._cover(ctx, chain.nodes)
            return self._check_and_rewrite(ctx, anchor, chain)
        region = self._match_region(ctx, anchor)
        return self._check_and_rewrite_region(ctx, anchor, region) if region is not None else None

    # (per-graph state lives in ctx.memo, which goes with the run: the pass itself keeps no graph)
    def _walk(self, ctx: PassContext) -> "_RegionWalk":
        """The linear-region walk of this pass over ctx's graph (its answers shared by every anchor)."""
        walk = ctx.memo.get(_WALK)
        if walk is None or walk[0] is not ctx:
            walk = ctx.memo[_WALK] = (ctx, _RegionWalk(self))
        return walk[1]

    @staticmethod
    def _covered(ctx: PassContext) -> set:
        covered = ctx.memo.get(_COVERED)
        return covered[1] if covered is not None and covered[0] is ctx else set()

    def _cover(self, ctx: PassContext, nodes) -> None:
        self._covered(ctx).update(nodes)

    def _covered_by_another(self, ctx: PassContext, anchor: Node) -> bool:
        """A scale multiply an earlier anchor's region takes (a matmul's other output times the scale)."""
        return anchor in self._covered(ctx)

    # -- patterns ---------------------------------------------------------------------
    def _match_through_layout(self, y: Node) -> Optional[SoftmaxBackward]:
        """A chain whose result reaches the scale through layout-only ops."""
        for i, operand in enumerate(y.args):
            if y.target == aten.div.Tensor and i != 0:
                break
            path = through_layout(operand)
            if not path.nodes:
                continue
            args = (*y.args[:i], path.source, *y.args[i + 1:])
            chain = self._match_softmax_backward_data(y, args) or self._match_decomposed(y, args)
            if chain is not None:
                chain.layout = path
                chain.nodes = list(dict.fromkeys([*chain.nodes, *path.nodes]))
                chain.form += ", through layout ops"
                return chain
        return None

    @staticmethod
    def _match_softmax_backward_data(y: Node, args: Optional[tuple] = None) -> Optional[SoftmaxBackward]:
        args = y.args if args is None else args
        inverted = y.target == aten.div.Tensor
        for sbd, x2 in (args, args[::-1]):
            if not is_call(sbd, aten._softmax_backward_data.default):
                continue
            if inverted and sbd is not args[0]:  # the softmax backward is the divisor: not a scale
                return None
            return _sbd_chain(sbd, x2, inverted)
        return None

    def _match_decomposed(self, y: Node, args: Optional[tuple] = None) -> Optional[SoftmaxBackward]:
        args = y.args if args is None else args
        if y.target == aten.div.Tensor:  # (decomposed chain) / T
            core = self._unscaled_core(args[0]) if isinstance(args[0], Node) else None
            if core is None or is_call(args[0], aten._softmax_backward_data.default):
                return None
            return dataclasses.replace(core, x2=args[1], scale_inverted=True)
        for a, b in (args, args[::-1]):
            # v2: (x1 * sub) * x2   |   v1: sub * (x2 * x1)   |   decomposed sbd: (m0 - x1 * s) * x2
            a_ops = binary_operands(a, aten.mul.Tensor)
            if a_ops is not None:
                for sub in a_ops:
                    if _plain_sub(sub):
                        found = self._from_sub(sub, x1_hint=_other(a_ops, sub), x2=b, extra=[a])
                        if found is not None:
                            return found
            if _plain_sub(a):
                b_ops = binary_operands(b, aten.mul.Tensor)
                if b_ops is not None:
                    found = self._from_sub(a, x1_hint=None, x2=b_ops, extra=[b])
                    if found is not None:
                        return found
                found = self._from_decomposed_sbd(a, x2=b)
                if found is not None:
                    return found
            if is_call(a, FMA):
                found = self._from_fma(a, x2=b)
                if found is not None:
                    return found
        return None

    @staticmethod
    def _from_fma(fma: Node, x2) -> Optional[SoftmaxBackward]:
        """fma(-x1, sum(m0), m0) = m0 - x1 * sum(m0): inductor's _softmax_backward_data."""
        neg_x1, total, m0 = fma.args
        reduced = sum_of_product(total)
        if not is_call(neg_x1, aten.neg.default) or reduced is None or reduced.product is not m0:
            return None
        x1 = neg_x1.args[0]
        grad = _other(m0.args, x1)
        if grad is None:
            return None
        return SoftmaxBackward(grad, x1, x2, [fma, neg_x1, total, *reduced.inner, m0], reduced.dims,
                               reduced.keepdim)

    @staticmethod
    def _from_sub(sub: Node, x1_hint, x2, extra) -> Optional[SoftmaxBackward]:
        """sub = grad - sum(grad * x1). x2 is a node/scalar, or (v1) the operands of x2 * x1."""
        first, second = sub.args
        for total, grad, swapped in ((second, first, False), (first, second, True)):
            reduced = sum_of_product(total)
            if reduced is None:
                continue
            x1 = _other(reduced.product.args, grad)
            if x1 is None:
                continue
            if swapped:
                raise NotFused(f"{describe(sub)} computes sum - grad, not grad - sum: "
                               "a different function, not softmax backward")
            if isinstance(x2, tuple):  # v1: the other Mul must be x2 * x1
                x2 = _other(x2, x1)
                if x2 is None:
                    raise NotFused("the scale Mul does not share x1 with the first Mul")
            elif x1_hint is not x1:
                raise NotFused("the Mul after the Sub does not share x1 with the first Mul")
            return SoftmaxBackward(grad, x1, x2, [*extra, sub, total, *reduced.inner, reduced.product],
                                   reduced.dims, reduced.keepdim)
        return None

    @staticmethod
    def _from_decomposed_sbd(sub: Node, x2) -> Optional[SoftmaxBackward]:
        """sub = m0 - x1 * sum(m0), m0 = grad * x1 (torch._decomp's _softmax_backward_data)."""
        m0, scaled = sub.args
        scaled_ops = binary_operands(scaled, aten.mul.Tensor)
        m0_ops = binary_operands(m0, aten.mul.Tensor)
        if scaled_ops is None or m0_ops is None:
            return None
        for total in scaled_ops:
            reduced = sum_of_product(total)
            if reduced is None or reduced.product is not m0:
                continue
            x1 = _other(scaled_ops, total)
            grad = _other(m0_ops, x1)
            if grad is None:
                return None
            return SoftmaxBackward(grad, x1, x2, [sub, scaled, total, *reduced.inner, m0], reduced.dims,
                                   reduced.keepdim)
        return None

    def _unscaled_core(self, node: Node) -> Optional[SoftmaxBackward]:
        """The softmax backward ``x1 * (grad - sum(grad * x1))`` that node computes, before any scale."""
        if is_call(node, aten._softmax_backward_data.default):
            return _sbd_chain(node, None)
        if is_call(node, FMA):
            return self._from_fma(node, None)
        if _plain_sub(node):
            return self._from_decomposed_sbd(node, None)
        ops = binary_operands(node, aten.mul.Tensor)
        for sub in ops or ():
            if _plain_sub(sub):
                try:
                    found = self._from_sub(sub, x1_hint=_other(ops, sub), x2=None, extra=[node])
                except NotFused:
                    return None
                if found is not None:
                    return found
        return None

    # -- linear regions between softmax backwards and a scalar scale -------------------------------
    def _match_region(self, ctx: PassContext, y: Node) -> Optional[Region]:
        """y = region(softmax backwards) * s (or / s) with the region linear: see the module docstring."""
        inverted = y.target == aten.div.Tensor
        for i, operand in enumerate(y.args):
            if inverted and i != 0:
                break
            if linear_operands(operand) is None:
                continue
            walk = self._walk(ctx)
            walk.budget = REGION_LIMIT
            try:
                found = walk.linear(operand)
            except _TooLarge:
                continue
            if not found:
                continue
            cores, members, free = walk.region(operand)
            if not cores:
                continue
            region = Region(cores, members, operand)
            if self._free_operands_depend_on(ctx, free, region):
                continue
            return self._extended(ctx, region, y, y.args[1 - i], inverted)
        return None

    def _free_operands_depend_on(self, ctx: PassContext, free: list, region: Region) -> bool:
        """A "free" operand (a scatter's indices) computed from the softmax backwards makes the region
        non-linear in them."""
        tensors = [n for n in free if isinstance(val(n), torch.Tensor)]  # sizes are not values
        return bool(tensors) and ctx.reaches(tensors, {*region.core_nodes(), *region.cores, *region.nodes}) \
            is not None

    def _extended(self, ctx: PassContext, region: Region, y: Node, scale, inverted: bool) -> Region:
        """region grown forward over the linear ops its other users are (the sink's slice and sum),
        so that what leaves it unscaled is as small as the graph allows; and its exits."""
        inside = {*region.nodes, *region.cores, *region.core_nodes()}
        frontier = [*region.cores, *region.nodes]
        grown = 0
        while frontier and grown < REGION_LIMIT:
            node = frontier.pop()
            for user in list(node.users):
                if user in inside or user is y or is_fill(user, "layout"):
                    continue
                spec = resolved(linear_operands(user), inside.__contains__)
                if spec is None:
                    continue
                fills = [op for op, role in spec if role != "free" and op not in inside and is_fill(op, role)]
                if not all(op in inside or op in fills if role != "free" else
                           not isinstance(val(op), torch.Tensor) or ctx.reaches([op], inside) is None
                           for op, role in spec):
                    continue
                # the replacement is built before y: what the grown node reads from outside must exist there
                late = [op for op in user.all_input_nodes if op not in inside and ctx.position(op) > ctx.position(y)]
                if not all(is_call(op, *SHAREABLE_VIEWS) and all(ctx.position(i) < ctx.position(y)
                                                            for i in op.all_input_nodes) for op in late):
                    continue
                region.remade += [op for op in late if op not in region.remade]
                for added in [*(f for f in fills if any(i in inside for i in f.all_input_nodes)), user]:
                    inside.add(added)
                    region.nodes.append(added)
                frontier.append(user)
                grown += 1
        region.nodes.sort(key=ctx.position)
        members = {*region.nodes, *region.cores}
        # copies writing y back into a region view (the functional form of ``scores *= s``) equal y
        region.copies = written_back(y, LayoutPath(region.operand, region.nodes))
        exits = [n for n in sorted(members, key=ctx.position)
                 if any(u not in members and u is not y and u not in region.copies for u in n.users)]
        for node in exits:  # read only by multiplies by the scale (a matmul's other output, ``baddbmm``'s alpha)
            readers = [u for u in node.users if u not in members and u is not y and u not in region.copies]
            if all(same_scale_multiply(u, node, scale, inverted) and all(ctx.position(r) > ctx.position(y)
                                                                          for r in u.users) for u in readers):
                region.rescaled[node] = readers
        region.exits = [n for n in exits if n not in region.rescaled]
        region.scale, region.inverted = scale, inverted
        return region

    def _check_and_rewrite_region(self, ctx: PassContext, y: Node, region: Region) -> Rewrite:
        self._cover(ctx, [*region.core_nodes(), *region.nodes, *(u for r in region.rescaled.values() for u in r)])
        x2 = scalar_like(region.scale)
        inverted = region.inverted
        cores = region.cores
        for core in cores.values():
            _check_static(("grad", val(core.grad)), ("x1", val(core.x1)))
        scale = val(x2)
        _check_divisor(scale, inverted)
        if isinstance(scale, torch.Tensor) and scale.numel() != 1:
            raise NotFused(f"x2 {x2.name} is a full tensor behind {describe(region.nodes[-1])}: only a scalar "
                           "scale is the same before and after the ops between the softmax backward and it")
        if not isinstance(scale, torch.Tensor) and (not isinstance(x2, Scalar) or isinstance(x2, bool)):
            raise NotFused(f"x2 {x2!r} is not a number or tensor")
        for core in cores.values():
            grad = val(core.grad)
            if not isinstance(scale, torch.Tensor):
                _check_scalar_scale(x2, inverted, grad.dtype)
            fake = val(self._scale_arg(FakeValues(ctx.fake_mode), x2, inverted, grad))
            check_op_args(check_softmax_grad_ext_args, grad, val(core.x1), fake, core.dims, core.keepdim)
        operand = val(region.operand)
        if not _leading_ones_of(val(y).shape, operand.shape):
            raise NotFused(f"the result has shape {list(val(y).shape)} (x2 {_shape_of(scale)} broadcasts it), "
                           f"but the ops after softmax_grad_ext give shape {list(operand.shape)}")
        self._check_rounding(region, [(y, region.operand), *((e, e) for e in region.exits),
                                      *((u, e) for e, readers in region.rescaled.items() for u in readers)])
        factor = self._check_exits(region, y, x2, inverted)
        inside = {*region.nodes, *region.cores}
        for exit_node in region.exits:  # the replacement is built before y: every reader must come after it
            early = [u for u in exit_node.users if u not in inside and u is not y and u not in region.copies
                     and ctx.position(u) < ctx.position(y)]
            if early:
                raise NotFused(f"{describe(early[0])} reads {exit_node.name} before {y.name} computes the scaled "
                               "result it would be given back from")
        if isinstance(x2, Node):
            cycle = ctx.reaches([x2], inside | set(region.core_nodes()))
            if cycle is not None:
                raise NotFused(f"x2 depends on {describe(cycle)} of the chain: fusing would make the op depend "
                               "on its own output")
        rescalings = [u for readers in region.rescaled.values() for u in readers]
        outputs = [y, *region.copies, *region.exits, *rescalings]
        nodes = _without_shared([*region.core_nodes(), *region.nodes, *rescalings], outputs)
        leaked = users_outside(nodes, outputs)
        if leaked is not None:
            raise NotFused(_leak_reason(leaked))

        def build(b: GraphBuilder) -> dict:
            env = {}
            for view in region.remade:  # (read by the region after y: made again from what precedes y)
                env[view] = b.call(view.target, *view.args, **view.kwargs)
            for node, core in cores.items():
                grad = val(core.grad)
                fused_scale = self._scale_arg(b, x2, inverted, grad)
                env[node] = b.cast(b.call(SOFTMAX_GRAD_EXT, core.grad, core.x1, fused_scale, [-1], True),
                                   val(node).dtype)
            for node in region.nodes:
                args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: env.get(n, n))
                env[node] = b.call(node.target, *args, **kwargs)
            out = env[region.operand]
            if val(y).dim() != val(out).dim():  # a one-element x2 of higher rank adds leading 1s
                out = b.call(aten.view.default, out, list(val(y).shape))
            out = b.cast(out, val(y).dtype)
            if val(y).is_contiguous() and not same_significant_strides(val(out), val(y)):
                # y is a fresh tensor and the region ends in a view (a slice of the row): lay it out as y
                out = b.call(aten.clone.default, out, memory_format=torch.contiguous_format)
            replaced = {y: out, **{copy: out for copy in region.copies}}
            for node in region.exits:
                replaced[node] = b.call(aten.mul.Tensor, env[node], factor)
            for node, readers in region.rescaled.items():
                replaced.update((u, b.cast(env[node], val(u).dtype)) for u in readers)
            return replaced

        ops = sorted({getattr(n.target, "__name__", str(n.target)).split(".")[0] for n in region.nodes})
        detail = f"{' + '.join(c.form for c in cores.values())}, scale moved in front of {', '.join(ops)}"
        if region.exits:
            detail += f"; {', '.join(e.name for e in region.exits)} given back unscaled (x 1/scale)"
        if rescalings:
            detail += f"; {', '.join(u.name for u in rescalings)} (the same scale) taken by it too"
        return Rewrite(y, [*nodes, *region.copies], self.op, build, detail=detail)

    @staticmethod
    def _check_rounding(region: Region, outputs: list) -> None:
        """Each output must be no wider than every rounding on its way from the softmax backward: the
        region is computed on the scaled value, so each of its roundings moves to after the scale."""
        widest: dict = {}  # node -> (eps of the coarsest rounding on its way, the node that rounds)

        def coarsest(node: Node):
            if node in widest:
                return widest[node]
            dtype = val(node).dtype
            found = (torch.finfo(dtype).eps, node)
            if node in region.cores:
                grad = val(region.cores[node].grad).dtype
                found = max(found, (torch.finfo(grad).eps, node), key=lambda f: f[0])
            elif node in region.nodes or node is region.operand:
                inside = lambda n: n in region.nodes or n in region.cores  # noqa: E731
                for operand, role in resolved(linear_operands(node), inside) or ():
                    if role == "linear" and inside(operand):
                        found = max(found, coarsest(operand), key=lambda f: f[0])
            widest[node] = found
            return found

        for output, value in outputs:
            eps, rounding = coarsest(value)
            dtype = val(output).dtype
            if torch.finfo(dtype).eps < eps:
                narrow = dtype_name(val(rounding).dtype)
                raise NotFused(f"{describe(rounding)} rounds the softmax backward to {narrow} before "
                               f"{describe(output)} computes in {dtype_name(dtype)}: eager rounds before the "
                               f"scale, softmax_grad_ext once after it, and the difference exceeds "
                               f"{dtype_name(dtype)}'s tolerance")

    @staticmethod
    def _check_exits(region: Region, y: Node, x2, inverted: bool) -> Optional[float]:
        """The factor that gives an exit its unscaled value back (1/scale), if exits cost less than the
        multiply the fusion removes."""
        if not region.exits:
            return None
        names = ", ".join(describe(e) for e in region.exits)
        if not isinstance(x2, Scalar) or x2 == 0:
            raise NotFused(f"{names} also read(s) the softmax backward unscaled, and the scale {x2} is not a "
                           "nonzero number: its value cannot be given back from the scaled result")
        factor = float(x2) if inverted else 1.0 / x2
        for exit_node in region.exits:
            _check_scalar_scale(factor, False, val(exit_node).dtype)
        cost, saved = sum(_numel(e) or 0 for e in region.exits), _numel(y) or 0
        if cost >= saved:
            users = ", ".join(describe(u) for e in region.exits for u in e.users if u not in region.nodes and u is not y)
            than = "as many as" if cost == saved else "more than"
            raise NotFused(f"{names} is also read unscaled by {users}: giving it back from the scaled result "
                           f"costs {cost} elements, {than} the {saved} of the multiply the fusion removes")
        return factor

    @staticmethod
    def _scale_arg(b: GraphBuilder, x2, inverted: bool, grad: torch.Tensor, widen: bool = True) -> Node:
        """x2 as softmax_grad_ext takes it: a [1] tensor of grad's dtype for a number, a one-element
        tensor viewed as [1] (and, with ``widen``, widened to grad's dtype, which is exact) for a tensor.
        ``b`` a GraphBuilder, or FakeValues for the value the op is asked about at match time."""
        if not isinstance(x2, Node):
            return b.call(aten.full.default, [1], _scale_value(x2, inverted), dtype=grad.dtype, device=grad.device,
                          pin_memory=False)
        scale = x2
        if val(scale).numel() == 1 and tuple(val(scale).shape) not in ((), (1,)):
            scale = b.call(aten.view.default, scale, [1])
        if widen and widens(val(scale).dtype, grad.dtype):
            scale = b.cast(scale, grad.dtype)
        return scale

    # -- constraints and replacement ------------------------------------------------------
    def _check_and_rewrite(self, ctx: PassContext, y: Node, chain: SoftmaxBackward) -> Rewrite:
        chain.x2 = scalar_like(chain.x2)
        copies = written_back(y, chain.layout) if chain.layout else []
        self._check(ctx, y, chain, copies)
        grad, x1, x2 = chain.grad, chain.x1, chain.x2
        dtype = val(grad).dtype

        def build(b: GraphBuilder) -> Node:
            scale = self._scale_arg(b, x2, chain.scale_inverted, val(grad), widen=False)
            out = b.call(SOFTMAX_GRAD_EXT, grad, x1, scale, [-1], True)
            if val(y).dim() != val(grad).dim():  # a one-element x2 of higher rank adds leading 1s
                out = b.call(aten.view.default, out, list(val(y).shape))
            if val(y).dtype != dtype:
                out = b.call(aten._to_copy.default, out, dtype=val(y).dtype)
            if chain.layout:
                out = b.call(aten.view.default, out, list(val(y).shape))
                return {y: out, **{copy: out for copy in copies}}
            return out

        return Rewrite(y, [*chain.nodes, *copies], self.op, build, detail=chain.form)

    def _check(self, ctx: PassContext, y: Node, chain: SoftmaxBackward, copies: list) -> None:
        grad, x1, x2 = val(chain.grad), val(chain.x1), val(chain.x2)
        _check_static(("grad", grad), ("x1", x1), *((("x2", x2),) if isinstance(x2, torch.Tensor) else ()))
        _check_divisor(x2, chain.scale_inverted)
        if not isinstance(x2, torch.Tensor):
            if not isinstance(chain.x2, Scalar) or isinstance(chain.x2, bool):
                raise NotFused(f"x2 {chain.x2!r} is not a number or tensor")
            _check_scalar_scale(chain.x2, chain.scale_inverted, grad.dtype)
        # the scale as the replacement passes it: one element as [1], a number as a tensor
        scale = val(self._scale_arg(FakeValues(ctx.fake_mode), chain.x2, chain.scale_inverted, grad, widen=False))
        check_op_args(check_softmax_grad_ext_args, grad, x1, scale, chain.dims, chain.keepdim)
        # the scale's operand: grad's shape, or through layout ops the same values laid out anew
        operand = val(chain.layout.nodes[0]) if chain.layout else grad
        if not _leading_ones_of(val(y).shape, operand.shape):
            raise NotFused(f"the result has shape {list(val(y).shape)} (x2 {_shape_of(x2)} broadcasts it), "
                           f"but softmax_grad_ext returns grad's values in shape {list(operand.shape)}")
        cycle = self._depends_on_chain(ctx, chain)
        if cycle is not None:
            raise NotFused(f"x2 depends on {describe(cycle)} of the chain: fusing would make the op depend "
                           "on its own output")
        if chain.layout:
            if isinstance(x2, torch.Tensor) and x2.numel() != 1:
                raise NotFused(f"x2 {chain.x2.name} is a full tensor across layout ops; only a scalar scale "
                               "is the same on both sides of them")
            if not val(y).is_contiguous():
                raise NotFused(f"{y.name} has strides {list(val(y).stride())}: the fused op's contiguous "
                               "result viewed to its shape would not match them")
        chain.nodes = _without_shared(chain.nodes, [y, *copies])
        leaked = users_outside(chain.nodes, [y, *copies])
        if leaked is not None:
            raise NotFused(_leak_reason(leaked))

    @staticmethod
    def _depends_on_chain(ctx: PassContext, chain: SoftmaxBackward) -> Optional[Node]:
        """The chain node x2 is computed from, if any (walks back only past the chain's start)."""
        if not isinstance(chain.x2, Node):
            return None
        return ctx.reaches([chain.x2], set(chain.nodes))

    # -- no silent site -------------------------------------------------------------------------
    def _silent_site(self, ctx: PassContext, node: Node) -> None:
        """A softmax backward that no scale anchor took: a near-miss saying where its result goes."""
        if node in self._covered(ctx):  # (before the costlier match)
            return None
        if is_call(node, aten.add.Tensor):
            divided = by_division(node)
            if divided is not None:
                raise NotFused(_by_division_reason(divided), near=[divided])
            return None
        core = self._site(node)
        if core is None:
            return None
        raise NotFused(_unscaled_reason(ctx, core))

    def _site(self, node: Node) -> Optional[Node]:
        """The node holding the (unscaled) softmax backward that node is the heart of, or node itself for
        the v1 form (whose scale multiplies x1 first); None when node is no softmax backward."""
        if is_call(node, aten._softmax_backward_data.default):
            return node
        if is_call(node, FMA):
            return node if self._from_fma(node, None) is not None else None
        if not _plain_sub(node):
            return None
        if self._from_decomposed_sbd(node, None) is not None:
            return node
        grad, total = node.args
        reduced = sum_of_product(total)
        x1 = _other(reduced.product.args, grad) if reduced is not None else None
        if x1 is None:
            return None
        for user in node.users:
            ops = binary_operands(user, aten.mul.Tensor)
            other = _other(ops, node) if ops is not None else None
            if other is x1:
                return user
            if other is not None and x1 in (binary_operands(other, aten.mul.Tensor) or ()):
                return node
        return None


# -- a softmax written by hand -----------------------------------------------------------------------
def by_division(add: Node) -> Optional[Node]:
    """The gradient of ``e`` in ``p = e / sum(e, -1, keepdim)`` as autograd writes it, ``g / Z +
    sum(-g * (e / Z / Z))`` (Z the sum, however it was kept or unsqueezed; the sum term expanded back; ``p / Z`` for ``e / Z / Z`` where the
    forward's p is saved), where add is that sum: the heart
    of the backward of a softmax written by hand, ``exp(s - max) / sum(exp(s - max))``; returns the
    gradient of the exp's input (the add times the exp's output), None where there is none."""
    for direct, total in (add.args, add.args[::-1]):
        # (the row sum broadcast back: kept dim, or squeezed and unsqueezed again, then expanded)
        while is_call(total, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.view.default,
                      aten.reshape.default):
            total = total.args[0]
        if not is_call(direct, aten.div.Tensor) or not is_call(total, aten.sum.dim_IntList):
            continue
        grad, divisor = direct.args[:2]
        product = binary_operands(total.args[0], aten.mul.Tensor)
        if product is None:
            continue
        for negated, twice in (product, product[::-1]):
            # (e / Z / Z, or p / Z where the partitioner saved the forward's p = e / Z)
            if is_call(negated, aten.neg.default) and negated.args[0] is grad and is_call(twice, aten.div.Tensor) \
                    and twice.args[1] is divisor:
                return next((u for u in add.users if _times_exp(u, add)), None)
    return None


def _times_exp(node: Node, add: Node) -> bool:
    """node is ``add * e`` with e the exp's output (the exp's own gradient): an ``exp`` the backward
    computes again, or a saved value of add's shape (a placeholder, through detaches). A division by a
    row sum that is no softmax (top-k routing weights renormalised) has no such multiply after it."""
    operands = binary_operands(node, aten.mul.Tensor)
    e = _other(operands, add) if operands is not None else None
    while is_call(e, aten.detach.default, aten.alias.default):
        e = e.args[0]
    return isinstance(e, Node) and (is_call(e, aten.exp.default) or e.op == "placeholder") and \
        shape_eq(val(e).shape, val(add).shape)


def _by_division_reason(node: Node) -> str:
    return (f"{describe(node)} is the backward of a softmax written by hand (exp(s - max) / sum(exp(s - max))): "
            "autograd differentiates the division and the sum apart, so the backward reads the exp's output and "
            "the sum, not one softmax output x1 softmax_grad_ext could take (nothing in the backward graph says "
            "that they are one softmax), and a subtracted max adds its own gradient; torch.softmax / F.softmax "
            "leave a softmax backward, which fuses")


class _TooLarge(Exception):
    pass


class _RegionWalk:
    """Which values are linear in softmax backwards (``f(s * v) = s * f(v)``), remembered for one
    pass over one graph: every scale anchor asks, each node is looked at once."""

    def __init__(self, fusion: "SoftmaxGradFusion"):
        self.fusion = fusion
        self.known: dict = {}  # node -> linear in softmax backwards (or zeros)?
        self.cores: dict = {}  # node -> its SoftmaxBackward, for the softmax backwards met
        self.budget = REGION_LIMIT

    def linear(self, node) -> bool:
        """Raises _TooLarge past REGION_LIMIT new nodes for one question (reset ``budget`` to ask again)."""
        if not isinstance(node, Node):
            return False
        if node in self.known:
            return self.known[node]
        self.budget -= 1
        if self.budget < 0:
            raise _TooLarge
        core = self.fusion._unscaled_core(node) if node.target in CORE_TARGETS else None
        if core is not None:
            self.cores[node] = core
            result = True
        elif is_zero_fill(node):
            result = True
        else:
            spec = resolved(linear_operands(node), self.linear)
            result = spec is not None and all(self._operand(op, role) for op, role in spec)
        self.known[node] = result
        return result

    def _operand(self, node: Node, role: str) -> bool:
        if role == "free":
            return True
        if role == "layout" and is_call(node, *FRESH_BUFFERS):
            return True
        return self.linear(node)

    def region(self, operand: Node) -> tuple:
        """(cores, members, free operands) of the linear value operand."""
        cores, members, free, fills = {}, [], [], []
        stack, seen = [operand], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in self.cores:
                cores[node] = self.cores[node]
            elif is_fill(node, "layout"):
                fills.append(node)
            else:
                members.append(node)
                for op, role in resolved(linear_operands(node), self.known.get):
                    (free if role == "free" else stack).append(op)
        inside = {*members, *cores}
        members += [f for f in fills if any(i in inside for i in f.all_input_nodes)]
        return cores, members, free


def _sbd_chain(sbd: Node, x2, inverted: bool = False) -> SoftmaxBackward:
    """``_softmax_backward_data(grad, x1, dim, dtype)`` (scaled by x2) as a chain."""
    grad, x1, dim = sbd.args[:3]
    return SoftmaxBackward(grad, x1, x2, [sbd], [dim], True, scale_inverted=inverted, form="softmax_backward_data")


def _unscaled_reason(ctx: PassContext, core: Node) -> str:
    """Where a softmax backward's result goes, when no scale takes it."""
    seen, frontier, ends = {core}, [core], []
    while frontier and len(seen) < REGION_LIMIT:
        node = frontier.pop()
        for user in node.users:
            if user in seen or is_fill(user, "layout"):  # reads only its dtype and device
                continue
            spec = linear_operands(user)  # (a matmul ends the way: "mm_3 reads it" says more than what is past it)
            if spec is not None and spec[0][1] != "either" and \
                    all(op in seen or is_zero_fill(op) for op, role in spec if role == "linear"):
                seen.add(user)
                frontier.append(user)
            else:
                ends.append((node, user))
    what = f"softmax backward {describe(core)} is not multiplied by a scale softmax_grad_ext can take"
    if not ends:
        return f"{what}: its result is used by nothing softmax_grad_ext could replace"
    parts = []
    for node, user in dict.fromkeys(ends):
        if user.op == "output":
            parts.append(f"{node.name} is a graph output")
        elif is_call(user, aten.div.Tensor) and user.args[1] is node:
            parts.append(f"{describe(user)} divides by it (a divisor is no scale)")
        elif is_call(user, aten.mul.Tensor, aten.div.Tensor):
            other = _other(user.args[:2], node)
            if isinstance(other, Node) and ctx.reaches([other], seen) is not None:
                parts.append(f"{describe(user)} multiplies it by a value computed from it")
            else:
                parts.append(f"{describe(user)} multiplies it, but through ops the scale cannot move across")
        elif linear_operands(user) is not None and is_call(user, aten.add.Tensor, aten.sub.Tensor):
            other = _other(user.args[:2], node)
            term = other.name if isinstance(other, Node) else repr(other)
            parts.append(f"{describe(user)} adds {term}, which is not computed from the softmax backward (a "
                         "scale after it would scale that too)")
        else:
            parts.append(f"{describe(user)} reads it")
    return (f"{what}: {'; '.join(parts)} (softmax_grad_ext replaces a softmax backward times its scale; "
            "this one stays for the lowering)")


# -- attention taken by inductor's SDPA patterns ---------------------------------------------------
SDPA_BACKWARD = tuple(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward") if hasattr(aten, name))
USER_CODE_META = ("stack_trace", "source_fn_stack", "fwd_source_fn_stack", "nn_module_stack", "fwd_nn_module_stack")


def made_by_compiler(node: Node) -> bool:
    """node comes from no line of user code: Dynamo tags every op a user's code calls (its stack trace,
    source function, module); the ops a pattern replacement inserts carry none of that."""
    return not any(node.meta.get(key) for key in USER_CODE_META)


def _traced_neighbours(node: Node, hops: int = 4) -> list:
    """Nodes near node that carry the user's code location: downstream first (the gradients it computes
    flow into its attention's own ops; torch 2.10 leaves its outputs' getitems untraced), then either way
    (its incoming gradient comes from the caller's code)."""
    return _traced_near(node, hops, lambda n: n.users) or _traced_near(
        node, hops, lambda n: (*n.users, *n.all_input_nodes))


def _traced_near(node: Node, hops: int, neighbours) -> list:
    found, frontier, seen = [], [node], {node}
    for _ in range(hops):
        following = []
        for current in frontier:
            for near in neighbours(current):
                if near not in seen:
                    seen.add(near)
                    following.append(near)
                    if not made_by_compiler(near) and near.op == "call_function":
                        found.append(near)
        if found:
            return found
        frontier = following
    return found


def _sdpa_reason(node: Node) -> str:
    op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return (f"taken by inductor's SDPA pattern (attention fused by inductor itself): inductor's joint-graph "
            f"pattern replaced an attention's softmax and its backward by {op}, which no user code called, so "
            "no softmax backward is left for softmax_grad_ext")
