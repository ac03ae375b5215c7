"""GE converters, through torchair's real FX->GE conversion (offline: no CANN, no NPU)."""

import pytest
import torch

import npu_fuse_backend as nf
from torchair_offline import ge_graphs_of, op_types, torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")

ROTATE_HALF_OPS = {"StridedSliceV2", "Neg", "ConcatV2"}


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rope_qk(rotate):
    def fn(q, k, cos, sin):
        return (q * cos + rotate(q) * sin) * 2 + (k * cos + rotate(k) * sin)
    return fn


def qk_tables(grad=False, head_dim=128):
    q = torch.randn(2, 16, 4, head_dim, requires_grad=grad)
    k = torch.randn(2, 16, 4, head_dim, requires_grad=grad)
    cos, sin = torch.randn(1, 16, 1, head_dim), torch.randn(1, 16, 1, head_dim)
    return q, k, cos, sin


def test_unfused_graph_has_the_rotate_half_ops():
    (graph,) = ge_graphs_of(rope_qk(rotate_half), *qk_tables(), fusion=False)
    assert ROTATE_HALF_OPS <= set(op_types(graph)) and "RotaryMul" not in op_types(graph)


def test_half_mode_becomes_one_rotary_mul_per_site():
    (graph,) = ge_graphs_of(rope_qk(rotate_half), *qk_tables())
    types = op_types(graph)
    assert types.count("RotaryMul") == 2
    assert not ROTATE_HALF_OPS & set(types)


def test_interleave_mode_becomes_rotary_position_embedding_mode_1():
    (graph,) = ge_graphs_of(rope_qk(rotate_every_two), *qk_tables())
    ropes = [op for op in graph.op if op.type == "RotaryPositionEmbedding"]
    assert len(ropes) == 2 and all(op.attr["mode"].i == 1 for op in ropes)
    assert not {"StridedSliceV2", "Neg", "Pack", "ConcatV2"} & set(op_types(graph))


def test_ascend950_uses_rotary_position_embedding_for_half_mode():
    with nf.config.patch(soc="Ascend950"):
        (graph,) = ge_graphs_of(rope_qk(rotate_half), *qk_tables())
    ropes = [op for op in graph.op if op.type == "RotaryPositionEmbedding"]
    assert len(ropes) == 2 and all(op.attr["mode"].i == 0 for op in ropes)
    assert "RotaryMul" not in op_types(graph)


def test_training_backward_graph_gets_one_grad_op_per_site():
    fw, bw = ge_graphs_of(rope_qk(rotate_half), *qk_tables(grad=True))
    assert op_types(fw).count("RotaryMul") == 2
    bw_types = op_types(bw)
    assert bw_types.count("RotaryPositionEmbeddingGrad") == 2
    assert not ROTATE_HALF_OPS & set(bw_types)


def test_softmax_backward_becomes_one_softmax_grad_ext():
    def attention(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)) * 0.125, dim=-1) @ v

    qkv = [torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)]
    fw, bw = ge_graphs_of(attention, *qkv)
    ext = [op for op in bw.op if op.type == "SoftmaxGradExt"]
    assert len(ext) == 1 and ext[0].attr["axes"].i == -1 and ext[0].attr["keep_dims"].b
    assert not {"SoftmaxGrad", "ReduceSumD", "ReduceSum", "Sub"} & set(op_types(bw))


def test_partial_interleave_rope_becomes_inplace_partial_rotary_mul():
    def gptj(q, cos, sin):
        q_rot, q_pass = q[..., :64], q[..., 64:]
        return torch.cat([q_rot * cos + rotate_every_two(q_rot) * sin, q_pass], -1) * 2

    q, cos, sin = torch.randn(2, 16, 4, 128), torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    (graph,) = ge_graphs_of(gptj, q, cos, sin)
    (op,) = [op for op in graph.op if op.type == "InplacePartialRotaryMul"]
    assert list(op.attr["partial_slice"].list.i) == [0, 64] and op.attr["rotary_mode"].s == b"interleave"
    assert not {"StridedSliceV2", "Neg", "ConcatV2", "Pack"} & set(op_types(graph))


def test_in_place_op_training_converts_forward_and_backward():
    from npu_fuse.ops import inplace_partial_rotary_mul

    def train(x, cos, sin):
        y = x * 1.0
        inplace_partial_rotary_mul(y, cos, sin, partial_slice=[0, 64])
        return y

    cos, sin = torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    fw, bw = ge_graphs_of(train, torch.randn(2, 16, 4, 128, requires_grad=True), cos, sin)
    assert op_types(fw).count("InplacePartialRotaryMul") == 1
    assert op_types(bw).count("InplacePartialRotaryMulGrad") == 1
