"""RoPE under mixed precision: a subgraph that differs from a fused op only by dtype casts fuses, in
the dtype that reproduces eager's rounding (the op computes in fp32 and rounds once), or is refused
saying which cast breaks that rule."""

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fuse_backend as nf
from conftest import TOL, assert_close, compile_fused, fused_ops, near_miss_reasons

aten = torch.ops.aten
ops = torch.ops.npu_fuse


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def tables(s=6, d=16, dtype=torch.float32):
    freqs = torch.rand(1, s, 1, d // 2) * 3
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(torch.nn.Module):
    """q/k projections and RoPE, as a model's attention starts."""

    def __init__(self, hidden=32, heads=2, head_dim=16):
        super().__init__()
        self.q = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = torch.nn.Linear(hidden, head_dim, bias=False)
        self.heads, self.head_dim = heads, head_dim

    def forward(self, h, cos, sin):
        b, s, _ = h.shape
        q = self.q(h).view(b, s, self.heads, self.head_dim)
        k = self.k(h).view(b, s, 1, self.head_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def train(model, h, cos, sin, compiled, autocast=None):
    """Outputs and parameter gradients of one step (a fixed weighted loss)."""
    model.zero_grad(set_to_none=True)
    fn = torch.compile(model, backend="npu_fuse") if compiled else model
    with torch.autocast("cpu", autocast) if autocast else torch.autocast("cpu", enabled=False):
        outs = fn(h, cos, sin)
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [p.grad.clone() for p in model.parameters()]


def fused_by_kind():
    reports = nf.get_reports()
    return {kind: sorted(m.op for r in reports if r.kind == kind for m in r.matches)
            for kind in ("forward", "backward")}


ROPE_FW_BW = {"forward": ["rotary_mul"] * 2, "backward": ["rotary_mul_backward"] * 2}


@pytest.mark.parametrize("case", ["autocast bf16", "autocast fp16", "bf16 weights", "fp16 weights",
                                  "bf16 activations, fp32 tables"])
def test_training_in_mixed_precision_fuses_forward_and_backward_within_eager_error(case):
    torch.manual_seed(0)
    model = Attention()
    h, (cos, sin) = torch.randn(2, 6, 32), tables()
    reference = train(copy.deepcopy(model), h, cos, sin, compiled=False)  # fp32
    autocast = {"autocast bf16": torch.bfloat16, "autocast fp16": torch.float16}.get(case)
    if case in ("bf16 weights", "fp16 weights"):
        dtype = torch.bfloat16 if case.startswith("bf16") else torch.float16
        model, h, cos, sin = model.to(dtype), h.to(dtype), cos.to(dtype), sin.to(dtype)
    elif case == "bf16 activations, fp32 tables":
        model, h = model.to(torch.bfloat16), h.to(torch.bfloat16)
    with nf.config.patch(fallback="aot_eager"):
        got = train(model, h, cos, sin, compiled=True, autocast=autocast)
    assert fused_by_kind() == ROPE_FW_BW, [r.summary() for r in nf.get_reports()]
    assert not near_miss_reasons(nf.get_reports())
    eager = train(model, h, cos, sin, compiled=False, autocast=autocast)
    low = torch.float16 if "fp16" in case else torch.bfloat16
    for g, e, r in zip(got, eager, reference):  # fused no farther from the fp32 run than eager, within the tolerance
        assert g.dtype == e.dtype and g.shape == e.shape
        err_g, err_e = (g.float() - r.float()).abs().max(), (e.float() - r.float()).abs().max()
        assert err_g <= 1.5 * err_e + TOL[low][0], (err_g, err_e)
    for g, e in zip(got[:2], eager[:2]):  # the RoPE outputs themselves: within the dtype's tolerance of eager
        assert_close(g, e, low)


def autocast_backward(g, cos, sin):
    """dq as autograd writes it under autocast: g * cos and g * sin computed in fp32, each cast to bf16
    (q's dtype) before the transposed rotation and the sum."""
    gs = (g * sin).to(torch.bfloat16)
    half = g.shape[-1] // 2
    rt = torch.cat((gs[..., half:], -gs[..., :half]), -1)
    return rt + (g * cos).to(torch.bfloat16)


def test_autocast_backward_runs_the_op_in_fp32_and_rounds_once():
    """Each product rounded to bf16 is a rounding to the result's own dtype: the fused op in fp32,
    cast to bf16 once, is closer to the exact result than eager is."""
    g, (cos, sin) = torch.randn(2, 6, 2, 16), tables()
    gm = make_fx(autocast_backward, tracing_mode="fake")(g, cos, sin)
    report = nf.run_fusion_passes(gm)
    assert [m.op for m in report.matches] in (["rotary_mul"], ["rotary_mul_backward"]), report.summary()
    (op,) = [n for n in gm.graph.nodes if n.target in (ops.rotary_mul.default, ops.rotary_mul_backward.default)]
    assert all(a.meta["val"].dtype == torch.float32 for a in op.args[:3] if isinstance(a, torch.fx.Node))
    out = gm(g, cos, sin)
    assert out.dtype == torch.bfloat16
    expected = autocast_backward(g, cos, sin)
    gs = g.double() * sin.double()
    exact = g.double() * cos.double() + torch.cat((gs[..., 8:], -gs[..., :8]), -1)
    assert (out.double() - exact).abs().max() <= (expected.double() - exact).abs().max() + 1e-6
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_x_with_fp32_tables_promotes_like_eager(dtype):
    def rope(q, cos, sin):
        return q * cos + rotate_half(q) * sin

    q, (cos, sin) = torch.randn(2, 6, 4, 16).to(dtype), tables()
    out, reports = compile_fused(rope, q, cos, sin)
    assert fused_ops(reports) == ["rotary_mul"] and out.dtype == torch.float32
    assert_close(out, rope(q, cos, sin))


@pytest.mark.parametrize("name, fn, phrase", [
    ("the cos term rounded to bf16, the result fp32",
     lambda q, c, s: (q * c).bfloat16().float() + rotate_half(q) * s, "rounds to bfloat16 in the middle"),
    ("bf16 inputs computed in fp32, the result rounded to bf16",
     lambda q, c, s: (q.bfloat16().float() * c + rotate_half(q.bfloat16().float()) * s).bfloat16(), None),
    ("x rounded to bf16 for the rotated term only",
     lambda q, c, s: q * c + rotate_half(q.bfloat16().float()) * s, "rounded differently for the two terms"),
])
def test_a_cast_the_single_rounding_cannot_reproduce_is_refused(name, fn, phrase):
    q, (cos, sin) = torch.randn(2, 6, 4, 16), tables()
    out, reports = compile_fused(fn, q, cos, sin)
    assert_close(out, fn(q, cos, sin))
    if phrase is None:  # rounding the result itself is the op's own rounding: it fuses
        assert fused_ops(reports) == ["rotary_mul"]
        return
    assert fused_ops(reports) == []
    assert any(phrase in r for r in near_miss_reasons(reports)), near_miss_reasons(reports)


def test_x_rounded_before_the_rotation_is_rounded_in_the_replacement():
    """A cast of x before any arithmetic (fp32 x, computed in bf16) is reproduced by casting x."""
    def rope(q, cos, sin):
        qb = q.bfloat16()
        return qb * cos.bfloat16() + rotate_half(qb) * sin.bfloat16()

    q, (cos, sin) = torch.randn(2, 6, 4, 16), tables()
    out, reports = compile_fused(rope, q, cos, sin)
    assert fused_ops(reports) == ["rotary_mul"]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rope(q, cos, sin), atol=2e-2, rtol=2e-2)
