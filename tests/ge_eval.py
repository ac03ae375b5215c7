"""Run a GE GraphDef on CPU with torch: enough ops to execute what the MLA converter emits, so
its GE graphs are checked for numbers, not only for names.

Each op follows its CANN/TF definition (input order and attrs as the IR names them); ops update
their ``var``/ref inputs in place as GE ref ops do. ``MlaPreprocess`` runs as the op contract it
implements (ATB's MLA prologue on the given caches, token slots as written), the reference kernel
of ``npu_fuse::mla_preprocess`` standing in for the NPU kernel. An op outside the table is an
error naming it.
"""

import re

import torch


def _torch_dtype(ge_dtype: int) -> torch.dtype:
    from torchair.ge._ge_graph import ge_type_to_torch_type

    return ge_type_to_torch_type(ge_dtype)


def _const(op) -> torch.Tensor:
    from torchair._ge_concrete_graph import ge_ir_pb2
    from torchair.ge._ge_graph import _ge_proto_dtype_to_ge_dtype

    value = op.attr["value"].t
    dtype = _torch_dtype(_ge_proto_dtype_to_ge_dtype(value.desc.dtype))
    shape = list(value.desc.shape.dim)
    assert value.desc.dtype != ge_ir_pb2.DataType.Value("DT_UNDEFINED")
    if not value.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(value.data), dtype=dtype).clone().reshape(shape)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _matmul(a, b, ta, tb):
    a, b = (a.transpose(-1, -2) if ta else a), (b.transpose(-1, -2) if tb else b)
    if a.dtype == torch.int8:  # int32 accumulation (exact in float64 for int8 operands)
        return (a.double() @ b.double()).to(torch.int32)
    return (a.float() @ b.float()).to(a.dtype)


def _mla_preprocess(inputs, attrs):
    """MlaPreprocess (F1 op-def) as the op contract: the reference kernel on the given caches."""
    from npu_fuse_backend.lowering.ops import mla_preprocess as M

    a = {name.replace("_0", "0").replace("_1", "1").replace("_2", "2"): t for name, t in inputs.items()}
    a["slotmapping"] = a.pop("slot_mapping")
    for name in ("descale0", "descale1"):
        if a[name].dtype == torch.int64:  # fp16 input: the float32 bits
            a[name] = a[name].to(torch.int32).view(torch.float32)
    quantized = a["wdqkv"].dtype == torch.int8
    assert attrs["do_rms_norm"] == quantized, "the op normalizes the input exactly when it quantizes it"
    assert attrs["wdq_dim"] == M.Q_LORA and attrs["transepose_wdq"] and attrs["transepose_wuq"]
    assert a["slotmapping"].dtype == torch.int32 and bool((a["slotmapping"] >= 0).all())
    kv_cache, kv_rope = a["kv_cache"].clone(), a["kv_cache_rope"].clone()  # fresh outputs, as GE allocates them
    if not quantized:
        for name in ("quant_scale0", "quant_offset0", "bias0", "quant_scale1", "quant_offset1", "bias1"):
            a[name] = None
    a.update(kv_cache=kv_cache, kv_cache_rope=kv_rope, cache_mode=attrs["cache_mode"],
             quant_mode=attrs["quant_mode"], epsilon=attrs["epsilon"])
    q0, q1 = M._run(a)
    return q0, kv_cache, q1, kv_rope


def _attrs(op) -> dict:
    out = {}
    for name, value in op.attr.items():
        field = value.WhichOneof("value")
        if field == "list":
            out[name] = list(value.list.i) or list(value.list.s)
        elif field is not None:
            out[name] = getattr(value, field)
    return out


OPS = {
    "Cast": lambda i, a: i[0].to(_torch_dtype(a["dst_type"])),
    "Bitcast": lambda i, a: i[0].view(_torch_dtype(a["type"])),
    "Mul": lambda i, a: i[0] * i[1],
    "Add": lambda i, a: i[0] + i[1],
    "Div": lambda i, a: i[0] / i[1],
    "Rsqrt": lambda i, a: torch.rsqrt(i[0]),
    "ReduceMean": lambda i, a: i[0].mean(i[1].tolist(), keepdim=a.get("keep_dims", False)),
    "Round": lambda i, a: torch.round(i[0]),
    "ClipByValue": lambda i, a: torch.clamp(i[0], i[1].item(), i[2].item()),
    "MatMulV2": lambda i, a: _matmul(i[0], i[1], a.get("transpose_x1"), a.get("transpose_x2")),
    "BatchMatMulV2": lambda i, a: _matmul(i[0], i[1], a.get("adj_x1"), a.get("adj_x2")),
    "Reshape": lambda i, a: i[0].reshape(i[1].tolist()),
    "Slice": lambda i, a: i[0][tuple(slice(o, None if s == -1 else o + s) for o, s in zip(i[1].tolist(),
                                                                                         i[2].tolist()))],
    "Transpose": lambda i, a: i[0].permute(i[1].tolist()),
    "ConcatV2": lambda i, a: torch.cat(i[:-1], dim=int(i[-1])),
    "Pack": lambda i, a: torch.stack(i, dim=a.get("axis", 0)),
    "Fill": lambda i, a: torch.full(i[0].tolist(), i[1].item(), dtype=i[1].dtype),
    "Less": lambda i, a: i[0] < i[1],
    "SelectV2": lambda i, a: torch.where(i[0], i[1], i[2]),
    "FloorDiv": lambda i, a: torch.div(i[0], i[1], rounding_mode="floor"),
    "FloorMod": lambda i, a: torch.remainder(i[0], i[1]),
    "RotaryPositionEmbedding": lambda i, a: (i[0].float() * i[1].float()
                                             + _rotate_half(i[0].float()) * i[2].float()).to(i[0].dtype),
    "TensorMove": lambda i, a: i[0].clone(),
    "Identity": lambda i, a: i[0],
}


def run_graph(graph, inputs: list) -> list:
    """The NetOutput values of ``graph`` for the compiled function's inputs; the inputs a ref op or
    an Assign updates are updated in place, as on the device. A Data op is named after the FX
    placeholder it feeds (``arg<i>_1``: input i; torchair leaves unused inputs out)."""
    values = {}

    def get(name):
        op_name, index = name.rsplit(":", 1)
        return values[op_name][int(index)]

    for op in graph.op:
        args = [get(name) for name in op.input if name and not name.endswith(":-1")]
        attrs = _attrs(op)
        if op.type == "Data":
            out = [inputs[int(re.fullmatch(r"arg(\d+)_1", op.name).group(1))]]
        elif op.type == "Const":
            out = [_const(op)]
        elif op.type == "NetOutput":
            return args
        elif op.type == "Assign":
            args[0].copy_(args[1])
            out = [args[0]]
        elif op.type == "ScatterNdUpdate":  # var[indices] = updates, in place: output var is input var
            var, indices, updates = args
            var[tuple(indices.long().unbind(-1))] = updates.to(var.dtype)
            out = [var]
        elif op.type == "MlaPreprocess":
            names = [d.name for d in op.input_desc]
            out = list(_mla_preprocess(dict(zip(names, args)), attrs))
        elif op.type in OPS:
            out = [OPS[op.type](args, attrs)]
        else:
            raise NotImplementedError(f"ge_eval has no {op.type} ({op.name})")
        values[op.name] = out
    raise AssertionError("graph without NetOutput")
