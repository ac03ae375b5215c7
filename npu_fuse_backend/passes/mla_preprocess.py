"""The MLA attention prologue -> ``npu_fuse::mla_preprocess`` (spec section 4, seed 003).

Pattern: DeepSeek-V2/V3 attention as serving engines write it, found from its q RoPE:

    [RMSNorm(+beta) + quantize]            x -> int8                    (w8a8 only)
    qkv = x @ wdqkv^T [dequantize]         [T, 1536 + 512 + 64]
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
op's half rotation computes exactly the same values.

Replacement: one ``mla_preprocess`` (KVCACHE mode; quant_mode 0 or unquantized) whose
q_out replaces the final cat and whose updated cache replaces the written cache.

A candidate with a stage missing (no fused wdqkv split, no cache write, no absorption,
as in training-style code such as Hugging Face's DeepSeek attention) is a near-miss
naming the stage; its RoPE sites stay for the RoPE fusions. Under a named SoC the NPU
op's limits are gates: Ascend910B family only, at most 1024 tokens, block size in
[1, 128] or 256, hidden 7168 (native) or 2048..8192 (aclnn path).
"""

import operator
from typing import Optional

import torch
from torch.fx import Node

from ..lowering.ops import mla_preprocess as mla

from ..fusion import FusionPass, GraphBuilder, PassContext, Rewrite, register_fusion
from ..soc import A2_A3, GENERIC
from .graph_utils import VIEWS, aten, is_call, rank, shape_eq, static_int, users_outside, val
from .rope import RopeSite, _last_dim_piece, match_rope_site

CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _uncast(node):
    """(node without dtype casts, the casts)."""
    casts = []
    while is_call(node, *CASTS) and set(node.kwargs) <= {"dtype", "layout", "device"}:
        casts.append(node)
        node = node.args[0]
    return node, casts


def _operands(node, target) -> Optional[tuple]:
    return tuple(node.args[:2]) if is_call(node, target) and len(node.args) == 2 else None


def match_rms_norm(node) -> Optional[dict]:
    """x * rsqrt(mean(x^2) + eps) * gamma [+ beta], with the casts around it."""
    out, nodes = _uncast(node)
    nodes, beta = list(nodes), None
    added = _operands(out, aten.add.Tensor)
    if added is not None:
        for a, b in (added, added[::-1]):
            b_root, b_casts = _uncast(b)
            if isinstance(b_root, Node) and rank(b_root) == 1:
                beta, nodes = b_root, [*nodes, out, *b_casts]
                out = a
                break
        else:
            return None
    out, casts = _uncast(out)
    nodes += casts
    product = _operands(out, aten.mul.Tensor)
    if product is None:
        return None
    for gamma_side, normed_side in (product, product[::-1]):
        gamma, gamma_casts = _uncast(gamma_side)
        normed, normed_casts = _uncast(normed_side)
        if not (isinstance(gamma, Node) and rank(gamma) == 1):
            continue
        found = _normalized(normed)
        if found is not None:
            x, eps, inner = found
            return dict(x=x, gamma=gamma, beta=beta, eps=eps,
                        nodes=[*nodes, out, *gamma_casts, *normed_casts, *inner])
    return None


def _normalized(node) -> Optional[tuple]:
    """(x, eps, nodes) for xf * rsqrt(mean(xf^2, -1, keepdim) + eps), xf = float(x)."""
    product = _operands(node, aten.mul.Tensor)
    if product is None:
        return None
    for xf, scale in (product, product[::-1]):
        if not is_call(scale, aten.rsqrt.default):
            continue
        total = _operands(scale.args[0], aten.add.Tensor)
        if total is None or not is_call(total[0], aten.mean.dim):
            continue
        mean = total[0]
        square = mean.args[0]
        if not (is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2 and square.args[0] is xf):
            continue
        if list(mean.args[1]) not in ([-1], [rank(mean) - 1]):
            continue
        x, casts = _uncast(xf)
        return x, total[1], [node, scale, scale.args[0], mean, square, *casts]
    return None


def _transposed(node) -> Optional[Node]:
    """w for w.t() (``t`` or, after inductor's decompositions, ``permute(w, [1, 0])``)."""
    if is_call(node, aten.t.default) or (is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        return node.args[0]
    return None


def match_linear(node) -> Optional[dict]:
    """x @ w^T (mm + t), or the w8a8 form: dequant(int_mm(quant(RMSNorm(x)), w^T))."""
    out, casts = _uncast(node)
    if is_call(out, aten.mm.default) and _transposed(out.args[1]) is not None:
        return dict(x=out.args[0], w=_transposed(out.args[1]), quant=None, nodes=[*casts, out, out.args[1]])
    scaled = _operands(out, aten.mul.Tensor)
    if scaled is None:
        return None
    for acc_side, descale in (scaled, scaled[::-1]):
        acc, acc_casts = _uncast(acc_side)
        biased = _operands(acc, aten.add.Tensor)
        if biased is None or not is_call(biased[0], aten._int_mm.default):
            continue
        int_mm, bias = biased
        if _transposed(int_mm.args[1]) is None:
            return None
        quant = _match_quantize(int_mm.args[0])
        if quant is None:
            return None
        return dict(x=quant["y"], w=_transposed(int_mm.args[1]), quant=dict(quant, bias=bias, descale=descale),
                    nodes=[*casts, out, *acc_casts, acc, int_mm, int_mm.args[1], *quant["nodes"]])
    return None


def _int8_clamped(node) -> Optional[tuple]:
    """(inner, nodes) for clamp(inner, -128, 127), or clamp_max(clamp_min(inner, -128), 127)."""
    if is_call(node, aten.clamp.default) and tuple(node.args[1:3]) == (-128, 127):
        return node.args[0], [node]
    if is_call(node, aten.clamp_max.default) and node.args[1] == 127 and \
            is_call(node.args[0], aten.clamp_min.default) and node.args[0].args[1] == -128:
        return node.args[0].args[0], [node, node.args[0]]
    return None


def _match_quantize(node) -> Optional[dict]:
    """int8(clamp(round(y / scale + offset), -128, 127))."""
    clamp, casts = _uncast(node)
    clamped = _int8_clamped(clamp)
    if not (casts and val(node).dtype == torch.int8 and clamped and is_call(clamped[0], aten.round.default)):
        return None
    rounded, clamp_nodes = clamped
    shifted = _operands(rounded.args[0], aten.add.Tensor)
    if shifted is None:
        return None
    divided = _operands(shifted[0], aten.div.Tensor)
    if divided is None:
        return None
    offset, offset_casts = _uncast(shifted[1])
    scale, scale_casts = _uncast(divided[1])
    y, y_casts = _uncast(divided[0])
    return dict(y=y, scale=scale, offset=offset,
                nodes=[*casts, *clamp_nodes, rounded, rounded.args[0], shifted[0],
                       *offset_casts, *scale_casts, *y_casts])


def _piece(node, size: int) -> Optional[tuple]:
    """(source, start, end, nodes) for a last-dim piece of a tensor whose last dim is ``size``."""
    piece = _last_dim_piece(node)
    if piece is None or piece[3] != 1 or static_int(val(piece[0]).shape[-1]) != size:
        return None
    return piece[0], piece[1], piece[2], piece[4]


def _pieces_of(node, size: int) -> dict:
    """{(start, end): (piece, nodes)} for the last-dim slices and split parts of node."""
    candidates = []
    for user in node.users:
        if is_call(user, aten.split.Tensor, aten.split_with_sizes.default):
            candidates += list(user.users)
        else:
            candidates.append(user)
    found = {}
    for candidate in candidates:
        piece = _piece(candidate, size)
        if piece is not None and piece[0] is node:
            found.setdefault((piece[1], piece[2]), (candidate, piece[3]))
    return found


def _deinterleaved(node) -> Optional[tuple]:
    """(pairs source, nodes) for x.view(..., 32, 2).transpose(-1, -2).reshape(..., 64)."""
    flat = node
    if not is_call(flat, *VIEWS):
        return None
    inner = flat.args[0]
    nodes = [flat]
    if is_call(inner, aten.clone.default):
        nodes.append(inner)
        inner = inner.args[0]
    if not _swaps_last_two(inner):
        return None
    pairs = inner.args[0]
    if not (is_call(pairs, *VIEWS) and list(val(pairs).shape[-2:]) == [32, 2]):
        return None
    return pairs.args[0], [*nodes, inner, pairs]


class _Miss(Exception):
    """A stage of the prologue is missing or breaks a rule (the near-miss reason)."""


@register_fusion
class MlaPreprocessFusion(FusionPass):
    """DeepSeek MLA prologue (projections, norms, RoPE, absorption, cache write) -> one op."""

    name = "mla_preprocess"
    family = "mla_preprocess"
    op = "mla_preprocess"
    order = 5  # before the RoPE passes, which would take its two RoPE sites alone

    def find(self, ctx: PassContext):
        for node in ctx.graph.nodes:
            if not is_call(node, aten.add.Tensor):
                continue
            site = match_rope_site(node)
            if not isinstance(site, RopeSite) or site.rotation.mode != "half":
                continue
            q_pe, deinterleave = site.x, []
            pairs = _deinterleaved(q_pe)
            if pairs is not None:
                q_pe, deinterleave = pairs
            piece = _piece(q_pe, mla.NOPE + mla.ROPE)
            if piece is None or piece[1:3] != (mla.NOPE, mla.NOPE + mla.ROPE) or rank(piece[0]) != 3:
                continue  # not the rope half of an MLA q head
            try:
                yield self._match(ctx, node, site, piece, deinterleave)
            except _Miss as miss:
                yield self.near_miss(node, f"MLA prologue: {miss}")

    def _match(self, ctx, q_rope_add, q_site, q_piece, deinterleave) -> Rewrite:
        q3, _, _, q_pe_nodes = q_piece
        nodes = [q_rope_add, *q_site.nodes, *q_pe_nodes, *deinterleave]
        heads = static_int(val(q3).shape[1])
        if not is_call(q3, *VIEWS):
            raise _Miss("q [T, N, 192] is not a view of the q_b projection")
        q_lin = match_linear(q3.args[0])
        if q_lin is None:
            raise _Miss("stage 5 (q_b projection x @ wuq^T) not found")
        norm1 = match_rms_norm(q_lin["x"])
        if norm1 is None:
            raise _Miss("stage 4 (RMSNorm of the q latent) not found")
        q_c = _piece(norm1["x"], mla.QKV)
        if q_c is None or q_c[1:3] != (0, mla.Q_LORA):
            raise _Miss("stages 2-3 (fused wdqkv projection split at 1536) not found")
        qkv = q_c[0]
        qkv_lin = match_linear(qkv)
        if qkv_lin is None:
            raise _Miss("stage 2 (x @ wdqkv^T) not found")
        quantized = qkv_lin["quant"] is not None
        if quantized != (q_lin["quant"] is not None):
            raise _Miss("one projection is quantized and the other is not")
        norm0 = match_rms_norm(qkv_lin["x"]) if quantized else None
        if quantized and norm0 is None:
            raise _Miss("stage 1 (input RMSNorm before quantization) not found")
        nodes += [q3, *q_lin["nodes"], *norm1["nodes"], *q_c[3], *qkv_lin["nodes"]] + (norm0["nodes"] if norm0 else [])
        kv_c, k_pe, kv_nodes = self._kv_pieces(qkv)
        ctkv = self._consumer(kv_c, match_rms_norm, "stage 6 (RMSNorm of the kv latent)")
        if ctkv["beta"] is not None:
            raise _Miss("the kv-latent RMSNorm adds a beta; the op's stage 6 has only gamma2")
        k_site = self._k_rope(k_pe, q_site, bool(deinterleave))
        cache_write = self._cache_write(ctkv["out"], k_site["out"])
        absorbed = self._absorption(q3, q_rope_add)
        nodes += [*kv_nodes, *ctkv["nodes"], *k_site["nodes"], *cache_write["nodes"], *absorbed["nodes"]]
        eps = {norm1["eps"], ctkv["eps"]} | ({norm0["eps"]} if norm0 else set())
        if not all(isinstance(e, float) for e in eps):
            raise _Miss("an RMSNorm eps is a runtime value (dynamic=True turns float attributes into inputs; "
                        "mark only the token dim dynamic); the op needs a constant")
        if len(eps) != 1:
            raise _Miss(f"the RMSNorms use different eps {sorted(eps)}; the op has one")
        q_out = absorbed["q_out"]
        self._check_limits(ctx, norm0["x"] if norm0 else qkv_lin["x"], qkv_lin, q_lin, heads, cache_write)
        leaked = users_outside(nodes, [q_out, cache_write["new_cache"]])
        if leaked is not None:
            raise _Miss(f"intermediate {leaked.name} is used outside the prologue (by "
                        f"{', '.join(u.name for u in leaked.users if u not in nodes)})")
        args = dict(x=(norm0["x"] if norm0 else qkv_lin["x"]), norm0=norm0, norm1=norm1, ctkv=ctkv,
                    qkv_lin=qkv_lin, q_lin=q_lin, w_uk=absorbed["w_uk"], cos=k_site["cos"], sin=k_site["sin"],
                    cache=cache_write["cache"], slots=cache_write["slots"], wrap=cache_write["wrap"],
                    heads=heads, eps=eps.pop(), permute=bool(deinterleave))
        anchor = min([q_out, cache_write["new_cache"]], key=ctx.position)
        self._inputs_precede(ctx, anchor, args)
        others = [n for n in (q_out, cache_write["new_cache"]) if n is not anchor]

        def build(b: GraphBuilder) -> dict:
            return _build(b, args, q_out, cache_write["new_cache"])

        detail = ("w8a8" if quantized else str(val(args["x"]).dtype).replace("torch.", "")) + \
            (", interleaved rope" if deinterleave else "")
        return Rewrite(anchor, list(dict.fromkeys([*nodes, *others])), self.op, build, detail=detail)

    # -- stages ----------------------------------------------------------------------
    def _kv_pieces(self, qkv):
        kv = _pieces_of(qkv, mla.QKV).get((mla.Q_LORA, mla.QKV))
        if kv is None:
            raise _Miss("stage 3 (kv part [1536:2112] of qkv) not found")
        pieces = _pieces_of(kv[0], mla.KV_LORA + mla.ROPE)
        kv_c, k_pe = pieces.get((0, mla.KV_LORA)), pieces.get((mla.KV_LORA, mla.KV_LORA + mla.ROPE))
        if kv_c is None or k_pe is None:
            raise _Miss("stage 6 (kv split into ctkv [512] and k_rope [64]) not found")
        return kv_c[0], k_pe[0], [*kv[1], *kv_c[1], *k_pe[1]]

    def _consumer(self, node, matcher, stage):
        seen, frontier = set(), [node]
        for _ in range(12):  # the norm's output is a few nodes downstream of its input
            nxt = []
            for n in frontier:
                for user in n.users:
                    if user in seen:
                        continue
                    seen.add(user)
                    found = matcher(user)
                    if found is not None and found["x"] is node:
                        return dict(found, out=user)
                    nxt.append(user)
            frontier = nxt
        raise _Miss(f"{stage} not found")

    def _k_rope(self, k_pe, q_site, deinterleaved: bool):
        if deinterleaved:  # k_pe -> view -> transpose -> [clone] -> reshape
            ends = [c for v in k_pe.users for t in v.users for c in t.users]
            ends += [f for c in ends if is_call(c, aten.clone.default) for f in c.users]
            xs = [(e, _deinterleaved(e)[1]) for e in ends if _deinterleaved(e) and _deinterleaved(e)[0] is k_pe]
        else:
            xs = [(k_pe, [])]
        for x, extra in xs:
            for user in x.users:
                for add in user.users:
                    site = match_rope_site(add)
                    if not (isinstance(site, RopeSite) and site.x is x and site.rotation.mode == "half"):
                        continue
                    cos, sin = _table_root(site.cos), _table_root(site.sin)
                    if cos is not _table_root(q_site.cos) or sin is not _table_root(q_site.sin):
                        raise _Miss("q and k RoPE use different cos/sin tables")
                    tokens = val(k_pe).shape[0]
                    for table, site_, expected in ((cos, None, [tokens, mla.ROPE]), (sin, None, [tokens, mla.ROPE]),
                                                   (q_site.cos, "q", [tokens, 1, mla.ROPE]),
                                                   (q_site.sin, "q", [tokens, 1, mla.ROPE]),
                                                   (site.cos, "k", [tokens, mla.ROPE]),
                                                   (site.sin, "k", [tokens, mla.ROPE])):
                        if not shape_eq(list(val(table).shape), expected):
                            raise _Miss(f"{site_ or 'the'} RoPE table {table.name} has shape {list(val(table).shape)}, "
                                        f"not {expected}: cos/sin must be one [T, 64] row per token")
                    return dict(out=add, nodes=[add, *site.nodes, *extra], cos=cos, sin=sin)
        raise _Miss("stage 7 (RoPE of k_rope, in the same layout as q's) not found")

    def _cache_write(self, ctkv_out, k_rope_out):
        for cat in ctkv_out.users:
            if not (is_call(cat, aten.cat.default) and list(cat.args[0]) == [ctkv_out, k_rope_out]):
                continue
            for write in cat.users:
                found = _written_cache(write, cat)
                if found is not None:
                    return dict(found, nodes=[cat, write, *found["nodes"]])
        raise _Miss("stage 9 (KV-cache write of cat(ctkv, k_rope) at slot_mapping) not found")

    def _absorption(self, q3, q_rope_add):
        for q_out in q_rope_add.users:
            if not (is_call(q_out, aten.cat.default) and len(q_out.args[0]) == 2 and q_out.args[0][1] is q_rope_add):
                continue
            back = q_out.args[0][0]
            if not _swaps_01(back):
                continue
            bmm = back.args[0]
            if not is_call(bmm, aten.bmm.default):
                continue
            front, w_uk = bmm.args
            if not _swaps_01(front):
                continue
            q_nope = _piece(front.args[0], mla.NOPE + mla.ROPE)
            if q_nope is None or q_nope[0] is not q3 or q_nope[1:3] != (0, mla.NOPE):
                continue
            if list(val(w_uk).shape) != [val(q3).shape[1], mla.NOPE, mla.KV_LORA]:
                raise _Miss(f"W_UK shape {list(val(w_uk).shape)} is not [N, 128, 512]")
            return dict(q_out=q_out, w_uk=w_uk, nodes=[q_out, back, bmm, front, *q_nope[3]])
        raise _Miss("stage 8 (weight absorption q_nope @ W_UK, then cat with q_rope) not found")

    # -- constraints -------------------------------------------------------------------
    def _check_limits(self, ctx, x_node, qkv_lin, q_lin, heads, cache_write):
        x = val(x_node)
        if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
            raise _Miss(f"input must be 2-D [T, hidden] float16/bfloat16, got {list(x.shape)} {x.dtype}")
        tokens, hidden = static_int(x.shape[0]), static_int(x.shape[1])
        if hidden is None or not mla.HIDDEN_RANGE[0] <= hidden <= mla.HIDDEN_RANGE[1]:
            raise _Miss(f"hidden size {x.shape[1]} is outside {mla.HIDDEN_RANGE[0]}..{mla.HIDDEN_RANGE[1]}")
        if tokens is not None and tokens > mla.MAX_TOKENS:
            raise _Miss(f"{tokens} tokens > {mla.MAX_TOKENS}")
        if heads is None:
            raise _Miss("head count is symbolic")
        if (val(qkv_lin["w"]).dtype == x.dtype) == bool(qkv_lin["quant"]):
            raise _Miss(f"wdqkv dtype {val(qkv_lin['w']).dtype} does not fit the {x.dtype} input")
        if qkv_lin["quant"] and val(q_lin["w"]).dtype != torch.int8:
            raise _Miss("wuq is not int8 on the quantized path")
        for name, lin in (("wdqkv", qkv_lin), ("wuq", q_lin)):
            quant = lin["quant"]
            if quant is None:
                continue
            out_features = val(lin["w"]).shape[0]
            if val(quant["scale"]).numel() != 1 or val(quant["offset"]).numel() != 1:
                raise _Miss(f"the activation quantization before {name} is not per-tensor (scale/offset numel 1)")
            if list(val(quant["descale"]).shape) != [out_features] or val(quant["bias"]).numel() != out_features:
                raise _Miss(f"{name}'s dequant scale/bias are not per output channel ([{out_features}])")
        cache = val(cache_write["cache"])
        block_size = static_int(cache.shape[1])
        if cache.dtype != x.dtype or block_size is None or not (1 <= block_size <= 128 or block_size == 256):
            raise _Miss(f"kv cache {list(cache.shape)} {cache.dtype}: needs {x.dtype} and block size in [1, 128] or 256")
        if ctx.soc == GENERIC:
            return
        if ctx.soc not in A2_A3:
            raise _Miss(f"MlaPreprocess runs on the Ascend910B family (Atlas 800I A2/A3) only, not {ctx.soc}")
        if tokens is None:
            raise _Miss(f"token count is symbolic; {ctx.soc}'s MlaPreprocess takes at most {mla.MAX_TOKENS}")

    def _inputs_precede(self, ctx, anchor, args):
        inputs = [v for v in args.values() if isinstance(v, Node)]
        for info in (args["norm0"], args["norm1"], args["ctkv"]):
            if info:
                inputs += [n for n in (info["gamma"], info["beta"]) if n is not None]
        for lin in (args["qkv_lin"], args["q_lin"]):
            inputs.append(lin["w"])
            if lin["quant"]:
                inputs += [lin["quant"][k] for k in ("scale", "offset", "bias", "descale")]
        late = [n for n in inputs if ctx.position(n) > ctx.position(anchor)]
        if late:
            raise _Miss(f"{late[0].name} is computed after the prologue's outputs")


def _swaps_last_two(node) -> bool:
    """x.transpose(-1, -2) (``permute`` swapping the last two dims after inductor's decompositions)."""
    n = rank(node)
    if is_call(node, aten.transpose.int):
        return {node.args[1] % n, node.args[2] % n} == {n - 1, n - 2}
    return is_call(node, aten.permute.default) and list(node.args[1]) == [*range(n - 2), n - 1, n - 2]


def _swaps_01(node) -> bool:
    """x.transpose(0, 1) of a 3-D x (``permute(x, [1, 0, 2])`` after inductor's decompositions)."""
    if is_call(node, aten.transpose.int):
        return sorted(d % 3 for d in node.args[1:3]) == [0, 1]
    return is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0, 2]


def _table_root(node):
    while is_call(node, aten.unsqueeze.default):
        node = node.args[0]
    return node


def _written_cache(write, value) -> Optional[dict]:
    """The cache a write of ``value`` into ``cache.view(-1, D)`` at slots updates."""
    if is_call(write, aten.index_put.default) and len(write.args[1]) == 1 and write.args[2] is value:
        flat, slots, wrap = write.args[0], write.args[1][0], True  # python indexing: -1 is the last slot
    elif is_call(write, aten.index_copy.default) and write.args[1] == 0 and write.args[3] is value:
        flat, slots, wrap = write.args[0], write.args[2], False
    elif is_call(write, aten.scatter.src) and write.args[1] == 0 and write.args[3] is value:
        index = write.args[2]
        if not (is_call(index, aten.expand.default) and is_call(index.args[0], aten.unsqueeze.default)):
            return None
        flat, slots, wrap = write.args[0], index.args[0].args[0], False
    else:
        return None
    if not (is_call(flat, *VIEWS) and rank(flat.args[0]) == 4):
        return None
    cache = flat.args[0]
    if list(val(cache).shape[2:]) != [1, mla.KV_LORA + mla.ROPE]:
        return None
    new_cache = [u for u in write.users if is_call(u, *VIEWS) and list(val(u).shape) == list(val(cache).shape)]
    if len(new_cache) != 1 or len(write.users) != 1:
        return None
    nodes = [flat, new_cache[0]]
    if is_call(write, aten.scatter.src):
        nodes += [write.args[2], write.args[2].args[0]]
    return dict(cache=cache, slots=slots, wrap=wrap, new_cache=new_cache[0], nodes=nodes)


def _build(b: GraphBuilder, a: dict, q_out: Node, new_cache: Node) -> dict:
    x = a["x"]
    dtype, device = val(x).dtype, val(x).device

    def full(shape, value, dtype_):
        return b.call(aten.full.default, shape, value, dtype=dtype_, device=device, pin_memory=False)

    quant0, quant1 = a["qkv_lin"]["quant"], a["q_lin"]["quant"]
    wdqkv, wuq = a["qkv_lin"]["w"], a["q_lin"]["w"]
    heads = a["heads"]
    descale0 = quant0["descale"] if quant0 else full([mla.QKV], 1.0, torch.float32)
    descale1 = quant1["descale"] if quant1 else full([heads * 192], 1.0, torch.float32)
    bias0, bias1 = (quant0["bias"] if quant0 else None), (quant1["bias"] if quant1 else None)
    if a["permute"]:  # the op rotates halves: put each rope part's pairs in half layout first
        rows0 = _rope_rows(b, device, mla.QKV, 1, mla.Q_LORA + mla.KV_LORA)
        rows1 = _rope_rows(b, device, mla.NOPE + mla.ROPE, heads, mla.NOPE)
        # aten.index (not index_select): inductor lowers it after its decompositions have run
        wdqkv, wuq = (b.call(aten.index.Tensor, w, [rows]) for w, rows in ((wdqkv, rows0), (wuq, rows1)))
        if quant0:
            descale0, bias0 = (b.call(aten.index.Tensor, t, [rows0]) for t in (descale0, bias0))
            descale1, bias1 = (b.call(aten.index.Tensor, t, [rows1]) for t in (descale1, bias1))
    hidden = val(x).shape[-1]
    # the unquantized path skips stage 1, whose gamma0/beta0 the op then never reads
    gamma0 = a["norm0"]["gamma"] if a["norm0"] else full([hidden], 1.0, dtype)
    beta0 = a["norm0"]["beta"] if a["norm0"] and a["norm0"]["beta"] is not None else full([hidden], 0.0, dtype)
    beta1 = a["norm1"]["beta"] if a["norm1"]["beta"] is not None else full([mla.Q_LORA], 0.0, dtype)
    slots = a["slots"]
    if a["wrap"]:
        slots = b.call(aten.remainder.Scalar, slots, val(a["cache"]).shape[0] * val(a["cache"]).shape[1])
    kv_rope = full([0], 0.0, dtype)
    kwargs = dict(cache_mode=mla.KVCACHE, quant_mode=mla.PER_TENSOR_QUANT_ASYMM, epsilon=a["eps"])
    if quant0:
        kwargs.update(quant_scale0=quant0["scale"], quant_offset0=quant0["offset"], bias0=bias0,
                      quant_scale1=quant1["scale"], quant_offset1=quant1["offset"], bias1=bias1)
    fused = b.call(torch.ops.higher_order.auto_functionalized_v2, torch.ops.npu_fuse.mla_preprocess.default,
                   input=x, gamma0=gamma0, beta0=beta0, wdqkv=wdqkv, descale0=descale0, gamma1=a["norm1"]["gamma"],
                   beta1=beta1, wuq=wuq, descale1=descale1, gamma2=a["ctkv"]["gamma"], cos=a["cos"], sin=a["sin"],
                   wuk=a["w_uk"], slotmapping=slots, **kwargs, _kv_cache_base_index=0,
                   _kv_cache_rope_base_index=1, _all_bases=[a["cache"], kv_rope])
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
