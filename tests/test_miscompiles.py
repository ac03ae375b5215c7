"""Issue 9: subgraphs that were rewritten into something else, inputs that slipped through
the ops' checks, and errors that named the wrong op or argument. Each test fails on the
code before the fix."""

import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import probs, rotate_every_two, rotate_half
from npu_fuse_backend import fusion

ops = torch.ops.npu_fuse
aten = torch.ops.aten


# -- 1. a one-element scale of higher rank broadcasts the result --------------------------------
SCALED = {
    "v2": lambda g, p, s: (p * (g - (g * p).sum(-1, keepdim=True))) * s,
    "v1": lambda g, p, s: (s * p) * (g - (g * p).sum(-1, keepdim=True)),
}


@pytest.mark.parametrize("order", SCALED)
@pytest.mark.parametrize("shape, scale_shape", [((3, 8, 8), (1, 1, 1, 1)), ((8,), (1, 1, 1, 1)), ((2, 8), (1, 1, 1))])
def test_a_one_element_scale_of_higher_rank_keeps_the_broadcast_rank(order, shape, scale_shape):
    fn = SCALED[order]
    g, p, s = torch.randn(shape), probs(*shape), torch.full(scale_shape, 0.5)
    out, reports = compile_fused(fn, g, p, s)
    expected = fn(g, p, s)
    assert out.shape == expected.shape
    assert fused_ops(reports) == ["softmax_grad_ext"]
    assert_close(out, expected)


def test_a_scale_that_broadcasts_grad_to_a_larger_shape_is_refused():
    fn = SCALED["v2"]
    g, p, s = torch.randn(3, 8), probs(3, 8), torch.rand(2, 3, 8)
    out, reports = compile_fused(fn, g, p, s)
    assert fused_ops(reports) == []
    assert out.shape == (2, 3, 8)
    assert_close(out, fn(g, p, s))


# -- 2. a Python-number scale outside the dtype's range --------------------------------------
@pytest.mark.parametrize("scale", [1e6, 7e4, 1e-8])
def test_fp16_scale_outside_fp16_range_is_not_rounded_into_the_op(scale):
    fn = SCALED["v2"]
    g = (torch.randn(4, 64) * (1e-2 if scale > 1 else 1e2)).half()
    p = torch.randn(4, 64).mul(4).softmax(-1).half()
    out, reports = compile_fused(lambda g, p: fn(g, p, scale), g, p)
    assert fused_ops(reports) == []
    assert any("outside torch.float16's normal range" in r for r in near_miss_reasons(reports))
    expected = fn(g, p, scale)
    assert expected.isfinite().all() and expected.abs().max() > 0  # eager is finite and not all zero here
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 1e6), (torch.float16, 0.125), (torch.float16, 1e4)])
def test_scales_inside_the_dtype_range_still_fuse(dtype, scale):
    fn = SCALED["v2"]
    g, p = (torch.randn(4, 64) * 1e-2).to(dtype), probs(4, 64, dtype=dtype)
    out, reports = compile_fused(lambda g, p: fn(g, p, scale), g, p)
    assert fused_ops(reports) == ["softmax_grad_ext"]
    assert_close(out, fn(g.float(), p.float(), scale), dtype)


# -- 3. direct op calls with a tensor on another device ---------------------------------------
def _meta(t):
    return torch.empty_like(t, device="meta")


DIRECT_CALLS = {
    "rotary_mul": lambda x, r, g, p: ops.rotary_mul(x, _meta(r), r),
    "rotary_mul_backward": lambda x, r, g, p: ops.rotary_mul_backward(x, x, r, _meta(r), "half", True),
    "rotary_mul_backward x": lambda x, r, g, p: ops.rotary_mul_backward(x, _meta(x), r, r, "half", True),
    "softmax_grad_ext": lambda x, r, g, p: ops.softmax_grad_ext(g, p, _meta(torch.tensor([0.5]))),
    "inplace_partial_rotary_mul": lambda x, r, g, p: ops.inplace_partial_rotary_mul(
        x, _meta(r[..., :4]), r[..., :4], partial_slice=[0, 4]),
    "inplace_partial_rotary_mul_backward": lambda x, r, g, p: ops.inplace_partial_rotary_mul_backward(
        x, r[..., :4], _meta(r[..., :4]), partial_slice=[0, 4]),
}


@pytest.mark.parametrize("call", DIRECT_CALLS)
def test_a_meta_tensor_among_real_ones_is_an_error_not_the_fake_kernel(call):
    x, r = torch.randn(2, 5, 3, 8), torch.randn(1, 5, 1, 8)
    g, p = torch.randn(2, 8), probs(2, 8)
    before = x.clone()
    op = call.split()[0]
    with pytest.raises(ValueError, match=rf"npu_fuse\.{op}: \w+ is on meta but \w+ is on cpu"):
        DIRECT_CALLS[call](x, r, g, p)
    assert torch.equal(x, before)


def test_every_tensor_on_meta_is_still_the_fake_kernel():
    x = torch.empty(2, 5, 3, 8, device="meta")
    assert ops.rotary_mul(x, x[:1, :, :1], x[:1, :, :1]).device.type == "meta"


# -- 4. fake kernels give the real kernels' strides ---------------------------------------------
def _bnsd_view(*shape):  # a BSND-shaped view of BNSD memory
    b, s, n, d = shape
    return torch.randn(b, n, s, d).transpose(1, 2)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_opcheck_rotary_mul_on_non_contiguous_inputs(mode):
    x = _bnsd_view(2, 5, 3, 8)
    r1 = torch.randn(1, 1, 5, 8).transpose(1, 2)  # a [1, 5, 1, 8] table with non-contiguous strides
    r2 = torch.randn(1, 5, 1, 16)[..., ::2]
    g = _bnsd_view(2, 5, 3, 8)
    opcheck(ops.rotary_mul.default, (x, r1, r2, mode))
    opcheck(ops.rotary_mul_backward.default, (g, x, r1, r2, mode, True))
    opcheck(ops.rotary_mul_backward.default, (g, None, r1, r2, mode, False))
    assert ops.rotary_mul(x, r1, r2, mode).stride() == x.stride()


def test_opcheck_softmax_grad_ext_on_non_contiguous_inputs():
    g = torch.randn(2, 8, 4).transpose(1, 2)
    p = probs(2, 4, 8)
    for x2 in (torch.tensor(0.5), torch.randn(2, 4, 16)[..., ::2]):
        opcheck(ops.softmax_grad_ext.default, (g, p, x2, [-1], True))
    assert ops.softmax_grad_ext(g, p, torch.tensor(0.5)).stride() == g.stride()


@pytest.mark.parametrize("op", ["inplace_partial_rotary_mul", "inplace_partial_rotary_mul_backward"])
def test_opcheck_partial_rotary_ops_on_non_contiguous_tables(op):
    x = torch.randn(2, 5, 3, 8)
    r = torch.randn(2, 1, 5, 4).transpose(1, 2)
    opcheck(getattr(ops, op).default, (x, r, r.clone()), dict(rotary_mode="interleave", partial_slice=[2, 6]))


def test_a_view_of_the_op_on_a_transposed_input_compiles():
    def fn(q, cos, sin):  # q [B, S, N, D]; rotate it in BNSD, then back and flatten the heads
        b, s = q.shape[:2]
        return ops.rotary_mul(q.transpose(1, 2), cos, sin).transpose(1, 2).view(b, s, -1)

    q, cos, sin = torch.randn(2, 5, 3, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    out, _ = compile_fused(fn, q, cos, sin)
    assert_close(out, fn(q, cos, sin))


def test_fused_rope_on_a_transposed_view_keeps_the_layout_later_views_need():
    def fn(q, cos, sin):
        x = q.transpose(1, 2)  # BNSD view of BSND memory
        out = x * cos + rotate_half(x) * sin
        return out.transpose(1, 2).view(q.shape[0], q.shape[1], -1)

    q, cos, sin = torch.randn(2, 5, 3, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    out, reports = compile_fused(fn, q, cos, sin)
    assert fused_ops(reports) == ["rotary_mul"]
    assert_close(out, fn(q, cos, sin))


def test_a_replacement_with_other_strides_under_a_view_is_refused():
    """The core's layout check, with a pass whose replacement changes the output's strides."""
    class ContiguousCopy(fusion.FusionPass):
        name = "contiguous_copy"
        anchor_targets = (aten.mul.Tensor,)

        def match(self, ctx, anchor):
            return fusion.Rewrite(anchor, [], "clone", lambda b: b.call(
                aten.clone.default, b.call(aten.mul.Tensor, *anchor.args), memory_format=torch.contiguous_format))

    def fn(x):
        return (x.transpose(0, 1) * 2).transpose(0, 1).view(-1)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 6))
    report = fusion.PassManager([ContiguousCopy()])(gm)
    assert report.matches == []
    assert "and view" in report.near_misses[0].reason and "strides" in report.near_misses[0].reason
    x = torch.randn(4, 6)
    torch.testing.assert_close(gm(x), fn(x))


# -- 5. zero-size inputs are near-misses, not pass failures -----------------------------------
def _rope(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def _partial(q, cos, sin):
    return torch.cat([q[..., :4] * cos + rotate_every_two(q[..., :4]) * sin, q[..., 4:]], -1)


@pytest.mark.parametrize("fn, shapes", [
    (_rope, [(2, 0, 3, 8), (1, 0, 1, 8)]),  # sequence 0
    (_rope, [(0, 3, 8), (0, 1, 8)]),  # T = 0
    (_rope, [(0, 8), (0, 8)]),
    (_partial, [(2, 0, 3, 8), (1, 0, 1, 4)]),
    (SCALED["v2"], [(0, 8), (0, 8)]),
])
def test_zero_size_inputs_are_near_misses(fn, shapes):
    x_shape, r_shape = shapes
    args = (torch.randn(x_shape), torch.randn(r_shape), torch.randn(r_shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, reports = compile_fused(fn, *args, strict=True)
    assert fused_ops(reports) == []
    assert any("empty" in r for r in near_miss_reasons(reports))
    assert out.shape == fn(*args).shape


def test_mla_prologue_of_zero_tokens_is_a_near_miss_with_the_ops_rule():
    from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs
    from test_mla_preprocess import projections_and_rope

    class Prologue(DeepSeekMLA):
        def forward(self, x, cos, sin, slot_mapping, kv_cache):
            q_nope, q_pe, kv_c, k_pe = projections_and_rope(self, x, cos, sin)
            q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            kv_cache.view(-1, 576)[slot_mapping] = torch.cat([self.kv_a_layernorm(kv_c), k_pe], -1)
            return torch.cat([q_nope, q_pe], -1)

    cfg = MLAConfig()
    model = Prologue(cfg).to(torch.bfloat16).eval()
    x, cos, sin, slots, _ = mla_decode_inputs(cfg, 0, 1)
    cache = torch.randn(cfg.num_blocks, cfg.block_size, 1, 576).to(torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, reports = compile_fused(model, x, cos, sin, slots, cache, strict=True)
    assert "mla_preprocess" not in fused_ops(reports)
    rule = "token count must be in 1..1024, got 0"
    assert any(rule in r for r in near_miss_reasons(reports)), near_miss_reasons(reports)
    assert out.shape == (0, cfg.heads, 576)


def test_an_op_rejecting_what_a_pass_built_is_a_near_miss_with_the_ops_rule(monkeypatch):
    """A fused op's argument check failing on the call a rewrite builds refuses that rewrite."""
    from npu_fuse_backend.passes import rope

    monkeypatch.setattr(rope.RopeFusion, "check_site", lambda *args: None)
    args = [torch.randn(shape, dtype=torch.float64) for shape in ((2, 5, 3, 8), (1, 5, 1, 8), (1, 5, 1, 8))]
    out, reports = compile_fused(_rope, *args, strict=True)
    assert fused_ops(reports) == []
    assert any("npu_fuse.rotary_mul: x dtype must be float16" in r for r in near_miss_reasons(reports))
    assert_close(out, _rope(*args))


# -- 6. a constant shared by several sites (inductor's zeros) ---------------------------------
def _rope_backward_sharing_zeros(g1, g2, cos, sin):
    """dx = g*cos + R^T(g*sin) for two layers, R^T written into one shared zeros, as inductor
    leaves backward graphs after deduplicating constants."""
    zeros = torch.zeros(g1.shape)
    half = g1.shape[-1] // 2
    out = []
    for g in (g1, g2):
        gs = g * sin
        rt = torch.slice_scatter(zeros, -gs[..., :half], -1, half) + \
            torch.slice_scatter(zeros, gs[..., half:], -1, 0, half)
        out.append(rt + g * cos)
    return out


def test_a_zeros_constant_shared_by_two_backward_ropes_is_an_input_of_each():
    args = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    gm = make_fx(_rope_backward_sharing_zeros, tracing_mode="fake")(*args)
    zeros = [n for n in gm.graph.nodes if n.target in (aten.zeros.default, aten.full.default)]
    assert len(zeros) == 1 and len(zeros[0].users) == 4
    report = nf.run_fusion_passes(gm)
    assert [m.op for m in report.matches] == ["rotary_mul_backward"] * 2, report.summary()
    assert not any(n.target in (aten.zeros.default, aten.full.default) for n in gm.graph.nodes)  # erased once unused
    for got, expected in zip(gm(*args), _rope_backward_sharing_zeros(*args)):
        assert_close(got, expected)


def test_a_zeros_constant_also_used_outside_the_sites_survives():
    def fn(g, cos, sin):
        zeros = torch.zeros(g.shape)
        gs = g * sin
        rt = torch.slice_scatter(zeros, -gs[..., :4], -1, 4) + torch.slice_scatter(zeros, gs[..., 4:], -1, 0, 4)
        return rt + g * cos, zeros + 1

    args = torch.randn(2, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    report = nf.run_fusion_passes(gm)
    assert [m.op for m in report.matches] == ["rotary_mul_backward"]
    for got, expected in zip(gm(*args), fn(*args)):
        assert_close(got, expected)


# -- 7. errors name the op and the argument ---------------------------------------------------
def _x(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


R = _x(1, 5, 1, 8)
BAD_CALLS = [
    # rotary_mul
    (lambda: ops.rotary_mul(_x(5, 3, 8), R, R), r"npu_fuse\.rotary_mul: x must be 4-D"),
    (lambda: ops.rotary_mul(_x(2, 5, 3, 8), R, R, "quarter"), r"npu_fuse\.rotary_mul: rotary_mode must be one of"),
    (lambda: ops.rotary_mul(_x(2, 5, 3, 8), R.half(), R), r"npu_fuse\.rotary_mul: r1, r2 and x must share one dtype"),
    (lambda: ops.rotary_mul(_x(2, 5, 3, 8), R, _x(5, 1, 8)), r"npu_fuse\.rotary_mul: r2 must be 4-D"),
    # rotary_mul_backward: the rotated tensor is grad
    (lambda: ops.rotary_mul_backward(_x(5, 3, 8), None, R, R, "half", False),
     r"npu_fuse\.rotary_mul_backward: grad must be 4-D"),
    (lambda: ops.rotary_mul_backward(_x(2, 5, 3, 8, dtype=torch.float64), None, R, R, "half", False),
     r"npu_fuse\.rotary_mul_backward: grad dtype must be"),
    (lambda: ops.rotary_mul_backward(_x(2, 5, 3, 7), None, _x(1, 5, 1, 7), _x(1, 5, 1, 7), "half", False),
     r"npu_fuse\.rotary_mul_backward: head dim \(last dim of grad\) must be even"),
    (lambda: ops.rotary_mul_backward(_x(2, 5, 3, 8), _x(2, 5, 3, 8), _x(1, 4, 1, 8), R, "half", True),
     r"npu_fuse\.rotary_mul_backward: r1 shape .* does not broadcast to grad shape"),
    (lambda: ops.rotary_mul_backward(_x(2, 5, 3, 8), _x(2, 4, 3, 8), R, R, "half", True),
     r"npu_fuse\.rotary_mul_backward: x shape \(2, 4, 3, 8\) must equal grad shape"),
    (lambda: ops.rotary_mul_backward(_x(2, 5, 3, 8), _x(2, 5, 3, 8).half(), R, R, "half", True),
     r"npu_fuse\.rotary_mul_backward: x dtype torch.float16 must equal grad dtype"),
    (lambda: ops.rotary_mul_backward(_x(2, 5, 3, 8), None, R, R, "half", True),
     r"npu_fuse\.rotary_mul_backward: need_backward=True .* needs x"),
    # softmax_grad_ext
    (lambda: ops.softmax_grad_ext(_x(2, 8), _x(2, 8).half(), torch.tensor(0.5)),
     r"npu_fuse\.softmax_grad_ext: .*x1 is torch.float16"),
    (lambda: ops.softmax_grad_ext(_x(2, 8), _x(2, 8), torch.tensor(0.5).half()),
     r"npu_fuse\.softmax_grad_ext: .*x2 is torch.float16"),
    (lambda: ops.softmax_grad_ext(_x(2, 8), _x(2, 8), _x(8)), r"npu_fuse\.softmax_grad_ext: x2 must be a scalar"),
    # inplace_partial_rotary_mul and its backward: the rotated tensor is x, resp. grad
    (lambda: ops.inplace_partial_rotary_mul(_x(5, 3, 8), R[..., :4], R[..., :4], partial_slice=[0, 4]),
     r"npu_fuse\.inplace_partial_rotary_mul: x must be 4-D"),
    (lambda: ops.inplace_partial_rotary_mul_backward(_x(5, 3, 8), R[..., :4], R[..., :4], partial_slice=[0, 4]),
     r"npu_fuse\.inplace_partial_rotary_mul_backward: grad must be 4-D"),
    (lambda: ops.inplace_partial_rotary_mul_backward(_x(2, 3, 5, 8).transpose(1, 2), R[..., :4], R[..., :4],
                                                     partial_slice=[0, 4]),
     r"npu_fuse\.inplace_partial_rotary_mul_backward: grad must be contiguous"),
    (lambda: ops.inplace_partial_rotary_mul_backward(_x(2, 5, 3, 8), R[..., :4], R[..., :4], partial_slice=[0, 10]),
     r"npu_fuse\.inplace_partial_rotary_mul_backward: partial_slice must satisfy"),
    (lambda: ops.inplace_partial_rotary_mul_backward(_x(2, 5, 3, 8), R[..., :4], R[..., :2], partial_slice=[0, 4]),
     r"npu_fuse\.inplace_partial_rotary_mul_backward: last dim of r2 must equal the slice length 4"),
    (lambda: ops.inplace_partial_rotary_mul_backward(_x(2, 0, 3, 8), R[..., :4], R[..., :4], partial_slice=[0, 4]),
     r"npu_fuse\.inplace_partial_rotary_mul_backward: every dim of grad must be > 0"),
]


@pytest.mark.parametrize("call, message", BAD_CALLS, ids=[m.split(": ")[-1][:40] for _, m in BAD_CALLS])
def test_errors_name_the_op_and_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    with pytest.raises(ValueError, match=message), torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        call()


# -- found by the fuzzer -------------------------------------------------------------------------
def test_the_backward_of_metas_complex_rope_fuses_instead_of_failing_the_pass():
    """The backward rotates by conj(freqs_cis), a conjugate view that has no real view."""
    def fn(x, freqs):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs.view(1, 3, 1, 4)).flatten(3)

    x, freqs = torch.randn(2, 3, 2, 8), torch.polar(torch.ones(3, 4), torch.randn(3, 4))
    leaf = x.clone().requires_grad_()
    with nf.config.patch(fallback="aot_eager", strict=True):
        torch.compile(fn, backend="npu_fuse")(leaf, freqs).pow(2).sum().backward()
    reports = nf.get_reports()
    fused = [(r.kind, m.op) for r in reports for m in r.matches]
    assert fused == [("forward", "rotary_mul"), ("backward", "rotary_mul")]
    expected = x.clone().requires_grad_()
    fn(expected, freqs).pow(2).sum().backward()
    assert_close(leaf.grad, expected.grad)
