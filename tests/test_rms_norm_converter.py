"""The rms_norm family's GE converters, through torchair's real FX->GE conversion (offline), every
node checked against CANN's op definitions (tests/cann_ir.py, ge_conformance)."""

import pytest
import torch

import npu_fuse_backend as nf
from ge_conformance import check_graph
from models import LlamaRMSNorm
from torchair_offline import ge_graphs_of, op_types, torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")

SOCS = ["generic", "Ascend910B", "Ascend910_93", "Ascend950"]
D = 64


def converted(fn, *args, soc):
    nf.clear_reports()
    with nf.config.patch(soc=soc):
        graphs = ge_graphs_of(fn, *args)
    for graph in graphs:
        assert [str(v) for v in check_graph(graph, soc)] == []
    return graphs


def ops_of(graph, op_type):
    return [op for op in graph.op if op.type == op_type]


def input_names(op):
    return [desc.name for desc in op.input_desc]


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_becomes_one_rms_norm_op(soc, dtype):
    norm, x = LlamaRMSNorm(D, eps=1e-5, dtype=dtype), torch.randn(2, 8, D, dtype=dtype)
    with torch.no_grad():
        (graph,) = converted(norm, x, soc=soc)
    (op,) = ops_of(graph, "RmsNorm")
    assert input_names(op) == ["x", "gamma"] and op.attr["epsilon"].f == pytest.approx(1e-5)
    assert not {"Rsqrt", "ReduceMean", "Pow"} & set(op_types(graph))


def test_a_float32_weight_with_a_bfloat16_activation_keeps_its_multiply():
    norm, x = LlamaRMSNorm(D), torch.randn(2, 8, D, dtype=torch.bfloat16)
    with torch.no_grad():
        (graph,) = converted(norm, x, soc="Ascend910B")
    assert len(ops_of(graph, "RmsNorm")) == 1 and "Mul" in op_types(graph)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_the_residual_add_and_norm_become_add_rms_norm(soc):
    norm = LlamaRMSNorm(D, dtype=torch.bfloat16)
    h, attn = torch.randn(2, 8, D, dtype=torch.bfloat16), torch.randn(2, 8, D, dtype=torch.bfloat16)

    def layer(h, attn):
        h = h + attn
        return norm(h), h * h

    with torch.no_grad():
        (graph,) = converted(layer, h, attn, soc=soc)
    (op,) = ops_of(graph, "AddRmsNorm")
    assert input_names(op) == ["x1", "x2", "gamma"]
    assert "Add" not in op_types(graph)  # the sum is the op's third output


def test_an_autocast_residual_stream_becomes_a_cast_and_a_float32_add_rms_norm():
    """float32 residual + bfloat16 projection: the addend cast up (exact), then AddRmsNorm in float32."""
    proj, norm = torch.nn.Linear(D, D), LlamaRMSNorm(D)
    h, x = torch.randn(2, 8, D), torch.randn(2, 8, D)

    def layer(h, x):
        h = h + proj(x)
        return norm(h), h * h

    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        (graph,) = converted(layer, h, x, soc="Ascend910B")
    (op,) = ops_of(graph, "AddRmsNorm")
    assert input_names(op) == ["x1", "x2", "gamma"] and "Add" not in op_types(graph)


def test_training_forward_returns_rstd_and_the_backward_converts():
    norm, x = LlamaRMSNorm(D), torch.randn(2, 8, D, requires_grad=True)
    fw, bw = converted(lambda x: norm(x).pow(2).sum(), x, soc="Ascend910B")
    assert len(ops_of(fw, "RmsNorm")) == 1 and "Rsqrt" not in op_types(fw)
    assert fw and bw


def test_a_direct_call_of_the_backward_op_is_rms_norm_grad():
    from npu_fuse.ops import rms_norm, rms_norm_backward

    x, gamma, dy = torch.randn(2, 8, D, dtype=torch.bfloat16), torch.randn(D), torch.randn(2, 8, D, dtype=torch.bfloat16)

    def step(x, gamma, dy):
        _, rstd = rms_norm(x, gamma)
        return rms_norm_backward(dy, x, gamma, rstd)

    (graph,) = converted(step, x, gamma, dy, soc="Ascend950")
    (op,) = ops_of(graph, "RmsNormGrad")
    assert input_names(op) == ["dy", "x", "rstd", "gamma"]
