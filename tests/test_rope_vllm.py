"""vLLM's ``_C::rotary_embedding`` -> rotary_mul (passes/rope_vllm.py).

The op is vLLM's own where vLLM is installed (``make test-vllm`` runs this file against its CPU
kernel), else the stand-in of ``tests/vllm_ops.py`` (vLLM's schema and semantics). The module
below is vLLM's attention prologue as ``LlamaAttention.forward`` writes it: a qkv projection,
``split``, the in-place RoPE op on the query and key views.
"""

import pytest
import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import config as inductor_config

import npu_fuse_backend as nf
import vllm_ops
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from npu_fuse_backend.passes import rope_vllm
from torch._dynamo.backends.common import aot_autograd

rotary_embedding = vllm_ops.rotary_embedding


class VllmAttentionPrologue(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=2, head_size=32, rotary_dim=32, is_neox=True, dtype=torch.float32,
                 cache_dtype=None, with_key=True):
        super().__init__()
        self.heads, self.kv_heads, self.head_size, self.is_neox, self.with_key = heads, kv_heads, head_size, is_neox, \
            with_key
        self.qkv = torch.nn.Linear(64, (heads + 2 * kv_heads) * head_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.randn(256, rotary_dim, dtype=cache_dtype or dtype))

    def forward(self, positions, hidden):
        qkv = self.qkv(hidden)
        q, k, v = qkv.split([self.heads * self.head_size, self.kv_heads * self.head_size,
                             self.kv_heads * self.head_size], dim=-1)
        rotary_embedding(positions, q, k if self.with_key else None, self.head_size, self.cos_sin_cache, self.is_neox)
        return q * 2, k + 1, v  # reads of the rotated query and key, as attention would


def inputs(tokens=7, dtype=torch.float32, positions_dtype=torch.int64):
    return torch.randint(0, 256, (tokens,), dtype=positions_dtype), torch.randn(tokens, 64, dtype=dtype)


def check_fuses(module, args, v2=False, dynamic=True, dtype=torch.float32, expected=1):
    expected_out = module(*args)
    with inductor_config.patch(enable_auto_functionalized_v2=v2):
        out, reports = compile_fused(module, *args, dynamic=dynamic)
    assert fused_ops(reports) == ["rotary_mul"] * expected, near_miss_reasons(reports)
    for got, want in zip(out, expected_out):
        assert_close(got, want, dtype)
    return reports


@pytest.fixture(autouse=True)
def inference():
    with torch.no_grad():  # vLLM serves without autograd; an in-place op on split views needs it off
        yield


# -- what fuses ------------------------------------------------------------------------------
@pytest.mark.parametrize("v2", [False, True], ids=["auto_functionalized", "auto_functionalized_v2"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_fuses_in_both_functionalized_forms(v2, is_neox, rotary_dim):
    reports = check_fuses(VllmAttentionPrologue(rotary_dim=rotary_dim, is_neox=is_neox), inputs(), v2=v2)
    match = reports[0].matches[0]
    assert match.family == "rope_vllm" and f"mode={'half' if is_neox else 'interleave'}" in match.detail
    assert ("rotary_dim=16 of head_size 32" in match.detail) == (rotary_dim == 16)


def fused_graph(module, args):
    """(output, aten graph after the passes) of module compiled with npu_fuse's passes."""
    graphs = []

    def fw(gm, _):
        nf.run_fusion_passes(gm, "aot_eager")
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"), inductor_config.patch(enable_auto_functionalized_v2=False):
        out = torch.compile(module, backend=aot_autograd(fw_compiler=fw), dynamic=True)(*args)
    return out, graphs[0]


def test_the_call_is_gone_and_the_rewrite_was_validated():
    from torch._dynamo.utils import counters

    module, args = VllmAttentionPrologue(), inputs()
    expected = module(*args)
    counters["npu_fuse_validation"].clear()
    out, gm = fused_graph(module, args)
    for got, want in zip(out, expected):
        assert_close(got, want)
    targets = [str(n.target) for n in gm.graph.nodes]
    assert not any("rotary_embedding" in t or "auto_functionalized" in t for t in targets), targets
    assert sum("npu_fuse.rotary_mul" in t for t in targets) == 2  # query and key
    assert "aten.as_strided.default" not in targets  # positions and tokens share their symbol here
    assert counters["npu_fuse_validation"]["equal"] == 1


def test_key_none_and_bf16():
    check_fuses(VllmAttentionPrologue(with_key=False), inputs())
    check_fuses(VllmAttentionPrologue(dtype=torch.bfloat16), inputs(dtype=torch.bfloat16), dtype=torch.bfloat16)


def test_positions_of_their_own_length():
    """vLLM passes a slice of its positions buffer: its length is a symbol of its own, not
    provably the query's rows; the kernels need one position per row."""
    module = VllmAttentionPrologue()
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        _, gm = fused_graph(module, inputs(tokens=7))
        assert "aten.as_strided.default" in [str(n.target) for n in gm.graph.nodes]
        nf.clear_reports()
        with nf.config.patch(fallback="aot_eager"):
            compiled = torch.compile(module, backend="npu_fuse", dynamic=True)
            for tokens in (7, 9):  # one graph for every token count
                args = inputs(tokens=tokens)
                for got, want in zip(compiled(*args), module(*args)):
                    assert_close(got, want)
    assert fused_ops(nf.get_reports()) == ["rotary_mul"]


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_fuses_on_each_soc(soc):
    module = VllmAttentionPrologue(is_neox=False, rotary_dim=16)
    out, reports = compile_fused(module, *inputs(), dynamic=True, soc=soc)
    assert fused_ops(reports) == ["rotary_mul"], near_miss_reasons(reports)


# -- what does not -----------------------------------------------------------------------------
class Traced(Exception):
    pass


def passes_only(fn, *args, v2=False) -> nf.GraphReport:
    """The report of the passes on fn's aten graph, without running it (some of these calls raise
    in eager, as vLLM's CPU kernel does)."""
    reports = []

    def fw(gm, _):
        reports.append(nf.run_fusion_passes(gm, "aot_eager"))

        def stop(*_):
            raise Traced

        return make_boxed_func(stop)

    torch._dynamo.reset()
    for arg in args:  # the token count symbolic, as vLLM compiles; the table static
        torch._dynamo.mark_dynamic(arg, 0)
    with inductor_config.patch(enable_auto_functionalized_v2=v2), pytest.raises(Traced):
        torch.compile(fn, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(*args)
    return reports[0]


def prologue(head_size=32, q_width=128, k_width=64, three_d=False, offset=0, inverse=False,
             cache_dtype=torch.float32, rotary_dim=32, is_neox=True):
    cache = torch.randn(256, rotary_dim, dtype=cache_dtype)

    def fn(positions, qkv):
        q, k = qkv.split([q_width, k_width], dim=-1)
        if three_d:
            q, k = q.unflatten(-1, (-1, head_size)), k.unflatten(-1, (-1, head_size))
        rotary_embedding(positions, q, k, head_size, cache, is_neox, offset, inverse)
        return qkv * 1

    return fn, q_width + k_width


@pytest.mark.parametrize("case, reason", [
    (dict(three_d=True), "the result depends on the build"),
    (dict(offset=8, rotary_dim=16), "rope_dim_offset=8: only 0 is fused"),
    (dict(inverse=True), "inverse=True: only the forward rotation is fused"),
    (dict(cache_dtype=torch.bfloat16), "must share one float dtype"),
    (dict(rotary_dim=48), "must be even, static and within head_size 32"),
    (dict(rotary_dim=15), "must be even"),
    (dict(q_width=112), "last dim 112 is not a static multiple of head_size 32"),
])
@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_refused_with_the_rule(case, reason, v2):
    fn, width = prologue(**case)
    report = passes_only(fn, torch.randint(0, 256, (7,)), torch.randn(7, width), v2=v2)
    assert not report.matches
    assert any(reason in n.reason for n in report.near_misses), [n.reason for n in report.near_misses]


def test_int32_positions_refused():
    fn, width = prologue()
    report = passes_only(fn, torch.randint(0, 256, (7,), dtype=torch.int32), torch.randn(7, width))
    assert not report.matches and "1-D int64 positions" in report.near_misses[0].reason


def test_a_look_alike_op_of_another_library_is_not_taken():
    lib = torch.library.Library("npu_fuse_test_vllm", "FRAGMENT")
    lib.define(vllm_ops.SCHEMA)
    lib.impl("rotary_embedding", lambda *a: None, "CompositeExplicitAutograd")
    torch.library.register_fake("npu_fuse_test_vllm::rotary_embedding", lambda *a: None, lib=lib)
    look_alike = torch.ops.npu_fuse_test_vllm.rotary_embedding
    cache = torch.randn(256, 32)

    def fn(positions, qkv):
        q, k = qkv.split([128, 64], dim=-1)
        look_alike(positions, q, k, 32, cache, True)
        return qkv * 1

    report = passes_only(fn, torch.randint(0, 256, (7,)), torch.randn(7, 192))
    assert not report.matches and not report.near_misses


def test_a_wrong_replacement_is_caught_by_validation(monkeypatch):
    """The net under the rules: with the rotation mode swapped, the replacement is run against
    the kernel (vLLM's where installed) on random inputs and refused."""
    original = rope_vllm._Site._rotate

    def swapped(self, b, x, cos, sin):
        self.mode = "interleave" if self.mode == "half" else "half"
        try:
            return original(self, b, x, cos, sin)
        finally:
            self.mode = "interleave" if self.mode == "half" else "half"

    monkeypatch.setattr(rope_vllm._Site, "_rotate", swapped)
    module, args = VllmAttentionPrologue(), inputs()
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        out, reports = compile_fused(module, *args, dynamic=True)
    assert not fused_ops(reports)
    assert any("replacement differs from the subgraph" in r for r in near_miss_reasons(reports))
    for got, want in zip(out, module(*args)):
        assert_close(got, want)


@pytest.mark.skipif(vllm_ops.REAL, reason="counts the stand-in's calls")
def test_validation_never_runs_the_kernel_out_of_range(monkeypatch):
    """vLLM's kernels do not check the range of positions: the validator draws valid rows only."""
    seen = []
    reference = vllm_ops.rotate_reference

    def recording(positions, *args):
        seen.append((int(positions.min()), int(positions.max())))
        return reference(positions, *args)

    monkeypatch.setattr(vllm_ops, "rotate_reference", recording)
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        _, reports = compile_fused(VllmAttentionPrologue(), *inputs(), dynamic=True)
    assert fused_ops(reports) == ["rotary_mul"]
    assert seen and all(0 <= low and high < 256 for low, high in seen), seen
