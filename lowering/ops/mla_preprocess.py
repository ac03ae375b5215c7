"""npu_fuse::mla_preprocess — the MLA attention prologue of DeepSeek-V2/V3 (spec section 4, seed 003).

One call does, in this order (the reference below replays every stage and every
quantize/dequantize rule, as seed 003 asks of a golden):

1. input RMSNorm (gamma0, beta0) + int8 quantize (quant_scale0, quant_offset0);
   skipped on the unquantized path (wdqkv of the input's fp16/bf16 dtype);
2. ``x @ wdqkv^T`` -> [T, 2112], dequantized ``(acc + bias0) * descale0``;
3. split at 1536: q latent | kv [T, 576];
4. q latent: RMSNorm (gamma1, beta1) + quantize (quant_scale1, quant_offset1);
5. ``@ wuq^T`` -> [T, N*192], dequantized; view [T, N, 192]; q_nope [..128] | q_rope [128..];
6. ctkv = RMSNorm(kv[:, :512]; gamma2); k_rope = kv[:, 512:];
7. half-rotation RoPE (cos, sin: [T, 64]) on q_rope and k_rope;
8. ``q_nope @ wuk`` ([N, 128, 512]) -> [T, N, 512] (weight absorption);
9. write ctkv / k_rope into the paged caches at slotmapping (slot < 0: skipped).

Quantization (as ATB's goldens define it): per-tensor asymmetric (quant_mode 0):
``q = clamp(round(y / quant_scale + quant_offset), -128, 127)``; per-token symmetric
(quant_mode 1): ``s_t = max|y_t| / 127``, ``q = clamp(round(y / s_t))`` and the
dequantize also multiplies by ``s_t``. INT8_NZCACHE quantizes ctkv as
``round(ctkv * ctkv_scale)`` and q_nope per head as ``round(q_nope * q_nope_scale)``.
NZ caches (modes 2, 3) hold ``[blocks, dim / c0, block_size, c0]`` in the memory of a
``[blocks, block_size, 1, dim]`` tensor, c0 = 16 (fp16/bf16) or 32 (int8).

Outputs by cache_mode: KVCACHE (0): q_out0 = [T, N, 576] = cat(q_nope absorbed, q_rope),
kv_cache holds [ctkv | k_rope]; KROPE_CTKV (1), INT8_NZCACHE (2), NZCACHE (3): q_out0 =
q_nope absorbed [T, N, 512] (int8 in mode 2), q_out1 = q_rope [T, N, 64], kv_cache holds
ctkv and kv_cache_rope holds k_rope. The caches are updated in place; the Python entry
point :func:`mla_preprocess` returns them as the aliased outputs.
"""

from typing import Optional

import torch
from torch import Tensor

from ..registry import decomposition, refuse_autograd
from ..rope_math import rotate

__all__ = ["mla_preprocess"]  # public entry points (npu_fuse.ops)

Q_LORA, KV_LORA, ROPE, NOPE = 1536, 512, 64, 128
QKV = Q_LORA + KV_LORA + ROPE  # 2112
KVCACHE, KROPE_CTKV, INT8_NZCACHE, NZCACHE = range(4)
PER_TENSOR_QUANT_ASYMM, PER_TOKEN_QUANT_SYMM, PER_TOKEN_QUANT_ASYMM, UNQUANT = range(4)
MAX_TOKENS = 1024
HIDDEN_RANGE = (2048, 8192)
NAME = "npu_fuse.mla_preprocess"

SCHEMA = (
    "(Tensor input, Tensor gamma0, Tensor beta0, Tensor wdqkv, Tensor descale0, Tensor gamma1, Tensor beta1, "
    "Tensor wuq, Tensor descale1, Tensor gamma2, Tensor cos, Tensor sin, Tensor wuk, Tensor(a!) kv_cache, "
    "Tensor(b!) kv_cache_rope, Tensor slotmapping, Tensor? quant_scale0=None, Tensor? quant_offset0=None, "
    "Tensor? bias0=None, Tensor? quant_scale1=None, Tensor? quant_offset1=None, Tensor? bias1=None, "
    "Tensor? ctkv_scale=None, Tensor? q_nope_scale=None, *, int cache_mode=0, int quant_mode=0, "
    "float epsilon=1e-06) -> (Tensor, Tensor)"
)


def _require(ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{NAME}: {rule}")


def is_quantized(input: Tensor, wdqkv: Tensor) -> bool:
    return not (wdqkv.dtype == input.dtype and input.dtype in (torch.float16, torch.bfloat16))


def check_mla_preprocess_args(a: dict) -> None:
    """Raise ValueError naming the first limit or shape rule the arguments break."""
    x, cache_mode, quant_mode = a["input"], a["cache_mode"], a["quant_mode"]
    _require(cache_mode in (KVCACHE, KROPE_CTKV, INT8_NZCACHE, NZCACHE),
             f"cache_mode must be 0 (KVCACHE), 1 (KROPE_CTKV), 2 (INT8_NZCACHE) or 3 (NZCACHE), got {cache_mode}")
    _require(quant_mode in (PER_TENSOR_QUANT_ASYMM, PER_TOKEN_QUANT_SYMM),
             f"quant_mode {quant_mode} is not supported: only 0 (PER_TENSOR_QUANT_ASYMM) and 1 "
             "(PER_TOKEN_QUANT_SYMM); 2 (PER_TOKEN_QUANT_ASYMM) and 3 (UNQUANT) are refused")
    _require(x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16),
             f"input must be [tokens, hidden] float16/bfloat16, got {tuple(x.shape)} {x.dtype}")
    tokens, hidden = x.shape
    _require(1 <= tokens <= MAX_TOKENS, f"token count must be in 1..{MAX_TOKENS}, got {tokens}")
    _require(HIDDEN_RANGE[0] <= hidden <= HIDDEN_RANGE[1],
             f"hidden size must be 7168 or in {HIDDEN_RANGE[0]}..{HIDDEN_RANGE[1]}, got {hidden}")
    heads = a["wuk"].shape[0] if a["wuk"].dim() == 3 else -1
    _require(tuple(a["wuk"].shape) == (heads, NOPE, KV_LORA) and heads > 0,
             f"wuk must be [heads, {NOPE}, {KV_LORA}], got {tuple(a['wuk'].shape)}")
    _require(tuple(a["wdqkv"].shape) == (QKV, hidden), f"wdqkv must be [{QKV}, {hidden}], got {tuple(a['wdqkv'].shape)}")
    _require(tuple(a["wuq"].shape) == (heads * (NOPE + ROPE), Q_LORA),
             f"wuq must be [{heads * (NOPE + ROPE)}, {Q_LORA}], got {tuple(a['wuq'].shape)}")
    for name, size in (("gamma1", Q_LORA), ("beta1", Q_LORA), ("gamma2", KV_LORA)):
        _require(tuple(a[name].shape) == (size,), f"{name} must be [{size}], got {tuple(a[name].shape)}")
    for name in ("cos", "sin"):
        _require(tuple(a[name].shape) == (tokens, ROPE), f"{name} must be [{tokens}, {ROPE}], got {tuple(a[name].shape)}")
    _require(tuple(a["slotmapping"].shape) == (tokens,) and a["slotmapping"].dtype in (torch.int32, torch.int64),
             f"slotmapping must be int32/int64 [{tokens}], got {tuple(a['slotmapping'].shape)} {a['slotmapping'].dtype}")
    quantized = is_quantized(x, a["wdqkv"])
    if quantized:
        _require(a["wdqkv"].dtype == torch.int8 and a["wuq"].dtype == torch.int8,
                 f"weights must be int8 (quantized path) or {x.dtype} (unquantized path), got wdqkv "
                 f"{a['wdqkv'].dtype}, wuq {a['wuq'].dtype}")
        for name, size in (("gamma0", hidden), ("beta0", hidden)):
            _require(tuple(a[name].shape) == (size,), f"{name} must be [{size}], got {tuple(a[name].shape)}")
        _require(tuple(a["descale0"].shape) == (QKV,), f"descale0 must be [{QKV}], got {tuple(a['descale0'].shape)}")
        _require(tuple(a["descale1"].shape) == (heads * 192,),
                 f"descale1 must be [{heads * 192}], got {tuple(a['descale1'].shape)}")
        if quant_mode == PER_TENSOR_QUANT_ASYMM:
            for name in ("quant_scale0", "quant_offset0", "quant_scale1", "quant_offset1"):
                _require(a[name] is not None and a[name].numel() == 1, f"{name} must be a [1] tensor (per-tensor quant)")
    else:
        _require(a["wuq"].dtype == x.dtype, f"unquantized path: wuq must be {x.dtype}, got {a['wuq'].dtype}")
    _require(a["wuk"].dtype == x.dtype, f"wuk must be {x.dtype}, got {a['wuk'].dtype}")
    kv_cache, kv_rope = a["kv_cache"], a["kv_cache_rope"]
    _require(kv_cache.dim() == 4 and kv_cache.shape[2] == 1, f"kv_cache must be [blocks, block_size, 1, dim], "
             f"got {tuple(kv_cache.shape)}")
    block_size = kv_cache.shape[1]
    _require(1 <= block_size <= 128 or block_size == 256, f"block_size must be in [1, 128] or 256, got {block_size}")
    if cache_mode in (INT8_NZCACHE, NZCACHE):
        _require(block_size == 128, f"cache_mode {cache_mode} (NZ cache) needs block_size 128, got {block_size}")
    width = KV_LORA + ROPE if cache_mode == KVCACHE else KV_LORA
    cache_dtype = torch.int8 if cache_mode == INT8_NZCACHE else x.dtype
    _require(kv_cache.shape[3] == width and kv_cache.dtype == cache_dtype,
             f"kv_cache must be [blocks, block_size, 1, {width}] {cache_dtype} for cache_mode {cache_mode}, "
             f"got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    if cache_mode != KVCACHE:
        _require(tuple(kv_rope.shape) == (kv_cache.shape[0], block_size, 1, ROPE) and kv_rope.dtype == x.dtype,
                 f"kv_cache_rope must be [{kv_cache.shape[0]}, {block_size}, 1, {ROPE}] {x.dtype}, "
                 f"got {tuple(kv_rope.shape)} {kv_rope.dtype}")
    if cache_mode == INT8_NZCACHE:
        _require(a["ctkv_scale"] is not None and a["ctkv_scale"].numel() == 1, "INT8_NZCACHE needs ctkv_scale [1]")
        _require(a["q_nope_scale"] is not None and a["q_nope_scale"].numel() == heads,
                 f"INT8_NZCACHE needs q_nope_scale with {heads} values (one per head)")


# -- stages of the reference -------------------------------------------------------------
def rms_norm(x: Tensor, gamma: Tensor, beta: Optional[Tensor], eps: float) -> Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
    return out + beta.float() if beta is not None else out


def quantize_per_tensor(y: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    return torch.clamp(torch.round(y / scale.float() + offset.float()), -128, 127).to(torch.int8)


def quantize_per_token(y: Tensor) -> tuple:
    token_scale = y.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.clamp(torch.round(y / token_scale), -128, 127).to(torch.int8), token_scale


def int8_matmul_dequant(q: Tensor, w: Tensor, descale: Tensor, bias: Optional[Tensor],
                        token_scale: Optional[Tensor]) -> Tensor:
    """int8 x int8^T with int32 accumulation, then (acc + bias) * descale [* token scale]."""
    acc = torch._int_mm(q, w.t())
    if bias is not None:
        acc = acc + bias.reshape(-1).to(torch.int32)
    out = acc.float() * descale.float().reshape(-1)
    return out * token_scale if token_scale is not None else out


def nz_view(cache: Tensor, c0: int) -> Tensor:
    """The NZ fractal view [blocks, dim/c0, block_size, c0] of a [blocks, block_size, 1, dim] cache."""
    blocks, block_size, _, dim = cache.shape
    return cache.view(blocks, dim // c0, block_size, c0)


def write_cache(cache: Tensor, rows: Tensor, slots: Tensor, nz: bool) -> None:
    """cache[slot] = rows for every token whose slot is >= 0 (ND or NZ layout)."""
    keep = slots >= 0
    slots, rows = slots[keep].long(), rows[keep].to(cache.dtype)
    blocks, block_size, _, dim = cache.shape
    if not nz:
        cache.view(-1, dim).index_copy_(0, slots, rows)
        return
    c0 = 32 if cache.dtype == torch.int8 else 16
    nz_cache = nz_view(cache, c0)
    block, offset = slots // block_size, slots % block_size
    nz_cache[block, :, offset, :] = rows.view(-1, dim // c0, c0)


def mla_preprocess_stages(a: dict) -> dict:
    """Every stage of the pipeline, returned by name (the golden tests look at each)."""
    x, eps, quant_mode = a["input"], a["epsilon"], a["quant_mode"]
    dtype, stages = x.dtype, {}
    if is_quantized(x, a["wdqkv"]):
        def project(h, gamma, beta, scale, offset, w, descale, bias):
            y = rms_norm(h, gamma, beta, eps).to(dtype).float()
            if quant_mode == PER_TENSOR_QUANT_ASYMM:
                q, token_scale = quantize_per_tensor(y, scale, offset), None
            else:
                q, token_scale = quantize_per_token(y)
            return q, int8_matmul_dequant(q, w, descale, bias, token_scale).to(dtype)

        stages["x_int8"], qkv = project(x, a["gamma0"], a["beta0"], a["quant_scale0"], a["quant_offset0"],
                                        a["wdqkv"], a["descale0"], a["bias0"])
        q_latent, kv = qkv.split([Q_LORA, KV_LORA + ROPE], dim=-1)
        stages["q_latent_int8"], q = project(q_latent, a["gamma1"], a["beta1"], a["quant_scale1"],
                                             a["quant_offset1"], a["wuq"], a["descale1"], a["bias1"])
    else:
        # matmuls in the input dtype (fp32 accumulation), as the NPU's cube unit computes them
        qkv = x @ a["wdqkv"].t()
        q_latent, kv = qkv.split([Q_LORA, KV_LORA + ROPE], dim=-1)
        q = rms_norm(q_latent, a["gamma1"], a["beta1"], eps).to(dtype) @ a["wuq"].t()
    stages["qkv"] = qkv
    heads = a["wuk"].shape[0]
    q_nope, q_rope = q.view(-1, heads, NOPE + ROPE).split([NOPE, ROPE], dim=-1)
    ctkv = rms_norm(kv[:, :KV_LORA], a["gamma2"], None, eps).to(dtype)
    cos, sin = a["cos"].float().unsqueeze(1), a["sin"].float().unsqueeze(1)
    q_rope = (q_rope.float() * cos + rotate(q_rope.float(), "half") * sin).to(dtype)
    k_rope = (kv[:, KV_LORA:].float() * a["cos"].float() + rotate(kv[:, KV_LORA:].float(), "half")
              * a["sin"].float()).to(dtype)
    q_nope = torch.bmm(q_nope.transpose(0, 1), a["wuk"]).transpose(0, 1).contiguous()
    stages.update(q_nope_absorbed=q_nope, q_rope=q_rope, ctkv=ctkv, k_rope=k_rope)
    return stages


def cache_written(cache: Tensor, rows: Tensor, slots: Tensor, nz: bool) -> Tensor:
    """Functional cache write (a new cache) for compilers, with static shapes and no copy of
    the cache. A skipped token (slot < 0) repeats the first written token's write (same
    place, same value), so the order of duplicate writes cannot matter; with no token
    written, it writes some of the cache's own values back in place."""
    blocks, block_size, _, dim = cache.shape
    rows, slot = rows.to(cache.dtype), slots.long()[:, None]
    if nz:  # element d of a slot's row lives at [block][d // c0][offset][d % c0] of the flat cache
        c0 = 32 if cache.dtype == torch.int8 else 16
        d = torch.arange(dim, device=cache.device)[None, :]
        block, offset = slot // block_size, slot % block_size
        target = cache.reshape(-1)
        index = block * block_size * dim + (d // c0) * block_size * c0 + offset * c0 + d % c0
        noop_index, noop_rows = d, target[:dim].view(1, dim)  # elements 0..dim-1 rewritten as they are
    else:  # whole rows of the [slots, dim] view
        target = cache.view(-1, dim)
        index, noop_index, noop_rows = slot, slot.new_zeros(1, 1), target[:1]
    keep = slot >= 0
    first = torch.argmax(keep.int()).view(1)  # the first written token (0 when none is)
    first_writes = keep.index_select(0, first)
    index = torch.where(keep, index, torch.where(first_writes, index.index_select(0, first), noop_index))
    rows = torch.where(keep, rows, torch.where(first_writes, rows.index_select(0, first), noop_rows))
    if nz:
        return target.index_put((index.reshape(-1),), rows.reshape(-1)).view(cache.shape)
    return target.index_put((index.reshape(-1),), rows).view(cache.shape)


def mla_preprocess_functional(**a) -> tuple:
    """The op without mutation: ((q_out0, q_out1), (new kv_cache, new kv_cache_rope))."""
    s = mla_preprocess_stages(a)
    mode, slots = a["cache_mode"], a["slotmapping"]
    if mode == KVCACHE:
        cache = cache_written(a["kv_cache"], torch.cat([s["ctkv"], s["k_rope"]], dim=-1), slots, nz=False)
        return (torch.cat([s["q_nope_absorbed"], s["q_rope"]], dim=-1), s["q_rope"].new_empty(0)), \
            (cache, a["kv_cache_rope"].clone())
    ctkv, q_nope = _mode_quantized(a, s)
    nz = mode in (INT8_NZCACHE, NZCACHE)
    return (q_nope, s["q_rope"]), (cache_written(a["kv_cache"], ctkv, slots, nz),
                                   cache_written(a["kv_cache_rope"], s["k_rope"], slots, nz))


def _mode_quantized(a: dict, s: dict) -> tuple:
    """ctkv and q_nope as the cache mode stores and returns them (int8 in INT8_NZCACHE)."""
    ctkv, q_nope = s["ctkv"], s["q_nope_absorbed"]
    if a["cache_mode"] == INT8_NZCACHE:
        ctkv = torch.clamp(torch.round(ctkv.float() * a["ctkv_scale"].float()), -128, 127)
        scale = a["q_nope_scale"].float().reshape(1, -1, 1)
        q_nope = torch.clamp(torch.round(q_nope.float() * scale), -128, 127).to(torch.int8)
    return ctkv, q_nope


def _run(a: dict) -> tuple:
    check_mla_preprocess_args(a)
    s = mla_preprocess_stages(a)
    mode, slots = a["cache_mode"], a["slotmapping"]
    if mode == KVCACHE:
        write_cache(a["kv_cache"], torch.cat([s["ctkv"], s["k_rope"]], dim=-1), slots, nz=False)
        return torch.cat([s["q_nope_absorbed"], s["q_rope"]], dim=-1), s["q_rope"].new_empty(0)
    ctkv, q_nope = _mode_quantized(a, s)
    nz = mode in (INT8_NZCACHE, NZCACHE)
    write_cache(a["kv_cache"], ctkv, slots, nz)
    write_cache(a["kv_cache_rope"], s["k_rope"], slots, nz)
    return q_nope, s["q_rope"]


ARG_NAMES = ("input", "gamma0", "beta0", "wdqkv", "descale0", "gamma1", "beta1", "wuq", "descale1", "gamma2",
             "cos", "sin", "wuk", "kv_cache", "kv_cache_rope", "slotmapping")


@torch.library.custom_op("npu_fuse::mla_preprocess", mutates_args=("kv_cache", "kv_cache_rope"), schema=SCHEMA)
def _mla_preprocess_op(input, gamma0, beta0, wdqkv, descale0, gamma1, beta1, wuq, descale1, gamma2, cos, sin,
                       wuk, kv_cache, kv_cache_rope, slotmapping, quant_scale0=None, quant_offset0=None,
                       bias0=None, quant_scale1=None, quant_offset1=None, bias1=None, ctkv_scale=None,
                       q_nope_scale=None, *, cache_mode=0, quant_mode=0, epsilon=1e-6):
    return _run(dict(locals()))


@_mla_preprocess_op.register_fake
def _(input, gamma0, beta0, wdqkv, descale0, gamma1, beta1, wuq, descale1, gamma2, cos, sin, wuk, kv_cache,
      kv_cache_rope, slotmapping, quant_scale0=None, quant_offset0=None, bias0=None, quant_scale1=None,
      quant_offset1=None, bias1=None, ctkv_scale=None, q_nope_scale=None, *, cache_mode=0, quant_mode=0,
      epsilon=1e-6):
    check_mla_preprocess_args(dict(locals()))
    tokens, heads = input.shape[0], wuk.shape[0]
    if cache_mode == KVCACHE:
        return input.new_empty(tokens, heads, KV_LORA + ROPE), input.new_empty(0)
    q_dtype = torch.int8 if cache_mode == INT8_NZCACHE else input.dtype
    return input.new_empty(tokens, heads, KV_LORA, dtype=q_dtype), input.new_empty(tokens, heads, ROPE)


def mla_preprocess(input, gamma0, beta0, wdqkv, descale0, gamma1, beta1, wuq, descale1, gamma2, cos, sin, wuk,
                   kv_cache, kv_cache_rope, slotmapping, **kwargs):
    """ATB's four outputs: (q_out0, kv_cache_out0, q_out1, kv_cache_out1); the cache
    outputs are the cache inputs, updated in place."""
    q_out0, q_out1 = torch.ops.npu_fuse.mla_preprocess(
        input, gamma0, beta0, wdqkv, descale0, gamma1, beta1, wuq, descale1, gamma2, cos, sin, wuk,
        kv_cache, kv_cache_rope, slotmapping, **kwargs)
    return q_out0, kv_cache, q_out1, kv_cache_rope


decomposition(torch.ops.npu_fuse.mla_preprocess.default)(mla_preprocess_functional)
refuse_autograd("mla_preprocess", "an inference op with no autograd; an input requires grad (call it under "
                "torch.no_grad())")
