"""interleave_rope: the op, the fusion of DeepSeek's two written forms (forward and backward),
the look-alikes that must not fuse, the per-SoC limits, and the GE converter."""

import re

import pytest
import torch
from torch.library import opcheck

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import rotate_half
from npu_fuse_backend import fusion
from npu_fuse_backend.lowering.registry import SOC_LIMITS

interleave_rope = torch.ops.npu_fuse.interleave_rope
interleave_rope_backward = torch.ops.npu_fuse.interleave_rope_backward


# -- the two ways real code writes it ------------------------------------------------------
def hf5_interleave(q, k, cos, sin, unsqueeze_dim=1):
    """transformers 5.x DeepseekV3 ``apply_rotary_pos_emb_interleave`` (cos/sin = cat(freqs, freqs))."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
            torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))


def reference_interleave(q, k, cos, sin, unsqueeze_dim=1):
    """DeepSeek's reference code (and transformers 4.x): de-interleave, then rotate_half."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def unbind_lanes(q, k, cos, sin):
    """Lanes by unbind of the pairs, operands written in another order."""
    cos, sin = cos[..., : cos.shape[-1] // 2].unsqueeze(1), sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    outs = []
    for x in (q, k):
        even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
        outs.append(torch.cat([cos * even - sin * odd, sin * even + cos * odd], dim=-1))
    return tuple(outs)


FORMS = {"transformers-5": hf5_interleave, "reference": reference_interleave, "unbind": unbind_lanes}


def qk_inputs(dtype=torch.float32, head_dim=16, grad=False):
    q = torch.randn(2, 4, 6, head_dim, dtype=dtype, requires_grad=grad)
    k = torch.randn(2, 1, 6, head_dim, dtype=dtype, requires_grad=grad)
    freqs = torch.randn(2, 6, head_dim // 2)
    emb = torch.cat([freqs, freqs], -1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


# -- the op -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cos_shape", [(2, 1, 6, 16), (1, 1, 6, 16), (2, 1, 1, 16), (1, 4, 6, 16)])
def test_opcheck_and_formula(cos_shape):
    x = torch.randn(2, 4, 6, 16)
    cos, sin = torch.randn(cos_shape), torch.randn(cos_shape)
    opcheck(interleave_rope.default, (x, cos, sin))
    opcheck(interleave_rope_backward.default, (x, cos, sin))
    xp = x.view(2, 4, 6, 8, 2).transpose(-1, -2).reshape(2, 4, 6, 16)
    assert_close(interleave_rope(x, cos, sin), xp * cos + rotate_half(xp) * sin)
    assert interleave_rope(x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin).is_contiguous()


def test_autograd_matches_eager_for_x_cos_and_sin():
    x = torch.randn(2, 4, 6, 16, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(1, 1, 6, 16, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(1, 1, 6, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 4, 6, 16, dtype=torch.float64)
    x32, c32, s32 = (t.detach().float().requires_grad_() for t in (x, cos, sin))
    interleave_rope(x32, c32, s32).backward(g.float())
    (eager,) = reference_interleave(x, x, cos.squeeze(1), sin.squeeze(1))[:1]
    eager.backward(g)
    for got, expected in ((x32, x), (c32, cos), (s32, sin)):
        torch.testing.assert_close(got.grad.double(), expected.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_computes_in_fp32_and_rounds_once(dtype):
    x, cos, sin = (torch.randn(2, 4, 6, 64).to(dtype) for _ in range(3))
    exact = interleave_rope(x.float(), cos.float(), sin.float())
    out = interleave_rope(x, cos, sin)
    assert out.dtype == dtype
    torch.testing.assert_close(out, exact.to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.randn(4, 6, 16)), "x must be 4-D"),
    (dict(x=torch.randn(2, 4, 6, 15), cos=torch.randn(1, 1, 6, 15), sin=torch.randn(1, 1, 6, 15)), "must be even"),
    (dict(cos=torch.randn(1, 1, 6, 8)), "full width"),
    (dict(sin=torch.randn(1, 1, 6, 16, dtype=torch.float64)), "share one dtype"),
    (dict(cos=torch.randn(1, 1, 5, 16)), "does not broadcast"),
    (dict(cos=torch.randn(6, 16)), "cos must be 4-D"),
    (dict(x=torch.randn(2, 4, 6, 16, dtype=torch.float64), cos=torch.randn(1, 1, 6, 16, dtype=torch.float64),
          sin=torch.randn(1, 1, 6, 16, dtype=torch.float64)), "float16, bfloat16 or float32"),
])
def test_argument_errors_name_the_rule(change, message):
    args = dict(x=torch.randn(2, 4, 6, 16), cos=torch.randn(1, 1, 6, 16), sin=torch.randn(1, 1, 6, 16))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        interleave_rope(**args)


@pytest.mark.parametrize("soc, dtype, x_shape, cos_shape, op, reason", [
    ("Ascend910B", torch.bfloat16, (2, 8, 16, 64), (2, 1, 16, 64), "interleave_rope", None),
    ("Ascend910B", torch.float16, (2, 8, 16, 64), (2, 1, 1, 64), "interleave_rope", None),
    ("Ascend910B", torch.float32, (2, 8, 16, 64), (2, 1, 16, 64), "interleave_rope", "float16 or bfloat16"),
    ("Ascend910_93", torch.bfloat16, (2, 8, 16, 128), (2, 1, 16, 128), "interleave_rope", "D = 64"),
    ("Ascend910B", torch.bfloat16, (2, 8, 16, 64), (1, 1, 16, 64), "interleave_rope", r"\(B, 1, S or 1, D\)"),
    ("Ascend910B", torch.bfloat16, (2, 16, 8, 64), (2, 16, 1, 64), "interleave_rope", r"\(B, 1, S or 1, D\)"),
    ("Ascend910B", torch.bfloat16, (2, 8, 16, 64), (2, 1, 16, 64), "interleave_rope_backward",
     "no InterleaveRope gradient"),
    ("Ascend950", torch.float32, (2, 8, 16, 128), (1, 1, 16, 128), "interleave_rope_backward", None),
    ("Ascend950", torch.float32, (2, 8, 16, 128), (1, 8, 16, 128), "interleave_rope", "layouts"),
    ("Ascend950", torch.bfloat16, (2, 8, 16, 2048), (1, 1, 16, 2048), "interleave_rope", "<= 1024"),
    ("generic", torch.float32, (2, 8, 16, 126), (1, 8, 16, 126), "interleave_rope", None),
])
def test_soc_limits(soc, dtype, x_shape, cos_shape, op, reason):
    x, cos = torch.empty(x_shape, dtype=dtype), torch.empty(cos_shape, dtype=dtype)
    got = SOC_LIMITS[getattr(torch.ops.npu_fuse, op).default](soc, x, cos, cos)
    if reason is None:
        assert got is None
    else:
        assert got is not None and re.search(reason, got), got


# -- the fusion ----------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_fuse_with_eager_numerics(form, dtype):
    fn = FORMS[form]
    q, k, cos, sin = qk_inputs(dtype, grad=True)
    (oq, ok), _ = compile_fused(fn, q, k, cos, sin)
    torch.autograd.backward((oq, ok), (torch.ones_like(oq), torch.ones_like(ok)))
    reports = nf.get_reports()  # the backward graph is compiled at the first backward
    assert fused_ops(reports) == ["interleave_rope"] * 2 + ["interleave_rope_backward"] * 2
    assert not near_miss_reasons(reports)
    got_grads = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    eq, ek = fn(q, k, cos, sin)
    torch.autograd.backward((eq, ek), (torch.ones_like(eq), torch.ones_like(ek)))
    for got, expected in zip((oq, ok, *got_grads), (eq, ek, q.grad, k.grad)):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("tables", ["four different", "cos and sin swapped in one half"])
def test_inference_graph_fuses_and_each_half_keeps_its_own_tables(tables):
    """Any tables in the four roles are still this op (its cos is cat of the halves' cos): the
    rotation's structure (signs, lanes, halves) decides, not whether a table repeats."""
    def fn(x, c1, s1, c2, s2):
        e, o = x[..., ::2], x[..., 1::2]
        return torch.cat([e * c1 - o * s1, o * c2 + e * s2], dim=-1)

    x = torch.randn(2, 4, 6, 16)
    c, s = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    args = [torch.randn(1, 1, 6, 8) for _ in range(4)] if tables == "four different" else [s, c, c, s]
    with torch.no_grad():
        out, reports = compile_fused(fn, x, *args)
    assert reports[0].kind == "inference" and fused_ops(reports) == ["interleave_rope"]
    assert_close(out, fn(x, *args))


@pytest.mark.parametrize("shape, table", [((6, 4, 16), (6, 1, 8)), ((6, 16), (6, 8))])
def test_token_major_x_is_lifted(shape, table):
    def fn(x, cos, sin):
        e, o = x[..., 0::2], x[..., 1::2]
        return torch.cat([e * cos - o * sin, o * cos + e * sin], -1)

    x, cos, sin = torch.randn(shape), torch.randn(table), torch.randn(table)
    out, reports = compile_fused(fn, x, cos, sin)
    assert fused_ops(reports) == ["interleave_rope"]
    assert_close(out, fn(x, cos, sin))


LOOK_ALIKES = {
    "swapped sign in the first half": (
        lambda e, o, c, s: torch.cat([e * c + o * s, o * c + e * s], -1),
        "same sign (+arg2_1 and +arg2_1): a reflection"),
    "swapped sign in the second half": (
        lambda e, o, c, s: torch.cat([e * c - o * s, o * c - e * s], -1),
        "same sign (-arg2_1 and -arg2_1): a reflection"),
    "even lane twice": (
        lambda e, o, c, s: torch.cat([e * c - e * s, o * c + e * s], -1),
        "lane 0 of the result reads arg0_1[..., 0] twice"),
    "halves in the other order": (
        lambda e, o, c, s: torch.cat([o * c + e * s, e * c - o * s], -1),
        "same sign (+arg1_1 and +arg1_1): a reflection"),
}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alikes_do_not_fuse(name):
    combine, reason = LOOK_ALIKES[name]

    def fn(x, cos, sin):
        return combine(x[..., 0::2], x[..., 1::2], cos, sin)

    x, cos, sin = torch.randn(2, 4, 6, 16), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    out, reports = compile_fused(fn, x, cos, sin)
    assert "interleave_rope" not in fused_ops(reports)
    assert_close(out, fn(x, cos, sin))
    assert any(reason in r for r in near_miss_reasons(reports)), near_miss_reasons(reports)


def test_lanes_of_two_tensors_or_a_third_lane_are_not_the_pattern():
    def two_tensors(x, y, cos, sin):
        return torch.cat([x[..., 0::2] * cos - y[..., 1::2] * sin, y[..., 1::2] * cos + x[..., 0::2] * sin], -1)

    def step_three(x, cos, sin):
        e, o = x[..., 0::3][..., :4], x[..., 1::3][..., :4]
        return torch.cat([e * cos - o * sin, o * cos + e * sin], -1)

    x, y = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    cos, sin = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    out, reports = compile_fused(two_tensors, x, y, cos, sin)
    assert fused_ops(reports) == [] and not near_miss_reasons(reports)
    x12 = torch.randn(2, 4, 6, 12)
    out, reports = compile_fused(step_three, x12, cos[..., :4], sin[..., :4])
    assert fused_ops(reports) == []
    assert_close(out, step_three(x12, cos[..., :4], sin[..., :4]))


def test_intermediate_used_elsewhere_is_a_near_miss():
    def fn(x, cos, sin):
        e, o = x[..., 0::2], x[..., 1::2]
        first = e * cos - o * sin
        return torch.cat([first, o * cos + e * sin], -1), first.sum()

    x, cos, sin = torch.randn(2, 4, 6, 16), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    out, reports = compile_fused(fn, x, cos, sin)
    assert fused_ops(reports) == []
    assert any("used outside the subgraph" in r for r in near_miss_reasons(reports))


def test_full_width_table_in_the_pairs_form_is_not_broadcastable():
    """A D-wide table against D/2-wide lanes would not even run in eager; D/2 tables that grow
    x's leading dims (the result is bigger than x) are refused with the shapes named."""
    def fn(x, cos, sin):
        e, o = x[..., 0::2], x[..., 1::2]
        return torch.cat([e * cos - o * sin, o * cos + e * sin], -1)

    x, cos, sin = torch.randn(1, 4, 6, 16), torch.randn(3, 1, 6, 8), torch.randn(3, 1, 6, 8)
    out, reports = compile_fused(fn, x, cos, sin)
    assert fused_ops(reports) == []
    assert any("differs from x shape" in r for r in near_miss_reasons(reports))


def test_a2_a3_limits_become_near_misses_naming_the_kernel():
    q, k, cos, sin = qk_inputs(torch.float32, head_dim=64)
    _, reports = compile_fused(hf5_interleave, q, k, cos, sin, soc="Ascend910B")
    assert fused_ops(reports) == []
    assert all("InterleaveRope takes float16 or bfloat16" in r for r in near_miss_reasons(reports))
    q, k, cos, sin = qk_inputs(torch.bfloat16, head_dim=64, grad=True)
    with nf.config.patch(soc="Ascend910B"):
        (oq, ok), _ = compile_fused(hf5_interleave, q, k, cos, sin)
        (oq.float().sum() + ok.float().sum()).backward()
    reports = nf.get_reports()
    assert fused_ops(reports) == ["interleave_rope"] * 2  # no gradient kernel on A2/A3
    assert sum("no InterleaveRope gradient kernel" in r for r in near_miss_reasons(reports)) == 2


def test_mla_prologue_pass_runs_first():
    order = [cls.name for cls in fusion.ordered(fusion.registered_fusions())]
    assert order.index("mla_preprocess") < order.index("interleave_rope") < order.index("rope")


def test_disabled_by_name():
    q, k, cos, sin = qk_inputs()
    _, reports = compile_fused(reference_interleave, q, k, cos, sin, disabled_fusions=["interleave_rope"])
    assert fused_ops(reports) == ["rotary_mul", "rotary_mul"]  # the half rotation alone, as before


def test_disabled_by_its_old_name_with_a_deprecation_warning():
    q, k, cos, sin = qk_inputs()
    with pytest.warns(DeprecationWarning, match="'rope_interleave' is deprecated; use 'interleave_rope'"):
        _, reports = compile_fused(reference_interleave, q, k, cos, sin, disabled_fusions=["rope_interleave"])
    assert fused_ops(reports) == ["rotary_mul", "rotary_mul"]


# -- the GE converter (torchair's real FX->GE conversion, offline) ------------------------------------
def _ge(fn, *args, soc):
    from torchair_offline import ge_graphs_of, torchair_dir

    if not (torchair_dir() / "torchair").is_dir():
        pytest.skip("torchair not fetched: run `make test`")
    with nf.config.patch(soc=soc):
        return ge_graphs_of(fn, *args)


def test_converter_a2_a3_emits_interleave_rope():
    q, k, cos, sin = qk_inputs(torch.bfloat16, head_dim=64)
    (graph,) = _ge(lambda q, k, c, s: sum(hf5_interleave(q, k, c, s)), q, k, cos, sin, soc="Ascend910B")
    ops = [op for op in graph.op if op.type == "InterleaveRope"]
    assert len(ops) == 2 and [d.name for d in ops[0].input_desc] == ["x", "cos", "sin"]
    assert not {"Sub", "Mul"} & {op.type for op in graph.op}  # only the tables are sliced and concatenated


def test_converter_ascend950_emits_rotary_position_embedding_mode_3_forward_and_backward():
    q, k, cos, sin = qk_inputs(torch.float32, head_dim=64, grad=True)
    fw, bw = _ge(lambda q, k, c, s: sum(reference_interleave(q, k, c, s)), q, k, cos, sin, soc="Ascend950")
    ropes = [op for op in fw.op if op.type == "RotaryPositionEmbedding"]
    assert len(ropes) == 2 and all(op.attr["mode"].i == 3 for op in ropes)
    grads = [op for op in bw.op if op.type == "RotaryPositionEmbeddingGrad"]
    assert len(grads) == 2 and all(op.attr["mode"].i == 3 for op in grads)
    # x, optional in the op-def and read only for dcos/dsin, is left out rather than faked
    assert all([d.name for d in op.input_desc] == ["dy", "cos", "sin"] for op in grads)


def test_inductor_lowers_the_fused_op_through_its_decomposition():
    """The one inductor compile here: the op and the glue around it (cat of the half tables,
    unsqueezes) lower through inductor, with eager numerics."""
    q, k, cos, sin = qk_inputs()
    with torch.no_grad():
        (oq, ok), reports = compile_fused(hf5_interleave, q, k, cos, sin, fallback="inductor")
        eq, ek = hf5_interleave(q, k, cos, sin)
    assert fused_ops(reports) == ["interleave_rope", "interleave_rope"]
    assert_close(oq, eq)
    assert_close(ok, ek)
