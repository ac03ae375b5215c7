"""The offline CANN proxy (tests/torchair_offline.py, tests/cann_ir.py): torchair's native IR registry
answering with what CANN defines."""

import pytest

from torchair_offline import torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")


@pytest.fixture(scope="module")
def ta():
    from torchair_offline import load_torchair_offline

    return load_torchair_offline()


# -- the proxy ---------------------------------------------------------------------------------------
def test_proxy_answers_with_the_op_def_of_cann_ops(ta):
    from torchair.core import _torchair

    status, inputs, outputs, attrs = _torchair.get_registered_ir_def("InplacePartialRotaryMul")
    assert status == "SUCCESS"
    assert inputs == [("x", "required"), ("cos", "required"), ("sin", "required")]
    assert outputs == [("x", "required")]
    assert attrs == [("rotary_mode", "VT_INT"), ("partial_slice", "VT_LIST_INT")]
    _, inputs, outputs, _ = _torchair.get_registered_ir_def("RotaryPositionEmbeddingGrad")
    assert inputs[-1] == ("x", "optional") and [o for o, _ in outputs] == ["dx", "dcos", "dsin"]


def test_proxy_parses_torchair_ordinary_ops_from_their_reg_op_docstrings(ta):
    from torchair.core import _torchair

    assert _torchair.get_registered_ir_def("ConcatV2") == (
        "SUCCESS", [("x", "dynamic"), ("concat_dim", "required")], [("y", "required")], [("N", "VT_INT")])
    _, inputs, _, attrs = _torchair.get_registered_ir_def("Cast")  # a multi-line docstring in ge/_ge_graph.py
    assert inputs == [("x", "required")] and attrs == [("dst_type", "VT_INT")]
    assert _torchair.get_registered_ir_def("TensorMove")[0] == "SUCCESS"


def test_an_op_the_proxy_does_not_know_fails_the_conversion(ta):
    from torchair import ge
    from torchair.core import _torchair

    assert _torchair.get_registered_ir_def("NoSuchFusedOp")[0] != "SUCCESS"
    with pytest.raises(RuntimeError, match="NoSuchFusedOp"):
        ge.custom_op("NoSuchFusedOp", inputs={}, outputs=["y"])


def test_a_raw_builders_op_the_installed_cann_lacks_fails_the_conversion(ta):
    """torchair's raw builders (RotaryMul) never ask the registry: the offline conversion does."""
    import torch

    import npu_fuse_backend as nf
    from npu_fuse.ops import rotary_mul
    from torchair_offline import ge_graphs_of, hidden_ops

    def direct(x, cos, sin):  # no fusion, so nothing consults the installed CANN beforehand
        return rotary_mul(x, cos, sin, "half") * 2

    args = torch.randn(2, 16, 4, 64), torch.randn(1, 16, 1, 64), torch.randn(1, 16, 1, 64)
    with nf.config.patch(soc="Ascend910B"):
        assert ge_graphs_of(direct, *args)
        with hidden_ops("RotaryMul"), pytest.raises(Exception, match=r"not registered .*\['RotaryMul'\]"):
            ge_graphs_of(direct, *args)


def test_check_cann_compat_checks_optional_inputs_and_attrs(ta):
    from torchair.core import _torchair

    assert _torchair.check_cann_compat("RotaryPositionEmbedding", ("rotate",), ("mode",)) == ""
    assert "no optional input 'x'" in _torchair.check_cann_compat("RotaryPositionEmbedding", ("x",), ())
    assert "no attr 'rotary_mode'" in _torchair.check_cann_compat("RotaryPositionEmbedding", (), ("rotary_mode",))
    assert "not registered" in _torchair.check_cann_compat("NoSuchFusedOp", (), ())


def test_a_ge_op_builder_fails_when_the_installed_cann_lacks_its_op(ta):
    from torchair._ge_concrete_graph import ge_apis
    from torchair.ge._ge_graph import GeGraph, Tensor, Data, default_ge_graph
    from torchair_offline import hidden_ops

    with default_ge_graph(GeGraph()):
        x = Data(index=0, dtype=0, shape=[2, 4], placement="NPU", node_name="x")
        assert isinstance(ge_apis.RotaryPositionEmbedding(x, x, x, mode=1), Tensor)
        with hidden_ops("RotaryPositionEmbedding"), pytest.raises(AssertionError, match="not registered"):
            ge_apis.RotaryPositionEmbedding(x, x, x, mode=1)


def test_every_cann_entry_names_its_sources_socs_and_consistent_dtype_columns():
    from cann_ir import CANN_OPS

    for ir in CANN_OPS.values():
        assert ir.source and ir.socs, ir.op
        names = {i.name for i in ir.inputs}
        for combo in ir.combos or ():
            assert set(combo) <= names, ir.op
        if ir.op not in ("RotaryMul", "RotaryMulGrad"):  # TBE kernels: no op-def format list
            assert all(spec.formats for spec in ir.inputs), ir.op
