"""RMSNorm and Add+RMSNorm -> ``npu_fuse::rms_norm`` / ``npu_fuse::add_rms_norm``.

Pattern, anchored at the normalisation ``N = xf * rsqrt(mean(xf^2, -1, keepdim=True) + eps)``
(xf: x, or x cast to float32) in every spelling ``matchers.match_rms_core`` knows, then forward from
N as far as one op computes what the code does:

* a cast of N back to x's dtype (transformers' ``h.to(input_dtype)``);
* the weight, ``N * w`` with w one value per lane of the last dim and not computed from x, when the
  multiply keeps N's dtype (a float32 weight times a bfloat16 N multiplies in float32 after eager
  rounded N: that multiply stays, and the op's gamma is 1, so the result is eager's bit for bit);
* a cast after the weight to x's dtype (Gemma's ``type_as``; its ``1 + w`` is the op's gamma).

The op computes that value from x when it has x's dtype (one rounding, as the NPU kernel; eager may
round twice, within the dtype's tolerance), else from xf. Where x is ``x1 + x2`` of one shape and
dtype (the residual add before a decoder's norms) and gamma has that dtype, the add joins:
``add_rms_norm`` returns the sum as its third output for the add's other users.

Training forward graphs: the rsqrt that autograd saves for the backward is the op's rstd output;
a value the backward needs that the op does not return (the normalized value before the weight)
ends the fused chain there, and a cast of x the backward reads stays as it is.

Backward graphs are not fused (decision): AOTAutograd partitions before the passes run, so the
backward reaches them decomposed into a dozen elementwise and reduce ops
(``dx = r*g*w - x*r^3*mean(g*w*x)``, ``dw = sum(g*x*r)``), one more pattern per spelling of the
forward; the forward's rstd output is what a fused backward would read, and the op's own autograd
(``rms_norm_backward``, torch_npu's ``npu_rms_norm_backward``) serves direct calls of the op.

Constraints (near-misses): the look-alikes ``match_rms_core`` refuses (another dim, a sum, no
epsilon, the RMS of another tensor); a constant epsilon (``dynamic=True`` makes a float attribute a
graph input); no intermediate used outside; and the op's own argument rules
(``check_rms_norm_args``), which the op checks on the call the rewrite builds.

Order (``fusion.PASS_ORDER``): after ``mla_preprocess``, whose prologue holds three RMSNorms.
"""

import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Node

from ..float_inputs import RUNTIME_FLOAT
from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, register_fusion
from ..graph_utils import aten, describe, dtype_name, shape_eq, size_eq, static_int, users_outside, val
from ..matchers import RmsCore, binary_operands, match_rms_core, uncast, widens
from npu_fuse_backend.lowering.common import FLOAT_DTYPES, HALF_DTYPES


@dataclasses.dataclass
class NormChain:
    """What one op computes, from the normalisation forward: its output node, the nodes after N,
    and the weight taken as gamma (None: gamma is 1)."""

    out: Node
    nodes: list
    weight: Optional[Node] = None


def _only_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_cast_to(node: Optional[Node], dtype: torch.dtype) -> bool:
    """node is a dtype cast (as ``uncast`` strips one) to dtype."""
    return node is not None and uncast(node).casts[:1] == [node] and val(node).dtype == dtype


@register_fusion
class RmsNormFusion(FusionPass):
    """RMSNorm (with its weight and casts), or Add+RMSNorm, -> one rms_norm / add_rms_norm."""

    name = "rms_norm"
    anchor_targets = (aten.mul.Tensor, aten.div.Tensor)

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        core = match_rms_core(anchor)
        if core is None:
            return None
        if not isinstance(core.eps, (int, float)) or isinstance(core.eps, bool):
            raise NotFused(f"epsilon {describe(core.eps) if isinstance(core.eps, Node) else repr(core.eps)} is a "
                           f"runtime value ({RUNTIME_FLOAT}); the op needs a constant")
        chain = self._chain(ctx, anchor, core)
        try:
            return self._rewrite(ctx, anchor, core, chain)
        except NotFused:
            if chain.weight is None:
                raise
            # the weight is computed after a value the graph reads: fuse the normalisation alone
            return self._rewrite(ctx, anchor, core, self._chain(ctx, anchor, core, weight=False))

    # -- how far one op computes the code -------------------------------------------------------
    def _chain(self, ctx: PassContext, n: Node, core: RmsCore, weight: bool = True) -> NormChain:
        x_dtype = val(core.x).dtype
        chain = NormChain(n, [n])
        nxt = _only_user(n)
        if val(n).dtype != x_dtype and _is_cast_to(nxt, x_dtype):
            chain.out, nxt = nxt, _only_user(nxt)
            chain.nodes.append(chain.out)
        w = self._weight(ctx, nxt, chain.out, core) if weight else None
        if w is not None:
            chain.weight, chain.out, nxt = w, nxt, _only_user(nxt)
            chain.nodes.append(chain.out)
            if val(chain.out).dtype != x_dtype and _is_cast_to(nxt, x_dtype):
                chain.out = nxt
                chain.nodes.append(nxt)
        return chain

    @staticmethod
    def _weight(ctx: PassContext, mul: Optional[Node], normed: Node, core: RmsCore) -> Optional[Node]:
        """w of ``normed * w``: one value per lane of the last dim, not computed from x, the product
        keeping normed's dtype."""
        operands = binary_operands(mul, aten.mul.Tensor) if mul is not None else None
        if operands is None or val(mul).dtype != val(normed).dtype:
            return None
        w = operands[1] if operands[0] is normed else operands[0]
        if not isinstance(w, Node) or w is normed:
            return None
        shape, lanes = list(val(w).shape), val(normed).shape[-1]
        if not shape or len(shape) > val(normed).dim() or not size_eq(shape[-1], lanes) or \
                not all(size_eq(s, 1) for s in shape[:-1]):
            return None
        return None if ctx.reaches([w], {core.x}) is not None else w  # computed from x: no weight

    # -- the replacement ----------------------------------------------------------------------------
    def _rewrite(self, ctx: PassContext, n: Node, core: RmsCore, chain: NormChain) -> Rewrite:
        x, xf, out, eps = core.x, core.xf, chain.out, float(core.eps)
        if val(xf).dtype not in FLOAT_DTYPES:
            raise NotFused(f"the RMS is computed in {val(xf).dtype} ({xf.name}); the op computes it in float32")
        if val(out).dtype == val(x).dtype:
            source = x
        elif val(out).dtype == val(xf).dtype:
            source = xf
        else:
            raise NotFused(f"{out.name} is {val(out).dtype}, neither x's {val(x).dtype} nor {val(xf).dtype}: "
                           "the op returns its input's dtype")
        dtype = val(source).dtype
        gamma_dtype = self._gamma_dtype(chain.weight, dtype)
        addends = _addends(source, gamma_dtype)
        intermediates = [node for node in dict.fromkeys([*core.nodes, *chain.nodes]) if node is not out]
        if source is x and not any(u for c in core.casts for u in c.users if u not in intermediates + core.casts):
            intermediates += core.casts  # x's casts, unless the graph reads them elsewhere (for the backward)
        recomputed = None  # xf computed a second time (Cohere's x - mean), the one squared
        if core.duplicate is not None:
            intermediates.append(core.duplicate)
            if any(u not in intermediates for u in core.duplicate.users):  # read elsewhere: the replacement
                recomputed = core.duplicate  # computes it again, from its own inputs
                if any(a in intermediates for a in recomputed.all_input_nodes):
                    raise NotFused(f"{describe(recomputed)} computes {xf.name} again from the normalisation's "
                                   "intermediates")
        outputs = [out]
        if core.rstd is not None and val(core.rstd).dtype == torch.float32 and \
                any(u not in intermediates and u is not out for u in core.rstd.users):
            outputs.append(core.rstd)  # what autograd saved: the op's rstd
        if addends is not None and core.rstd in outputs and dtype in HALF_DTYPES:
            # add_rms_norm's rstd is that of the float32 sum, eager's that of the sum rounded to x's dtype:
            # a float32 value the backward reads, so the add stays and the norm of its result fuses
            addends = None
        if addends is not None:
            outputs.append(source)
        if recomputed is not None:
            outputs.append(recomputed)
        leaked = users_outside(intermediates, outputs)
        if leaked is not None:
            raise NotFused(f"intermediate {describe(leaked)} is used outside the normalisation")
        subgraph = list(dict.fromkeys([*intermediates, *outputs]))
        inputs = [*(addends or [source]), chain.weight, *(recomputed.all_input_nodes if recomputed else [])]
        anchor = self._anchor(ctx, subgraph, outputs, inputs)
        lanes = val(source).shape[-1]
        op = "add_rms_norm" if addends is not None else "rms_norm"

        def build(b: GraphBuilder) -> dict:
            size = static_int(lanes)
            size = size if size is not None else b.call(aten.sym_size.int, source, val(source).dim() - 1)
            if chain.weight is None:
                gamma = b.call(aten.full.default, [size], 1.0, dtype=gamma_dtype, device=val(source).device,
                               pin_memory=False)
            else:
                gamma = chain.weight
                if val(gamma).dim() != 1:
                    gamma = b.call(aten.view.default, gamma, [size])
                gamma = b.cast(gamma, gamma_dtype)
            if addends is not None:
                fused = b.call(torch.ops.npu_fuse.add_rms_norm.default,
                               *(b.cast(a, val(source).dtype) for a in addends), gamma, eps)
            else:
                fused = b.call(torch.ops.npu_fuse.rms_norm.default, source, gamma, eps)
            replaced = {out: b.call(operator.getitem, fused, 0)}
            if core.rstd in outputs:
                replaced[core.rstd] = b.call(operator.getitem, fused, 1)
            if addends is not None:
                replaced[source] = b.call(operator.getitem, fused, 2)
            if recomputed is not None:
                replaced[recomputed] = b.call(recomputed.target, *recomputed.args, **recomputed.kwargs)
            return replaced

        detail = ("from " + dtype_name(val(source).dtype) +
                  (", weight" if chain.weight is not None else ", no weight") +
                  (", rstd for the backward" if core.rstd in outputs else ""))
        return Rewrite(anchor, [node for node in subgraph if node is not anchor], op, build, detail=detail)

    @staticmethod
    def _gamma_dtype(weight: Optional[Node], dtype: torch.dtype) -> torch.dtype:
        """The op takes gamma in x's dtype, or float32 with a half x: a float32 weight stays one."""
        if weight is not None and dtype in HALF_DTYPES and val(weight).dtype == torch.float32:
            return torch.float32
        return dtype

    @staticmethod
    def _anchor(ctx: PassContext, subgraph: list, outputs: list, inputs: list) -> Node:
        """The first subgraph node after every input: the replacement goes before it, so it must come
        before every outside use of an output."""
        after = max((ctx.position(n) for n in inputs if isinstance(n, Node)), default=-1)
        inside = set(subgraph)
        anchor = min((n for n in subgraph if ctx.position(n) > after), key=ctx.position, default=None)
        if anchor is None:
            raise NotFused("an input of the normalisation is computed after it")
        early = [u for o in outputs for u in o.users if u not in inside and ctx.position(u) < ctx.position(anchor)]
        if early:
            raise NotFused(f"{describe(early[0])} reads an output of the normalisation before its inputs are all "
                           "computed")
        return anchor


def _addends(source: Node, gamma_dtype: torch.dtype) -> Optional[list]:
    """[x1, x2] where source is ``x1 + x2`` (no broadcast, no alpha), each of source's shape and of its
    dtype or one that widens to it exactly, and AddRmsNorm can take gamma in source's dtype; else None.
    (Under autocast a float32 residual plus a bfloat16 projection is a float32 sum: torch adds in the
    promoted dtype, so the addend cast up first gives the same sum.)"""
    operands = binary_operands(source, aten.add.Tensor)
    dtype = val(source).dtype
    if operands is None or gamma_dtype != dtype:
        return None
    if not all(isinstance(t, Node) and shape_eq(val(t).shape, val(source).shape) and
               (val(t).dtype == dtype or widens(val(t).dtype, dtype)) for t in operands):
        return None
    return list(operands)
