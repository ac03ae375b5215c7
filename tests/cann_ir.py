"""The GE operator IR the offline torchair answers with: what CANN defines, not what torchair accepts.

Two parts:

* ``CANN_OPS``: the ops our converters emit or could emit, transcribed from
  ``shared/reference/cann-ops.md`` (and the op-defs it cites). Each entry keeps its
  sources in ``source``; per input the IR kind (required/optional/dynamic), the dtypes
  and the formats the op-def fixes; the allowed dtype combinations (the op-def's
  columns); the SoCs of its AICore configs.
* torchair's ordinary ops (Data, Mul, Cast, TensorMove, Assign, ConcatV2, ...): the IR
  parsed from the ``REG_OP`` docstrings of torchair's generated builders
  (``_ge_concrete_graph/auto_generated_ge_raw_ops.py`` and ``ge/_ge_graph.py``), plus the
  three graph-structure ops that have no docstring (Data, Const, NetOutput). They carry no
  SoC list (torchair emits them for aten ops on every SoC) and dtype lists only where the
  docstring spells them out.

Source tags (see cann-ops.md): OT hicann/ops-transformer, ON hicann/ops-nn, RAW the
generated builders (``:line``), W the torch_npu 2.13.0 wheel, F1/F3 forks of ops-transformer.
"""

import dataclasses
import itertools
import re
from pathlib import Path
from typing import Any, Iterable, Optional

F16, F32, BF16 = "DT_FLOAT16", "DT_FLOAT", "DT_BF16"
I8, I32, I64 = "DT_INT8", "DT_INT32", "DT_INT64"
FLOATS = (F16, F32, BF16)

# CANN AICore config names of the SoCs npu_fuse targets (and two more the op-defs list).
ASCEND910B, ASCEND910_93, ASCEND950 = "ascend910b", "ascend910_93", "ascend950"
A2_A3 = (ASCEND910B, ASCEND910_93)
ROPE_SOCS = (ASCEND910B, ASCEND910_93, ASCEND950, "ascend960dt", "ascend350")

# GE attr type names (REG_OP spelling) -> the value type get_registered_ir_def reports.
ATTR_VALUE_TYPES = {
    "Int": "VT_INT", "Float": "VT_FLOAT", "Bool": "VT_BOOL", "String": "VT_STRING", "Str": "VT_STRING",
    "Type": "VT_DATA_TYPE", "Tensor": "VT_TENSOR", "ListInt": "VT_LIST_INT", "ListFloat": "VT_LIST_FLOAT",
    "ListBool": "VT_LIST_BOOL", "ListString": "VT_LIST_STRING", "ListStr": "VT_LIST_STRING",
    "ListType": "VT_LIST_DATA_TYPE", "ListListInt": "VT_LIST_LIST_INT", "ListListFloat": "VT_LIST_LIST_FLOAT",
}


@dataclasses.dataclass(frozen=True)
class In:
    name: str
    kind: str = "required"  # "required" | "optional" | "dynamic"
    dtypes: Optional[frozenset] = None  # None: not restricted by what we know
    formats: Optional[tuple] = None  # the formats the op-def allows; None: not fixed


@dataclasses.dataclass(frozen=True)
class Out:
    name: str
    kind: str = "required"  # "required" | "dynamic"


@dataclasses.dataclass(frozen=True)
class Attr:
    name: str
    ge_type: str  # REG_OP spelling: "Int", "Float", "ListInt", ...
    default: Any = None
    required: bool = False

    @property
    def value_type(self) -> str:
        return ATTR_VALUE_TYPES[self.ge_type]


@dataclasses.dataclass(frozen=True)
class OpIR:
    op: str
    inputs: tuple
    outputs: tuple
    attrs: tuple = ()
    socs: Optional[tuple] = None  # CANN SoC keys of the op-def; None: an ordinary op, on every SoC
    combos: Optional[tuple] = None  # allowed dtypes as {input name: dtype}, one dict per op-def column
    source: str = ""

    def input(self, name: str) -> Optional[In]:
        return next((i for i in self.inputs if i.name == name), None)

    def attr(self, name: str) -> Optional[Attr]:
        return next((a for a in self.attrs if a.name == name), None)

    def registered_ir_def(self) -> tuple:
        """What GE's GetRegisteredIrDef reports: (inputs, outputs, attrs) as name/kind pairs."""
        return ([(i.name, i.kind) for i in self.inputs], [(o.name, o.kind) for o in self.outputs],
                [(a.name, a.value_type) for a in self.attrs])


def opdef(op: str, inputs: Iterable[In], outputs: Iterable, attrs: Iterable[Attr] = (), *, socs, combos=None,
          formats=("ND",), source: str) -> OpIR:
    """An op-def entry: every input gets the op-def's formats unless it fixes its own, and its
    dtype set from the combos unless it gives one."""
    combos = tuple(combos) if combos is not None else None
    full = []
    for i in inputs:
        dtypes = i.dtypes
        if dtypes is None and combos is not None:
            dtypes = frozenset(c[i.name] for c in combos if i.name in c) or None
        full.append(dataclasses.replace(i, dtypes=dtypes, formats=i.formats or formats))
    outs = tuple(o if isinstance(o, Out) else Out(o) for o in outputs)
    return OpIR(op, tuple(full), outs, tuple(attrs), tuple(socs), combos, source)


def same_dtype(names: Iterable[str], dtypes: Iterable[str]) -> list:
    """Columns where every named input has one dtype."""
    names = list(names)
    return [{n: dt for n in names} for dt in dtypes]


def columns(table: dict) -> list:
    """Op-def ``DataType({...})`` columns: {input: [dtype per column]} -> one dict per column."""
    width = {len(v) for v in table.values()}
    assert len(width) == 1, "op-def columns of unequal length"
    return [{name: dts[k] for name, dts in table.items()} for k in range(width.pop())]


def req(name, **kw) -> In:
    return In(name, "required", **kw)


def opt(name, **kw) -> In:
    return In(name, "optional", **kw)


def _mla_preprocess() -> OpIR:
    """F1 ``attention/mla_preprocess/op_host/mla_preprocess_def.cpp`` (cann-ops.md, MlaPreprocess)."""
    x_like = ("input", "gamma_0", "beta_0", "quant_scale_0", "gamma_1", "beta_1", "quant_scale_1", "gamma_2",
              "cos", "sin", "wuk", "kv_cache_rope", "ctkv_scale", "q_nope_scale")
    order = ("input", "gamma_0", "beta_0", "quant_scale_0", "quant_offset_0", "wdqkv", "descale_0", "bias_0",
             "gamma_1", "beta_1", "quant_scale_1", "quant_offset_1", "wuq", "descale_1", "bias_1", "gamma_2",
             "cos", "sin", "wuk", "kv_cache", "kv_cache_rope", "slot_mapping", "ctkv_scale", "q_nope_scale")
    combos = []
    for x, weights_int8, cache_int8 in itertools.product((F16, BF16), (True, False), (True, False)):
        combo = {name: x for name in x_like}
        combo.update(quant_offset_0=I8, quant_offset_1=I8, bias_0=I32, bias_1=I32, slot_mapping=I32,
                     descale_0=I64 if x == F16 else F32, descale_1=I64 if x == F16 else F32,
                     wdqkv=I8 if weights_int8 else x, wuq=I8 if weights_int8 else x,
                     kv_cache=I8 if cache_int8 else x)
        combos.append(combo)
    fixed = {"wdqkv": ("FRACTAL_NZ",), "wuq": ("FRACTAL_NZ",), "wuk": ("ND", "FRACTAL_NZ"),
             "kv_cache": ("ND", "FRACTAL_NZ"), "kv_cache_rope": ("ND", "FRACTAL_NZ")}
    attrs = (Attr("wdq_dim", "Int", 128), Attr("q_rope_dim", "Int", 64), Attr("k_rope_dim", "Int", 64),
             Attr("epsilon", "Float", 1e-5), Attr("q_rotary_coeff", "Int", 2), Attr("k_rotary_coeff", "Int", 2),
             Attr("transepose_wdq", "Bool", True), Attr("transepose_wuq", "Bool", True),
             Attr("transepose_wuk", "Bool", True), Attr("cache_mode", "Int", 0), Attr("quant_mode", "Int", 0),
             Attr("do_rms_norm", "Bool", True), Attr("wdkv_split_count", "Int", 1))
    return opdef("MlaPreprocess", [req(n, formats=fixed.get(n)) for n in order],
                 ["q_out", "kv_cache_out", "q_rope_out", "kr_cache_out"], attrs, socs=A2_A3, combos=combos,
                 source="F1 mla_preprocess_def.cpp (24 required inputs, attrs, SoCs 910b/910_93); dtype columns and "
                        "formats as cann-ops.md summarises them (kv_cache/kv_cache_rope: ND for X, NZ for X or "
                        "int8; only the per-input sets are enforced for the format/cache combination)")


_MLA_PROLOG_A2 = {  # OT op-def DataType columns (A2/A3 configs) of the inputs that have columns
    "MlaProlog": dict(
        token_x=[BF16, BF16, BF16, I8, I8], weight_dq=[BF16, BF16, BF16, I8, I8],
        weight_uq_qr=[BF16, I8, I8, I8, I8], weight_uk=[BF16] * 5, weight_dkv_kr=[BF16, BF16, BF16, I8, I8],
        rmsnorm_gamma_cq=[BF16] * 5, rmsnorm_gamma_ckv=[BF16] * 5, rope_sin=[BF16] * 5, rope_cos=[BF16] * 5,
        kv_cache=[BF16, I8, BF16, I8, BF16], kr_cache=[BF16, I8, BF16, I8, BF16]),
    "MlaPrologV2": dict(
        token_x=[BF16, BF16, BF16, I8, I8, I8], weight_dq=[BF16, BF16, BF16, I8, I8, I8],
        weight_uq_qr=[BF16, I8, I8, I8, I8, I8], weight_uk=[BF16] * 6, weight_dkv_kr=[BF16, BF16, BF16, I8, I8, I8],
        rmsnorm_gamma_cq=[BF16] * 6, rmsnorm_gamma_ckv=[BF16] * 6, rope_sin=[BF16] * 6, rope_cos=[BF16] * 6,
        kv_cache=[BF16, I8, BF16, I8, BF16, I8], kr_cache=[BF16, I8, BF16, I8, BF16, BF16]),
}
_MLA_PROLOG_A2["MlaPrologV3"] = dict(_MLA_PROLOG_A2["MlaPrologV2"])  # OT @ 70ae0bdb: the V2 columns


def _mla_prolog(op: str) -> OpIR:
    """OT ``attention/mla_prolog{,_v2,_v3}/op_host/*_def.cpp`` (V1/V2 @ 88ee5c54, V3 @ 70ae0bdb)."""
    v3 = op == "MlaPrologV3"
    nz = ("FRACTAL_NZ",)
    head = [req("token_x"), req("weight_dq", formats=nz), req("weight_uq_qr", formats=nz), req("weight_uk"),
            req("weight_dkv_kr", formats=nz), req("rmsnorm_gamma_cq"), req("rmsnorm_gamma_ckv"), req("rope_sin"),
            req("rope_cos")]
    scales = [opt(n, dtypes=frozenset({F32})) for n in (
        "dequant_scale_x", "dequant_scale_w_dq", "dequant_scale_w_uq_qr", "dequant_scale_w_dkv_kr",
        "quant_scale_ckv", "quant_scale_ckr", "smooth_scales_cq")]
    index = frozenset({I64})
    if v3:
        inputs = head + [req("kv_cache"), req("kr_cache"), opt("cache_index", dtypes=index)] + scales + \
                 [opt("actual_seq_len", dtypes=frozenset({I32}))]
    else:
        inputs = head + [req("cache_index", dtypes=index), req("kv_cache"), req("kr_cache")] + scales
    outputs = ["query", "query_rope", "kv_cache", "kr_cache"]
    outputs += {"MlaProlog": [], "MlaPrologV2": ["dequant_scale_q_nope"],
                "MlaPrologV3": ["dequant_scale_q_nope", "query_norm", "dequant_scale_q_norm"]}[op]
    attrs = [Attr("rmsnorm_epsilon_cq", "Float", 1e-5), Attr("rmsnorm_epsilon_ckv", "Float", 1e-5),
             Attr("cache_mode", "String", "BNSD")]
    if v3:
        attrs += [Attr("query_norm_flag", "Bool", False), Attr("weight_quant_mode", "Int", 0),
                  Attr("kv_cache_quant_mode", "Int", 0), Attr("query_quant_mode", "Int", 0),
                  Attr("ckvkr_repo_mode", "Int", 0), Attr("quant_scale_repo_mode", "Int", 0),
                  Attr("tile_size", "Int", 128), Attr("k_nope_clip_alpha", "Float", 1.0),
                  Attr("qc_qr_scale", "Float", 1.0), Attr("kc_scale", "Float", 1.0)]
    socs = A2_A3 if v3 else A2_A3 + (ASCEND950,)
    return opdef(op, inputs, outputs, attrs, socs=socs, combos=columns(_MLA_PROLOG_A2[op]),
                 source=f"OT {op} op-def (V1/V2 @ 88ee5c54 adds an ascend950 config with fp8 columns, not listed "
                        "here; V3 @ 70ae0bdb, A2/A3 only). W (RAW:20910/21154/21406) differs: cache_mode default "
                        "PA_BSND, f16 for weight_uk/gammas/rope, V3 k_nope_clip_alpha an optional f32 input")


def _kv_rms_norm_rope_cache() -> OpIR:
    f16_bf16, cache = frozenset({F16, BF16}), frozenset({F16, BF16, I8})
    inputs = [req("kv", dtypes=f16_bf16), req("gamma", dtypes=f16_bf16), req("cos", dtypes=f16_bf16),
              req("sin", dtypes=f16_bf16), req("index", dtypes=frozenset({I64})), req("k_cache", dtypes=cache),
              req("ckv_cache", dtypes=cache)]
    inputs += [opt(n, dtypes=frozenset({F32})) for n in ("k_rope_scale", "c_kv_scale", "k_rope_offset", "c_kv_offset")]
    return opdef("KvRmsNormRopeCache", inputs, ["k_cache", "ckv_cache", "k_rope", "c_kv"],
                 [Attr("epsilon", "Float", 1e-5), Attr("cache_mode", "String", "Norm"),
                  Attr("is_output_kv", "Bool", False)], socs=A2_A3 + (ASCEND950,),
                 source="F3 kv_rms_norm_rope_cache_def.cpp; W (RAW:92511) adds an optional input v and f32 "
                        "for kv/gamma/cos/sin")


ROPE_SAME = ("x", "cos", "sin")

NORM_SOCS = (ASCEND910B, ASCEND910_93, ASCEND950, "ascend350")
# RmsNorm's (and RmsNormGrad's) op-def columns: (x, gamma)
NORM_COLUMNS = [dict(x=F16, gamma=F32), dict(x=BF16, gamma=F32), dict(x=F16, gamma=F16), dict(x=F32, gamma=F32),
                dict(x=BF16, gamma=BF16)]

CANN_OPS = {ir.op: ir for ir in [
    opdef("RotaryMul", [req("x"), req("r1"), req("r2")], ["y"], socs=A2_A3,
          combos=same_dtype(("x", "r1", "r2"), FLOATS), formats=None,
          source="RAW:48936 (IR, one dtype for all); SoCs: W torch_npu/_op_plugin_docs.py:3523-3560 "
                 "(Atlas A2/A3 training), TBE kernel: no op-def format list"),
    opdef("RotaryMulGrad", [req("x"), req("r1"), req("r2"), req("dy")], ["dx", "dr1", "dr2"],
          [Attr("need_backward", "Bool", True)], socs=A2_A3,
          combos=same_dtype(("x", "r1", "r2", "dy"), FLOATS), formats=None,
          source="RAW:48977 (IR); SoCs as RotaryMul (W npu_rotary_mul_backward converter: A2/A3 only)"),
    opdef("RotaryPositionEmbedding", [req("x"), req("cos"), req("sin"), opt("rotate")], ["y"],
          [Attr("mode", "Int", 0)], socs=ROPE_SOCS, combos=same_dtype(ROPE_SAME + ("rotate",), FLOATS),
          source="OT @ 5871dd99 rotary_position_embedding_def.cpp (kirin/310p configs, f16/f32 only, omitted)"),
    opdef("RotaryPositionEmbeddingGrad", [req("dy"), req("cos"), req("sin"), opt("x")], ["dx", "dcos", "dsin"],
          [Attr("mode", "Int", 0)], socs=ROPE_SOCS, combos=same_dtype(("dy", "cos", "sin", "x"), FLOATS),
          source="OT @ 5871dd99 rotary_position_embedding_grad_def.cpp"),
    opdef("InterleaveRope", [req("x"), req("cos"), req("sin")], ["y"], socs=A2_A3,
          combos=same_dtype(ROPE_SAME, (F16, BF16)),
          source="OT @ c29bc106 interleave_rope_def.cpp (W RAW:92788: f16 only; 950 via a fusion pass to "
                 "RotaryPositionEmbedding mode 3)"),
    opdef("SoftmaxGrad", [req("softmax"), req("grad_softmax")], ["grad_x"], [Attr("axes", "ListInt", [-1])],
          socs=A2_A3 + (ASCEND950,), combos=same_dtype(("softmax", "grad_softmax"), FLOATS),
          source="ON softmax_grad_def.cpp (AscendC, ascend950) + ON softmax_grad/README.md (A2, A3 built-in)"),
    opdef("SoftmaxGradExt", [req("grad"), req("x1"), req("x2")], ["y"],
          [Attr("axes", "Int", -1), Attr("keep_dims", "Bool", True)], socs=(ASCEND950,),
          combos=same_dtype(("grad", "x1", "x2"), FLOATS),
          source="ON softmax_grad_ext_def.cpp (ascend950 only); proto: axes default 1, FRACTAL_NZ except on 950, "
                 "deprecated; W RAW:50154: f16/f32, keep_dims default false"),
    opdef("InplacePartialRotaryMul", [req("x"), req("cos"), req("sin")], [Out("x")],
          [Attr("rotary_mode", "Int", 0), Attr("partial_slice", "ListInt", [0, 0])], socs=ROPE_SOCS,
          combos=[dict(x=F16, cos=F16, sin=F16), dict(x=F32, cos=F32, sin=F32), dict(x=BF16, cos=BF16, sin=BF16),
                  dict(x=F16, cos=F32, sin=F32), dict(x=BF16, cos=F32, sin=F32)],
          source="OT @ 5871dd99 inplace_partial_rotary_mul_def.cpp"),
    opdef("InplacePartialRotaryMulGrad", [req("dy"), req("cos"), req("sin")], [Out("dy")],
          [Attr("rotary_mode", "Int", 0), Attr("partial_slice", "ListInt", [0, 0])], socs=(ASCEND950,),
          combos=[dict(dy=dy, cos=c, sin=c) for dy in FLOATS for c in FLOATS],
          source="OT @ 5871dd99 inplace_partial_rotary_mul_grad_def.cpp (kernel ..._apt, ascend950 only)"),
    # ON = hicann/ops-nn @ 9d221427 for the three norm ops (op-defs; protos @ 19c18706 / 54df588a; goldens)
    opdef("RmsNorm", [req("x"), req("gamma")], ["y", "rstd"], [Attr("epsilon", "Float", 1e-6)], socs=NORM_SOCS,
          combos=NORM_COLUMNS,
          source="ON norm/rms_norm/op_host/rms_norm_def.cpp (ascend910b, ascend910_93; ascend950/350 regbase; "
                 "310p/910/kirin f16/f32 only, omitted); rstd f32; proto rms_norm_proto.h: y = gamma * (x * rstd); "
                 "aclnnRmsNorm.md: gamma = x.shape[n:], x 1-8-D"),
    opdef("AddRmsNorm", [req("x1"), req("x2"), req("gamma")], ["y", "rstd", "x"], [Attr("epsilon", "Float", 1e-6)],
          socs=NORM_SOCS, combos=same_dtype(("x1", "x2", "gamma"), FLOATS),
          source="ON norm/add_rms_norm/op_host/add_rms_norm_def.cpp (one dtype for x1, x2, gamma; ascend910b, "
                 "ascend910_93, ascend950, ascend350; 310p/kirin f16/f32 omitted); proto: x = x1 + x2, "
                 "epsilon >= 0"),
    opdef("RmsNormGrad", [req("dy"), req("x"), req("rstd", dtypes=frozenset({F32})), req("gamma")], ["dx", "dgamma"],
          socs=NORM_SOCS, combos=[dict(c, dy=c["x"]) for c in NORM_COLUMNS],
          source="ON norm/rms_norm_grad/op_host/rms_norm_grad_def.cpp (inputs dy, x, rstd, gamma: rstd f32; "
                 "dgamma f32; SoCs as RmsNorm)"),
    _mla_preprocess(),
    _mla_prolog("MlaProlog"),
    _mla_prolog("MlaPrologV2"),
    _mla_prolog("MlaPrologV3"),
    _kv_rms_norm_rope_cache(),
]}

# -- torchair's ordinary ops: the REG_OP docstrings of its generated builders -----------------------
_STRUCTURE_OPS = {ir.op: ir for ir in [  # no docstring: torchair builds them in ge/_ge_graph.py
    OpIR("Data", (In("x"),), (Out("y"),), (Attr("index", "Int", 0),), source="W TA/ge/_ge_graph.py:1572 Data"),
    OpIR("Const", (), (Out("y"),), (Attr("value", "Tensor"),), source="W TA/ge/_ge_graph.py:1642 Const"),
    OpIR("NetOutput", (In("input", "dynamic"),), (), source="W GC/ge_apis.py:19 NetOutput"),
]}

_DTYPE_ALIASES = {"DT_BFLOAT16": BF16, "DT_FLOAT32": F32}
_NAMED_TYPES = {"IndexNumberType": frozenset({I32, I64})}  # others (BasicType, ALL, ...): not restricted here


def _parse_type(text: str, type_vars: dict) -> Optional[frozenset]:
    text = text.strip()
    if text.startswith('"'):
        return type_vars.get(text.strip('"'))
    named = re.findall(r"(\w+)\(\)", text)
    if any(n not in _NAMED_TYPES for n in named):
        return None
    dtypes = {_DTYPE_ALIASES.get(t, t) for t in re.findall(r"\bDT_\w+", text)}
    for n in named:
        dtypes |= _NAMED_TYPES[n]
    return frozenset(dtypes) or None


def _split_args(text: str) -> list:
    """Top-level comma split of a REG_OP call's arguments."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


_ENTRY = re.compile(r"\.([A-Z_]+)\(")


def _entries(body: str) -> list:
    """[(kind, argument text)] of a REG_OP chain, each ``.KIND(...)`` read up to its balanced ")"."""
    body = body.replace("\\n", " ")
    found, pos = [], 0
    while (match := _ENTRY.search(body, pos)) is not None:
        depth, end = 1, match.end()
        while depth and end < len(body):
            depth += {"(": 1, ")": -1}.get(body[end], 0)
            end += 1
        found.append((match.group(1), " ".join(body[match.end():end - 1].split())))
        pos = end
    return found


def parse_reg_op(op: str, body: str, source: str) -> OpIR:
    entries = _entries(body)
    type_vars = {}
    for kind, args in entries:
        if kind == "DATATYPE":
            name, spec = _split_args(args)[:2]
            type_vars[name] = _parse_type(spec, {})
    inputs, outputs, attrs = [], [], []
    for kind, args in entries:
        parts = _split_args(args)
        if kind in ("INPUT", "OPTIONAL_INPUT", "DYNAMIC_INPUT"):
            ir_kind = {"INPUT": "required", "OPTIONAL_INPUT": "optional", "DYNAMIC_INPUT": "dynamic"}[kind]
            inputs.append(In(parts[0], ir_kind, _parse_type(parts[1], type_vars) if len(parts) > 1 else None))
        elif kind in ("OUTPUT", "DYNAMIC_OUTPUT"):
            outputs.append(Out(parts[0], "dynamic" if kind == "DYNAMIC_OUTPUT" else "required"))
        elif kind in ("ATTR", "ATRR", "REQUIRED_ATTR"):
            ge_type = {"int": "Int"}.get(parts[1], parts[1])
            attrs.append(Attr(parts[0], ge_type, parts[2] if len(parts) > 2 else None, kind == "REQUIRED_ATTR"))
    return OpIR(op, tuple(inputs), tuple(outputs), tuple(attrs), None, None, source)


def parse_builder_docstrings(path: Path, tag: str) -> dict:
    text = path.read_text()
    found = {}
    for match in re.finditer(r'REG_OP\((\w+)\)(.*?)"""', text, re.S):
        line = text.count("\n", 0, match.start()) + 1
        found.setdefault(match.group(1), parse_reg_op(match.group(1), match.group(2), f"{tag}:{line}"))
    return found


def load_ir_table(torchair_root: Path) -> dict:
    """{op type: OpIR}: the CANN table over torchair's ordinary ops."""
    table = parse_builder_docstrings(torchair_root / "_ge_concrete_graph" / "auto_generated_ge_raw_ops.py", "RAW")
    for op, ir in parse_builder_docstrings(torchair_root / "ge" / "_ge_graph.py", "W TA/ge/_ge_graph.py").items():
        table.setdefault(op, ir)
    table.update(_STRUCTURE_OPS)
    table.update(CANN_OPS)
    return table
