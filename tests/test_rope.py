"""The RoPE fusion pass, end to end through the npu_fuse backend (aot_eager lowering)."""

import warnings

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close, assert_no_worse_than_eager, compile_fused, fused_ops, near_miss_reasons
from npu_fuse_backend import fusion


# -- the ways real model code writes RoPE ---------------------------------------------
def rotate_half_slice(x):  # HF Llama / Qwen / Mistral
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_split_neg_mul(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=x.dim() - 1)
    return torch.cat([x2 * -1, x1], dim=3)


def rotate_every_two(x):  # GPT-J
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_pairs_unbind(x):  # lucidrains rotary-embedding-torch
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


ROTATIONS = {
    "half-slice": (rotate_half_slice, "half"),
    "half-chunk": (rotate_half_chunk, "half"),
    "half-split-mul": (rotate_half_split_neg_mul, "half"),
    "interleave-stack": (rotate_every_two, "interleave"),
    "interleave-unbind": (rotate_pairs_unbind, "interleave"),
}

ORDERS = {
    "x*cos + rot*sin": lambda x, r, c, s: x * c + r * s,
    "sin*rot + cos*x": lambda x, r, c, s: s * r + c * x,
    "cos*x + rot*sin": lambda x, r, c, s: c * x + r * s,
}


def tables(shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize("style", ROTATIONS)
@pytest.mark.parametrize("order", ORDERS)
def test_every_style_and_operand_order_fuses_with_eager_numerics(style, order):
    rotate, mode = ROTATIONS[style]
    combine = ORDERS[order]

    def rope(q, k, cos, sin):
        return combine(q, rotate(q), cos, sin), combine(k, rotate(k), cos, sin)

    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)  # BNSD, GQA k
    cos, sin = tables((1, 1, 6, 16))
    out, reports = compile_fused(rope, q, k, cos, sin)
    assert fused_ops(reports) == ["rotary_mul", "rotary_mul"]
    assert all(m.detail == f"mode={mode}" for r in reports for m in r.matches)
    for got, expected in zip(out, rope(q, k, cos, sin)):
        assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
def test_hf_llama_cos_sin_from_position_ids_in_graph(dtype, layout):
    """cos/sin built in the graph: inv_freq matmul, cat, cos/sin, cast, index, unsqueeze."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))

    def model(q, k, position_ids):
        freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        dim = 2 if layout == "BSND" else 1
        cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
        return (q * cos) + (rotate_half_slice(q) * sin), (k * cos) + (rotate_half_slice(k) * sin)

    shape_q = (2, 10, 4, 32) if layout == "BSND" else (2, 4, 10, 32)
    shape_k = (2, 10, 1, 32) if layout == "BSND" else (2, 1, 10, 32)
    q, k = torch.randn(shape_q, dtype=dtype), torch.randn(shape_k, dtype=dtype)
    pos = torch.arange(10).expand(2, 10)
    out, reports = compile_fused(model, q, k, pos)
    assert fused_ops(reports).count("rotary_mul") == 2
    for got, expected in zip(out, model(q, k, pos)):
        assert got.dtype == dtype
        assert_close(got, expected, dtype)


def test_cos_sin_indexed_by_position_ids_and_expanded():
    def model(q, cos_cached, sin_cached, position_ids):
        cos = cos_cached[position_ids].unsqueeze(1).expand(-1, q.shape[1], -1, -1)
        sin = sin_cached[position_ids].unsqueeze(1).expand(-1, q.shape[1], -1, -1)
        return q * cos + rotate_half_chunk(q) * sin

    q = torch.randn(2, 4, 8, 16)
    cos, sin = tables((32, 16))
    pos = torch.randint(0, 32, (2, 8))
    out, reports = compile_fused(model, q, cos, sin, pos)
    assert fused_ops(reports) == ["rotary_mul"]
    assert_close(out, model(q, cos, sin, pos))


def test_mixed_dtypes_follow_type_promotion():
    """bf16 q with fp32 cos/sin: eager promotes to fp32, and so does the fusion."""
    def rope(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    q = torch.randn(2, 3, 4, 16, dtype=torch.bfloat16)
    cos, sin = tables((1, 3, 1, 16))
    out, reports = compile_fused(rope, q, cos, sin)
    assert fused_ops(reports) == ["rotary_mul"]
    assert out.dtype == torch.float32
    assert_close(out, rope(q, cos, sin))


def test_token_major_3d_x_is_lifted_to_4d():
    def rope(q, cos, sin):  # [T, N, D] with [T, 1, D] tables, as serving engines lay them out
        return q * cos + rotate_half_slice(q) * sin

    q = torch.randn(7, 4, 16)
    cos, sin = tables((7, 1, 16))
    out, reports = compile_fused(rope, q, cos, sin)
    assert fused_ops(reports) == ["rotary_mul"]
    assert out.shape == q.shape
    assert_close(out, rope(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_llama_complex_form(dtype):
    def apply_rotary_emb(xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        shape = [d if i == 1 or i == xq_.ndim - 1 else 1 for i, d in enumerate(xq_.shape)]
        freqs_cis = freqs_cis.view(*shape)
        xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    xq, xk = torch.randn(2, 9, 4, 16, dtype=dtype), torch.randn(2, 9, 2, 16, dtype=dtype)
    freqs = torch.outer(torch.arange(9).float(), 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    out, reports = compile_fused(apply_rotary_emb, xq, xk, freqs_cis)
    assert fused_ops(reports) == ["rotary_mul", "rotary_mul"]
    assert all("complex" in m.detail for r in reports for m in r.matches)
    for got, expected in zip(out, apply_rotary_emb(xq, xk, freqs_cis)):
        assert_close(got, expected, dtype)


# -- training: forward and backward graphs ---------------------------------------------
@pytest.mark.parametrize("style", ROTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_fuses_forward_and_backward_with_eager_gradients(style, dtype):
    rotate, _ = ROTATIONS[style]

    def rope(q, k, cos, sin):
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    q = torch.randn(2, 6, 4, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 6, 2, 16, dtype=dtype, requires_grad=True)
    cos, sin = tables((1, 6, 1, 16), dtype)
    def run(fn, *tensors):
        q_, k_ = (t.detach().requires_grad_() for t in tensors[:2])
        out = fn(q_, k_, *tensors[2:])
        (out[0].float().pow(2).sum() + out[1].float().sum()).backward()
        return (*out, q_.grad, k_.grad)

    compiled = torch.compile(rope, backend="npu_fuse", fullgraph=True)
    with nf.config.patch(fallback="aot_eager"):
        got = run(compiled, q, k, cos, sin)
    eager = run(rope, q, k, cos, sin)
    exact = run(rope, *(t.double() for t in (q, k, cos, sin)))
    for g, e, x in zip(got, eager, exact):
        assert_no_worse_than_eager(g, e, x)
    kinds = {r.kind: [m.op for m in r.matches] for r in nf.get_reports()}  # bw compiles lazily
    assert kinds["forward"] == ["rotary_mul", "rotary_mul"]
    assert kinds["backward"] == ["rotary_mul_backward", "rotary_mul_backward"]


def test_llama_layer_training_step_through_inductor():
    """The one inductor compile of this file: a whole Llama layer, fw+bw, vs eager."""
    from models import tiny_llama

    model = tiny_llama(heads=2, kv_heads=1, head_dim=32, intermediate=96)
    x = torch.randn(2, 8, 64, requires_grad=True)
    pos = torch.arange(8).expand(2, 8)
    out, reports = compile_fused(model, x, pos, fallback="inductor")
    out.sum().backward()
    got_grad = x.grad
    x.grad = None
    expected = model(x, pos)
    expected.sum().backward()
    assert_close(out, expected)
    torch.testing.assert_close(got_grad, x.grad, atol=1e-4, rtol=1e-4)
    reports = nf.get_reports()
    assert {r.lowering for r in reports} == {"inductor"}
    # the norms: forward; the layer's `scores / sqrt(d)` softmax backward: a division by a number (issue 15)
    assert sorted(fused_ops(reports)) == ["add_rms_norm", "add_rms_norm", "rms_norm", "rotary_mul", "rotary_mul",
                                          "rotary_mul_backward", "rotary_mul_backward", "softmax_grad_ext"]


# -- dynamic shapes --------------------------------------------------------------------
def test_dynamic_batch_and_sequence_still_fuse():
    proj = torch.nn.Linear(64, 64).requires_grad_(False)

    def model(x, cos, sin):
        b, s, _ = x.shape
        q = proj(x).view(b, s, 4, 16)
        return q * cos + rotate_half_slice(q) * sin

    outs = []
    for b, s in ((2, 5), (3, 9)):
        x = torch.randn(b, s, 64)
        cos, sin = tables((1, s, 1, 16))
        torch._dynamo.reset()
        out, reports = compile_fused(model, x, cos, sin, dynamic=True)
        assert fused_ops(reports) == ["rotary_mul"]
        outs.append((out, model(x, cos, sin)))
    for got, expected in outs:
        assert_close(got, expected)


def test_symbolic_head_dim_is_a_near_miss():
    def rope(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    q = torch.randn(2, 3, 4, 16)
    cos, sin = tables((1, 3, 1, 16))
    out, reports = compile_fused(rope, q, cos, sin, dynamic=True)
    assert fused_ops(reports) == []
    assert any("head dim" in r and "symbolic" in r for r in near_miss_reasons(reports))
    assert_close(out, rope(q, cos, sin))


# -- near-misses: not RoPE, or RoPE the op cannot take ------------------------------------
def _single_rope_reasons(fn, *args):
    out, reports = compile_fused(fn, *args)
    eager = fn(*args)
    for got, expected in zip(out if isinstance(out, tuple) else (out,), eager if isinstance(eager, tuple) else (eager,)):
        assert_close(got, expected)
    assert "rotary_mul" not in fused_ops(reports)
    return near_miss_reasons(reports)


def test_intermediate_used_outside_blocks_fusion():
    def fn(q, cos, sin):
        rot = rotate_half_slice(q)
        return q * cos + rot * sin, rot.sum()

    reasons = _single_rope_reasons(fn, torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 16)))
    assert any("is used outside the subgraph" in r for r in reasons)


def test_cos_that_grows_x_is_not_broadcastable():
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    reasons = _single_rope_reasons(fn, torch.randn(1, 3, 4, 16), *tables((2, 3, 1, 16)))
    assert any("result shape [2, 3, 4, 16] differs from x shape [1, 3, 4, 16]" in r for r in reasons)


def test_cos_with_last_dim_one_is_refused():
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    reasons = _single_rope_reasons(fn, torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 1)))
    assert any("last dim 1 != the 16 lanes rotated, and the fused ops' tables are full width" in r for r in reasons), reasons


def test_rotated_tensor_differs_from_the_one_times_cos():
    def fn(q, k, cos, sin):
        return q * cos + rotate_half_slice(k) * sin

    reasons = _single_rope_reasons(fn, torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 16),
                                   *tables((1, 3, 1, 16)))
    assert any("is not the rotated tensor" in r for r in reasons)


def test_odd_head_dim_is_a_near_miss():
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    reasons = _single_rope_reasons(fn, torch.randn(2, 3, 4, 7), *tables((1, 3, 1, 7)))
    assert any("head dim 7 is odd" in r for r in reasons)


def test_half_swap_without_negation_is_a_reflection_not_rope():
    def fn(q, cos, sin):
        x1, x2 = q.chunk(2, dim=-1)
        return q * cos + torch.cat((x2, x1), dim=-1) * sin

    reasons = _single_rope_reasons(fn, torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 16)))
    assert len(reasons) == 1 and "sign error" in reasons[0] and "a reflection, not a rotation" in reasons[0]


def test_five_dim_x_is_a_near_miss():
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    reasons = _single_rope_reasons(fn, torch.randn(2, 2, 3, 4, 16), *tables((1, 1, 3, 1, 16)))
    assert any("5-D" in r for r in reasons)


# -- the backend's promises: config, report, robustness ------------------------------------
def test_disabled_fusion_leaves_graph_alone():
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    q = torch.randn(2, 3, 4, 16)
    _, reports = compile_fused(fn, q, *tables((1, 3, 1, 16)), disabled_fusions=["rope"])
    assert fused_ops(reports) == []


def test_counters_and_report_api():
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    _, reports = compile_fused(fn, torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 16)))
    assert torch._dynamo.utils.counters["npu_fuse"]["rotary_mul"] == 1
    (report,) = reports
    (match,) = report.matches
    assert match.family == "rope" and match.op == "rotary_mul"
    assert {"cat", "neg"} <= {name.rstrip("_0123456789") for name in match.nodes_replaced}
    assert "fused rotary_mul" in report.summary()
    assert report.kind == "inference" and report.lowering == "aot_eager"


def test_report_is_logged_to_the_npu_fuse_logger(caplog):
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    with caplog.at_level("INFO", logger="npu_fuse"):
        compile_fused(fn, torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 16)))
    assert any("fused rotary_mul" in rec.getMessage() for rec in caplog.records)


def _rope_pass_building(name: str, around):
    """A pass that matches as the RoPE pass and builds its replacement by ``around(build, b, anchor)``
    (``build``: the RoPE pass's own)."""
    from npu_fuse_backend.passes.rope import RopeFusion

    class Wrapped(RopeFusion):
        def match(self, ctx, anchor):
            rewrite = super().match(ctx, anchor)
            if rewrite is not None:
                build = rewrite.build
                rewrite.build = lambda b: around(build, b, anchor)
            return rewrite

    Wrapped.name = name
    return Wrapped


def _exploding_pass():
    """Matches like the RoPE pass, then fails while building its replacement."""
    def around(build, b, anchor):
        build(b)  # nodes are inserted, then the pass dies
        raise RuntimeError("boom")

    return _rope_pass_building("exploding", around)


@pytest.fixture
def exploding_pass(monkeypatch):
    monkeypatch.setattr(fusion, "_registry", {"exploding": _exploding_pass()})
    monkeypatch.setattr(fusion, "_discovered", True)


def test_failing_pass_leaves_graph_unfused_with_a_warning(exploding_pass):
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    q, (cos, sin) = torch.randn(2, 3, 4, 16), tables((1, 3, 1, 16))
    with pytest.warns(RuntimeWarning, match="'exploding' failed and left the graph unfused.*boom"):
        out, reports = compile_fused(fn, q, cos, sin)
    assert fused_ops(reports) == [] and reports[0].errors
    assert_close(out, fn(q, cos, sin))


def test_failing_pass_raises_under_strict(exploding_pass):
    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    with pytest.raises(Exception, match="boom"):
        compile_fused(fn, torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 16)), strict=True)


def test_rollback_restores_the_exact_graph(exploding_pass):
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 16)))
    before = str(gm.graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nf.run_fusion_passes(gm)
    assert str(gm.graph) == before


def test_a_replacement_node_before_what_it_reads_leaves_the_graph_unfused_with_a_warning(monkeypatch):
    """A pass whose build inserts a node that reads the replacement built after it: the graph would
    read a value before computing it. The pass's edits are checked and undone, never handed on."""
    def around(build, b, anchor):
        b.call(torch.ops.aten.neg.default, anchor)  # reads the anchor: its replacement, once built
        return build(b)

    monkeypatch.setattr(fusion, "_registry", {"misordered": _rope_pass_building("misordered", around)})
    monkeypatch.setattr(fusion, "_discovered", True)

    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    q, (cos, sin) = torch.randn(2, 3, 4, 16), tables((1, 3, 1, 16))
    # (translation validation would refuse it too, evaluating the nodes in order: the check is the pass manager's)
    with pytest.warns(RuntimeWarning, match="'misordered' failed and left the graph unfused.*not before it"):
        out, reports = compile_fused(fn, q, cos, sin, translation_validation=False)
    assert fused_ops(reports) == [] and reports[0].errors
    assert_close(out, fn(q, cos, sin))


def test_each_pass_sees_graph_positions_after_the_previous_passes_edits(monkeypatch):
    """PassContext.position caches node order; a pass that rewrites must not leave the next
    pass a stale order (the MLA and softmax passes both walk positions)."""
    seen = []

    class Positions(fusion.FusionPass):
        name = "positions"

        def anchors(self, ctx):
            seen.append({n.name: ctx.position(n) for n in ctx.graph.nodes})
            return []

    monkeypatch.setattr(fusion, "_registry", {"positions_before": type("Before", (Positions,), {"runs_before": "rope"}),
                                              "rope": _rope_pass(), "positions_after": Positions})
    monkeypatch.setattr(fusion, "_discovered", True)

    def fn(q, cos, sin):
        return q * cos + rotate_half_slice(q) * sin

    compile_fused(fn, torch.randn(2, 3, 4, 16), *tables((1, 3, 1, 16)), strict=True)
    before, after = seen
    assert any(name.startswith("rotary_mul") for name in after)  # the node the RoPE pass inserted
    assert not any(name.startswith("rotary_mul") for name in before)


def _rope_pass():
    from npu_fuse_backend.passes.rope import RopeFusion
    return RopeFusion
