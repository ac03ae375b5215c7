"""GE converters, through torchair's real FX->GE conversion (offline: no CANN, no NPU), with the
proxy answering as CANN does; every graph is checked against the op definitions (ge_conformance)."""

import pytest
import torch

import npu_fuse_backend as nf
from ge_conformance import check_graph, input_copies
from torchair_offline import ge_graphs_of, op_types, torchair_dir
from models import attention, gptj, rotate_every_two, rotate_half

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")

ROTATE_HALF_OPS = {"StridedSliceV2", "Neg", "ConcatV2"}
SOCS = ["generic", "Ascend910B", "Ascend910_93", "Ascend950"]


def rope_qk(rotate):
    def fn(q, k, cos, sin):
        return (q * cos + rotate(q) * sin) * 2 + (k * cos + rotate(k) * sin)
    return fn


def qk_tables(grad=False, head_dim=128):
    q = torch.randn(2, 16, 4, head_dim, requires_grad=grad)
    k = torch.randn(2, 16, 4, head_dim, requires_grad=grad)
    cos, sin = torch.randn(1, 16, 1, head_dim), torch.randn(1, 16, 1, head_dim)
    return q, k, cos, sin


def converted(fn, *args, soc="generic", **kw):
    """The GE graphs of fn for soc, each checked: no violation of the op definitions, no copy of
    a graph input."""
    with nf.config.patch(soc=soc):
        graphs = ge_graphs_of(fn, *args, **kw)
    for graph in graphs:
        assert [str(v) for v in check_graph(graph, soc)] == []
        assert input_copies(graph) == []
    return graphs


def ops_of(graph, op_type):
    return [op for op in graph.op if op.type == op_type]


def input_names(op):
    return [desc.name for desc in op.input_desc]


def test_unfused_graph_has_the_rotate_half_ops():
    (graph,) = converted(rope_qk(rotate_half), *qk_tables(), fusion=False)
    assert ROTATE_HALF_OPS <= set(op_types(graph)) and "RotaryMul" not in op_types(graph)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93"])
def test_half_mode_on_a2_a3_becomes_one_rotary_mul_per_site(soc):
    (graph,) = converted(rope_qk(rotate_half), *qk_tables(), soc=soc)
    assert [input_names(op) for op in ops_of(graph, "RotaryMul")] == [["x", "r1", "r2"]] * 2
    assert not ROTATE_HALF_OPS & set(op_types(graph))


@pytest.mark.parametrize("soc", ["generic", "Ascend950"])
def test_half_mode_elsewhere_is_rotary_position_embedding_mode_0(soc):
    """RotaryMul exists on A2/A3 only; generic must run on every SoC."""
    (graph,) = converted(rope_qk(rotate_half), *qk_tables(), soc=soc)
    ropes = ops_of(graph, "RotaryPositionEmbedding")
    assert len(ropes) == 2 and all(input_names(op) == ["x", "cos", "sin"] for op in ropes)
    assert all("mode" not in op.attr for op in ropes)  # the IR default (0) is not written
    assert "RotaryMul" not in op_types(graph)


@pytest.mark.parametrize("soc", SOCS)
def test_interleave_mode_becomes_rotary_position_embedding_mode_1(soc):
    q, k, _, _ = qk_tables()
    cos, sin = torch.randn(1, 16, 1, 128), torch.randn(1, 16, 1, 128)  # 1S1D: every SoC's interleave layout
    (graph,) = converted(rope_qk(rotate_every_two), q, k, cos, sin, soc=soc)
    ropes = ops_of(graph, "RotaryPositionEmbedding")
    assert len(ropes) == 2 and all(op.attr["mode"].i == 1 for op in ropes)
    assert not {"StridedSliceV2", "Neg", "Pack", "ConcatV2"} & set(op_types(graph))


@pytest.mark.parametrize("soc", SOCS)
def test_fused_backward_is_rotary_position_embedding_grad_without_x(soc):
    """The fused backward has no x (need_backward=False): the op-def's optional x is left out."""
    fw, bw = converted(rope_qk(rotate_half), *qk_tables(grad=True), soc=soc)
    grads = ops_of(bw, "RotaryPositionEmbeddingGrad")
    assert len(grads) == 2 and all(input_names(op) == ["dy", "cos", "sin"] for op in grads)
    assert all(len([i for i in op.input if not i.endswith(":-1")]) == 3 for op in grads)
    assert not ROTATE_HALF_OPS & set(op_types(bw))


def direct_rotary_mul(x, cos, sin):
    from npu_fuse.ops import rotary_mul

    return rotary_mul(x, cos, sin, "half") * 2


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93"])
def test_rotary_mul_grad_on_a2_a3_where_torch_npus_guards_hold(soc):
    x = torch.randn(2, 16, 4, 64, requires_grad=True)
    cos, sin = torch.randn(1, 16, 1, 64), torch.randn(1, 16, 1, 64)  # broadcast over B * N = 8 <= 1024
    _, bw = converted(direct_rotary_mul, x, cos, sin, soc=soc)
    (grad,) = ops_of(bw, "RotaryMulGrad")
    assert input_names(grad) == ["x", "r1", "r2", "dy"] and grad.attr["need_backward"].b is False


@pytest.mark.parametrize("shape, tables, why", [
    ((2, 16, 4, 96), (1, 16, 1, 96), "head dim not a multiple of 64"),
    ((64, 32, 2, 64), (1, 1, 2, 64), "broadcast product 64 * 32 > 1024"),
])
def test_rotary_mul_grad_guards_fall_back_to_rotary_position_embedding_grad(shape, tables, why):
    x = torch.randn(*shape, requires_grad=True)
    cos, sin = torch.randn(*tables), torch.randn(*tables)
    _, bw = converted(direct_rotary_mul, x, cos, sin, soc="Ascend910B")
    assert "RotaryMulGrad" not in op_types(bw), why
    (grad,) = ops_of(bw, "RotaryPositionEmbeddingGrad")
    assert input_names(grad) == ["dy", "cos", "sin", "x"]  # x given: the table gradients need it


def test_rotary_mul_grad_needs_static_shapes():
    x = torch.randn(2, 16, 4, 64, requires_grad=True)
    cos, sin = torch.randn(1, 16, 1, 64), torch.randn(1, 16, 1, 64)
    _, bw = converted(direct_rotary_mul, x, cos, sin, soc="Ascend910B", dynamic=True)
    assert "RotaryMulGrad" not in op_types(bw) and len(ops_of(bw, "RotaryPositionEmbeddingGrad")) == 1


def test_softmax_backward_on_ascend950_becomes_one_softmax_grad_ext():
    qkv = [torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)]
    fw, bw = converted(attention, *qkv, soc="Ascend950")
    (ext,) = ops_of(bw, "SoftmaxGradExt")
    assert input_names(ext) == ["grad", "x1", "x2"] and ext.attr["axes"].i == -1 and ext.attr["keep_dims"].b
    assert not {"SoftmaxGrad", "ReduceSumD", "ReduceSum", "Sub"} & set(op_types(bw))


@pytest.mark.parametrize("soc", ["generic", "Ascend910B", "Ascend910_93"])
def test_softmax_backward_elsewhere_keeps_softmax_grad(soc):
    qkv = [torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)]
    _, bw = converted(attention, *qkv, soc=soc)
    assert "SoftmaxGradExt" not in op_types(bw) and "SoftmaxGrad" in op_types(bw)
    reasons = [n.reason for r in nf.get_reports() for n in r.near_misses if n.family == "softmax_grad"]
    assert any("SoftmaxGradExt GE op exists on Ascend950 only" in r or "targets Ascend950 only" in r
               for r in reasons), reasons


@pytest.mark.parametrize("soc", ["generic", "Ascend910B"])
def test_a_direct_softmax_grad_ext_call_off_ascend950_converts_to_ops_every_soc_has(soc):
    from npu_fuse.ops import softmax_grad_ext

    def fn(grad, probs, scale):
        return softmax_grad_ext(grad, probs, scale) * 2

    (graph,) = converted(fn, torch.randn(2, 8), torch.softmax(torch.randn(2, 8), -1), torch.full((1,), 0.5),
                         soc=soc)
    assert "SoftmaxGradExt" not in op_types(graph) and {"SoftmaxGrad", "Mul"} <= set(op_types(graph))


@pytest.mark.parametrize("soc", ["generic", "Ascend910B", "Ascend910_93"])
def test_partial_interleave_rope_becomes_inplace_partial_rotary_mul_as_cann_defines_it(soc):
    q, cos, sin = torch.randn(2, 16, 4, 128), torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)  # BS1D
    (graph,) = converted(gptj, q, cos, sin, soc=soc)
    (op,) = ops_of(graph, "InplacePartialRotaryMul")
    assert input_names(op) == ["x", "cos", "sin"] and [d.name for d in op.output_desc] == ["x"]
    assert op.attr["rotary_mode"].i == 1 and list(op.attr["partial_slice"].list.i) == [0, 64]
    assert not {"StridedSliceV2", "Neg", "ConcatV2", "Pack"} & set(op_types(graph))


def test_partial_rope_tables_of_another_dtype_are_cast_to_a_column_of_the_op_def():
    from npu_fuse.ops import inplace_partial_rotary_mul

    def fn(x, cos, sin):
        y = x * 2
        inplace_partial_rotary_mul(y, cos, sin, partial_slice=[0, 64])
        return y

    def table_producers(graph):
        (op,) = ops_of(graph, "InplacePartialRotaryMul")
        producers = {o.name: o.type for o in graph.op}
        return [producers[name.split(":")[0]] for name in op.input[1:3]]

    x, cos, sin = torch.randn(2, 16, 4, 128), torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    (graph,) = converted(fn, x, cos.half(), sin.half(), soc="Ascend910B")  # (f32, f16, f16) is no column
    assert table_producers(graph) == ["Cast", "Cast"]
    (graph,) = converted(fn, x.half(), cos, sin, soc="Ascend910B")  # (f16, f32, f32) is one
    assert table_producers(graph) == ["Data", "Data"]


def train_partial(x, cos, sin):
    from npu_fuse.ops import inplace_partial_rotary_mul

    y = x * 1.0
    inplace_partial_rotary_mul(y, cos, sin, partial_slice=[0, 64])
    return y


@pytest.mark.parametrize("soc", ["generic", "Ascend910B", "Ascend910_93"])
def test_partial_rope_backward_on_a2_a3_is_the_forward_op_with_swapped_negated_sin(soc):
    """InplacePartialRotaryMulGrad exists on Ascend950 only."""
    cos, sin = torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    fw, bw = converted(train_partial, torch.randn(2, 16, 4, 128, requires_grad=True), cos, sin, soc=soc)
    assert op_types(fw).count("InplacePartialRotaryMul") == 1
    assert "InplacePartialRotaryMulGrad" not in op_types(bw)
    (op,) = ops_of(bw, "InplacePartialRotaryMul")
    assert input_names(op) == ["x", "cos", "sin"] and {"GatherV2", "Neg"} <= set(op_types(bw))


def test_partial_rope_backward_on_ascend950_is_inplace_partial_rotary_mul_grad():
    cos, sin = torch.randn(2, 16, 1, 64), torch.randn(2, 1, 1, 64)
    cos = cos[:, :1]  # B11D: an Ascend950 layout
    _, bw = converted(train_partial, torch.randn(2, 16, 4, 128, requires_grad=True), cos, sin, soc="Ascend950")
    (op,) = ops_of(bw, "InplacePartialRotaryMulGrad")
    assert input_names(op) == ["dy", "cos", "sin"] and [d.name for d in op.output_desc] == ["dy"]
    assert op.attr["rotary_mode"].i == 1

