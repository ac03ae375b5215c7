"""Softmax backward with a scale -> ``npu_fuse::softmax_grad_ext`` (spec section 3, seed 004).

Pattern, anchored at the final multiply ``y`` (operands of every commutative op in
any order; ``x2`` a Python scalar, a scalar-like tensor, or a tensor of grad's shape):

* v1: ``y = (x2 * x1) * sub``            with ``sub = grad - sum(grad * x1, -1, keepdim)``
* v2: ``y = (x1 * sub) * x2``
* decomposed ``_softmax_backward_data``: ``y = (m0 - x1 * sum(m0, -1, keepdim)) * x2``, ``m0 = grad * x1``,
  or with ``fma(-x1, sum(m0), m0)`` for the Sub, as inductor's decompositions write it
* training graphs: ``y = _softmax_backward_data(grad, x1, -1, dtype) * x2`` (or ``/ scale``).
* any of these with layout-only ops (views, clones, copies into a fresh buffer) between the
  chain and its scale, as Falcon's in-place ``scores /= sqrt(d)`` leaves them in the backward
  graph (with the copies that write ``y`` back into the view); the result is viewed back to
  ``y``'s shape, which must be contiguous. A scale expanded from one element is that element.

Constraints (each failure is a near-miss with its reason): the op's own argument rules
(``check_softmax_grad_ext_args``: reduction over the last dim with keepdim, grad and x1 of
equal shape, rank 1..6, not empty, one float dtype, x2 scalar-like or grad's shape), asked
of the op on the arguments the replacement gives it; static shapes; a number scale that stays
a normal number in grad's dtype; the first Mul and the Sub share grad and both Muls share x1 (by
construction of the match; ``sum - grad`` is different math and never matches); no intermediate
used outside the chain; no rewrite that would make the fused op depend on its own output. The
SoC limit (the GE op exists on Ascend950 only) is the op's ``unavailable_on``.
"""

import dataclasses
import math
from typing import Any, Optional

import torch
from torch.fx import Node

from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, check_op_args, register_fusion
from ..graph_utils import VIEWS, aten, describe, is_call, shape_eq, static_int, users_outside, val
from ..matchers import binary_operands
from npu_fuse_backend.lowering.ops.softmax_grad import check_softmax_grad_ext_args

Scalar = (int, float)


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
    """``sum(a * b, dims, keepdim)``."""

    product: Node
    dims: list
    keepdim: bool


def sum_of_product(node) -> Optional[ReducedProduct]:
    if not is_call(node, aten.sum.dim_IntList) or node.kwargs.get("dtype") is not None:
        return None
    product = node.args[0]
    if binary_operands(product, aten.mul.Tensor) is None or not all(isinstance(a, Node) for a in product.args):
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
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


def _leading_ones_of(shape, base) -> bool:
    """shape is base with zero or more leading 1s (what a one-element x2 of higher rank makes)."""
    extra = len(shape) - len(base)
    return extra >= 0 and list(shape[extra:]) == list(base) and all(s == 1 for s in shape[:extra])


def _shape_of(x2) -> str:
    return str(list(x2.shape)) if isinstance(x2, torch.Tensor) else "a number"


@dataclasses.dataclass
class SoftmaxBackward:
    """A matched chain: ``x2 * x1 * (grad - sum(grad * x1, dims, keepdim))``."""

    grad: Node
    x1: Node
    x2: Any  # a node, or a Python scalar
    nodes: list
    dims: list
    keepdim: bool
    scale_inverted: bool = False  # y = softmax_backward / x2
    form: str = "decomposed chain"
    layout: Optional[LayoutPath] = None  # layout-only ops between the chain and the scale

    def __post_init__(self):
        self.nodes = list(dict.fromkeys(self.nodes))


@register_fusion
class SoftmaxGradFusion(FusionPass):
    """Mul -> ReduceSum -> Sub -> Mul -> Mul, or softmax backward * scale -> softmax_grad_ext."""

    name = "softmax_grad"
    op = "softmax_grad_ext"
    anchor_targets = (aten.mul.Tensor, aten.div.Tensor)

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        if len(anchor.args) != 2:
            return None
        chain = self._match_softmax_backward_data(anchor) or self._match_decomposed(anchor) or \
            self._match_through_layout(anchor)
        return self._check_and_rewrite(ctx, anchor, chain) if chain is not None else None

    # -- patterns ---------------------------------------------------------------------
    def _match_through_layout(self, y: Node) -> Optional[SoftmaxBackward]:
        """A chain whose result reaches the scale through layout-only ops."""
        for i, operand in enumerate(y.args):
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
        for sbd, x2 in (args, args[::-1]):
            if not is_call(sbd, aten._softmax_backward_data.default):
                continue
            if y.target == aten.div.Tensor and (sbd is not args[0] or not isinstance(x2, Scalar)):
                return None
            grad, x1, dim = sbd.args[:3]
            return SoftmaxBackward(grad, x1, x2, [sbd], [dim], True, scale_inverted=y.target == aten.div.Tensor,
                                   form="softmax_backward_data")
        return None

    def _match_decomposed(self, y: Node, args: Optional[tuple] = None) -> Optional[SoftmaxBackward]:
        if y.target != aten.mul.Tensor:
            return None
        args = y.args if args is None else args
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
            if is_call(a, torch.ops.prims.fma.default):
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
        return SoftmaxBackward(grad, x1, x2, [fma, neg_x1, total, m0], reduced.dims, reduced.keepdim)

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
            return SoftmaxBackward(grad, x1, x2, [*extra, sub, total, reduced.product], reduced.dims,
                                   reduced.keepdim)
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
            return SoftmaxBackward(grad, x1, x2, [sub, scaled, total, m0], reduced.dims, reduced.keepdim)
        return None

    # -- constraints and replacement ------------------------------------------------------
    def _check_and_rewrite(self, ctx: PassContext, y: Node, chain: SoftmaxBackward) -> Rewrite:
        chain.x2 = scalar_like(chain.x2)
        copies = written_back(y, chain.layout) if chain.layout else []
        self._check(ctx, y, chain, copies)
        grad, x1, x2 = chain.grad, chain.x1, chain.x2
        dtype = val(grad).dtype

        def build(b: GraphBuilder) -> Node:
            if isinstance(x2, Node):
                scale = x2
                if val(scale).numel() == 1 and tuple(val(scale).shape) not in ((), (1,)):
                    scale = b.call(aten.view.default, scale, [1])
            else:
                scale = b.call(aten.full.default, [1], _scale_value(x2, chain.scale_inverted), dtype=dtype,
                               device=val(grad).device,
                               pin_memory=False)
            out = b.call(torch.ops.npu_fuse.softmax_grad_ext.default, grad, x1, scale, [-1], True)
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
        for name, t in (("grad", grad), ("x1", x1)) + ((("x2", x2),) if isinstance(x2, torch.Tensor) else ()):
            symbolic = [s for s in t.shape if static_int(s) is None]
            if symbolic:
                raise NotFused(f"{name} has symbolic dim {symbolic[0]}: SoftmaxGradExt needs static shapes")
        if not isinstance(x2, torch.Tensor):
            if not isinstance(chain.x2, Scalar) or isinstance(chain.x2, bool):
                raise NotFused(f"x2 {chain.x2!r} is not a number or tensor")
            _check_scalar_scale(chain.x2, chain.scale_inverted, grad.dtype)
        with ctx.fake_mode:  # the scale as the replacement passes it: one element as [1], a number as a tensor
            if not isinstance(x2, torch.Tensor):
                scale = torch.empty(1, dtype=grad.dtype, device=grad.device)
            else:
                scale = x2.view(1) if x2.numel() == 1 and tuple(x2.shape) not in ((), (1,)) else x2
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
        leaked = users_outside(chain.nodes, [y, *copies])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")

    @staticmethod
    def _depends_on_chain(ctx: PassContext, chain: SoftmaxBackward) -> Optional[Node]:
        """The chain node x2 is computed from, if any (walks back only past the chain's start)."""
        if not isinstance(chain.x2, Node):
            return None
        start = min(ctx.position(n) for n in chain.nodes)
        inside = set(chain.nodes)
        stack, seen = [chain.x2], set()
        while stack:
            node = stack.pop()
            if node in inside:
                return node
            if node in seen or ctx.position(node) < start:
                continue
            seen.add(node)
            stack.extend(node.all_input_nodes)
        return None
