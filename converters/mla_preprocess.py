"""npu_fuse::mla_preprocess -> GE: ``MlaPreprocess`` on Atlas A2/A3, the stages in ordinary GE
ops elsewhere, the cache rows written by ``ScatterNdUpdate`` in both.

Which GE op (decision, with the evidence):

- ``MlaPreprocess`` (F1 ``attention/mla_preprocess/op_host/mla_preprocess_def.cpp``) is our op's
  contract: one fused wdqkv split at 1536, RMSNorms with beta, static per-tensor asymmetric
  quant with an int8 offset, int32 bias and per-channel dequant scale, one [blocks, bs, 1, 576]
  cache in KVCACHE mode. It exists on ascend910b / ascend910_93 only.
- ``MlaProlog``/``V2``/``V3`` (OT ``attention/mla_prolog*/op_host/*_def.cpp``) fit only a part of
  it: separate weight_dq and weight_dkv_kr, gamma-only norms, dynamic per-token quant scales
  (dequant_scale_x/_w_*, no offset, no int32 bias), and two caches (kv_cache [.., 512] and
  kr_cache [.., 64]): neither the w8a8 path nor the KVCACHE cache the fusion writes can be
  expressed, and a zero beta1 is a runtime value the converter cannot see. So: MlaPreprocess.

No copy of the cache (the KV cache is a graph input, updated in place):

- MlaPreprocess's cache outputs are named ``kv_cache_out``/``kr_cache_out``, not like their inputs,
  so GE does not alias them with the caches, and its kernel writes the rows through the output
  address (F1 ``op_kernel/mla_preprocess_bf16.h``: ``keycacheGmTensor1.SetGlobalBuffer(keycacheOutGm)``):
  in a GE graph only the written rows of ``kv_cache_out`` are defined, the rest of the cache is
  not. torchair's copy removal also only knows the ops of its fixed table
  (``_ge_concrete_graph/graph_pass.py`` ``_get_output_to_input_ref_idx``), which lacks it.
- So MlaPreprocess writes a scratch cache, token t at slot t (block size 128, its documented one),
  and the rows go into the real cache with ``ScatterNdUpdate`` (ON
  ``index/scatter_nd_update/op_host/scatter_nd_update_def.cpp``: 910b, 910_93, 950; output ``var``
  is its input ``var``), emitted last, whose ``var`` is the cache torchair's
  auto_functionalized_v2 copied: a table op at its mapped input, so torchair binds the update to
  ``var`` and its ``optimize_reference_op_redundant_copy`` drops the TensorMove of the graph input.
- ScatterNdUpdate does not support out-of-range or negative indexes (its aclnn doc): negative
  slots are wrapped into range first (the op's Python-index meaning); an out-of-range slot is not
  detected on the NPU (the reference kernel and the inductor lowering raise).

Elsewhere (Ascend950: no MlaPreprocess; ``generic``: the graph must run on every SoC; a CANN
without MlaPreprocess) the stages are spelled out in ordinary GE ops (fp32 RMSNorm and
quantize math, int8 MatMulV2 + dequant, RotaryPositionEmbedding, BatchMatMulV2) in the
reference kernel's order and roundings, then the same ScatterNdUpdate.

NZ weights: MlaPreprocess takes wdqkv/wuq as FRACTAL_NZ; the converter declares that format on
its inputs. On the NPU pass NZ weights (``torch_npu.npu_format_cast(w, 29)``, as for MlaProlog)
or GE converts them on every call. Cache modes: KVCACHE (0) and KROPE_CTKV (1), quant mode 0:
what ``@soc_limits`` lets the fusion emit; other calls are refused here with the reason.
"""

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F32, I8, I32, I64, Support
from torchair.ge import attr, custom_op
from torchair._ge_concrete_graph.utils import specific_op_input_layout
from torchair.ge._ge_graph import DataType, Tensor, torch_type_to_ge_type

from npu_fuse_backend.lowering.ops import mla_preprocess as mla
from npu_fuse_backend.soc import A2_A3, ASCEND950, GENERIC
from npu_fuse_backend.converters.common import declare_ge_ops, target_soc

# MlaPreprocess's 24 required inputs, in op-def order
GE_INPUTS = ("input", "gamma_0", "beta_0", "quant_scale_0", "quant_offset_0", "wdqkv", "descale_0", "bias_0",
             "gamma_1", "beta_1", "quant_scale_1", "quant_offset_1", "wuq", "descale_1", "bias_1", "gamma_2", "cos",
             "sin", "wuk", "kv_cache", "kv_cache_rope", "slot_mapping", "ctkv_scale", "q_nope_scale")
GE_OUTPUTS = ["q_out", "kv_cache_out", "q_rope_out", "kr_cache_out"]
NZ_INPUTS = ("wdqkv", "wuq")
SCRATCH_BLOCK = 128  # MlaPreprocess's documented block size (aclnnMlaPreprocess.md)


def _tokens_heads(a) -> tuple:
    return a["input"].symsize[0], a["wuk"].symsize[0]


def _dtype(t: Tensor):
    """A converter input's GE dtype, from its FX value (the desc of a GE op's output may not know it)."""
    return torch_type_to_ge_type(t.meta.dtype) if isinstance(t.meta, torch.Tensor) else t.dtype


def _quantized(a) -> bool:
    return _dtype(a["wdqkv"]) == DataType.DT_INT8


def _const(value, dtype) -> Tensor:
    return ge.Const(value, dtype=dtype)


def _f32(t: Tensor) -> Tensor:
    return t if _dtype(t) == DataType.DT_FLOAT else ge.Cast(t, dst_type=DataType.DT_FLOAT)


def _fill(shape, value, dtype) -> Tensor:
    return ge.Fill(_const(list(shape), DataType.DT_INT64), _const(value, dtype))


def _descale(descale: Tensor, dtype) -> Tensor:
    """MlaPreprocess's dequant scale: float32 for bf16 input; for fp16 input the float32 bits as
    int64 (ATB's MlaPreprocess tests: ``torch.frombuffer(f32 bytes, int32).to(int64)``).

    The int32 bits are widened without a Cast: each one paired with its sign word (little-endian:
    low word first) and the pairs bitcast to int64. torchair infers the symbolic shapes of the ops
    a converter emits for an op GE does not build in (MlaPreprocess) and knows a Cast only of a
    tensor it has inferred; a Cast of the Bitcast made it warn "infer and generate sym shape
    failed ... 'NoneType' object has no attribute 'to'" and leave MlaPreprocess without its
    inference rule (GE then falls back to the op's own InferShape on an NPU)."""
    scale = _f32(descale)
    if dtype == DataType.DT_FLOAT16:
        low = ge.Bitcast(scale, type=DataType.DT_INT32)
        high = ge.SelectV2(ge.Less(low, _const(0, DataType.DT_INT32)), _const(-1, DataType.DT_INT32),
                           _const(0, DataType.DT_INT32))
        pairs = ge.Pack([low, high], N=2, axis=-1)  # [n, 2] int32
        scale = ge.Reshape(ge.Bitcast(pairs, type=DataType.DT_INT64), _const([-1], DataType.DT_INT64))
    return scale


def _mla_preprocess_registered() -> bool:
    from torchair.core import _torchair

    return _torchair.get_registered_ir_def("MlaPreprocess")[0] == "SUCCESS"


def _uses_mla_preprocess(a) -> bool:
    """On A2/A3 when the installed CANN has the op and the call is within its limits (a direct call
    may not be: the fusion's calls are, ``mla_preprocess_soc_limits``)."""
    tokens, heads = _tokens_heads(a)
    hidden = a["input"].symsize[1]
    return (target_soc() in A2_A3 and mla.mla_preprocess_ge_refusal(tokens, heads, hidden) is None
            and _mla_preprocess_registered())


# what the conversion cannot do without (version tolerance): MlaPreprocess is taken when the installed
# CANN has it, else the stages are spelled out (RotaryPositionEmbedding), so neither is required on A2/A3
declare_ge_ops("mla_preprocess", {
    **{soc: ("ScatterNdUpdate",) for soc in A2_A3},
    ASCEND950: ("RotaryPositionEmbedding", "ScatterNdUpdate"),
    GENERIC: ("RotaryPositionEmbedding", "ScatterNdUpdate"),
})


@declare_supported([
    Support(BF16(4, 2048), BF16(2048), BF16(2048), BF16(2112, 2048), F32(2112), BF16(1536), BF16(1536),
            BF16(3072, 1536), F32(3072), BF16(512), BF16(4, 64), BF16(4, 64), BF16(16, 128, 512),
            BF16(16, 16, 1, 576), F32(0), I64(4), cache_mode=0, quant_mode=0, epsilon=1e-6),
    Support(BF16(4, 2048), BF16(2048), BF16(2048), I8(2112, 2048), F32(2112), BF16(1536), BF16(1536),
            I8(3072, 1536), F32(3072), BF16(512), BF16(4, 64), BF16(4, 64), BF16(16, 128, 512),
            BF16(16, 16, 1, 576), F32(0), I32(4), BF16(1), I8(1), I32(2112), BF16(1), I8(1), I32(3072),
            cache_mode=0, quant_mode=0, epsilon=1e-6),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.mla_preprocess.default)
def convert_mla_preprocess(*args, meta_outputs=None, **kwargs):
    a = mla.bind_args(args, kwargs)  # the op's arguments by name
    cache_mode = a["cache_mode"]
    refusal = mla.ge_modes_refusal(cache_mode, a["quant_mode"])
    if refusal:
        raise NotImplementedError(f"npu_fuse.mla_preprocess under torchair: {refusal}")
    stages = _with_mla_preprocess(a) if _uses_mla_preprocess(a) else _stage_by_stage(a)
    q_out0, q_out1, rows = stages
    if cache_mode == mla.KVCACHE:  # q_out1 is empty in this mode; emitted before the scatter (the last op)
        q_out1 = _fill([0], 0, _dtype(a["input"]))
    else:
        _scatter_rows(a["kv_cache_rope"], rows[1], a["slotmapping"])
    # kv_cache last: torchair binds the updated cache to an output of the last op only
    _scatter_rows(a["kv_cache"], rows[0], a["slotmapping"])
    return q_out0, q_out1


def _scatter_rows(cache: Tensor, rows: Tensor, slots: Tensor) -> Tensor:
    """cache[slot] = row, slots as Python indexes into the cache's [blocks * block_size] rows."""
    blocks, block_size, _, width = cache.symsize
    slot = ge.Cast(slots, dst_type=DataType.DT_INT64)
    count = _const(blocks * block_size, DataType.DT_INT64)
    row = ge.SelectV2(ge.Less(slot, _const(0, DataType.DT_INT64)), ge.Add(slot, count), slot)
    size = _const(block_size, DataType.DT_INT64)
    indices = ge.Pack([ge.FloorDiv(row, size), ge.FloorMod(row, size)], N=2, axis=1)  # [T, 2]: (block, offset)
    updates = ge.Reshape(rows, _const([-1, 1, width], DataType.DT_INT64))
    return ge.ScatterNdUpdate(cache, indices, updates)


# -- Atlas A2/A3: MlaPreprocess into a scratch cache ----------------------------------------------
def _with_mla_preprocess(a) -> tuple:
    x = a["input"]
    dtype, quantized = _dtype(x), _quantized(a)
    tokens, heads = _tokens_heads(a)
    kv_width = mla.KV_LORA + mla.ROPE if a["cache_mode"] == mla.KVCACHE else mla.KV_LORA
    blocks = -(-tokens // SCRATCH_BLOCK)
    q_out_width = (heads * (mla.NOPE + mla.ROPE),)
    given = {
        "input": x, "gamma_0": a["gamma0"], "beta_0": a["beta0"], "wdqkv": a["wdqkv"], "gamma_1": a["gamma1"],
        "beta_1": a["beta1"], "wuq": a["wuq"], "gamma_2": a["gamma2"], "cos": a["cos"], "sin": a["sin"],
        "wuk": a["wuk"], "descale_0": _descale(a["descale0"], dtype), "descale_1": _descale(a["descale1"], dtype),
        # the op writes token t at scratch slot t; the real caches are written after it
        "kv_cache": _fill([blocks, SCRATCH_BLOCK, 1, kv_width], 0, dtype),
        "kv_cache_rope": _fill([blocks, SCRATCH_BLOCK, 1, mla.ROPE], 0, dtype),
        "slot_mapping": _const(list(range(tokens)), DataType.DT_INT32),
        "ctkv_scale": a["ctkv_scale"] if a["ctkv_scale"] is not None else _fill([1], 1, dtype),
        "q_nope_scale": a["q_nope_scale"] if a["q_nope_scale"] is not None else _fill([1], 1, dtype),
    }
    for i, width in ((0, (mla.QKV,)), (1, q_out_width)):  # unquantized: neutral, unread quant parameters
        given[f"quant_scale_{i}"] = a[f"quant_scale{i}"] if quantized else _fill([1], 1, dtype)
        given[f"quant_offset_{i}"] = a[f"quant_offset{i}"] if quantized else _fill([1], 0, DataType.DT_INT8)
        bias = a[f"bias{i}"] if quantized else None
        given[f"bias_{i}"] = bias if bias is not None else _fill(list(width), 0, DataType.DT_INT32)
    outputs = custom_op(
        "MlaPreprocess", inputs={name: given[name] for name in GE_INPUTS}, outputs=GE_OUTPUTS,
        attrs={"wdq_dim": attr.Int(mla.Q_LORA), "q_rope_dim": attr.Int(mla.ROPE), "k_rope_dim": attr.Int(mla.ROPE),
               "epsilon": attr.Float(a["epsilon"]), "q_rotary_coeff": attr.Int(2), "k_rotary_coeff": attr.Int(2),
               "transepose_wdq": attr.Bool(True), "transepose_wuq": attr.Bool(True),
               "transepose_wuk": attr.Bool(True), "cache_mode": attr.Int(a["cache_mode"]),
               "quant_mode": attr.Int(a["quant_mode"]), "do_rms_norm": attr.Bool(quantized),
               "wdkv_split_count": attr.Int(1)})
    specific_op_input_layout(outputs[0], [GE_INPUTS.index(name) for name in NZ_INPUTS], layout="FRACTAL_NZ")
    q_out, kv_out, q_rope, kr_out = outputs

    def written(scratch: Tensor, width: int) -> Tensor:  # rows 0..T-1 of the scratch cache
        flat = ge.Reshape(scratch, _const([-1, width], DataType.DT_INT64))
        return ge.Slice(flat, _const([0, 0], DataType.DT_INT64), _const([tokens, width], DataType.DT_INT64))

    if a["cache_mode"] == mla.KVCACHE:
        return q_out, None, [written(kv_out, kv_width)]
    return q_out, q_rope, [written(kv_out, mla.KV_LORA), written(kr_out, mla.ROPE)]


# -- elsewhere: the stages in ordinary GE ops ------------------------------------------------------
def _rms_norm(x: Tensor, gamma: Tensor, beta, eps: float, dtype) -> Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * gamma [+ beta] in fp32, rounded once to ``dtype``."""
    xf = _f32(x)
    mean = ge.ReduceMean(ge.Mul(xf, xf), _const([-1], DataType.DT_INT64), keep_dims=True)
    y = ge.Mul(ge.Mul(xf, ge.Rsqrt(ge.Add(mean, _const(eps, DataType.DT_FLOAT)))), _f32(gamma))
    if beta is not None:
        y = ge.Add(y, _f32(beta))
    return ge.Cast(y, dst_type=dtype)


def _projection(h: Tensor, w: Tensor, a, i: int, norm) -> Tensor:
    """Stage 1/4 + 2/5: [RMSNorm + quantize,] h @ w^T [, dequantize], in the input's dtype."""
    dtype, eps = _dtype(a["input"]), a["epsilon"]
    if not _quantized(a):
        h = _rms_norm(h, *norm, eps, dtype) if norm else h
        return ge.MatMulV2(h, w, None, None, transpose_x2=True)
    y = _f32(_rms_norm(h, *norm, eps, dtype))
    q = ge.Round(ge.Add(ge.Div(y, _f32(a[f"quant_scale{i}"])), _f32(a[f"quant_offset{i}"])))
    q = ge.Cast(ge.ClipByValue(q, _const(-128.0, DataType.DT_FLOAT), _const(127.0, DataType.DT_FLOAT)),
                dst_type=DataType.DT_INT8)
    acc = ge.MatMulV2(q, w, None, None, transpose_x2=True)  # int32 accumulation
    if a[f"bias{i}"] is not None:
        acc = ge.Add(acc, a[f"bias{i}"])
    return ge.Cast(ge.Mul(_f32(acc), _f32(a[f"descale{i}"])), dst_type=dtype)


def _slice(x: Tensor, start: list, size: list) -> Tensor:
    return ge.Slice(x, _const(start, DataType.DT_INT64), _const(size, DataType.DT_INT64))


def _rope(x4: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half rotation of x [1, T, n, 64] (BSND) with cos/sin [T, 64]."""
    table = _const([1, -1, 1, mla.ROPE], DataType.DT_INT64)
    return ge.RotaryPositionEmbedding(x4, ge.Reshape(cos, table), ge.Reshape(sin, table), mode=0)


def _stage_by_stage(a) -> tuple:
    x = a["input"]
    _, heads = _tokens_heads(a)
    norm0 = (a["gamma0"], a["beta0"]) if _quantized(a) else None
    qkv = _projection(x, a["wdqkv"], a, 0, norm0)  # [T, 2112]
    q_latent = _slice(qkv, [0, 0], [-1, mla.Q_LORA])
    kv_latent = _slice(qkv, [0, mla.Q_LORA], [-1, mla.KV_LORA])
    k_rope = _slice(qkv, [0, mla.Q_LORA + mla.KV_LORA], [-1, mla.ROPE])
    q = _projection(q_latent, a["wuq"], a, 1, (a["gamma1"], a["beta1"]))  # [T, N * 192]
    q = ge.Reshape(q, _const([1, -1, heads, mla.NOPE + mla.ROPE], DataType.DT_INT64))
    q_nope = _slice(q, [0, 0, 0, 0], [-1, -1, -1, mla.NOPE])
    q_rope = _rope(_slice(q, [0, 0, 0, mla.NOPE], [-1, -1, -1, mla.ROPE]), a["cos"], a["sin"])
    k_rope = _rope(ge.Reshape(k_rope, _const([1, -1, 1, mla.ROPE], DataType.DT_INT64)), a["cos"], a["sin"])
    ctkv = _rms_norm(kv_latent, a["gamma2"], None, a["epsilon"], _dtype(x))
    # weight absorption: [N, T, 128] @ [N, 128, 512] -> [T, N, 512]
    q_nope = ge.Transpose(ge.Reshape(q_nope, _const([-1, heads, mla.NOPE], DataType.DT_INT64)),
                          _const([1, 0, 2], DataType.DT_INT64))
    q_nope = ge.Transpose(ge.BatchMatMulV2(q_nope, a["wuk"], None, None), _const([1, 0, 2], DataType.DT_INT64))
    q_rope = ge.Reshape(q_rope, _const([-1, heads, mla.ROPE], DataType.DT_INT64))
    k_rope = ge.Reshape(k_rope, _const([-1, mla.ROPE], DataType.DT_INT64))
    if a["cache_mode"] == mla.KVCACHE:
        return (ge.ConcatV2([q_nope, q_rope], _const(-1, DataType.DT_INT32), N=2), None,
                [ge.ConcatV2([ctkv, k_rope], _const(-1, DataType.DT_INT32), N=2)])
    return q_nope, q_rope, [ctkv, k_rope]
