"""softmax_grad_ext behind a linear region: attention sinks (gpt-oss), two softmax backwards summed
before one scale, and the cheap intermediates inductor shares between two softmax backwards of one
softmax; and the look-alikes whose region is not linear in the softmax backward, or whose shared
value is not one cheap op."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import probs

sbd = torch.ops.aten._softmax_backward_data
fma = torch.ops.prims.fma


def train(fn, *tensors):
    """fn compiled (aot_eager) and eager: outputs and input gradients of one step, and the reports."""
    def step(f):
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
        out = f(*leaves)
        out.float().pow(2).sum().backward()
        return [out, *(t.grad for t in leaves if t.requires_grad)]

    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"):
        got = step(torch.compile(fn, backend="npu_fuse"))
    return got, step(fn), nf.get_reports()


def backward_matches(reports):
    return [m for r in reports if r.kind == "backward" for m in r.matches]


def causal(seq):
    return torch.zeros(seq, seq).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))


# -- attention sinks --------------------------------------------------------------------------------------
class SinkModule(torch.nn.Module):
    """What transformers' gpt-oss eager_attention_forward reads of its module."""

    def __init__(self, heads):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.num_key_value_groups = 1


def gpt_oss_reference(q, k, v, sinks, sm_scale=0.25):
    """openai/gpt-oss's reference sdpa (torch/model.py): in-place scale, sink column, no max shift."""
    n_tokens = q.shape[2]
    qk = torch.einsum("bhqd,bhkd->bhqk", q, k)
    qk *= sm_scale
    qk += torch.triu(q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    qk = torch.cat([qk, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, n_tokens, -1)], dim=-1)
    w = torch.softmax(qk, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bhkd->bhqd", w, v)


def test_transformers_gpt_oss_attention_with_sinks_fuses():
    """transformers' own gpt-oss attention: the row max subtracted, softmax, sink column dropped. The
    softmax backward of the whole row, the max's gradient and the sink's gradient are all linear in it:
    the scale moves in front, the sink's gradient is given back unscaled."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    module = SinkModule(heads=4)

    def attention(q, k, v):
        return gpt_oss.eager_attention_forward(module, q, k, v, causal(8), scaling=0.25)[0]

    qkv = [torch.randn(2, 4, 8, 16) for _ in range(3)]
    got, eager, reports = train(attention, *qkv)
    (match,) = backward_matches(reports)
    assert match.op == "softmax_grad_ext" and "given back unscaled" in match.detail, match
    assert not near_miss_reasons(reports)
    for a, b in zip(got, eager):
        assert_close(a, b)
    # the sink's own gradient (a parameter of the module): through the fused op too
    module.sinks.grad = None
    with nf.config.patch(fallback="aot_eager"):
        torch.compile(attention, backend="npu_fuse")(*qkv).pow(2).sum().backward()
    fused_sink_grad = module.sinks.grad.clone()
    module.sinks.grad = None
    attention(*qkv).pow(2).sum().backward()
    assert_close(fused_sink_grad, module.sinks.grad)


def test_gpt_oss_reference_sinks_fuse():
    qkv = [torch.randn(2, 4, 8, 16) for _ in range(3)]
    got, eager, reports = train(gpt_oss_reference, *qkv, torch.randn(4))
    assert [m.op for m in backward_matches(reports)] == ["softmax_grad_ext"], [r.summary() for r in reports]
    for a, b in zip(got, eager):
        assert_close(a, b)


def test_sinks_whose_probability_is_used_too_fuse():
    """The sink column's probability is also used: g's sink column is its own gradient, not 0. The
    fused op takes any grad row: still one softmax backward times the scale."""
    def attention(q, k, v, sinks):
        qk = torch.cat([q @ k.transpose(-1, -2) * 0.25, sinks.reshape(1, -1, 1, 1).expand(2, -1, 8, -1)], -1)
        p = qk.softmax(-1)
        return p[..., :-1] @ v + p[..., -1:] * v

    got, eager, reports = train(attention, *[torch.randn(2, 4, 8, 16) for _ in range(3)], torch.randn(4))
    assert [m.op for m in backward_matches(reports)] == ["softmax_grad_ext"]
    for a, b in zip(got, eager):
        assert_close(a, b)


def test_a_sink_row_with_an_extra_gradient_term_is_a_near_miss():
    """A z-loss on the row's logsumexp adds a gradient term that is not the softmax backward's: the
    scale multiplies it too, so no scale can move in front of the softmax backward alone."""
    def attention(q, k, v, sinks):
        qk = torch.cat([q @ k.transpose(-1, -2), sinks.reshape(1, -1, 1, 1).expand(2, -1, 8, -1)], -1) * 0.25
        out = qk.softmax(-1)[..., :-1] @ v
        return out + qk.logsumexp(-1, keepdim=True).pow(2)

    got, eager, reports = train(attention, *[torch.randn(2, 4, 8, 16) for _ in range(3)], torch.randn(4))
    assert not backward_matches(reports)
    reasons = near_miss_reasons(reports)
    assert any("is not computed from the softmax backward" in r for r in reasons), reasons
    for a, b in zip(got, eager):
        assert_close(a, b)


# -- regions at the graph level -------------------------------------------------------------------------
def fused_graph(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    report = nf.run_fusion_passes(gm)
    return gm, report


def sink_backward(g, p, idx):
    """The backward of gpt-oss's row: softmax backward of [B, S, S+1], the max shift's gradient, the
    weights' slice scaled, the sink column summed."""
    full = torch.ops.aten.slice_backward(g, list(p.shape), -1, 0, -1, 1)
    row = sbd(full, p, -1, torch.float32)
    shift = row.neg().sum(-1, keepdim=True)
    row = row + torch.zeros_like(row).scatter(-1, idx, shift)
    return row[..., :-1] * 0.25, row[..., -1:].sum(0)


def test_the_max_shift_and_sink_terms_are_rebuilt_on_the_scaled_row():
    g, p, idx = torch.randn(3, 8, 8), probs(3, 8, 9), torch.randint(0, 9, (3, 8, 1))
    gm, report = fused_graph(sink_backward, g, p, idx)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    for a, b in zip(gm(g, p, idx), sink_backward(g, p, idx)):
        assert_close(a, b)


def test_an_index_computed_from_the_softmax_backward_is_not_linear():
    def backward(g, p):
        row = sbd(g, p, -1, torch.float32)
        row = row + torch.zeros_like(row).scatter(-1, row.argmax(-1, keepdim=True), row.sum(-1, keepdim=True))
        return row * 0.25

    assert_unfused_and_reported(backward, torch.randn(3, 8, 9), probs(3, 8, 9))


def assert_unfused_and_reported(backward, *args):
    gm, report = fused_graph(backward, *args)
    assert not report.matches
    assert report.near_misses, "the softmax backward must be reported"
    for a, b in zip(*(out if isinstance(out, tuple) else (out,) for out in (gm(*args), backward(*args)))):
        assert_close(a, b)


def test_a_row_read_unscaled_in_full_elsewhere_is_refused_as_costlier():
    def backward(g, p):
        row = sbd(g, p, -1, torch.float32)
        return row[..., :-1] * 0.25, row.exp()

    g, p = torch.randn(3, 8, 9), probs(3, 8, 9)
    gm, report = fused_graph(backward, g, p)
    assert not report.matches
    assert any("more than the" in n.reason for n in report.near_misses), [n.reason for n in report.near_misses]
    for a, b in zip(gm(g, p), backward(g, p)):
        assert_close(a, b)


def test_a_value_given_back_unscaled_needs_a_number_scale():
    def backward(g, p, s):
        row = sbd(g, p, -1, torch.float32)
        return row[..., :-1] * s, row[..., -1:].sum()

    g, p, s = torch.randn(3, 8, 9), probs(3, 8, 9), torch.tensor(0.25)
    gm, report = fused_graph(backward, g, p, s)
    assert not report.matches
    assert any("is not a nonzero number" in n.reason for n in report.near_misses)
    for a, b in zip(gm(g, p, s), backward(g, p, s)):
        assert_close(a, b)


def test_two_softmax_backwards_summed_before_one_scale_fuse():
    """Two softmaxes of one scaled logits tensor (differential attention with shared logits): the
    logits' gradient is the sum of both softmax backwards, then one scale."""
    def attention(q, k, v1, v2, bias):
        logits = q @ k.transpose(-1, -2) * 0.25
        return logits.softmax(-1) @ v1 - 0.5 * ((logits + bias).softmax(-1) @ v2)

    tensors = [torch.randn(2, 4, 8, 16) for _ in range(4)] + [torch.randn(8, 8)]
    got, eager, reports = train(attention, *tensors)
    (match,) = backward_matches(reports)
    assert match.detail.count("softmax_backward_data") == 2, match
    for a, b in zip(got, eager):
        assert_close(a, b)


def test_an_additive_term_before_the_scale_is_a_near_miss_naming_it():
    def backward(g, p, t):
        return (sbd(g, p, -1, torch.float32) + t) * 0.25

    g, p, t = torch.randn(4, 16), probs(4, 16), torch.randn(4, 16)
    gm, report = fused_graph(backward, g, p, t)
    assert not report.matches
    (reason,) = [n.reason for n in report.near_misses]
    assert "adds t" in reason and "is not computed from the softmax backward" in reason
    assert_close(gm(g, p, t), backward(g, p, t))


# -- intermediates shared by two softmax backwards ---------------------------------------------------------
def two_chains_sharing_neg(g1, g2, p):
    """inductor's decomposition of two softmax backwards of one softmax, with neg(p) merged."""
    neg = -p
    m1, m2 = g1 * p, g2 * p
    return fma(neg, m1.sum(-1, keepdim=True), m1) * 0.25, fma(neg, m2.sum(-1, keepdim=True), m2) * 0.5


def test_a_shared_neg_does_not_block_either_fusion():
    g1, g2, p = torch.randn(4, 16), torch.randn(4, 16), probs(4, 16)
    gm, report = fused_graph(two_chains_sharing_neg, g1, g2, p)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"] * 2, [n.reason for n in report.near_misses]
    for a, b in zip(gm(g1, g2, p), two_chains_sharing_neg(g1, g2, p)):
        assert_close(a, b)


def test_a_product_read_elsewhere_stays_for_its_other_reader():
    def backward(g, p):
        m0 = g * p
        return (m0 - p * m0.sum(-1, keepdim=True)) * 0.25, m0.exp()

    g, p = torch.randn(4, 16), probs(4, 16)
    gm, report = fused_graph(backward, g, p)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    assert any(n.target == torch.ops.aten.exp.default for n in gm.graph.nodes)
    for a, b in zip(gm(g, p), backward(g, p)):
        assert_close(a, b)


@pytest.mark.parametrize("shared", ["sum", "sub"])
def test_a_shared_value_computed_from_the_chain_blocks_the_fusion(shared):
    """A reduction, or the Sub, read elsewhere: not one op of the chain's inputs; keeping it would
    compute the chain twice."""
    def backward(g, p):
        m0 = g * p
        total = m0.sum(-1, keepdim=True)
        sub = m0 - p * total
        return sub * 0.25, (total if shared == "sum" else sub).exp()

    g, p = torch.randn(4, 16), probs(4, 16)
    gm, report = fused_graph(backward, g, p)
    assert not report.matches
    assert any("is used outside the subgraph (it reads the chain's own values" in n.reason
               for n in report.near_misses), [n.reason for n in report.near_misses]
    for a, b in zip(gm(g, p), backward(g, p)):
        assert_close(a, b)


def test_shared_neg_through_the_backend():
    out, reports = compile_fused(two_chains_sharing_neg, torch.randn(4, 16), torch.randn(4, 16), probs(4, 16))
    assert fused_ops(reports) == ["softmax_grad_ext"] * 2


# -- a scale applied after the matmuls (baddbmm's alpha) -------------------------------------------------
bmm = torch.ops.aten.bmm


def baddbmm_attention(q, k, v):
    """Bloom-style scores, ``baddbmm(zeros, q, k^T, beta=0, alpha=1/sqrt(d))``: the backward scales the
    two matmuls of the softmax backward (``mul.Scalar(bmm(ds, k), alpha)`` and ``q^T``'s), never ds."""
    zeros = torch.zeros(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype)
    scores = torch.baddbmm(zeros, q, k.transpose(1, 2), beta=0.0, alpha=0.125)
    return torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                             (torch.float32, True)], ids=["fp32", "bf16", "fp16", "autocast-bf16"])
def test_a_scale_after_both_matmuls_of_the_softmax_backward_moves_in_front(dtype, autocast):
    tensors = [torch.randn(6, 16, 8, dtype=dtype) for _ in range(3)]
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        got, eager, reports = train(baddbmm_attention, *tensors)
    (match,) = backward_matches(reports)
    assert "bmm" in match.detail.split("scale moved in front of ")[1] and "(the same scale) taken by it too" in match.detail
    assert not [n for r in reports for n in r.near_misses], [n.reason for r in reports for n in r.near_misses]
    for a, b in zip(got, eager):
        assert_close(a, b)


def test_a_scale_after_the_matmuls_under_dynamic_shapes_is_a_near_miss_naming_the_static_shapes():
    nf.clear_reports()
    torch._dynamo.reset()
    q, k, v = (torch.randn(6, 16, 8, requires_grad=True) for _ in range(3))
    with nf.config.patch(fallback="aot_eager"):
        torch.compile(baddbmm_attention, backend="npu_fuse", dynamic=True)(q, k, v).sum().backward()
    reports = nf.get_reports()
    assert not backward_matches(reports)
    assert any("SoftmaxGradExt needs static shapes" in n.reason for r in reports for n in r.near_misses)


def test_mul_scalar_is_a_scale_multiply():
    """autograd writes ``mul.Scalar`` (canonicalized to ``mul.Tensor``) for some scales."""
    def backward(g, p):
        return torch.ops.aten.mul.Scalar(sbd(g, p, -1, torch.float32), 0.25)

    g, p = torch.randn(4, 16), probs(4, 16)
    gm, report = fused_graph(backward, g, p)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    assert_close(gm(g, p), backward(g, p))


def test_matmuls_scaled_apart_are_a_near_miss():
    def backward(g, p, k, q):
        ds = sbd(g, p, -1, torch.float32)
        return bmm(ds, k) * 0.125, bmm(q.transpose(1, 2), ds) * 0.25

    assert_unfused_and_reported(backward, torch.randn(2, 8, 8), probs(2, 8, 8), torch.randn(2, 8, 4),
                                torch.randn(2, 8, 4))


def test_a_product_of_the_softmax_backward_with_itself_is_not_linear():
    def backward(g, p):
        ds = sbd(g, p, -1, torch.float32)
        return bmm(ds, ds.transpose(1, 2)) * 0.125

    assert_unfused_and_reported(backward, torch.randn(2, 8, 8), probs(2, 8, 8))


def test_a_query_scaled_before_its_matmul_leaves_the_softmax_backward_unscaled():
    """Whisper/BART scale q, not the scores: the key's gradient reads ds unscaled, and giving it back
    from a scaled ds costs what the fusion saves."""
    def attention(q, k, v):
        return torch.softmax((q * 0.125) @ k.transpose(-1, -2), dim=-1) @ v

    got, eager, reports = train(attention, *[torch.randn(2, 4, 16, 8) for _ in range(3)])
    assert not backward_matches(reports)
    reasons = [n.reason for r in reports for n in r.near_misses]
    assert any("also read unscaled" in r and "costs 1024 elements, as many as the 1024" in r for r in reasons), reasons
    for a, b in zip(got, eager):
        assert_close(a, b)


# -- a mask filled into the scores (nanoGPT's causal mask) ------------------------------------------------
def nanogpt_attention(q, k, v):
    """karpathy/nanoGPT's CausalSelfAttention (its non-flash path): the scores scaled, the causal mask
    filled in with -inf, softmax. The backward fills the mask's places of the softmax backward with zeros
    before the scale: linear in it."""
    seq = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / q.shape[-1] ** 0.5)
    att = att.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(att, dim=-1) @ v


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                             (torch.float32, True)], ids=["fp32", "bf16", "fp16", "autocast-bf16"])
def test_a_masked_fill_of_the_scores_moves_the_scale_in_front_of_the_mask(dtype, autocast):
    tensors = [torch.randn(2, 4, 8, 16, dtype=dtype) for _ in range(3)]
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        got, eager, reports = train(nanogpt_attention, *tensors)
    (match,) = backward_matches(reports)
    assert match.op == "softmax_grad_ext" and "masked_fill" in match.detail.split("scale moved in front of ")[1]
    assert not near_miss_reasons(reports)
    for a, b in zip(got, eager):
        assert_close(a, b)


def test_a_masked_fill_of_the_scores_under_dynamic_shapes_is_a_near_miss_naming_the_static_shapes():
    nf.clear_reports()
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    with nf.config.patch(fallback="aot_eager"):
        out = torch.compile(nanogpt_attention, backend="npu_fuse", dynamic=True)(q, k, v)
    out.sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    nanogpt_attention(q, k, v).sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert_close(got, want)
    reports = nf.get_reports()
    assert not backward_matches(reports)
    assert any("SoftmaxGradExt needs static shapes" in n.reason for r in reports for n in r.near_misses)


def masked_backward(value):
    def backward(g, p, mask):
        return sbd(g, p, -1, torch.float32).masked_fill(mask, value) * 0.125
    return backward


def test_a_mask_filled_with_zeros_after_the_softmax_backward_fuses_and_any_other_value_does_not():
    g, p, mask = torch.randn(3, 8, 8), probs(3, 8, 8), torch.ones(8, 8, dtype=torch.bool).triu(1)
    gm, report = fused_graph(masked_backward(0.0), g, p, mask)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    assert_close(gm(g, p, mask), masked_backward(0.0)(g, p, mask))
    gm, report = fused_graph(masked_backward(1.0), g, p, mask)  # s * fill(v, 1) is fill(s * v, s), not fill(s * v, 1)
    assert report.matches == [] and "masked_fill" in report.near_misses[0].reason, report.near_misses


def where_backward(other):
    def backward(g, p, mask):
        row = sbd(g, p, -1, torch.float32)
        return torch.where(mask, other(row), row) * 0.125
    return backward


def test_a_where_with_zeros_on_one_side_is_linear_and_with_another_value_is_not():
    g, p, mask = torch.randn(3, 8, 8), probs(3, 8, 8), torch.ones(8, 8, dtype=torch.bool).triu(1)
    zeros = where_backward(torch.zeros_like)
    gm, report = fused_graph(zeros, g, p, mask)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    assert_close(gm(g, p, mask), zeros(g, p, mask))
    ones = where_backward(torch.ones_like)
    gm, report = fused_graph(ones, g, p, mask)
    assert report.matches == [] and report.near_misses, report.summary()


def test_a_mask_computed_from_the_softmax_backward_is_not_linear():
    """``masked_fill(v, v < 0, 0)`` is a relu of v, and ``where(v > 0, v, 0)`` too: the mask depends on the
    values it fills, so the fill is not linear in them (a scale of -1 changes which places are zeroed)."""
    g, p = torch.randn(3, 8, 8), probs(3, 8, 8)

    def relu_fill(g, p):
        row = sbd(g, p, -1, torch.float32)
        return row.masked_fill(row < 0, 0.0) * 0.125

    def relu_where(g, p):
        row = sbd(g, p, -1, torch.float32)
        return torch.where(row > 0, row, torch.zeros_like(row)) * 0.125

    for fn in (relu_fill, relu_where):
        gm, report = fused_graph(fn, g, p)
        assert report.matches == [] and report.near_misses, report.summary()
        assert_close(gm(g, p), fn(g, p))
