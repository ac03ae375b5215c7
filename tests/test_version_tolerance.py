"""An installed CANN without a fused op's GE op: the fusion is a near-miss naming the op, the compile
succeeds (offline: the proxy plays that CANN, ``hidden_ops``)."""

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close
from models import attention, gptj, rotate_half
from ge_conformance import check_graph
from torchair_offline import ge_graphs_of, hidden_ops, op_types, torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")


def rope(q, cos, sin):
    return (q * cos + rotate_half(q) * sin) * 2


def near_misses(family):
    return [n.reason for r in nf.get_reports() for n in r.near_misses if n.family == family]


def fused(family):
    return [m.op for r in nf.get_reports() for m in r.matches if m.family == family]


def converted(fn, *args, soc):
    nf.clear_reports()
    with nf.config.patch(soc=soc):
        graphs = ge_graphs_of(fn, *args)
    for graph in graphs:
        assert check_graph(graph, soc) == []
    return graphs


def test_unsupported_ops_lists_what_the_installed_cann_lacks():
    from torchair_offline import load_torchair_offline

    load_torchair_offline()
    from npu_fuse_backend.lowering.npu import unsupported_ops

    assert set(unsupported_ops("Ascend950")) == set()
    # SoftmaxGradExt and the interleave-half RoPE gradient exist on Ascend950 only; no one GE op
    # does the interleave-half RoPE on every SoC
    assert set(unsupported_ops("Ascend910B")) == {"softmax_grad_ext", "interleave_rope_backward"}
    assert set(unsupported_ops("generic")) == {"softmax_grad_ext", "interleave_rope", "interleave_rope_backward"}
    with hidden_ops("RotaryMul"):
        reasons = unsupported_ops("Ascend910B")
        assert "RotaryMul" in reasons["rotary_mul"] and "rotary_mul_backward" not in reasons
        assert "rotary_mul" not in unsupported_ops("Ascend950")  # no RotaryMul there
    with hidden_ops("InplacePartialRotaryMulGrad"):
        assert set(unsupported_ops("Ascend950")) == {"inplace_partial_rotary_mul_backward"}
    assert "unrecognised NPU" in unsupported_ops("Ascend310P3")["rotary_mul"]


def test_a_soc_without_the_ops_kernel_is_said_once_beside_the_op():
    """The converter's table takes the SoCs where the op has no kernel from the op
    (``unavailable_on``) with the op's reason, and refuses to restate them."""
    from torchair_offline import load_torchair_offline

    load_torchair_offline()
    from npu_fuse_backend.converters.common import GE_OPS, declare_ge_ops
    from npu_fuse_backend.lowering.registry import UNAVAILABLE, soc_refusal

    op = torch.ops.npu_fuse.softmax_grad_ext.default
    g = torch.empty(2, 8, device="meta")
    for soc, reason in UNAVAILABLE[op].items():
        assert GE_OPS["softmax_grad_ext"][soc] == reason == soc_refusal(op, soc, g, g, g)
    with pytest.raises(ValueError, match=r"\['Ascend910B'\] are the op's unavailable_on SoCs"):
        declare_ge_ops("softmax_grad_ext", {"Ascend910B": "again"})
    assert GE_OPS["softmax_grad_ext"]["Ascend910B"] != "again"


def test_without_rotary_mul_the_rope_fusion_is_a_near_miss_and_the_graph_converts():
    q, cos, sin = torch.randn(2, 16, 4, 128), torch.randn(1, 16, 1, 128), torch.randn(1, 16, 1, 128)
    with hidden_ops("RotaryMul"):
        (graph,) = converted(rope, q, cos, sin, soc="Ascend910B")
    assert fused("rope") == [] and "RotaryMul" not in op_types(graph)
    assert any("the installed CANN has no GE op RotaryMul" in r for r in near_misses("rope"))
    (graph,) = converted(rope, q, cos, sin, soc="Ascend910B")
    assert fused("rope") == ["rotary_mul"] and "RotaryMul" in op_types(graph)


def test_without_the_grad_op_only_the_backward_fusion_is_a_near_miss():
    q, cos, sin = torch.randn(2, 16, 4, 128, requires_grad=True), torch.randn(1, 16, 1, 128), \
        torch.randn(1, 16, 1, 128)
    with hidden_ops("RotaryPositionEmbeddingGrad"):
        fw, bw = converted(rope, q, cos, sin, soc="Ascend950")
    assert "RotaryPositionEmbedding" in op_types(fw) and "RotaryPositionEmbeddingGrad" not in op_types(bw)
    assert any("no GE op RotaryPositionEmbeddingGrad" in r for r in near_misses("rope"))


def test_without_inplace_partial_rotary_mul_partial_rope_is_a_near_miss():
    q, cos, sin = torch.randn(2, 16, 4, 128), torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    with hidden_ops("InplacePartialRotaryMul"):
        (graph,) = converted(gptj, q, cos, sin, soc="Ascend910B")
    assert "InplacePartialRotaryMul" not in op_types(graph)
    assert any("no GE op InplacePartialRotaryMul" in r for r in near_misses("partial_rope"))


def test_without_softmax_grad_ext_softmax_backward_keeps_softmax_grad():
    qkv = [torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)]
    with hidden_ops("SoftmaxGradExt"):
        _, bw = converted(attention, *qkv, soc="Ascend950")
    assert "SoftmaxGradExt" not in op_types(bw) and "SoftmaxGrad" in op_types(bw)
    assert any("no GE op SoftmaxGradExt" in r for r in near_misses("softmax_grad"))


def test_the_npu_lowering_compiles_and_runs_on_an_older_cann():
    """Through the backend's torchair lowering (torchair's real backend, run eagerly)."""
    from torchair.configs.compiler_config import CompilerConfig

    from npu_fuse_backend.lowering.npu import compile_with_torchair

    cfg = CompilerConfig()
    cfg.debug.run_eagerly = True

    def backend(gm, inputs):
        return compile_with_torchair(gm, inputs, nf.run_fusion_passes, compiler_config=cfg)

    q, cos, sin = torch.randn(2, 16, 4, 128), torch.randn(1, 16, 1, 128), torch.randn(1, 16, 1, 128)
    nf.clear_reports()
    with hidden_ops("RotaryMul"), nf.config.patch(soc="Ascend910B"):
        out = torch.compile(rope, backend=backend)(q, cos, sin)
    assert_close(out, rope(q, cos, sin))
    assert fused("rope") == [] and any("no GE op RotaryMul" in r for r in near_misses("rope"))
