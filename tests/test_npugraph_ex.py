"""The npugraph_ex route through npugraph_ex's real pipeline (offline: tests/npugraph_ex_offline.py):
AOTAutograd, our pre-pass, npugraph_ex's FX passes, its converter and codegen, up to the FX graph it
would capture into an aclgraph. That graph holds the fused ops; run with each fused op's eager NPU
kernel (torch_npu's ops as the wheel's schemas define them) it computes what eager does, and a fused
in-place op on a graph input updates the input itself, with no copy of it."""

import pytest
import torch

import npu_fuse
import npu_fuse_backend as nf
from conftest import assert_close
from test_inplace_graph_inputs import assign_slice
from npu_fuse_backend.demo_models import DecoderConfig, DeepSeekMLA, LlamaModel, MLAConfig, mla_decode_inputs
from npugraph_ex_offline import (
    CAPTURES, load_npugraph_ex_offline, npugraph_ex_available, npugraph_ex_graphs_of, npugraph_ex_run,
)

pytestmark = pytest.mark.skipif(not npugraph_ex_available(), reason="torch_npu not fetched: run `make test`")

fused = torch.ops.npu_fuse
SOCS = ["Ascend910B", "Ascend950"]


def fused_calls(capture) -> list:
    return [n for n in capture.graph_module.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "npu_fuse"]


def fused_names(capture) -> list:
    return [n.target._opname for n in fused_calls(capture)]


def input_copies(capture) -> list:
    """(input, node) for each node that copies a graph input the graph mutates."""
    gm = capture.graph_module
    mutated = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        bound = dict(zip([a.name for a in schema.arguments], node.args)) | dict(node.kwargs)
        for arg in schema.arguments:
            value = bound.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and getattr(value, "op", "") == "placeholder":
                mutated.add(value)
    copies = (torch.ops.aten.clone.default, torch.ops.aten.copy.default, torch.ops.aten._to_copy.default,
              torch.ops.aten.copy_.default)
    return [(x.name, user.name) for x in mutated for user in x.users
            if user.target in copies and user.args[-1 if user.target is torch.ops.aten.copy_.default else 0] is x]


# the Llama block's fused ops, in graph order: its first RMSNorm, RoPE on q and k, the residual adds + RMSNorms
LLAMA_FORWARD = ["rms_norm", "rotary_mul", "rotary_mul", "add_rms_norm", "add_rms_norm"]


def llama():
    return LlamaModel(DecoderConfig(hidden=64, heads=2, kv_heads=1, head_dim=64, intermediate=64))


def hidden():
    return torch.randn(1, 8, 64), torch.arange(8)[None]


def mla_step():
    cfg = MLAConfig()
    model = DeepSeekMLA(cfg).to(torch.bfloat16).eval()
    x, cos, sin, slots, context = mla_decode_inputs(cfg, 4, 1)
    cache = torch.randn(cfg.num_blocks, cfg.block_size, 1, cfg.kv_lora + cfg.rope).to(torch.bfloat16)
    return model, (x, cos, sin, slots, cache, context)


# -- what npugraph_ex would capture -----------------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("soc", SOCS)
def test_llama_inference_graph_holds_the_fused_ops(soc, dynamic):
    model, (x, pos) = llama(), hidden()
    with torch.no_grad(), nf.config.patch(soc=soc):
        expected = model(x, pos)
        got, (capture,) = npugraph_ex_run(model, x, pos, dynamic=dynamic)
    assert capture.phase == "forward" and capture.graph_module is not None
    assert fused_names(capture) == LLAMA_FORWARD  # (dynamic=True: the RMSNorms' eps specialized, float_inputs.py)
    assert [r.lowering for r in nf.get_reports()] == ["npugraph_ex"]
    assert_close(got, expected)


@pytest.mark.parametrize("soc", SOCS)
def test_mla_decode_step_writes_the_cache_input_itself(soc):
    model, args = mla_step()
    eager_cache = args[4].clone()
    with torch.no_grad(), nf.config.patch(soc=soc):
        expected = model(*args[:4], eager_cache, args[5])
        got, (capture,) = npugraph_ex_run(model, *args)
    (call,) = fused_calls(capture)
    assert call.target is fused.mla_preprocess.default
    cache = call.args[13]  # kv_cache, Tensor(a!): the graph input, updated in place by the op
    assert cache.op == "placeholder" and input_copies(capture) == []
    assert not [n for n in capture.graph_module.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert_close(got, expected, torch.bfloat16)
    assert_close(args[4], eager_cache, torch.bfloat16)


@pytest.mark.parametrize("soc", SOCS)
def test_in_place_partial_rope_on_a_graph_input_has_no_copy_of_it(soc):
    table = (2, 1, 1, 64) if soc == "Ascend950" else (2, 16, 1, 64)
    x, cos, sin = torch.randn(2, 16, 4, 128), torch.randn(table), torch.randn(table)
    expected = x.clone()
    assign_slice(expected, cos, sin)
    with nf.config.patch(soc=soc):
        (capture,) = npugraph_ex_graphs_of(assign_slice, x, cos, sin)
    (call,) = fused_calls(capture)
    assert call.target is fused.inplace_partial_rotary_mul.default and call.args[0].op == "placeholder"
    assert input_copies(capture) == []
    assert_close(x, expected)


# -- every fused-op call as its eager NPU kernel, against torch_npu's schemas -------------------------------
@pytest.fixture
def npu_kernels(monkeypatch):
    """{fused op overload: its @npu_kernel}, with torch.ops.npu the wheel's schemas (checked calls,
    CPU references) and torch_npu.atb.npu_mla_preprocess its schema-checked stand-in."""
    from test_mla_preprocess_op import fake_atb
    from test_npu_kernels import REFERENCES, checked, torch_npu_schemas

    from npu_fuse_backend.lowering import registry
    from npu_fuse_backend.lowering.ops import mla_preprocess as M

    schemas = torch_npu_schemas()
    lib = torch.library.Library("npu_fuse_npugraph_ex_schemas", "DEF")
    for name, impl in REFERENCES.items():
        lib.define(schemas[name])
        lib.impl(name, checked(schemas[name], impl), "CompositeExplicitAutograd")
    monkeypatch.setattr(torch.ops, "npu", torch.ops.npu_fuse_npugraph_ex_schemas)
    atb_calls = []
    monkeypatch.setattr(M, "_atb_mla_preprocess", lambda: fake_atb(atb_calls))
    yield {op._opoverload: fn for op, fn in registry._npu_kernels}, atb_calls
    del lib


class WithNpuKernels(torch.fx.Interpreter):
    def __init__(self, gm, kernels):
        super().__init__(gm)
        self.kernels, self.called = kernels, []

    def call_function(self, target, args, kwargs):
        if getattr(target, "namespace", None) == "npu_fuse":
            self.called.append(target._opname)
            return self.kernels[target](*args, **kwargs)  # KeyError: a fused op without an NPU kernel
        return super().call_function(target, args, kwargs)


def clones(values):
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def assert_kernels_compute_the_graph(capture, kernels, dtype=torch.float32):
    reference_inputs, kernel_inputs = clones(capture.inputs), clones(capture.inputs)
    expected = capture.graph_module(*reference_inputs)
    run = WithNpuKernels(capture.graph_module, kernels)
    got = run.run(*kernel_inputs)
    assert run.called == fused_names(capture)
    for g, e in zip([*got, *kernel_inputs], [*expected, *reference_inputs]):
        if isinstance(e, torch.Tensor) and e.is_floating_point():
            assert_close(g, e, dtype)
    return run.called


@pytest.mark.parametrize("soc", SOCS)
def test_captured_llama_runs_with_torch_npus_kernels(soc, npu_kernels):
    kernels, _ = npu_kernels
    model, (x, pos) = llama(), hidden()
    with nf.config.patch(soc=soc):
        captures = npugraph_ex_graphs_of(model, x, pos)
        called = [assert_kernels_compute_the_graph(c, kernels) for c in captures]
    expected = {"Ascend910B": [LLAMA_FORWARD, ["rotary_mul_backward"] * 2],
                "Ascend950": [LLAMA_FORWARD, ["softmax_grad_ext"] + ["rotary_mul_backward"] * 2]}
    assert [c.phase for c in captures] == ["forward", "backward"]
    assert called == expected[soc]


@pytest.mark.parametrize("soc", SOCS)
def test_captured_mla_decode_step_runs_with_its_npu_kernel(soc, npu_kernels):
    kernels, atb_calls = npu_kernels
    model, args = mla_step()
    with torch.no_grad(), nf.config.patch(soc=soc):
        (capture,) = npugraph_ex_graphs_of(model, *args)
        assert assert_kernels_compute_the_graph(capture, kernels, torch.bfloat16) == ["mla_preprocess"]
    assert len(atb_calls) == (1 if soc == "Ascend910B" else 0)  # ATB's kernel on Atlas A2/A3, else the reference


# -- training graphs -------------------------------------------------------------------------------------------
def test_npugraph_ex_captures_backward_graphs_too():
    """npugraph_ex compiles the backward with the compiler of the forward and hands both to its
    aclgraph (npu_fx_compiler._compile_graph_with_aot: bw_compiler = the same _NpuFxCompiler):
    a training step is two captured graphs, with and without npu_fuse."""
    ng = load_npugraph_ex_offline()
    model, (x, pos) = llama(), hidden()
    x.requires_grad_(True)
    plain = npugraph_ex_graphs_of(model, x, pos, backend=ng.get_npu_backend(compiler_config=ng.CompilerConfig()))
    assert [c.phase for c in plain] == ["forward", "backward"] and not any(fused_calls(c) for c in plain)
    expected = torch.autograd.grad(model(x, pos).sum(), x)[0]
    with nf.config.patch(soc="Ascend950"):
        captures = npugraph_ex_graphs_of(model, x.detach().requires_grad_(True), pos)
    assert [(c.phase, sorted(set(fused_names(c)))) for c in captures] == [
        ("forward", sorted(set(LLAMA_FORWARD))), ("backward", ["rotary_mul_backward", "softmax_grad_ext"])]
    got_x = x.detach().requires_grad_(True)
    with nf.config.patch(soc="Ascend950"):
        npugraph_ex_run(model, got_x, pos)
    assert_close(got_x.grad, expected)


def test_a_fused_scale_does_not_break_the_backward_compile(monkeypatch):
    """npugraph_ex's converter evaluates each node a second time outside the fake mode, and a backward
    graph compiles with no fake mode active: a ``full`` our softmax fusion inserts would then be a real
    tensor beside fake ones. The pre-pass builds it as ``new_full`` of a fake tensor instead; without
    that, the compile fails."""
    from npu_fuse_backend.lowering import npugraph_ex

    model, (x, pos) = llama(), hidden()
    with nf.config.patch(soc="Ascend950"):
        (_, backward) = npugraph_ex_graphs_of(model, x, pos, training=True)
        scale = next(n for n in fused_calls(backward) if n.target is fused.softmax_grad_ext.default).args[2]
        assert scale.target is torch.ops.aten.new_full.default
        monkeypatch.setattr(npugraph_ex, "_factory_calls_as_new_full", lambda gm, before: 0)
        with pytest.raises(Exception, match="convert all Tensors to FakeTensors"):
            npugraph_ex_graphs_of(model, x, pos, training=True)


def test_a_fused_op_without_an_npu_kernel_is_a_near_miss_on_this_route():
    from npu_fuse_backend.lowering.npugraph_ex import unsupported_ops

    assert list(unsupported_ops()) == ["interleave_rope_backward"]

    def rope(q, cos, sin):
        cos, sin = cos[..., :32].unsqueeze(1), sin[..., :32].unsqueeze(1)
        q1, q2 = q[..., 0::2], q[..., 1::2]
        return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)

    emb = torch.randn(1, 8, 32).repeat(1, 1, 2)
    q = torch.randn(1, 2, 8, 64, requires_grad=True)
    with nf.config.patch(soc="Ascend950"):
        forward, backward = npugraph_ex_graphs_of(rope, q, emb.cos(), emb.sin())
    assert fused_names(forward) == ["interleave_rope"] and fused_names(backward) == []
    (miss,) = [n for r in nf.get_reports() if r.kind == "backward" for n in r.near_misses]
    assert "interleave_rope_backward has no eager NPU kernel" in miss.reason


# -- the ways in: mode="npugraph_ex", get_npugraph_ex_backend, backend="npugraph_ex" ----------------------------
def test_mode_npugraph_ex_on_an_npu_lowers_through_npugraph_ex():
    load_npugraph_ex_offline()
    model, (x, pos) = llama(), hidden()
    with torch.no_grad(), nf.config.patch(lowering="npu", soc="Ascend910B"):  # lowering="npu": as on an NPU
        captures = npugraph_ex_graphs_of(model, x, pos, backend="npu_fuse", mode="npugraph_ex")
    assert [fused_names(c) for c in captures] == [LLAMA_FORWARD]
    assert [r.lowering for r in nf.get_reports()] == ["npugraph_ex"]


def test_get_npugraph_ex_backend_copies_the_config_and_runs_the_users_pass_after_ours():
    ng = load_npugraph_ex_offline()
    seen = []

    def my_pass(gm, example_inputs, config):
        seen.append(sorted({n.target._opname for n in gm.graph.nodes
                            if getattr(n.target, "namespace", None) == "npu_fuse"}))

    cfg = ng.CompilerConfig()
    cfg.post_grad_custom_pre_pass = my_pass
    cfg.frozen_parameter = True
    backend = npu_fuse.get_npugraph_ex_backend(compiler_config=cfg)
    model, (x, pos) = llama(), hidden()
    with torch.no_grad():
        for _ in range(2):  # reusing the config does not stack our pass up
            (capture,) = npugraph_ex_graphs_of(model, x, pos, backend=backend, options={"clone_input": False})
            assert capture.config["frozen_parameter"] is True and capture.config["clone_input"] is False
    assert seen == [sorted(set(LLAMA_FORWARD))] * 2  # ours ran first, exactly once each time
    assert cfg.post_grad_custom_pre_pass.value is my_pass and cfg.clone_input.value is True  # never modified


def test_npugraph_ex_options_are_checked_against_its_config():
    load_npugraph_ex_offline()
    x = torch.randn(2, 4)
    backend = npu_fuse.get_npugraph_ex_backend()
    with pytest.raises(Exception, match=r"options\['experimental_config.frozen_parameter'\] is not an npugraph_ex "
                                        r"CompilerConfig field \(did you mean \['frozen_parameter'\]\?\)"):
        npugraph_ex_graphs_of(torch.sin, x, backend=backend, options={"experimental_config.frozen_parameter": True})
    with pytest.raises(Exception, match=r"npugraph_ex rejects options\['capture_limit'\]=0"):
        npugraph_ex_graphs_of(torch.sin, x, backend=backend, options={"capture_limit": 0})
    with pytest.raises(Exception, match="mode='max-autotune' is no npugraph_ex mode"):
        npugraph_ex_graphs_of(torch.sin, x, backend=backend, mode="max-autotune")
    with pytest.raises(TypeError, match="must be an npugraph_ex CompilerConfig, got dict"):
        npu_fuse.get_npugraph_ex_backend(compiler_config={})


def test_the_one_liner_for_backend_npugraph_ex():
    """torch_npu registers backend="npugraph_ex" as npugraph_ex.get_npu_backend on a fresh CompilerConfig
    whose torch.compile options set its fields (torch_npu/dynamo/__init__.py, _exec); our fusions are
    then one option."""
    ng = load_npugraph_ex_offline()

    def backend_npugraph_ex(gm, example_inputs, **kwargs):  # torch_npu's _exec
        return ng.get_npu_backend(compiler_config=ng.CompilerConfig())(gm, example_inputs, **kwargs)

    model, (x, pos) = llama(), hidden()
    with torch.no_grad():
        (capture,) = npugraph_ex_graphs_of(model, x, pos, backend=backend_npugraph_ex,
                                           options={"post_grad_custom_pre_pass": npu_fuse.npugraph_ex_pre_pass})
    assert fused_names(capture) == LLAMA_FORWARD
    assert [(r.lowering, len(r.matches)) for r in nf.get_reports()] == [("npugraph_ex", len(LLAMA_FORWARD))]
    assert CAPTURES[-1] is capture


def test_the_ge_route_still_compiles_after_the_npugraph_ex_route_in_one_process():
    """torchair fails when npugraph_ex went first (its op_broadcast import, its aten::to.other patch):
    npu_fuse's npugraph_ex route loads torchair and its patches first. A fresh process, this order."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from npugraph_ex_offline import npugraph_ex_graphs_of
        import npu_fuse
        from test_configuration import rope, rope_args
        from torchair_offline import ge_graphs_of, load_torchair_offline
        assert [len(c.graph_module.graph.nodes) > 0 for c in npugraph_ex_graphs_of(rope, *rope_args())] == [True]
        (graph,) = ge_graphs_of(rope, *rope_args())  # torchair's real FX->GE conversion
        torchair = load_torchair_offline()
        with npu_fuse.config.patch(lowering="npu"):
            torch._dynamo.reset()
            torch.compile(rope, backend=npu_fuse.get_npu_backend(
                compiler_config=torchair.CompilerConfig()), options={"debug.run_eagerly": True})(*rope_args())
        print("ok", [op.type for op in graph.op if op.type.startswith("Rotary")])
    """)
    tests = str(Path(__file__).parent)
    result = subprocess.run([sys.executable, "-c", script, tests], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2].startswith("ok ['RotaryPositionEmbedding']")
