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
``[T, N, D]`` or 2-D ``[T, D]`` x is lifted to 4-D and back), static head dim, no intermediate
used outside the subgraph, the rotated tensor is the one multiplied by cos, and the op's own
argument rules (``check_rotary_mul_args``: even head dim, cos/sin broadcast to x with last dim D,
float16/bfloat16/float32), which the op checks on the call the rewrite builds.

Replacement: one ``rotary_mul(x, cos, sin, mode)``, with casts to the dtype eager
would compute in (type promotion) and unsqueezes to make cos/sin 4-D.

Backward graphs. AOTAutograd partitions before our passes run, so the backward of
a RoPE site reaches us decomposed: ``dx = g * cos + R^T(g * sin)``, R^T built by
autograd from ``slice_backward``/``slice_scatter`` (or ``cat``/``stack`` of the
grad's pieces). :func:`match_rotation_transpose` recognises it and the site becomes
``rotary_mul_backward(g, None, cos, sin, mode, need_backward=False)[0]``.
"""

import operator
from typing import Optional

import torch
from torch.fx import Node

from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, register_fusion
from ..graph_utils import VIEWS, aten, broadcasts_to, describe, is_call, rank, shape_eq, size_eq, static_int, \
    users_outside, val
from ..matchers import Rotation, match_rope_grad_site, match_rope_site


@register_fusion
class RopeFusion(FusionPass):
    """Full-width RoPE on q or k, half or interleave, -> one rotary_mul."""

    name = "rope"
    op = "rotary_mul"
    anchor_targets = (aten.add.Tensor, aten.view_as_real.default)

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        if anchor.target == aten.view_as_real.default:
            return self._match_complex(anchor)
        site = match_rope_site(anchor)
        if site is not None:
            return self._rewrite(anchor, site.rotation, x=site.x, cos=site.cos, sin=site.sin, extra=site.nodes)
        site = match_rope_grad_site(anchor)  # dx = g * cos + R^T(g * sin), in a backward graph
        if site is not None:
            return self._rewrite(anchor, site.rotation, x=site.x, cos=site.cos, sin=site.sin, extra=site.nodes,
                                 backward=True)
        return None

    def _rewrite(self, anchor: Node, rot: Rotation, x: Node, cos: Node, sin: Node,
                 extra: list, backward: bool = False) -> Rewrite:
        nodes = list(dict.fromkeys([*extra, *rot.nodes]))
        self._check(anchor, x, nodes)
        out_dtype = val(anchor).dtype
        x_rank = rank(x)

        def build(b: GraphBuilder) -> Node:
            xx, cc, ss = (b.lifted(b.cast(t, out_dtype), x_rank, LIFT[x_rank]) for t in (x, cos, sin))
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

    @staticmethod
    def _check(anchor: Node, x: Node, nodes: list) -> None:
        xv = val(x)
        if xv.dim() not in LIFT:
            raise NotFused(f"x {x.name} is {xv.dim()}-D; rotary_mul takes 4-D BSND/BNSD x "
                           "(3-D [T, N, D] and 2-D [T, D] are lifted)")
        head_dim = static_int(xv.shape[-1])
        if head_dim is None:
            raise NotFused(f"head dim of {x.name} is symbolic ({xv.shape[-1]}); rotary_mul needs a static one")
        if size_eq(xv.numel(), 0):
            raise NotFused(f"x {x.name} of shape {list(xv.shape)} is empty; nothing to fuse")
        if not shape_eq(val(anchor).shape, xv.shape):
            raise NotFused(f"result shape {list(val(anchor).shape)} differs from x shape {list(xv.shape)}")
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")

    # -- Meta's complex form ----------------------------------------------------------
    def _match_complex(self, as_real: Node) -> Optional[Rewrite]:
        prod = as_real.args[0]
        if not is_call(prod, aten.mul.Tensor) or not all(isinstance(a, Node) for a in prod.args[:2]):
            return None
        for i in (0, 1):
            as_complex, freqs = prod.args[i], prod.args[1 - i]
            if not is_call(as_complex, aten.view_as_complex.default):
                continue
            pairs = as_complex.args[0]
            if not is_call(pairs, *VIEWS):
                raise NotFused(f"{pairs.name} is not a view of x as (..., D/2, 2) pairs")
            x = pairs.args[0]
            ps, xs = val(pairs).shape, val(x).shape
            if len(ps) != len(xs) + 1 or not size_eq(ps[-1], 2) or not shape_eq(ps[:-2], xs[:-1]):
                raise NotFused(f"{pairs.name} does not split the last dim of {x.name} in pairs")
            if val(freqs).dtype != torch.complex64:
                raise NotFused(f"freqs_cis {freqs.name} has dtype {val(freqs).dtype}, expected complex64")
            return self._rewrite_complex(as_real, x, freqs, [prod, as_complex, pairs])
        return None

    def _rewrite_complex(self, anchor: Node, x: Node, freqs: Node, nodes: list) -> Rewrite:
        xv, fv = val(x), val(freqs)
        if xv.dim() not in (3, 4):
            raise NotFused(f"x {x.name} is {xv.dim()}-D; rotary_mul takes 4-D (or 3-D) x")
        if xv.dtype != torch.float32:
            raise NotFused(f"x {x.name} has dtype {xv.dtype}; view_as_complex needs float32")
        complex_shape = val(anchor.args[0]).shape
        if fv.dim() > len(complex_shape) or not broadcasts_to(fv.shape, complex_shape) or \
                not shape_eq(complex_shape, val(nodes[1]).shape):
            raise NotFused(f"freqs_cis shape {list(fv.shape)} is not broadcastable to "
                           f"x pairs shape {list(val(nodes[1]).shape)}")
        head_dim = static_int(xv.shape[-1])
        if head_dim is None:
            raise NotFused(f"head dim of {x.name} is symbolic; rotary_mul needs a static one")
        if size_eq(xv.numel(), 0):
            raise NotFused(f"x {x.name} of shape {list(xv.shape)} is empty; nothing to fuse")
        if not size_eq(fv.shape[-1], head_dim // 2):
            raise NotFused(f"freqs_cis last dim {fv.shape[-1]} != head dim / 2 = {head_dim // 2}")
        leaked = users_outside(nodes, [anchor])
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the subgraph")
        lift = xv.dim() == 3

        def build(b: GraphBuilder) -> Node:
            # a conjugate view (the backward rotates by conj(freqs_cis)) has no real view until resolved
            table = b.call(aten.resolve_conj.default, freqs) if fv.is_conj() else freqs
            parts = b.call(aten.view_as_real.default, table)  # (..., D/2, 2): cos, sin
            cos, sin = (_repeat_pairs(b, b.call(aten.select.int, parts, -1, lane)) for lane in (0, 1))
            xx = b.call(aten.unsqueeze.default, x, 0) if lift else x
            out = b.call(torch.ops.npu_fuse.rotary_mul.default, xx, b.unsqueeze_to(cos, 4), b.unsqueeze_to(sin, 4),
                         "interleave")
            if lift:
                out = b.call(aten.squeeze.dim, out, 0)
            return b.call(aten.view.default, out, _sizes(b, out, keep=xv.dim() - 1) + [head_dim // 2, 2])

        return Rewrite(anchor, nodes, self.op, build, detail="mode=interleave, complex form")


# Unsqueezes that take x to BSND: [T, N, D] -> [1, T, N, D]; [T, D] -> [1, T, 1, D].
LIFT = {4: (), 3: (0,), 2: (0, 2)}


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
