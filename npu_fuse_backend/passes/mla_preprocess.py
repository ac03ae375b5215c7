"""The MLA attention prologue -> ``npu_fuse::mla_preprocess`` (spec section 4, seed 003).

Pattern: DeepSeek-V2/V3 attention as serving engines write it, found from its q RoPE:

    [RMSNorm(+beta) + quantize]            x -> int8                    (w8a8 only)
    qkv = x @ wdqkv^T (or x @ wdqkv)       [T, 1536 + 512 + 64], [dequantize]
    q_c, kv = split(qkv, [1536, 576])
    q = RMSNorm(q_c)[+quant] @ wuq^T [dequant] .view(T, N, 192); q_nope, q_pe = split(q, [128, 64])
    kv_c, k_pe = split(kv, [512, 64]); ctkv = RMSNorm(kv_c)
    q_pe, k_pe = RoPE(q_pe), RoPE(k_pe)    half rotation, cos/sin [T, 64]
    q_nope = bmm(q_nope^T01, W_UK)^T01     weight absorption
    cache.view(-1, 576)[slots] = cat(ctkv, k_pe)   index_put / index_copy / scatter
    q_out = cat(q_nope, q_pe)              [T, N, 576]

RoPE may also be DeepSeek's reference "interleaved" form, which de-interleaves the pairs
(``view(.., 32, 2).transpose(-1, -2).reshape``) before a half rotation: the fusion then
permutes the rope rows of wdqkv and wuq (and their descale/bias) the same way, so the
op's half rotation computes exactly the same values. Weights kept ``[in, out]`` (``x @ w``)
are handed to the op transposed.

Replacement: one ``mla_preprocess`` (KVCACHE mode; quant_mode 0 or unquantized) whose
q_out replaces the final cat and whose updated cache replaces the written cache.

Every candidate (a half RoPE on the tail of a [T, N, D] head) ends as a fusion or as a
near-miss naming the stage and the value that broke it: a missing stage (training-style
code such as Hugging Face's DeepSeek attention: no fused wdqkv split, no cache write, no
absorption), a size the op does not take, a dtype, a write flag that changes the meaning
(``accumulate=True``), or an argument the op's contract refuses. Its RoPE sites then stay
for the RoPE fusions. Slots keep eager's meaning: ``index_put`` reads them as Python
indexes, as the op does; ``index_copy_``/``scatter_`` refuse negative ones, so those become
an out-of-range slot the op refuses too. What each SoC's lowering accepts is checked by the
pass manager against the op's ``@soc_limits``.
"""

import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Node

from .. import rotation
from ..float_inputs import RUNTIME_FLOAT
from ..fusion import FakeValues, FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, check_op_args, \
    register_fusion
from ..graph_utils import VIEWS, aten, dtype_name, is_call, rank, shape_eq, static_int, users_outside, val
from npu_fuse_backend.lowering.ops import mla_preprocess as mla
from ..matchers import RmsNorm, Stripped, binary_operands, last_dim_piece, match_rms_norm, uncast


# -- the prologue's own matchers: projections (x @ w^T, w8a8), last-dim pieces, transposes ----------
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
    cast = uncast(node)
    casts, clamped = cast.casts, _int8_clamped(cast.node)
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


@dataclasses.dataclass
class Weight:
    """The right operand of a 2-D matmul: ``w.t()`` (w stored [out, in]) or a plain 2-D w ([in, out])."""

    w: Node
    in_out: bool
    nodes: list  # the transpose, if any


def _weight(node) -> Optional[Weight]:
    if transposed(node) is not None:
        return Weight(transposed(node), False, [node])
    if rank(node) == 2:
        return Weight(node, True, [])
    return None


def match_linear(node) -> Optional[Linear]:
    cast = uncast(node)
    out, casts = cast.node, cast.casts
    if is_call(out, aten.mm.default):
        weight = _weight(out.args[1])
        if weight is None:
            return None
        return Linear(out.args[0], weight.w, None, [*casts, out, *weight.nodes], weight.in_out)
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
        return Linear(quant.y, weight.w, QuantLinear(quant, bias, descale),
                      [*casts, out, *acc.casts, acc.node, int_mm, *weight.nodes, *quant.nodes], weight.in_out)
    return None


@dataclasses.dataclass
class PieceUse:
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



def swaps_01(node) -> bool:
    """x.transpose(0, 1) of a 3-D x (``permute(x, [1, 0, 2])`` after inductor's decompositions)."""
    if rank(node) != 3:
        return False
    if is_call(node, aten.transpose.int):
        return sorted(d % 3 for d in node.args[1:3]) == [0, 1]
    return is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0, 2]



@dataclasses.dataclass
class KvPieces:
    """Stage 6's split of the kv latent: ctkv [512] and k_rope [64]."""

    ctkv: Node
    k_rope: Node
    nodes: list


@dataclasses.dataclass
class NormOf:
    """An RMSNorm found downstream of its input, and the node that outputs it."""

    norm: RmsNorm
    out: Node


@dataclasses.dataclass
class KvRope:
    """The k RoPE stage: its output add, its nodes and the [T, 64] tables it shares with q."""

    out: Node
    nodes: list
    cos: Node
    sin: Node


@dataclasses.dataclass
class CacheWrite:
    """``cache.view(-1, 576)[slots] = rows`` and the updated cache it produces."""

    cache: Node
    slots: Node
    python_indexes: bool  # index_put: a negative slot counts from the end; index_copy/scatter refuse it
    new_cache: Node
    nodes: list


@dataclasses.dataclass
class Absorption:
    """``q_out = cat(bmm(q_nope^T01, W_UK)^T01, q_rope)``."""

    q_out: Node
    w_uk: Node
    nodes: list


@dataclasses.dataclass
class Prologue:
    """Everything the replacement needs, stage by stage."""

    x: Node
    norm0: Optional[RmsNorm]
    norm1: RmsNorm
    ctkv: RmsNorm
    qkv_lin: Linear
    q_lin: Linear
    w_uk: Node
    cos: Node
    sin: Node
    cache: Node
    slots: Node
    python_indexes: bool
    heads: int
    eps: float
    permute: bool  # DeepSeek's interleaved RoPE: the rope rows of the weights are permuted

    def inputs(self) -> list:
        """Every graph value the replacement reads."""
        nodes = [self.x, self.w_uk, self.cos, self.sin, self.cache, self.slots]
        for norm in (self.norm0, self.norm1, self.ctkv):
            if norm:
                nodes += [n for n in (norm.gamma, norm.beta) if n is not None]
        for lin in (self.qkv_lin, self.q_lin):
            nodes.append(lin.w)
            if lin.quant:
                q = lin.quant
                nodes += [q.quantize.scale, q.quantize.offset, q.bias, q.descale]
        return [n for n in nodes if isinstance(n, Node)]


def _piece_of(node, size: int):
    """A step-1 last-dim piece of a tensor whose last dim is ``size``."""
    piece = last_dim_piece(node)
    if piece is None or piece.step != 1 or static_int(val(piece.source).shape[-1]) != size:
        return None
    return piece


@register_fusion
class MlaPreprocessFusion(FusionPass):
    """DeepSeek MLA prologue (projections, norms, RoPE, absorption, cache write) -> one op."""

    name = "mla_preprocess"
    op = "mla_preprocess"
    anchor_targets = (aten.add.Tensor,)

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        site = rotation.analysis(ctx).rotation_at(anchor)
        if site is None or site.passthrough or site.backward or site.lead_perm:
            return None  # (the RoPE passes report a RoPE site's near-miss)
        q3 = site.x
        width = static_int(val(q3).shape[-1])
        if rank(q3) != 3 or width is None or not 0 < site.start < site.end == width:
            return None  # not the rope tail of a [T, N, nope + rope] q head
        if site.form == rotation.INTERLEAVE:
            raise NotFused("stage 7: the q RoPE rotates interleaved pairs (x[2k], x[2k+1]); the op rotates "
                           "halves (DeepSeek's de-interleave-then-rotate-halves form fuses)")
        if site.form not in (rotation.HALF, rotation.PAIRS_TO_HALF):
            return None
        return self._match(ctx, anchor, site)

    def _match(self, ctx, q_rope_add, q_site: rotation.Rotation) -> Rewrite:
        q3 = q_site.x
        nodes = [q_rope_add, *q_site.nodes]
        permuted = q_site.form == rotation.PAIRS_TO_HALF
        nope, rope = q_site.start, q_site.width
        if rope != mla.ROPE:
            raise NotFused(f"stage 7: q rope dim {rope} (of a {nope + rope}-wide q head); the op takes {mla.ROPE}")
        if nope != mla.NOPE:
            raise NotFused(f"stage 5: q nope dim {nope} (of a {nope + rope}-wide q head); the op takes {mla.NOPE}")
        heads = static_int(val(q3).shape[1])
        if heads is None:
            raise NotFused(f"stage 5: the head count {val(q3).shape[1]} is symbolic; the op needs a static one")
        if not is_call(q3, *VIEWS):
            raise NotFused(f"stage 5: q {list(val(q3).shape)} is not a view of the q_b projection")
        q_lin = match_linear(q3.args[0])
        if q_lin is None:
            raise NotFused("stage 5 (q_b projection x @ wuq^T or x @ wuq) not found")
        norm1 = match_rms_norm(q_lin.x)
        if norm1 is None:
            raise NotFused("stage 4 (RMSNorm over the last dim of the q latent) not found")
        q_c = last_dim_piece(norm1.x)
        if q_c is None or q_c.step != 1 or q_c.start != 0:
            raise NotFused("stages 2-3 (the q latent as the first part of a fused wdqkv projection) not found")
        if q_c.end != mla.Q_LORA:
            raise NotFused(f"stage 3: q latent width {q_c.end}; the op takes {mla.Q_LORA}")
        qkv = q_c.source
        qkv_width = static_int(val(qkv).shape[-1])
        if qkv_width != mla.QKV:
            raise NotFused(f"stage 2: fused wdqkv projection width {qkv_width}; the op takes {mla.QKV} "
                           f"({mla.Q_LORA} + {mla.KV_LORA} + {mla.ROPE})")
        qkv_lin = match_linear(qkv)
        if qkv_lin is None:
            raise NotFused("stage 2 (x @ wdqkv^T or x @ wdqkv) not found")
        quantized = qkv_lin.quant is not None
        if quantized != (q_lin.quant is not None):
            raise NotFused("one projection is quantized and the other is not")
        norm0 = match_rms_norm(qkv_lin.x) if quantized else None
        if quantized and norm0 is None:
            raise NotFused("stage 1 (input RMSNorm before quantization) not found")
        nodes += [q3, *q_lin.nodes, *norm1.nodes, *q_c.nodes, *qkv_lin.nodes] + (norm0.nodes if norm0 else [])
        kv = self._kv_pieces(qkv)
        kv_c, k_pe, kv_nodes = kv.ctkv, kv.k_rope, kv.nodes
        ctkv_norm = self._consumer_norm(kv_c)
        ctkv, ctkv_out = ctkv_norm.norm, ctkv_norm.out
        if ctkv.beta is not None:
            raise NotFused("the kv-latent RMSNorm adds a beta; the op's stage 6 has only gamma2")
        k_rope = self._k_rope(ctx, qkv, kv_nodes, k_pe, q_site)
        cache_write = self._cache_write(ctkv_out, k_rope.out)
        absorbed = self._absorption(q3, q_rope_add)
        nodes += [*kv_nodes, *ctkv.nodes, ctkv_out, *k_rope.nodes, *cache_write.nodes, *absorbed.nodes]
        eps = {norm1.eps, ctkv.eps} | ({norm0.eps} if norm0 else set())
        if not all(isinstance(e, float) for e in eps):
            raise NotFused(f"an RMSNorm eps is a runtime value ({RUNTIME_FLOAT}); the op needs a constant")
        if len(eps) != 1:
            raise NotFused(f"the RMSNorms use different eps {sorted(eps)}; the op has one")
        q_out = absorbed.q_out
        x = norm0.x if norm0 else qkv_lin.x
        if (val(qkv_lin.w).dtype == val(x).dtype) == quantized:
            raise NotFused(f"wdqkv dtype {val(qkv_lin.w).dtype} does not fit the {val(x).dtype} input")
        leaked = users_outside(nodes, [q_out, cache_write.new_cache])
        if leaked is not None:
            raise NotFused(f"intermediate {leaked.name} is used outside the prologue (by "
                           f"{', '.join(u.name for u in leaked.users if u not in nodes)})")
        prologue = Prologue(x=x, norm0=norm0, norm1=norm1, ctkv=ctkv, qkv_lin=qkv_lin, q_lin=q_lin,
                            w_uk=absorbed.w_uk, cos=k_rope.cos, sin=k_rope.sin, cache=cache_write.cache,
                            slots=cache_write.slots, python_indexes=cache_write.python_indexes, heads=heads,
                            eps=eps.pop(), permute=permuted)
        arguments = {name: val(value) for name, value in _op_arguments(FakeValues(ctx.fake_mode), prologue).items()}
        check_op_args(mla.check_mla_preprocess_args, mla.bind_args((), arguments))
        anchor = min([q_out, cache_write.new_cache], key=ctx.position)
        late = [n for n in prologue.inputs() if ctx.position(n) > ctx.position(anchor)]
        if late:
            raise NotFused(f"{late[0].name} is computed after the prologue's outputs")
        others = [n for n in (q_out, cache_write.new_cache) if n is not anchor]

        def build(b: GraphBuilder) -> dict:
            return _build(b, prologue, q_out, cache_write.new_cache)

        detail = ("w8a8" if quantized else dtype_name(val(x).dtype)) + \
            (", interleaved rope" if permuted else "") + \
            (", [in, out] weights" if qkv_lin.in_out or q_lin.in_out else "")
        return Rewrite(anchor, list(dict.fromkeys([*nodes, *others])), self.op, build, detail=detail)

    # -- stages ----------------------------------------------------------------------
    @staticmethod
    def _kv_pieces(qkv) -> "KvPieces":
        kv = pieces_of(qkv).get((mla.Q_LORA, mla.QKV))
        if kv is None:
            raise NotFused("stage 3 (kv part [1536:2112] of qkv) not found")
        pieces = pieces_of(kv.node)
        kv_c, k_pe = pieces.get((0, mla.KV_LORA)), pieces.get((mla.KV_LORA, mla.KV_LORA + mla.ROPE))
        if kv_c is None or k_pe is None:
            raise NotFused("stage 6 (kv split into ctkv [512] and k_rope [64]) not found")
        return KvPieces(kv_c.node, k_pe.node, [*kv.nodes, *kv_c.nodes, *k_pe.nodes])

    @staticmethod
    def _consumer_norm(node) -> "NormOf":
        """The RmsNorm of node: its output is a few nodes downstream of its input."""
        seen, frontier = set(), [node]
        for _ in range(12):
            nxt = []
            for n in frontier:
                for user in n.users:
                    if user in seen:
                        continue
                    seen.add(user)
                    found = match_rms_norm(user)
                    if found is not None and found.x is node:
                        return NormOf(found, user)
                    nxt.append(user)
            frontier = nxt
        raise NotFused("stage 6 (RMSNorm over the last dim of the kv latent) not found")

    @staticmethod
    def _k_rope(ctx, qkv, kv_nodes, k_pe, q_site: rotation.Rotation) -> KvRope:
        """The RoPE of k_pe (lanes [2048, 2112) of the fused projection), in q's form and tables."""
        kv = kv_nodes[0]
        lanes = {uncast(qkv).node: (mla.QKV - mla.ROPE, mla.QKV), kv: (mla.KV_LORA, mla.KV_LORA + mla.ROPE),
                 k_pe: (0, mla.ROPE)}
        for site in rotation.analysis(ctx).rotations():
            if not (lanes.get(uncast(site.x).node) == (site.start, site.end)
                    and site.form == q_site.form and not site.passthrough and not site.backward):
                continue
            tables = [_table_root(t.leaf()) for t in (*site.tables, *q_site.tables)]
            if None in tables:
                raise NotFused("the RoPE tables are not one [T, 64] cos and sin row per token")
            cos, sin, q_cos, q_sin = tables
            if cos is not q_cos or sin is not q_sin:
                raise NotFused("q and k RoPE use different cos/sin tables")
            tokens = val(k_pe).shape[0]
            for table, which, expected in ((cos, "the", [tokens, mla.ROPE]), (sin, "the", [tokens, mla.ROPE]),
                                           (q_site.tables[0].leaf(), "q", [tokens, 1, mla.ROPE]),
                                           (q_site.tables[1].leaf(), "q", [tokens, 1, mla.ROPE]),
                                           (site.tables[0].leaf(), "k", [tokens, mla.ROPE]),
                                           (site.tables[1].leaf(), "k", [tokens, mla.ROPE])):
                if not shape_eq(list(val(table).shape), expected):
                    raise NotFused(f"{which} RoPE table {table.name} has shape {list(val(table).shape)}, "
                                   f"not {expected}: cos/sin must be one [T, 64] row per token")
            return KvRope(site.anchor, [site.anchor, *site.nodes], cos, sin)
        raise NotFused("stage 7 (RoPE of k_rope, in the same layout as q's) not found")

    @staticmethod
    def _cache_write(ctkv_out, k_rope_out) -> CacheWrite:
        reason = None
        for cat in ctkv_out.users:
            if not (is_call(cat, aten.cat.default) and list(cat.args[0]) == [ctkv_out, k_rope_out]):
                continue
            values = [cat] + [v for v in cat.users if _drops_unit_token_dim(v, cat)]  # T = 1: view(cat, [576])
            for value in values:
                for write in value.users:
                    try:
                        found = _written_cache(write, value)
                    except NotFused as miss:
                        reason = reason or str(miss)
                        continue
                    if found is not None:
                        found.nodes = list(dict.fromkeys([cat, value, write, *found.nodes]))
                        return found
        raise NotFused(reason or "stage 9 (KV-cache write of cat(ctkv, k_rope) at slot_mapping) not found")

    @staticmethod
    def _absorption(q3, q_rope_add) -> Absorption:
        for q_out in q_rope_add.users:
            if not (is_call(q_out, aten.cat.default) and len(q_out.args[0]) == 2 and q_out.args[0][1] is q_rope_add):
                continue
            back = q_out.args[0][0]
            cast = uncast(back)
            if cast.casts and swaps_01(cast.node) and is_call(cast.node.args[0], aten.bmm.default):
                raise NotFused(f"stage 8: the absorbed q_nope ({dtype_name(val(cast.node).dtype)}) is cast to "
                               f"{dtype_name(val(back).dtype)} before its cat with q_rope (autocast over a "
                               f"{dtype_name(val(back).dtype)} model?); the op's outputs are in its input's dtype")
            if not swaps_01(back):
                continue
            bmm = back.args[0]
            if not is_call(bmm, aten.bmm.default):
                continue
            front, w_uk = bmm.args
            if not swaps_01(front):
                continue
            q_nope = _piece_of(front.args[0], mla.NOPE + mla.ROPE)
            if q_nope is None or q_nope.source is not q3 or (q_nope.start, q_nope.end) != (0, mla.NOPE):
                continue
            if list(val(w_uk).shape) != [val(q3).shape[1], mla.NOPE, mla.KV_LORA]:
                raise NotFused(f"stage 8: W_UK shape {list(val(w_uk).shape)} is not [N, 128, 512]")
            return Absorption(q_out, w_uk, [q_out, back, bmm, front, *q_nope.nodes])
        raise NotFused("stage 8 (weight absorption q_nope @ W_UK, then cat with q_rope) not found")


def _table_root(node):
    while is_call(node, aten.unsqueeze.default):
        node = node.args[0]
    return node


def _drops_unit_token_dim(view, cat) -> bool:
    """view(cat, [576]) of a [1, 576] cat: what a one-token write's value becomes."""
    shape = list(val(cat).shape)
    return is_call(view, *VIEWS) and shape[0] == 1 and list(val(view).shape) == shape[1:]


def _index_put_accumulates(write) -> bool:
    return bool(write.args[3] if len(write.args) > 3 else write.kwargs.get("accumulate", False))


def _written_cache(write, value) -> Optional[CacheWrite]:
    """The cache a write of ``value`` into ``cache.view(-1, D)`` at slots updates; NotFused for a
    write whose meaning is not an overwrite of whole rows."""
    if is_call(write, aten.index_put.default) and write.args[2] is value:
        if len(write.args[1]) != 1 or write.args[1][0] is None:
            return None
        if _index_put_accumulates(write):
            raise NotFused(f"stage 9: {write.name} adds into the cache (index_put with accumulate=True); "
                           "the op overwrites")
        flat, slots, python_indexes = write.args[0], write.args[1][0], True
    elif is_call(write, aten.index_copy.default) and write.args[1] == 0 and write.args[3] is value:
        flat, slots, python_indexes = write.args[0], write.args[2], False
    elif is_call(write, aten.scatter.src) and write.args[1] == 0 and write.args[3] is value:
        index = write.args[2]  # slots.unsqueeze(-1).expand(-1, D): every column of a slot's row
        if not (is_call(index, aten.expand.default) and is_call(index.args[0], aten.unsqueeze.default)
                and rank(index.args[0]) == 2 and index.args[0].args[1] in (1, -1)
                and shape_eq(val(index).shape, val(value).shape)):
            raise NotFused(f"stage 9: {write.name} scatters with an index that is not one slot per token "
                           "for every column")
        flat, slots, python_indexes = write.args[0], index.args[0].args[0], False
    else:
        return None
    if not (is_call(flat, *VIEWS) and rank(flat.args[0]) == 4 and rank(flat) == 2):
        return None
    cache = flat.args[0]
    if list(val(cache).shape[2:]) != [1, mla.KV_LORA + mla.ROPE]:
        raise NotFused(f"stage 9: cache {list(val(cache).shape)} is not [blocks, block_size, 1, 576]")
    if rank(slots) != 1:
        raise NotFused(f"stage 9: slots {list(val(slots).shape)} are not one per token")
    new_cache = [u for u in write.users if is_call(u, *VIEWS) and shape_eq(val(u).shape, val(cache).shape)]
    if len(new_cache) != 1 or len(write.users) != 1:
        return None
    nodes = [flat, new_cache[0]]
    if is_call(write, aten.scatter.src):
        nodes += [write.args[2], write.args[2].args[0]]
    return CacheWrite(cache, slots, python_indexes, new_cache[0], nodes)


def _op_arguments(b, p: Prologue) -> dict:
    """The op's arguments by name (nodes of the graph, or what ``b`` builds: a GraphBuilder, or
    FakeValues to check them at match time)."""
    x = p.x
    dtype, device = val(x).dtype, val(x).device

    def full(shape, value, dtype_):
        return b.call(aten.full.default, shape, value, dtype=dtype_, device=device, pin_memory=False)

    def out_in(lin: Linear):  # the op takes [out, in] weights
        return b.call(aten.t.default, lin.w) if lin.in_out else lin.w

    quant0, quant1 = p.qkv_lin.quant, p.q_lin.quant
    wdqkv, wuq = out_in(p.qkv_lin), out_in(p.q_lin)
    descale0 = quant0.descale if quant0 else full([mla.QKV], 1.0, torch.float32)
    descale1 = quant1.descale if quant1 else full([p.heads * 192], 1.0, torch.float32)
    bias0, bias1 = (quant0.bias if quant0 else None), (quant1.bias if quant1 else None)
    if p.permute:  # the op rotates halves: put each rope part's pairs in half layout first
        rows0 = _rope_rows(b, device, mla.QKV, 1, mla.Q_LORA + mla.KV_LORA)
        rows1 = _rope_rows(b, device, mla.NOPE + mla.ROPE, p.heads, mla.NOPE)
        # aten.index (not index_select): inductor lowers it after its decompositions have run
        wdqkv, wuq = (b.call(aten.index.Tensor, w, [rows]) for w, rows in ((wdqkv, rows0), (wuq, rows1)))
        if quant0:
            descale0, bias0 = (b.call(aten.index.Tensor, t, [rows0]) for t in (descale0, bias0))
            descale1, bias1 = (b.call(aten.index.Tensor, t, [rows1]) for t in (descale1, bias1))
    hidden = val(x).shape[-1]
    slots = p.slots
    if not p.python_indexes:  # index_copy_/scatter_ refuse a negative slot: make it one the op refuses
        slot_count = val(p.cache).shape[0] * val(p.cache).shape[1]
        slots = b.call(aten.masked_fill.Scalar, slots, b.call(aten.lt.Scalar, slots, 0), slot_count)
    arguments = dict(
        input=x, wdqkv=wdqkv, descale0=descale0, gamma1=p.norm1.gamma, wuq=wuq, descale1=descale1,
        gamma2=p.ctkv.gamma, cos=p.cos, sin=p.sin, wuk=p.w_uk, kv_cache=p.cache, slotmapping=slots,
        # the unquantized path skips stage 1, whose gamma0/beta0 the op then never reads
        gamma0=p.norm0.gamma if p.norm0 else full([hidden], 1.0, dtype),
        beta0=p.norm0.beta if p.norm0 and p.norm0.beta is not None else full([hidden], 0.0, dtype),
        beta1=p.norm1.beta if p.norm1.beta is not None else full([mla.Q_LORA], 0.0, dtype),
        # unused in KVCACHE mode; its (zero-byte) copy keeps a plain dtype
        kv_cache_rope=full([0], 0.0, torch.float32),
        cache_mode=mla.KVCACHE, quant_mode=mla.PER_TENSOR_QUANT_ASYMM, epsilon=p.eps)
    if quant0:
        arguments.update(quant_scale0=quant0.quantize.scale, quant_offset0=quant0.quantize.offset, bias0=bias0,
                         quant_scale1=quant1.quantize.scale, quant_offset1=quant1.quantize.offset, bias1=bias1)
    return arguments


def _build(b: GraphBuilder, p: Prologue, q_out: Node, new_cache: Node) -> dict:
    arguments = _op_arguments(b, p)
    caches = [arguments.pop("kv_cache"), arguments.pop("kv_cache_rope")]  # mutated: the bases
    fused = b.call(torch.ops.higher_order.auto_functionalized_v2, torch.ops.npu_fuse.mla_preprocess.default,
                   **arguments, _kv_cache_base_index=0, _kv_cache_rope_base_index=1, _all_bases=caches)
    return {q_out: b.call(operator.getitem, fused, 0), new_cache: b.call(operator.getitem, fused, 2)}


def _rope_rows(b: GraphBuilder, device, block: int, count: int, rope_at: int) -> Node:
    """Row indices of ``count`` blocks of ``block`` rows, each block's rope rows
    [rope_at, rope_at + 64) reordered from pairs (2k, 2k+1) to halves (evens, then odds)."""
    def arange(start, end, step=1):
        return b.call(aten.arange.start_step, start, end, step, dtype=torch.int64, device=device)

    within = b.call(aten.cat.default, [arange(0, rope_at), arange(rope_at, rope_at + mla.ROPE, 2),
                                       arange(rope_at + 1, rope_at + mla.ROPE, 2), arange(rope_at + mla.ROPE, block)])
    starts = b.call(aten.mul.Tensor, arange(0, count), block)
    rows = b.call(aten.add.Tensor, b.call(aten.unsqueeze.default, starts, 1), b.call(aten.unsqueeze.default, within, 0))
    return b.call(aten.view.default, rows, [count * block])
