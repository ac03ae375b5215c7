"""No copy of a mutated graph input: the in-place partial RoPE on a graph input, on the GE graph after
torchair's GE passes (the decision and its evidence: converters/partial_rope.py)."""

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close
from models import rotate_every_two
from ge_conformance import check_graph, input_copies
from torchair_offline import ge_graphs_of, op_types, torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")

SOCS = ["generic", "Ascend910B", "Ascend910_93", "Ascend950"]


def assign_slice(x, cos, sin):
    s = x[..., 8:72]
    x[..., 8:72] = s * cos + rotate_every_two(s) * sin
    return cos.sum()


def copy_into_slice(x, cos, sin):
    s = x[..., 8:72]
    s.copy_(s * cos + rotate_every_two(s) * sin)
    return sin.sum()


def args(soc):
    table = (2, 1, 1, 64) if soc == "Ascend950" else (2, 16, 1, 64)  # B11D / BS1D: a layout each SoC takes
    return torch.randn(2, 16, 4, 128), torch.randn(table), torch.randn(table)


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("fn", [assign_slice, copy_into_slice])
def test_in_place_partial_rope_on_a_graph_input_has_no_copy_of_it(fn, soc):
    with nf.config.patch(soc=soc):
        (graph,) = ge_graphs_of(fn, *args(soc))
    assert graph.mutated_inputs == ("arg0_1",)
    (op,) = [op for op in graph.op if op.type == "InplacePartialRotaryMul"]
    assert op.input[0] == "arg0_1:0"  # the graph input itself, updated in place (output "x")
    assert "TensorMove" not in op_types(graph) and input_copies(graph) == []
    assert not {"Assign", "ConcatV2", "StridedSliceV2"} & set(op_types(graph))
    (net_output,) = [op for op in graph.op if op.type == "NetOutput"]
    assert f"{op.name}:-1" in net_output.input  # kept alive (dont_prune_me): nothing reads its output
    assert check_graph(graph, soc) == []


def test_without_the_reinplacing_torchair_keeps_a_copy_of_the_input():
    """The evidence that re-inplacing is what removes the copy: the same fused graph converted
    through auto_functionalized_v2 keeps torchair's TensorMove (the op is not in its table)."""
    from torchair.configs.compiler_config import CompilerConfig

    cfg = CompilerConfig()
    (graph,) = ge_graphs_of(assign_slice, *args("Ascend910B"), fusion=False, config=cfg)
    assert "InplacePartialRotaryMul" not in op_types(graph)  # unfused: no copy either, but 10+ ops
    cfg = CompilerConfig()
    cfg.post_grad_custom_pre_pass = lambda gm, inputs, config: nf.run_fusion_passes(gm, "torchair")
    (graph,) = ge_graphs_of(assign_slice, *args("Ascend910B"), fusion=False, config=cfg)
    (op,) = [op for op in graph.op if op.type == "InplacePartialRotaryMul"]
    assert input_copies(graph) == ["TensorMove"] and op.input[0] == "TensorMove:0"


def test_an_input_also_read_elsewhere_keeps_its_copy():
    """GE orders readers of a Data only by data edges: re-inplacing would let them see the new
    value, so an input with another reader keeps torchair's copy."""
    def fn(x, cos, sin):
        before = x.sum()
        assign_slice(x, cos, sin)
        return before

    (graph,) = ge_graphs_of(fn, *args("Ascend910B"))
    (op,) = [op for op in graph.op if op.type == "InplacePartialRotaryMul"]
    assert op.input[0] == "TensorMove:0" and input_copies(graph) == ["TensorMove"]


def test_reinplaced_graph_runs_eagerly_with_the_input_updated():
    """torchair's run_eagerly executes the FX graph after our pre-pass: the in-place call on the
    input itself must give what eager does."""
    from torchair.configs.compiler_config import CompilerConfig

    from npu_fuse_backend.lowering.npu import compile_with_torchair

    cfg = CompilerConfig()
    cfg.debug.run_eagerly = True

    def backend(gm, inputs):
        return compile_with_torchair(gm, inputs, nf.run_fusion_passes, compiler_config=cfg)

    for fn in (assign_slice, copy_into_slice):
        x, cos, sin = args("generic")
        expected = x.clone()
        fn(expected, cos, sin)
        torch._dynamo.reset()
        with nf.config.patch(soc="Ascend910B"):
            torch.compile(fn, backend=backend)(x, cos, sin)
        assert_close(x, expected)
        assert [m.op for r in nf.get_reports() for m in r.matches][-1] == "inplace_partial_rotary_mul"


def test_reinplace_rewrites_only_write_back_only_graph_inputs():
    from torch.fx.experimental.proxy_tensor import make_fx

    from npu_fuse_backend.lowering.npu import load_converters, reinplace_graph_inputs

    load_converters()

    def traced(fn):  # functionalized as AOTAutograd does: mutations become copy_ into the inputs
        from torch.func import functionalize

        gm = make_fx(functionalize(fn, remove="mutations"), tracing_mode="fake")(*args("generic"))
        gm.graph.eliminate_dead_code()
        nf.run_fusion_passes(gm, "torchair")
        return gm

    gm = traced(assign_slice)
    assert reinplace_graph_inputs(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.npu_fuse.inplace_partial_rotary_mul.default in targets
    assert torch.ops.higher_order.auto_functionalized_v2 not in targets and torch.ops.aten.copy_.default not in targets

    def also_returned(x, cos, sin):
        assign_slice(x, cos, sin)
        return x * 2  # the new value is read again: not a write-back only

    gm = traced(also_returned)
    assert reinplace_graph_inputs(gm) == 0
