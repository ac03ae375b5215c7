"""softmax_grad_ext: the op, the fusion of every chain form, its constraints and robustness."""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import probs

softmax_grad_ext = torch.ops.npu_fuse.softmax_grad_ext


# -- the op ----------------------------------------------------------------------------
@pytest.mark.parametrize("x2", [torch.tensor(0.5), torch.tensor([0.5]), None])
def test_opcheck_and_formula(x2):
    g, p = torch.randn(2, 3, 8), probs(2, 3, 8)
    x2 = torch.randn(2, 3, 8) if x2 is None else x2
    opcheck(softmax_grad_ext.default, (g, p, x2, [-1], True))
    expected = x2 * p * (g - (g * p).sum(-1, keepdim=True))
    assert_close(softmax_grad_ext(g, p, x2), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_computes_in_fp32(dtype):
    g, p = torch.randn(4, 64, dtype=dtype), probs(4, 64, dtype=dtype)
    x2 = torch.tensor(0.125, dtype=dtype)
    expected = (x2.float() * p.float() * (g.float() - (g.float() * p.float()).sum(-1, keepdim=True)))
    out = softmax_grad_ext(g, p, x2)
    assert out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("args, message", [
    (dict(p_shape=(2, 3, 4)), "equal shapes"),
    (dict(g_shape=(1,) * 7, p_shape=(1,) * 7), "1-D to 6-D"),
    (dict(g_shape=(0, 8), p_shape=(0, 8)), "empty tensors"),
    (dict(dtype=torch.float64), "share one dtype"),
    (dict(x2_shape=(3, 8)), "x2 must be a scalar"),
    (dict(axes=[0]), "axes must be the last dim"),
    (dict(keep_dims=False), "keep_dims must be True"),
])
def test_argument_errors_name_the_rule(args, message):
    g = torch.randn(*args.get("g_shape", (2, 3, 8)), dtype=args.get("dtype", torch.float32))
    p = torch.randn(*args.get("p_shape", (2, 3, 8)), dtype=args.get("dtype", torch.float32))
    x2 = torch.randn(args.get("x2_shape", ()), dtype=args.get("dtype", torch.float32))
    with pytest.raises(ValueError, match=message):
        softmax_grad_ext(g, p, x2, args.get("axes", [-1]), args.get("keep_dims", True))


# -- the chain forms -----------------------------------------------------------------------
CHAINS = {
    "v1 (x2*x1)*sub": lambda g, p, s: (s * p) * (g - (g * p).sum(-1, keepdim=True)),
    "v1 sub*(x1*x2)": lambda g, p, s: (g - (p * g).sum(-1, keepdim=True)) * (p * s),
    "v2 (x1*sub)*x2": lambda g, p, s: (p * (g - (g * p).sum(-1, keepdim=True))) * s,
    "v2 (sub*x1)*x2": lambda g, p, s: ((g - (g * p).sum(dim=-1, keepdim=True)) * p) * s,
    "v2 x2*(x1*sub)": lambda g, p, s: s * (p * (g - (p * g).sum(3, keepdim=True))),
    "v2 x2*(sub*x1)": lambda g, p, s: s * ((g - (g * p).sum(-1, keepdim=True)) * p),
    "decomposed sbd": lambda g, p, s: (lambda m0: (m0 - p * m0.sum(-1, keepdim=True)) * s)(g * p),
}
SCALES = {"python": lambda: 0.125, "0-d": lambda: torch.tensor(0.125), "(1,)": lambda: torch.tensor([0.125]),
          "full": lambda: torch.rand(2, 4, 8, 8)}


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("scale", SCALES)
def test_every_chain_form_and_scale_fuses(chain, scale):
    fn, x2 = CHAINS[chain], SCALES[scale]()
    g, p = torch.randn(2, 4, 8, 8), probs(2, 4, 8, 8)
    out, reports = compile_fused(fn, g, p, x2)
    assert fused_ops(reports) == ["softmax_grad_ext"]
    assert_close(out, fn(g, p, x2))


def test_inductor_fma_form_is_recognised():
    """inductor's decomposition writes the Sub as fma(-x1, sum, m0)."""
    def fn(g, p):
        m0 = g * p
        return torch.ops.prims.fma(-p, m0.sum(-1, keepdim=True), m0) * 0.5

    g, p = torch.randn(2, 8, 16), probs(2, 8, 16)
    gm = make_fx(fn, tracing_mode="fake")(g, p)
    report = nf.run_fusion_passes(gm)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    assert_close(gm(g, p), fn(g, p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", ["mul", "div"])
def test_training_step_replaces_softmax_backward(dtype, scaling):
    def attention(q, k, v):
        scores = q @ k.transpose(-1, -2)
        scores = scores * (1 / math.sqrt(q.shape[-1])) if scaling == "mul" else scores / math.sqrt(q.shape[-1])
        return torch.softmax(scores, dim=-1) @ v

    def run(fn, tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.float().pow(2).sum().backward()
        return (out, *(t.grad for t in leaves))

    tensors = [torch.randn(2, 4, 16, 8, dtype=dtype) for _ in range(3)]
    with nf.config.patch(fallback="aot_eager"):
        got = run(torch.compile(attention, backend="npu_fuse"), tensors)
    reports = nf.get_reports()
    backward = [r for r in reports if r.kind == "backward"]
    assert [m.op for r in backward for m in r.matches] == ["softmax_grad_ext"]
    assert torch._dynamo.utils.counters["npu_fuse"]["softmax_grad_ext"] == 1
    eager = run(attention, tensors)
    exact = run(attention, [t.double() for t in tensors])
    for a, b, c in zip(got, eager, exact):
        err, err_eager = (a.double() - c).abs().max(), (b.double() - c).abs().max()
        assert err <= 1.5 * err_eager + 1e-5


# -- constraints: each a near-miss with its reason ------------------------------------------
def _reasons(fn, *args, **patches):
    out, reports = compile_fused(fn, *args, **patches)
    for got, expected in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, fn(*args)))):
        assert_close(got, expected)
    assert "softmax_grad_ext" not in fused_ops(reports)
    return near_miss_reasons(reports)


V2 = CHAINS["v2 (x1*sub)*x2"]


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93"])
def test_soc_gate_refuses_a2_a3(soc):
    reasons = _reasons(V2, torch.randn(2, 8), probs(2, 8), 0.5, soc=soc)
    assert any(f"exists on Ascend950 only, not {soc}" in r for r in reasons)


def test_soc_gate_allows_ascend950():
    _, reports = compile_fused(V2, torch.randn(2, 8), probs(2, 8), 0.5, soc="Ascend950")
    assert fused_ops(reports) == ["softmax_grad_ext"]


def test_reduction_not_over_last_dim():
    def fn(g, p, s):
        return (p * (g - (g * p).sum(1, keepdim=True))) * s
    assert any("axes must be the last dim" in r for r in _reasons(fn, torch.randn(2, 3, 8), probs(2, 3, 8), 0.5))


KEPT = {"[..., None]": lambda t: t[..., None], "unsqueeze(-1)": lambda t: t.unsqueeze(-1),
        "unsqueeze(D)": lambda t: t.unsqueeze(t.dim())}


@pytest.mark.parametrize("validation", [True, False])
@pytest.mark.parametrize("kept", KEPT.values(), ids=KEPT.keys())
def test_row_sum_restored_by_unsqueeze_is_the_kept_sum(kept, validation):
    def fn(g, p, s):
        return (p * (g - kept((g * p).sum(-1)))) * s
    g, p = torch.randn(2, 4, 8), probs(2, 4, 8)
    out, reports = compile_fused(fn, g, p, 0.5, translation_validation=validation)
    assert fused_ops(reports) == ["softmax_grad_ext"]
    assert_close(out, fn(g, p, 0.5))


def test_row_sum_unsqueezed_into_another_dim_is_another_function():
    def fn(g, p, s):
        return (p * (g - (g * p).sum(-1).unsqueeze(-2))) * s  # [B, 1, N] against [B, N, N]
    g, p = torch.randn(2, 8, 8), probs(2, 8, 8)
    out, reports = compile_fused(fn, g, p, 0.5)
    assert fused_ops(reports) == []
    assert_close(out, fn(g, p, 0.5))


def test_reduction_without_keepdim_or_unsqueeze_stays():
    def fn(g, p, s):
        return (p * (g - (g * p).sum(-1))) * s  # [B, N] - [B]: broadcasts over another dim
    g, p = torch.randn(8, 8), probs(8, 8)
    out, reports = compile_fused(fn, g, p, 0.5)
    assert fused_ops(reports) == []
    assert_close(out, fn(g, p, 0.5))


def test_an_unsqueezed_row_sum_used_elsewhere_blocks_fusion():
    def fn(g, p, s):
        total = (g * p).sum(-1)
        return (p * (g - total.unsqueeze(-1))) * s, total
    reasons = _reasons(fn, torch.randn(2, 8), probs(2, 8), 0.5)
    assert any("used outside the subgraph" in r for r in reasons)


def test_rank_seven_is_refused():
    shape = (1, 1, 1, 1, 2, 2, 4)
    assert any("7-D" in r for r in _reasons(V2, torch.randn(shape), probs(*shape), 0.5))


def test_mixed_dtypes_are_refused():
    reasons = _reasons(V2, torch.randn(2, 8), probs(2, 8, dtype=torch.bfloat16).float().half(), 0.5)
    assert reasons == [] or any("dtype" in r for r in reasons)
    reasons = _reasons(V2, torch.randn(2, 8, dtype=torch.bfloat16), probs(2, 8, dtype=torch.bfloat16),
                       torch.tensor(0.5))
    assert any("must share one dtype of float16, bfloat16, float32; x2 is torch.float32, grad torch.bfloat16" in r
               for r in reasons)


def test_x2_of_another_broadcast_shape_is_refused():
    reasons = _reasons(V2, torch.randn(2, 3, 8), probs(2, 3, 8), torch.rand(3, 8))
    assert any("x2 must be a scalar, shape (1,) or grad's shape (2, 3, 8), got (3, 8)" in r for r in reasons)


def test_symbolic_dims_are_refused():
    reasons = _reasons(V2, torch.randn(2, 8), probs(2, 8), 0.5, dynamic=True)
    assert any("symbolic dim" in r for r in reasons)


# -- robustness (seed 004's fusion-pass tests, in FX terms) ---------------------------------
def test_intermediate_with_outside_consumer_blocks_fusion():
    def fn(g, p, s):
        total = (g * p).sum(-1, keepdim=True)
        return (p * (g - total)) * s, total
    reasons = _reasons(fn, torch.randn(2, 8), probs(2, 8), 0.5)
    assert any("used outside the subgraph" in r for r in reasons)


def test_rewrite_that_would_create_a_cycle_is_refused():
    def fn(g, p):
        sub = g - (g * p).sum(-1, keepdim=True)
        return (p * sub) * sub.mean()  # x2 computed from the chain's own Sub
    reasons = _reasons(fn, torch.randn(2, 8), probs(2, 8))
    assert any("depend on its own output" in r for r in reasons)


def test_shared_scale_survives():
    def fn(g, p, s):
        return (p * (g - (g * p).sum(-1, keepdim=True))) * s, s * 2
    g, p, s = torch.randn(2, 8), probs(2, 8), torch.tensor(0.5)
    out, reports = compile_fused(fn, g, p, s)
    assert fused_ops(reports) == ["softmax_grad_ext"]
    for a, b in zip(out, fn(g, p, s)):
        assert_close(a, b)


def test_swapped_sub_changes_the_math_and_does_not_fuse():
    def fn(g, p, s):
        return (p * ((g * p).sum(-1, keepdim=True) - g)) * s
    assert any("sum - grad" in r for r in _reasons(fn, torch.randn(2, 8), probs(2, 8), 0.5))


def test_mul_with_a_different_x1_does_not_fuse():
    def fn(g, p, q, s):
        return (q * (g - (g * p).sum(-1, keepdim=True))) * s
    reasons = _reasons(fn, torch.randn(2, 8), probs(2, 8), probs(2, 8), 0.5)
    assert any("does not share x1" in r for r in reasons)


def test_chained_chains_fuse_in_order():
    """The output of one chain is the grad of the next: both fuse, no double rewrite."""
    def fn(g, p1, p2):
        y1 = (p1 * (g - (g * p1).sum(-1, keepdim=True))) * 0.5
        return (p2 * (y1 - (y1 * p2).sum(-1, keepdim=True))) * 0.25
    g, p1, p2 = torch.randn(2, 8), probs(2, 8), probs(2, 8)
    out, reports = compile_fused(fn, g, p1, p2)
    assert fused_ops(reports) == ["softmax_grad_ext", "softmax_grad_ext"]
    assert_close(out, fn(g, p1, p2))


def test_chains_sharing_their_first_mul_are_refused_not_crashed():
    def fn(g, p):
        m0 = (g * p).sum(-1, keepdim=True)
        return (p * (g - m0)) * 0.5, (p * (g - m0)) * 0.25
    reasons = _reasons(fn, torch.randn(2, 8), probs(2, 8))
    assert reasons and all("used outside" in r or "overlaps" in r for r in reasons)


def test_many_chains_in_one_graph():
    def fn(g, p):
        return sum((p * (g - (g * p).sum(-1, keepdim=True))) * (i + 1.0) for i in range(40))
    g, p = torch.randn(2, 8), probs(2, 8)
    out, reports = compile_fused(fn, g, p)
    assert fused_ops(reports) == ["softmax_grad_ext"] * 40
    assert_close(out, fn(g, p), torch.float32)


@pytest.mark.parametrize("chain", CHAINS)
def test_bf16_chains_are_no_less_accurate_than_eager(chain):
    from conftest import assert_no_worse_than_eager

    fn = CHAINS[chain]
    g, p = torch.randn(2, 4, 8, 64, dtype=torch.bfloat16), probs(2, 4, 8, 64, dtype=torch.bfloat16)
    x2 = torch.tensor(0.125, dtype=torch.bfloat16)
    out, reports = compile_fused(fn, g, p, x2)
    assert fused_ops(reports) == ["softmax_grad_ext"]
    assert_no_worse_than_eager(out, fn(g, p, x2), fn(g.double(), p.double(), x2.double()))

