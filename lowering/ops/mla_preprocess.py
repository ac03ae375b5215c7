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
9. write ctkv / k_rope into the paged caches at slotmapping.

Quantization (as ATB's goldens define it): per-tensor asymmetric (quant_mode 0):
``q = clamp(round(y / quant_scale + quant_offset), -128, 127)``; per-token symmetric
(quant_mode 1): ``s_t = max|y_t| / 127``, ``q = clamp(round(y / s_t))`` and the
dequantize also multiplies by ``s_t``. INT8_NZCACHE quantizes ctkv as
``round(ctkv * ctkv_scale)`` and q_nope per head as ``round(q_nope * q_nope_scale)``.
NZ caches (modes 2, 3) hold ``[blocks, dim / c0, block_size, c0]`` in the memory of a
``[blocks, block_size, 1, dim]`` tensor, c0 = 16 (fp16/bf16) or 32 (int8).

Slots (decision): a slot indexes the ``[blocks * block_size]`` rows of a cache as Python
indexing does, ``-S <= slot < S`` with negatives counting from the end; anything else is
an error. This is the meaning of ``cache.view(-1, D)[slot_mapping] = rows``, the code
the fusion replaces, so the rewrite keeps eager's meaning, and eager's IndexError, for
every slot. (ATB's own kernel instead skips tokens whose slot is negative; the NPU
kernel below maps the slots onto it.)

Outputs by cache_mode: KVCACHE (0): q_out0 = [T, N, 576] = cat(q_nope absorbed, q_rope),
kv_cache holds [ctkv | k_rope]; KROPE_CTKV (1), INT8_NZCACHE (2), NZCACHE (3): q_out0 =
q_nope absorbed [T, N, 512] (int8 in mode 2), q_out1 = q_rope [T, N, 64], kv_cache holds
ctkv and kv_cache_rope holds k_rope. The caches are updated in place; the Python entry
point :func:`mla_preprocess` returns them as the aliased outputs.

Where it runs: the reference kernel and the inductor decomposition everywhere; on an NPU,
torch_npu's ATB kernel (``torch_npu.atb.npu_mla_preprocess``) eagerly and the GE
conversion in ``converters/mla_preprocess.py`` under torchair. ``@soc_limits`` below holds
what those accept per SoC.
"""

import inspect
from typing import Optional

import torch
from torch import Tensor

from npu_fuse_backend.soc import A2_A3, GENERIC
from npu_fuse_backend.lowering.registry import (decomposition, kernel_size_limits, npu_kernel, refuse_autograd,
                                                soc_limits)
from npu_fuse_backend.lowering.common import FLOAT_DTYPES, HALF_DTYPES, half_matmul, rotate

__all__ = ["mla_preprocess"]  # public entry points (npu_fuse.ops)

Q_LORA, KV_LORA, ROPE, NOPE = 1536, 512, 64, 128
QKV = Q_LORA + KV_LORA + ROPE  # 2112
KVCACHE, KROPE_CTKV, INT8_NZCACHE, NZCACHE = range(4)
PER_TENSOR_QUANT_ASYMM, PER_TOKEN_QUANT_SYMM, PER_TOKEN_QUANT_ASYMM, UNQUANT = range(4)
MAX_TOKENS = 1024
HIDDEN_RANGE = (2048, 8192)
NAME = "npu_fuse.mla_preprocess"

# The op's arguments, declared once (ATB's names and order): the kernels, the converter and the
# pass take them by name through bind_args.
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
    return not (wdqkv.dtype == input.dtype and input.dtype in HALF_DTYPES)


def bind_args(args: tuple, kwargs: dict) -> dict:
    """The op's arguments by name, defaults filled in (``args`` in schema order)."""
    bound = {name: default for name, _, _, default in ARGUMENTS}
    bound.update(zip([name for name, keyword_only, _, _ in ARGUMENTS if not keyword_only], args))
    bound.update(kwargs)
    return bound


def _signature() -> inspect.Signature:
    """The entry point's signature, from the op's schema: as ATB's ``npu_mla_preprocess``, the 16
    required tensors positional and every optional argument keyword-only."""
    return inspect.Signature([
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY if keyword_only or has_default
                          else inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          default=default if has_default else inspect.Parameter.empty)
        for name, keyword_only, has_default, default in ARGUMENTS])


def _shape(t) -> tuple:
    return tuple(t.shape)


def dims(a: dict) -> tuple:
    """(q_lora, kv_lora, rope, nope) of a call, from its arguments' shapes. The NPU kernel fixes them at
    DeepSeek's 1536, 512, 64 and 128, which the checker requires; what the op computes is the same at
    any, so with the kernels' size limits lifted (translation validation, at shrunk sizes) the
    checker requires only that the arguments agree."""
    def size(t: Tensor, dim: int) -> int:  # (-1 for a tensor with too few dims: the checker says which)
        return t.shape[dim] if t.dim() >= -dim else -1

    return size(a["gamma1"], -1), size(a["gamma2"], -1), size(a["cos"], -1), size(a["wuk"], -2)


def check_mla_preprocess_args(a: dict) -> None:
    """Raise ValueError naming the first limit, shape, dtype, layout or device rule the arguments
    break (everything but the slot values, which only the kernels can read)."""
    x, cache_mode, quant_mode = a["input"], a["cache_mode"], a["quant_mode"]
    _require(cache_mode in (KVCACHE, KROPE_CTKV, INT8_NZCACHE, NZCACHE),
             f"cache_mode must be 0 (KVCACHE), 1 (KROPE_CTKV), 2 (INT8_NZCACHE) or 3 (NZCACHE), got {cache_mode}")
    _require(quant_mode in (PER_TENSOR_QUANT_ASYMM, PER_TOKEN_QUANT_SYMM),
             f"quant_mode {quant_mode} is not supported: only 0 (PER_TENSOR_QUANT_ASYMM) and 1 "
             "(PER_TOKEN_QUANT_SYMM); 2 (PER_TOKEN_QUANT_ASYMM) and 3 (UNQUANT) are refused")
    _require(x.dim() == 2 and x.dtype in HALF_DTYPES,
             f"input must be [tokens, hidden] float16/bfloat16, got {_shape(x)} {x.dtype}")
    for name, t in a.items():
        if isinstance(t, Tensor) and t.device != x.device:
            raise ValueError(f"{NAME}: every tensor must be on input's device {x.device}, got {name} on {t.device}")
    dtype, (tokens, hidden) = x.dtype, x.shape
    limits = kernel_size_limits()  # (the NPU kernel's ranges, not the computation's: see registry)
    _require(1 <= tokens and (tokens <= MAX_TOKENS or not limits),
             f"token count must be in 1..{MAX_TOKENS}, got {tokens}")
    if limits:
        _require(HIDDEN_RANGE[0] <= hidden <= HIDDEN_RANGE[1],
                 f"hidden size must be 7168 or in {HIDDEN_RANGE[0]}..{HIDDEN_RANGE[1]}, got {hidden}")
    heads = a["wuk"].shape[0] if a["wuk"].dim() == 3 else -1
    q_lora, kv_lora, rope, nope = dims(a) if not limits else (Q_LORA, KV_LORA, ROPE, NOPE)
    _require(rope > 0 and rope % 2 == 0, f"the rope dim (cos's last) must be even, got {rope}")
    qkv = q_lora + kv_lora + rope
    _require(_shape(a["wuk"]) == (heads, nope, kv_lora) and heads > 0,
             f"wuk must be [heads, {nope}, {kv_lora}], got {_shape(a['wuk'])}")
    _require(_shape(a["wdqkv"]) == (qkv, hidden), f"wdqkv must be [{qkv}, {hidden}], got {_shape(a['wdqkv'])}")
    _require(_shape(a["wuq"]) == (heads * (nope + rope), q_lora),
             f"wuq must be [{heads * (nope + rope)}, {q_lora}], got {_shape(a['wuq'])}")
    for name, size in (("gamma1", q_lora), ("beta1", q_lora), ("gamma2", kv_lora)):
        _require(_shape(a[name]) == (size,), f"{name} must be [{size}], got {_shape(a[name])}")
    for name in ("cos", "sin"):
        _require(_shape(a[name]) == (tokens, rope), f"{name} must be [{tokens}, {rope}], got {_shape(a[name])}")
    for name in ("gamma1", "beta1", "gamma2", "cos", "sin", "wuk"):
        _require(a[name].dtype == dtype, f"{name} must be {dtype} (input's dtype), got {a[name].dtype}")
    _require(_shape(a["slotmapping"]) == (tokens,) and a["slotmapping"].dtype in (torch.int32, torch.int64),
             f"slotmapping must be int32/int64 [{tokens}], got {_shape(a['slotmapping'])} {a['slotmapping'].dtype}")
    quantized = is_quantized(x, a["wdqkv"])
    if quantized:
        _require(a["wdqkv"].dtype == torch.int8 and a["wuq"].dtype == torch.int8,
                 f"weights must be int8 (quantized path) or {dtype} (unquantized path), got wdqkv "
                 f"{a['wdqkv'].dtype}, wuq {a['wuq'].dtype}")
        for name, size in (("gamma0", hidden), ("beta0", hidden)):
            _require(_shape(a[name]) == (size,) and a[name].dtype == dtype,
                     f"{name} must be [{size}] {dtype}, got {_shape(a[name])} {a[name].dtype}")
        for name, size in (("descale0", qkv), ("descale1", heads * (nope + rope))):
            _require(_shape(a[name]) == (size,) and a[name].dtype in FLOAT_DTYPES,
                     f"{name} must be [{size}] float32/float16/bfloat16, got {_shape(a[name])} {a[name].dtype}")
        if quant_mode == PER_TENSOR_QUANT_ASYMM:
            for i, size in ((0, qkv), (1, heads * (nope + rope))):
                scale, offset, bias = a[f"quant_scale{i}"], a[f"quant_offset{i}"], a[f"bias{i}"]
                _require(scale is not None and _shape(scale) == (1,) and scale.dtype == dtype,
                         f"quant_scale{i} must be a [1] {dtype} tensor (per-tensor quant in the input's dtype)")
                _require(offset is not None and _shape(offset) == (1,) and offset.dtype == torch.int8,
                         f"quant_offset{i} must be a [1] int8 tensor (per-tensor quant)")
                _require(bias is None or (_shape(bias) == (size,) and bias.dtype == torch.int32),
                         f"bias{i} must be [{size}] int32")
    else:
        _require(a["wuq"].dtype == dtype, f"unquantized path: wuq must be {dtype}, got {a['wuq'].dtype}")
    kv_cache, kv_rope = a["kv_cache"], a["kv_cache_rope"]
    _require(not _overlap(kv_cache, kv_rope),
             "kv_cache and kv_cache_rope must not share memory: the op updates both in place (schema "
             "Tensor(a!) kv_cache, Tensor(b!) kv_cache_rope); in cache_mode 0 (KVCACHE) pass an empty tensor, "
             "e.g. torch.empty(0), as kv_cache_rope")
    _require(kv_cache.dim() == 4 and kv_cache.shape[2] == 1, f"kv_cache must be [blocks, block_size, 1, dim], "
             f"got {_shape(kv_cache)}")
    block_size = kv_cache.shape[1]
    _require(1 <= block_size <= 128 or block_size == 256, f"block_size must be in [1, 128] or 256, got {block_size}")
    if cache_mode in (INT8_NZCACHE, NZCACHE):
        _require(block_size == 128, f"cache_mode {cache_mode} (NZ cache) needs block_size 128, got {block_size}")
    width = kv_lora + rope if cache_mode == KVCACHE else kv_lora
    cache_dtype = torch.int8 if cache_mode == INT8_NZCACHE else dtype
    _require(kv_cache.shape[3] == width and kv_cache.dtype == cache_dtype,
             f"kv_cache must be [blocks, block_size, 1, {width}] {cache_dtype} for cache_mode {cache_mode}, "
             f"got {_shape(kv_cache)} {kv_cache.dtype}")
    caches = [("kv_cache", kv_cache)]
    if cache_mode != KVCACHE:
        _require(_shape(kv_rope) == (kv_cache.shape[0], block_size, 1, rope) and kv_rope.dtype == dtype,
                 f"kv_cache_rope must be [{kv_cache.shape[0]}, {block_size}, 1, {rope}] {dtype}, "
                 f"got {_shape(kv_rope)} {kv_rope.dtype}")
        caches.append(("kv_cache_rope", kv_rope))
    for name, cache in caches:  # the kernels write rows of the cache's [slots, dim] view
        _require(cache.is_contiguous(), f"{name} must be contiguous (the op writes rows of its "
                 f"[blocks * block_size, dim] view), got strides {tuple(cache.stride())}")
    if cache_mode == INT8_NZCACHE:
        _require(a["ctkv_scale"] is not None and a["ctkv_scale"].numel() == 1, "INT8_NZCACHE needs ctkv_scale [1]")
        _require(a["q_nope_scale"] is not None and a["q_nope_scale"].numel() == heads,
                 f"INT8_NZCACHE needs q_nope_scale with {heads} values (one per head)")


def _overlap(a: Tensor, b: Tensor) -> bool:
    """a and b are one tensor, or views of one storage (fake and functional tensors included)."""
    if a is b:
        return True
    if a.numel() == 0 or b.numel() == 0:
        return False
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except Exception:  # a tensor without storage (e.g. functional wrappers): only identity tells
        return torch._C._is_alias_of(a, b)


def check_slots(slots: Tensor, cache: Tensor) -> None:
    """IndexError for a slot outside ``-S..S-1`` (S = blocks * block_size), as Python indexing."""
    count = cache.shape[0] * cache.shape[1]
    bad = (slots < -count) | (slots >= count)
    if bool(bad.any()):
        raise IndexError(f"{NAME}: slotmapping value {int(slots[bad][0])} is out of range for a cache of "
                         f"{count} slots (valid: -{count}..{count - 1}, negative counting from the end)")


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


def slot_rows(slots: Tensor, cache: Tensor) -> Tensor:
    """The row of each slot in the cache's [blocks * block_size, dim] view (int64; negative
    slots count from the end). Out-of-range slots stay out of range."""
    count = cache.shape[0] * cache.shape[1]
    slots = slots.long()
    return torch.where(slots < 0, slots + count, slots)


def write_cache(cache: Tensor, rows: Tensor, slots: Tensor, nz: bool) -> None:
    """cache[slot] = rows (ND or NZ layout), slots as Python indexes (checked: :func:`check_slots`)."""
    slots, rows = slot_rows(slots, cache), rows.to(cache.dtype)
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
    q_lora, kv_lora, rope, nope = dims(a)
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
        q_latent, kv = qkv.split([q_lora, kv_lora + rope], dim=-1)
        stages["q_latent_int8"], q = project(q_latent, a["gamma1"], a["beta1"], a["quant_scale1"],
                                             a["quant_offset1"], a["wuq"], a["descale1"], a["bias1"])
    else:
        # matmuls of the input dtype, accumulated in fp32 and rounded once (the NPU's cube unit; half_matmul)
        qkv = half_matmul(torch.mm, x, a["wdqkv"].t())
        q_latent, kv = qkv.split([q_lora, kv_lora + rope], dim=-1)
        q = half_matmul(torch.mm, rms_norm(q_latent, a["gamma1"], a["beta1"], eps).to(dtype), a["wuq"].t())
    stages["qkv"] = qkv
    heads = a["wuk"].shape[0]
    q_nope, q_rope = q.view(-1, heads, nope + rope).split([nope, rope], dim=-1)
    ctkv = rms_norm(kv[:, :kv_lora], a["gamma2"], None, eps).to(dtype)
    cos, sin = a["cos"].float().unsqueeze(1), a["sin"].float().unsqueeze(1)
    q_rope = (q_rope.float() * cos + rotate(q_rope.float(), "half") * sin).to(dtype)
    k_rope = (kv[:, kv_lora:].float() * a["cos"].float() + rotate(kv[:, kv_lora:].float(), "half")
              * a["sin"].float()).to(dtype)
    # (in float32, rounded once: the cube unit's accumulation; a CPU's 16-bit bmm is ~10x slower)
    q_nope = torch.bmm(q_nope.transpose(0, 1).float(), a["wuk"].float()).to(dtype).transpose(0, 1).contiguous()
    stages.update(q_nope_absorbed=q_nope, q_rope=q_rope, ctkv=ctkv, k_rope=k_rope)
    return stages


def cache_written(cache: Tensor, rows: Tensor, slots: Tensor, nz: bool) -> Tensor:
    """Functional cache write (a new cache) for compilers, with static shapes and no copy of
    the cache: one ``index_put``, whose compiled form (inductor) wraps negative indexes and
    raises on out-of-range ones exactly as eager indexing does."""
    blocks, block_size, _, dim = cache.shape
    rows = rows.to(cache.dtype)
    if not nz:  # whole rows of the [slots, dim] view
        return cache.view(-1, dim).index_put((slots.long(),), rows).view(cache.shape)
    # element d of a slot's row lives at [block][d // c0][offset][d % c0] of the flat cache
    c0 = 32 if cache.dtype == torch.int8 else 16
    row = slot_rows(slots, cache)[:, None]
    d = torch.arange(dim, device=cache.device)[None, :]
    block, offset = row // block_size, row % block_size
    index = block * block_size * dim + (d // c0) * block_size * c0 + offset * c0 + d % c0
    index = torch.where((row >= 0) & (row < blocks * block_size), index, cache.numel())  # out of range stays so
    return cache.reshape(-1).index_put((index.reshape(-1),), rows.reshape(-1)).view(cache.shape)


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
    check_slots(a["slotmapping"], a["kv_cache"])  # (before any work: an out-of-range slot costs nothing)
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


@torch.library.custom_op("npu_fuse::mla_preprocess", mutates_args=("kv_cache", "kv_cache_rope"), schema=SCHEMA)
def _mla_preprocess_op(*args, **kwargs):
    return _run(bind_args(args, kwargs))


# (name, keyword-only, has a default, default) of each argument of SCHEMA, as plain Python values
ARGUMENTS = tuple((arg.name, arg.kwarg_only, arg.has_default_value(), arg.default_value)
                  for arg in torch.ops.npu_fuse.mla_preprocess.default._schema.arguments)


@_mla_preprocess_op.register_fake
def _(*args, **kwargs):
    a = bind_args(args, kwargs)
    check_mla_preprocess_args(a)
    x, cache_mode = a["input"], a["cache_mode"]
    tokens, heads = x.shape[0], a["wuk"].shape[0]
    _, kv_lora, rope, _ = dims(a)
    if cache_mode == KVCACHE:
        return x.new_empty(tokens, heads, kv_lora + rope), x.new_empty(0)
    q_dtype = torch.int8 if cache_mode == INT8_NZCACHE else x.dtype
    return x.new_empty(tokens, heads, kv_lora, dtype=q_dtype), x.new_empty(tokens, heads, rope)


def mla_preprocess(*args, **kwargs):
    """DeepSeek's MLA attention prologue in one call, as ATB's ``npu_mla_preprocess``.

    input [T, hidden] -> [RMSNorm(gamma0, beta0) + int8 quant] -> ``@ wdqkv^T`` (descale0, bias0)
    split into the q latent [T, 1536] and kv [T, 576] -> q: RMSNorm(gamma1, beta1) [+ quant] ->
    ``@ wuq^T`` (descale1, bias1) -> q_nope | q_rope; kv: RMSNorm(kv[:, :512]; gamma2) | k_rope ->
    half RoPE (cos, sin [T, 64]) on q_rope and k_rope -> ``q_nope @ wuk`` ([N, 128, 512]) -> the
    rows written into the paged caches at ``slotmapping`` (Python indexing of the cache's rows).
    An int8 wdqkv is the w8a8 path (quant_scale*/quant_offset* the static per-tensor quant, quant_mode
    0; 1: per-token); an fp16/bf16 wdqkv skips the input norm and quantization. cache_mode: 0
    KVCACHE (kv_cache [blocks, block, 1, 576]), 1 KROPE_CTKV (kv_cache 512 wide, kv_cache_rope 64),
    2 INT8_NZCACHE (ctkv_scale, q_nope_scale), 3 NZCACHE.

    Returns ATB's four outputs ``(q_out0, kv_cache_out0, q_out1, kv_cache_out1)``: KVCACHE q_out0 is
    cat(absorbed q_nope, q_rope) [T, N, 576], otherwise absorbed q_nope [T, N, 512] and q_out1 q_rope
    [T, N, 64]; the cache outputs are the caches, updated in place. Inference only (no autograd).
    """
    a = mla_preprocess.__signature__.bind(*args, **kwargs).arguments  # TypeError on a misspelt keyword
    q_out0, q_out1 = torch.ops.npu_fuse.mla_preprocess(**a)
    return q_out0, a["kv_cache"], q_out1, a["kv_cache_rope"]


mla_preprocess.__signature__ = _signature()
decomposition(torch.ops.npu_fuse.mla_preprocess.default)(mla_preprocess_functional)
refuse_autograd("mla_preprocess", "an inference op with no autograd; an input requires grad (call it under "
                "torch.no_grad())")


# -- what each SoC's lowering of the op accepts ---------------------------------------------
# Atlas A2/A3 run GE ``MlaPreprocess`` under torchair (its aclnn limits: OT @ 107749eb
# attention/mla_preprocess/docs/aclnnMlaPreprocess.md; head counts of the older doc, F2 @ 9cfcdcb3)
# and ATB's kernel eagerly (tokens <= 1024): a call must fit both.
GE_MAX_TOKENS = 256
GE_HEADS = (16, 32, 64, 128)
GE_HIDDEN_MULTIPLE = 256
GE_CACHE_MODES = (KVCACHE, KROPE_CTKV)  # the ND caches the conversion scatters into (converters/mla_preprocess.py)


def ge_modes_refusal(cache_mode: int, quant_mode: int) -> Optional[str]:
    """Why the GE conversion (any SoC) cannot take these modes, or None."""
    if cache_mode not in GE_CACHE_MODES:
        return f"cache_mode {cache_mode}: the GE conversion writes ND caches (KVCACHE 0, KROPE_CTKV 1) only"
    if quant_mode != PER_TENSOR_QUANT_ASYMM:
        return f"quant_mode {quant_mode}: the GE op implements PER_TENSOR_QUANT_ASYMM (0) only"
    return None


def mla_preprocess_ge_refusal(tokens, heads, hidden) -> Optional[str]:
    """Why GE ``MlaPreprocess`` (Atlas A2/A3) cannot take these sizes, or None (the converter then
    spells the stages out in other GE ops)."""
    if not isinstance(tokens, int):
        return f"token count is symbolic ({tokens}); MlaPreprocess needs a static one of at most {GE_MAX_TOKENS}"
    if tokens > GE_MAX_TOKENS:
        return f"{tokens} tokens: MlaPreprocess takes at most {GE_MAX_TOKENS}"
    if heads not in GE_HEADS:
        return f"{heads} heads: MlaPreprocess takes {', '.join(map(str, GE_HEADS))}"
    if hidden % GE_HIDDEN_MULTIPLE:
        return f"hidden size {hidden}: MlaPreprocess takes a multiple of {GE_HIDDEN_MULTIPLE}"
    return None


@soc_limits(torch.ops.npu_fuse.mla_preprocess.default)
def mla_preprocess_soc_limits(soc: str, *args, **kwargs) -> Optional[str]:
    """Why the op's NPU lowering on ``soc`` cannot take this call, or None."""
    if soc == GENERIC:
        return None
    a = bind_args(args, kwargs)
    refusal = ge_modes_refusal(a["cache_mode"], a["quant_mode"])
    if refusal or soc not in A2_A3:  # Ascend950: no MlaPreprocess there, the conversion spells the stages out
        return refusal
    tokens, hidden = a["input"].shape
    return mla_preprocess_ge_refusal(tokens, a["wuk"].shape[0], hidden)


# -- the eager NPU kernel: torch_npu's ATB MlaPreprocess ---------------------------------------
# torch_npu 2.13.0 (torch_npu/lib/libop_plugin_atb.so; doc torch_npu/op_plugin/atb/_atb_api_docs.py):
# npu_mla_preprocess(input, gamma0, beta0, wdqkv, descale0, gamma1, beta1, wuq, descale1, gamma2, cos, sin,
# wuk, kv_cache, kv_cache_rope, slotmapping, *, quant_scale0, quant_offset0, bias0, quant_scale1,
# quant_offset1, bias1, ctkv_scale, q_nope_scale, str? cache_mode, str? quant_mode) -> 4 Tensors.
ATB_CACHE_MODES = {KROPE_CTKV: "krope_ctkv", INT8_NZCACHE: "int8_nzcache", NZCACHE: "nzcache"}
ATB_QUANT_MODES = {PER_TENSOR_QUANT_ASYMM: "per_tensor_quant_asymm", PER_TOKEN_QUANT_SYMM: "per_token_quant_symm"}
ATB_EPSILON = 1e-6  # the binding has no epsilon; ATB's MlaPreprocess goldens normalize with 1e-6


def _atb_mla_preprocess():
    import torch_npu

    return torch_npu.atb.npu_mla_preprocess


def atb_descale(descale: Tensor, dtype: torch.dtype) -> Tensor:
    """ATB's dequant scale: float32 with bf16 input; with fp16 input the float32 bits as int64
    (ATB's MlaPreprocess tests: ``torch.frombuffer(f32 bytes, int32).to(int64)``)."""
    descale = descale.float().contiguous()
    return descale.view(torch.int32).to(torch.int64) if dtype == torch.float16 else descale


def _atb_call(a: dict, kv_cache: Tensor, kv_cache_rope: Tensor, slots: Tensor, cache_mode: int) -> tuple:
    """ATB's binding takes the op's tensors in its order: the required ones positionally, the
    optional ones by name, and the modes as strings."""
    given = dict(a, kv_cache=kv_cache, kv_cache_rope=kv_cache_rope, slotmapping=slots.int())
    if is_quantized(a["input"], a["wdqkv"]):
        given.update(descale0=atb_descale(a["descale0"], a["input"].dtype),
                     descale1=atb_descale(a["descale1"], a["input"].dtype))
    required = [given[name] for name, _, has_default, _ in ARGUMENTS if not has_default]
    optional = {name: given[name] for name, keyword_only, has_default, _ in ARGUMENTS
                if has_default and not keyword_only}
    return _atb_mla_preprocess()(*required, **optional, cache_mode=ATB_CACHE_MODES[cache_mode],
                                 quant_mode=ATB_QUANT_MODES[a["quant_mode"]])


def mla_preprocess_npu(a: dict) -> tuple:
    """The op on an NPU. ATB skips tokens whose slot is negative and has no KVCACHE mode in
    torch_npu, so the ND modes let ATB write a scratch cache pair (token t at slot t) and
    scatter its rows into the real caches with Python indexing; the NZ modes get their slots
    wrapped into range. Off the Atlas A2/A3 family (no ATB kernel) or with another epsilon,
    the reference kernel runs on the NPU."""
    from npu_fuse_backend.soc import resolve_soc

    check_mla_preprocess_args(a)
    if resolve_soc() not in A2_A3 or a["epsilon"] != ATB_EPSILON:
        return _run(a)
    mode, x, slots = a["cache_mode"], a["input"], a["slotmapping"]
    if mode in (INT8_NZCACHE, NZCACHE):
        q_nope, kv_out, q_rope, kr_out = _atb_call(a, a["kv_cache"], a["kv_cache_rope"],
                                                   slot_rows(slots, a["kv_cache"]), mode)
        for cache, out in ((a["kv_cache"], kv_out), (a["kv_cache_rope"], kr_out)):
            if out.data_ptr() != cache.data_ptr():
                cache.copy_(out)
        return q_nope, q_rope
    tokens = x.shape[0]
    ctkv = x.new_empty(tokens, 1, 1, KV_LORA)
    k_rope = x.new_empty(tokens, 1, 1, ROPE)
    q_nope, ctkv, q_rope, k_rope = _atb_call(a, ctkv, k_rope, torch.arange(tokens, device=x.device), KROPE_CTKV)
    ctkv, k_rope = ctkv.view(tokens, KV_LORA), k_rope.view(tokens, ROPE)
    if mode == KVCACHE:
        a["kv_cache"].view(-1, KV_LORA + ROPE).index_put_((slots.long(),), torch.cat([ctkv, k_rope], -1))
        return torch.cat([q_nope, q_rope], dim=-1), q_rope.new_empty(0)
    a["kv_cache"].view(-1, KV_LORA).index_put_((slots.long(),), ctkv)
    a["kv_cache_rope"].view(-1, ROPE).index_put_((slots.long(),), k_rope)
    return q_nope, q_rope


@npu_kernel(_mla_preprocess_op)
def _mla_preprocess_npu(*args, **kwargs):
    return mla_preprocess_npu(bind_args(args, kwargs))
