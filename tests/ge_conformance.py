"""Conformance of an emitted GE graph to the operator IR CANN defines (``cann_ir``).

``check_graph(graph, soc)`` validates every node of a GraphDef and returns the
violations, each naming its rule:

- ``known-op``: the op type has an IR (CANN's table or torchair's generated builders);
- ``soc``: an op with an op-def SoC list is available on the target SoC. ``generic``
  (npu_fuse's "no NPU known") has no device to run on, so a generic graph must run on
  every SoC npu_fuse supports: the op must exist on Ascend910B, Ascend910_93 and Ascend950;
- ``input-names``: data inputs, in IR order, named as the IR names them (optional inputs
  may be left out, dynamic ones are ``name0, name1, ...``), nothing extra;
- ``required-input``: a required input is connected (not an empty slot);
- ``attr-name`` / ``attr-type`` / ``required-attr``: every written attr is in the IR with
  its GE value type; required attrs are written (attrs starting with ``_`` are torchair's
  own annotations, not op attrs);
- ``dtype`` / ``dtype-combo``: each input's dtype is in the IR's set, and the dtypes of
  the inputs together form one of the op-def's columns. Only dtypes torchair knows are
  checked: a desc carrying the FX value (``_meta``) or fed by a Data/Const; an op torchair
  builds inside a converter (a Pack of sizes) has its output dtype inferred by GE later;
- ``format``: an input whose format the op-def fixes (e.g. FRACTAL_NZ) has that format;
- ``output-names``: outputs in IR order with IR names (an unnamed output is positional).

``input_copies(graph)`` lists the TensorMove copies of mutated graph inputs (``Data``) left
in a graph: each is a full copy of the input made on every call.
"""

import dataclasses
from typing import Optional

from cann_ir import A2_A3, ASCEND910B, ASCEND910_93, ASCEND950, OpIR

SOC_KEYS = {"Ascend910B": ASCEND910B, "Ascend910_93": ASCEND910_93, "Ascend950": ASCEND950}
GENERIC_SOCS = (ASCEND910B, ASCEND910_93, ASCEND950)  # a generic graph must run on all of them
assert A2_A3 == (ASCEND910B, ASCEND910_93)

GRAPH_FEEDS = {"Data": "<graph input>"}  # ops whose input is fed by the caller, not by an edge
_ATTR_FIELD_TYPES = {"s": "VT_STRING", "i": "VT_INT", "f": "VT_FLOAT", "b": "VT_BOOL", "bt": "VT_BYTES",
                     "t": "VT_TENSOR", "td": "VT_TENSOR_DESC", "g": "VT_GRAPH", "dt": "VT_DATA_TYPE",
                     "func": "VT_NAMED_ATTRS", "list_list_int": "VT_LIST_LIST_INT",
                     "list_list_float": "VT_LIST_LIST_FLOAT"}
_LIST_FIELDS = {"s": "VT_LIST_STRING", "i": "VT_LIST_INT", "f": "VT_LIST_FLOAT", "b": "VT_LIST_BOOL",
                "dt": "VT_LIST_DATA_TYPE", "t": "VT_LIST_TENSOR", "td": "VT_LIST_TENSOR_DESC"}


@dataclasses.dataclass(frozen=True)
class Violation:
    node: str
    op: str
    rule: str
    detail: str

    def __str__(self):
        return f"{self.node} ({self.op}) [{self.rule}]: {self.detail}"


def _dtype_name(desc) -> str:
    from torchair._ge_concrete_graph import ge_ir_pb2

    return ge_ir_pb2.DataType.Name(desc.dtype)


def attr_value_type(value) -> str:
    """The GE value type (VT_*) an AttrDef holds."""
    field = value.WhichOneof("value")
    if field != "list":
        return _ATTR_FIELD_TYPES.get(field, f"VT_{str(field).upper()}")
    lst = value.list
    if lst.val_type:
        return type(lst).ListValueType.Name(lst.val_type)
    filled = [name for name in _LIST_FIELDS if len(getattr(lst, name))]
    return _LIST_FIELDS[filled[0]] if filled else "VT_LIST_NONE"


def data_inputs(op) -> list:
    """(tensor name, input desc) of each data input; control edges ("node:-1") carry no desc. A
    graph input (Data) has the desc of its feed and no edge."""
    names = [name for name in op.input if not name.endswith(":-1")]
    if op.type in GRAPH_FEEDS and not names:
        names = [GRAPH_FEEDS[op.type]] * len(op.input_desc)
    return list(zip(names, op.input_desc))


def socs_of(soc: str) -> tuple:
    if soc == "generic":
        return GENERIC_SOCS
    if soc not in SOC_KEYS:
        raise ValueError(f"unknown target SoC {soc!r}: expected generic or one of {sorted(SOC_KEYS)}")
    return (SOC_KEYS[soc],)


def check_node(op, soc: str, table: dict, producers: Optional[dict] = None) -> list:
    """Violations of one node; ``producers`` maps a tensor name to its producer's op type (to tell
    which input dtypes torchair knows), None: all of them."""
    ir: Optional[OpIR] = table.get(op.type)
    bad = []

    def fail(rule, detail):
        bad.append(Violation(op.name, op.type, rule, detail))

    if ir is None:
        fail("known-op", f"no registered IR for op type {op.type!r}")
        return bad
    if ir.socs is not None:
        missing = [s for s in socs_of(soc) if s not in ir.socs]
        if missing:
            fail("soc", f"not available on {', '.join(missing)} (op-def SoCs: {', '.join(ir.socs)}; target {soc})")
    present = _check_inputs(op, ir, fail)
    known = {name: desc for name, (tensor, desc) in present.items() if _dtype_known(tensor, desc, producers)}
    _check_dtypes(ir, known, fail)
    _check_attrs(op, ir, fail)
    _check_outputs(op, ir, fail)
    return bad


def _dtype_known(tensor: str, desc, producers: Optional[dict]) -> bool:
    if producers is None or "_meta" in desc.attr:
        return True
    return producers.get(tensor.rsplit(":", 1)[0]) in ("Data", "Const")


def _check_inputs(op, ir: OpIR, fail) -> dict:
    """Input names/order/presence; returns {IR input name: (tensor, desc)} of the connected inputs."""
    given = data_inputs(op)
    present, k = {}, 0
    for spec in ir.inputs:
        if spec.kind == "dynamic":
            j = 0
            while k < len(given) and given[k][1].name == f"{spec.name}{j}":
                present[f"{spec.name}{j}"] = given[k]
                k, j = k + 1, j + 1
            continue
        here = k < len(given) and given[k][1].name == spec.name
        if not here:
            if spec.kind == "required":
                got = repr(given[k][1].name) if k < len(given) else "nothing"
                fail("input-names", f"input #{k} should be required input {spec.name!r}, got {got}")
            continue
        tensor, desc = given[k]
        k += 1
        if not tensor:
            if spec.kind == "required":
                fail("required-input", f"required input {spec.name!r} is an empty slot")
            continue
        present[spec.name] = (tensor, desc)
        if spec.formats is not None and (desc.layout or "ND") not in spec.formats:
            fail("format", f"input {spec.name!r} has format {desc.layout or 'ND'}, the op-def fixes "
                           f"{' or '.join(spec.formats)}")
    for _, desc in given[k:]:
        expected = [i.name for i in ir.inputs]
        fail("input-names", f"unexpected input {desc.name!r} (IR inputs, in order: {expected})")
    return present


def _check_dtypes(ir: OpIR, present: dict, fail) -> None:
    dtypes = {name: _dtype_name(desc) for name, desc in present.items()}
    for spec in ir.inputs:
        allowed = spec.dtypes
        for name, dtype in dtypes.items():
            is_this = name == spec.name or (spec.kind == "dynamic" and name.startswith(spec.name)
                                            and name[len(spec.name):].isdigit())
            if is_this and allowed is not None and dtype not in allowed:
                fail("dtype", f"input {name!r} is {dtype}, the IR allows {sorted(allowed)}")
    if ir.combos:
        combo_inputs = {name for combo in ir.combos for name in combo}
        got = {name: dt for name, dt in dtypes.items() if name in combo_inputs}
        if got and not any(all(combo.get(name) == dt for name, dt in got.items()) for combo in ir.combos):
            fail("dtype-combo", f"input dtypes {got} are not one of the op-def's dtype combinations")


# torchair's own annotations without a leading "_": the input/output formats a converter sets with
# utils.specific_op_input_layout, moved into the descs by fx2ge_converter._normalize_ge_graph
TORCHAIR_ANNOTATIONS = ("input_layout_info", "output_layout_info")


def _check_attrs(op, ir: OpIR, fail) -> None:
    written = {name: value for name, value in op.attr.items()
               if not name.startswith("_") and name not in TORCHAIR_ANNOTATIONS}
    for name, value in written.items():
        spec = ir.attr(name)
        if spec is None:
            fail("attr-name", f"attr {name!r} is not in the IR (IR attrs: {[a.name for a in ir.attrs]})")
        elif attr_value_type(value) != spec.value_type:
            fail("attr-type", f"attr {name!r} is {attr_value_type(value)}, the IR says {spec.value_type} "
                              f"({spec.ge_type})")
    for spec in ir.attrs:
        if spec.required and spec.name not in written:
            fail("required-attr", f"required attr {spec.name!r} is not set")


def _check_outputs(op, ir: OpIR, fail) -> None:
    names = [desc.name for desc in op.output_desc]
    expected = []
    for spec in ir.outputs:
        if spec.kind == "dynamic":
            expected += [f"{spec.name}{j}" for j in range(len(names) - len(expected))]
        else:
            expected.append(spec.name)
    if len(names) > len(expected) or any(got and got != want for got, want in zip(names, expected)):
        fail("output-names", f"outputs {names}, the IR's are {[o.name for o in ir.outputs]}")


def check_graph(graph, soc: str, table: Optional[dict] = None) -> list:
    """Every violation of every node of a GE GraphDef against the IR table (the proxy's by default)."""
    if table is None:
        from torchair_offline import ir_table

        table = ir_table()
    producers = {op.name: op.type for op in graph.op}
    return [v for op in graph.op for v in check_node(op, soc, table, producers)]


def input_copies(graph, mutated_inputs=None) -> list:
    """Names of the TensorMove ops that copy a mutated graph input (a Data). ``mutated_inputs``:
    the names of the mutated inputs (default: the graph's ``mutated_inputs``, else every Data;
    a copy of an input the function does not mutate is its functional result, not waste)."""
    if mutated_inputs is None:
        mutated_inputs = getattr(graph, "mutated_inputs", None)
    data = {f"{op.name}:0" for op in graph.op
            if op.type == "Data" and (mutated_inputs is None or op.name in mutated_inputs)}
    return [op.name for op in graph.op if op.type == "TensorMove" and op.input and op.input[0] in data]
