"""The GE conformance check (tests/ge_conformance.py) itself: each rule must be able to fail."""

import pytest

from torchair_offline import torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")


@pytest.fixture(scope="module")
def pb():
    from torchair_offline import load_torchair_offline

    load_torchair_offline()
    from torchair._ge_concrete_graph import ge_ir_pb2

    return ge_ir_pb2


# -- the conformance check: each rule on hand-built nodes -----------------------------------------------
def node(pb, op_type, inputs=(), outputs=("y",), attrs=None, name="n"):
    """inputs: (ir name, dtype, format[, tensor]); attrs: {name: (field, value)}."""
    op = pb.OpDef(name=name, type=op_type)
    for spec in inputs:
        ir_name, dtype, layout = spec[:3]
        op.input.append(spec[3] if len(spec) > 3 else f"src_{ir_name}:0")
        desc = op.input_desc.add(name=ir_name, dtype=pb.DataType.Value(dtype), layout=layout)
        desc.attr["_meta"].s = b"known"
    for out in outputs:
        op.output_desc.add(name=out)
    for key, (field, value) in (attrs or {}).items():
        if field == "list_i":
            op.attr[key].list.i.extend(value)
            op.attr[key].list.val_type = pb.AttrDef.ListValue.VT_LIST_INT
        else:
            setattr(op.attr[key], field, value)
    return op


def iprm(pb, x="DT_FLOAT", cos="DT_FLOAT", names=("x", "cos", "sin"), mode=("i", 1), fmt="ND"):
    return node(pb, "InplacePartialRotaryMul", [(names[0], x, fmt), (names[1], cos, "ND"), (names[2], cos, "ND")],
                ["x"], {"rotary_mode": mode, "partial_slice": ("list_i", [0, 64])})


def rules(op, soc="Ascend910B"):
    from ge_conformance import check_node
    from torchair_offline import ir_table

    return sorted({v.rule for v in check_node(op, soc, ir_table())})


def test_a_conformant_node_passes_on_every_soc_it_exists_on(pb):
    for soc in ("generic", "Ascend910B", "Ascend910_93", "Ascend950"):
        assert rules(iprm(pb), soc) == []


@pytest.mark.parametrize("bad, rule", [
    (lambda pb: node(pb, "NoSuchFusedOp"), "known-op"),
    (lambda pb: node(pb, "SoftmaxGradExt", [(n, "DT_FLOAT", "ND") for n in ("grad", "x1", "x2")]), "soc"),
    (lambda pb: iprm(pb, names=("x", "r1", "r2")), "input-names"),
    (lambda pb: iprm(pb, names=("x", "sin", "cos")), "input-names"),
    (lambda pb: node(pb, "RotaryMul", [("x", "DT_FLOAT", "ND"), ("r1", "DT_FLOAT", "ND"), ("r2", "DT_FLOAT", "ND"),
                                       ("r3", "DT_FLOAT", "ND")]), "input-names"),
    (lambda pb: node(pb, "RotaryMul", [("x", "DT_FLOAT", "ND"), ("r1", "DT_FLOAT", "ND", ""),
                                       ("r2", "DT_FLOAT", "ND")]), "required-input"),
    (lambda pb: iprm(pb, mode=("s", b"interleave")), "attr-type"),
    (lambda pb: node(pb, "RotaryMul", [(n, "DT_FLOAT", "ND") for n in ("x", "r1", "r2")],
                     attrs={"mode": ("i", 1)}), "attr-name"),
    (lambda pb: node(pb, "Cast", [("x", "DT_FLOAT", "ND")]), "required-attr"),
    (lambda pb: iprm(pb, x="DT_INT32", cos="DT_INT32"), "dtype"),
    (lambda pb: iprm(pb, x="DT_FLOAT", cos="DT_FLOAT16"), "dtype-combo"),
    (lambda pb: node(pb, "MlaProlog", [(n, "DT_BF16", "ND") for n in (
        "token_x", "weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr", "rmsnorm_gamma_cq", "rmsnorm_gamma_ckv",
        "rope_sin", "rope_cos")] + [("cache_index", "DT_INT64", "ND"), ("kv_cache", "DT_BF16", "ND"),
                                    ("kr_cache", "DT_BF16", "ND")],
        ["query", "query_rope", "kv_cache", "kr_cache"]), "format"),
    (lambda pb: node(pb, "InplacePartialRotaryMul", [(n, "DT_FLOAT", "ND") for n in ("x", "cos", "sin")], ["y"],
                     {"rotary_mode": ("i", 1)}), "output-names"),
])
def test_each_rule_fails_on_a_node_that_breaks_it(pb, bad, rule):
    assert rule in rules(bad(pb))


def test_generic_means_every_supported_soc():
    from ge_conformance import GENERIC_SOCS, socs_of

    assert socs_of("generic") == GENERIC_SOCS == ("ascend910b", "ascend910_93", "ascend950")
    with pytest.raises(ValueError, match="unknown target SoC"):
        socs_of("Ascend310P")


def test_soc_rule_names_the_missing_socs(pb):
    from ge_conformance import check_node
    from torchair_offline import ir_table

    rotary_mul = node(pb, "RotaryMul", [(n, "DT_FLOAT", "ND") for n in ("x", "r1", "r2")])
    assert rules(rotary_mul, "Ascend910B") == rules(rotary_mul, "Ascend910_93") == []
    (violation,) = check_node(rotary_mul, "generic", ir_table())
    assert violation.rule == "soc" and "ascend950" in violation.detail


def test_optional_and_dynamic_inputs(pb):
    x = [(n, "DT_FLOAT16", "ND") for n in ("x", "cos", "sin")]
    assert rules(node(pb, "RotaryPositionEmbedding", x, attrs={"mode": ("i", 1)})) == []
    assert rules(node(pb, "RotaryPositionEmbedding", x + [("rotate", "DT_FLOAT16", "ND")])) == []
    assert rules(node(pb, "RotaryPositionEmbedding", x + [("rotate", "DT_FLOAT", "ND")])) == ["dtype-combo"]
    pieces = [("x0", "DT_FLOAT", "ND"), ("x1", "DT_FLOAT", "ND"), ("concat_dim", "DT_INT32", "ND")]
    concat = node(pb, "ConcatV2", pieces,
                  attrs={"N": ("i", 2)})
    assert rules(concat) == []


def test_control_edges_and_unknown_dtypes_are_not_data_inputs(pb):
    from ge_conformance import check_node
    from torchair_offline import ir_table

    op = iprm(pb, x="DT_INT32", cos="DT_INT32")
    op.input.append("other:-1")  # a control edge: no desc
    for desc in op.input_desc:
        del desc.attr["_meta"]
    # dtypes of tensors made inside a converter (no FX value) are inferred by GE later: not judged
    assert check_node(op, "Ascend910B", ir_table(), producers={"src_x": "Pack", "src_cos": "Pack",
                                                               "src_sin": "Pack"}) == []
    rules_seen = {v.rule for v in check_node(op, "Ascend910B", ir_table(), producers={"src_x": "Data"})}
    assert rules_seen == {"dtype", "dtype-combo"}


def test_input_copies_finds_tensor_moves_of_mutated_graph_inputs(pb):
    from ge_conformance import input_copies

    graph = pb.GraphDef()
    graph.op.add(name="x", type="Data")
    graph.op.add(name="y", type="Mul", input=["x:0", "x:0"])
    graph.op.add(name="copy_x", type="TensorMove", input=["x:0"])
    graph.op.add(name="copy_y", type="TensorMove", input=["y:0"])
    assert input_copies(graph) == ["copy_x"]
    graph.op.add(name="z", type="Data")
    graph.op.add(name="copy_z", type="TensorMove", input=["z:0"])
    assert input_copies(graph, mutated_inputs=("z",)) == ["copy_z"]
