"""No silent site: every softmax backward ends fused or as one near-miss with its reason (a bare
one, a divisor, a tensor divisor), look-alike reductions (norm backwards, log_softmax) are no
sites, and on inductor an attention its own SDPA pattern took is reported as such."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import probs

sbd = torch.ops.aten._softmax_backward_data
fma = torch.ops.prims.fma
softmax_grad_ext = torch.ops.npu_fuse.softmax_grad_ext.default

CORES = {
    "softmax_backward_data": lambda g, p: sbd(g, p, -1, torch.float32),
    "fma": lambda g, p: (lambda m0: fma(-p, m0.sum(-1, keepdim=True), m0))(g * p),
    "decomposed": lambda g, p: (lambda m0: m0 - p * m0.sum(-1, keepdim=True))(g * p),
    "x1 * sub": lambda g, p: p * (g - (g * p).sum(-1, keepdim=True)),
}


def fused_graph(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm, nf.run_fusion_passes(gm)


@pytest.mark.parametrize("core", CORES)
def test_a_bare_softmax_backward_is_one_near_miss_saying_where_it_goes(core):
    g, p = torch.randn(4, 16), probs(4, 16)
    gm, report = fused_graph(CORES[core], g, p)
    assert not report.matches
    (reason,) = [n.reason for n in report.near_misses]
    assert "is not multiplied by a scale" in reason and "is a graph output" in reason, reason
    assert_close(gm(g, p), CORES[core](g, p))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("scaling", ["* 0.125", "/ 8.0"])
def test_a_scaled_softmax_backward_is_one_match_and_no_near_miss(core, scaling):
    def fn(g, p):
        y = CORES[core](g, p)
        return y * 0.125 if scaling == "* 0.125" else y / 8.0

    g, p = torch.randn(4, 16), probs(4, 16)
    gm, report = fused_graph(fn, g, p)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"] and not report.near_misses
    (call,) = [n for n in gm.graph.nodes if n.target == softmax_grad_ext]
    assert call.args[2].target == torch.ops.aten.full.default and call.args[2].args[1] == 0.125
    assert_close(gm(g, p), fn(g, p))


@pytest.mark.parametrize("core", CORES)
def test_the_softmax_backward_as_a_divisor_is_a_near_miss(core):
    g, p, t = torch.randn(4, 16), probs(4, 16), torch.rand(4, 16) + 0.5
    gm, report = fused_graph(lambda g, p, t: t / CORES[core](g, p), g, p, t)
    assert not report.matches
    (reason,) = [n.reason for n in report.near_misses]
    assert "divides by it (a divisor is no scale)" in reason


@pytest.mark.parametrize("core", CORES)
def test_a_tensor_divisor_is_a_near_miss_saying_why(core):
    """1/T is eager's x/T only where 1/T is a normal number: a tensor T is not known to be one."""
    g, p, t = torch.randn(4, 16), probs(4, 16), torch.tensor(3.0)
    gm, report = fused_graph(lambda g, p, t: CORES[core](g, p) / t, g, p, t)
    assert not report.matches
    (reason,) = [n.reason for n in report.near_misses]
    assert "divided by a tensor" in reason and "subnormal" in reason


def test_temperature_softmax_in_training():
    def attention(q, k, v, temperature):
        return torch.softmax(q @ k.transpose(-1, -2) / temperature, dim=-1) @ v

    qkv = [torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3)]
    for temperature, fused in ((4.0, ["softmax_grad_ext"]), (torch.tensor(4.0), [])):
        nf.clear_reports()
        torch._dynamo.reset()
        with nf.config.patch(fallback="aot_eager"):
            torch.compile(attention, backend="npu_fuse")(*qkv, temperature).sum().backward()
        assert fused_ops(nf.get_reports()) == fused
        reasons = near_miss_reasons(nf.get_reports())
        assert reasons == [] if fused else (len(reasons) == 1 and "divided by a tensor" in reasons[0]), reasons


def test_a_refused_chain_is_reported_once():
    def fn(g, p):
        return p * (g - (g * p).sum(-1, keepdim=True)) * 0.5

    _, reports = compile_fused(fn, torch.randn(2, 8), probs(2, 8), dynamic=True)
    (reason,) = near_miss_reasons(reports)
    assert "SoftmaxGradExt needs static shapes" in reason


# -- look-alike reductions are no sites ---------------------------------------------------------------
def layer_norm(x, w):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + 1e-5) * w


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("fn", [layer_norm, rms_norm,
                                lambda x, w: F.cross_entropy(x @ w.diag(), torch.arange(x.shape[0]) % 16),
                                lambda x, w: F.log_softmax(x * w, -1) * 0.5])
def test_norm_and_log_softmax_backwards_are_not_softmax_backwards(fn):
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    nf.clear_reports()
    with nf.config.patch(fallback="aot_eager"):
        torch.compile(fn, backend="npu_fuse")(x, w).sum().backward()
    assert [r.kind for r in nf.get_reports()] == ["forward", "backward"]
    assert not [n for r in nf.get_reports() for n in r.near_misses if n.family == "softmax_grad"]


# -- a softmax written by hand -------------------------------------------------------------------------
def by_hand(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def by_hand_without_max(q, k, v):
    e = torch.exp(q @ k.transpose(-1, -2) * 0.25)
    return (e / e.sum(-1, keepdim=True)) @ v


def by_hand_spelled_otherwise(q, k, v):
    """max(...).values, torch.div, and the sum squeezed and unsqueezed (its gradient squeezes and unsqueezes)."""
    s = torch.matmul(q, k.transpose(2, 3)) / 4.0
    e = (s - s.max(dim=-1, keepdim=True).values).exp()
    return torch.matmul(torch.div(e, e.sum(dim=-1).unsqueeze(-1)), v)


@pytest.mark.parametrize("fn", [by_hand, by_hand_without_max, by_hand_spelled_otherwise])
def test_a_softmax_written_by_hand_is_a_near_miss_in_training(fn):
    """Its backward is autograd's chain through the division and the sum (and the max): one near-miss
    naming it, located at the user's code, gradients equal to eager's."""
    tensors = [torch.randn(2, 4, 8, 16) for _ in range(3)]

    def step(f):
        leaves = [t.detach().requires_grad_() for t in tensors]
        f(*leaves).pow(2).sum().backward()
        return [t.grad for t in leaves]

    nf.clear_reports()
    with nf.config.patch(fallback="aot_eager"):
        got = step(torch.compile(fn, backend="npu_fuse"))
    reports = nf.get_reports()
    assert not [m for r in reports for m in r.matches if m.family == "softmax_grad"]
    (miss,) = [n for r in reports for n in r.near_misses if n.family == "softmax_grad"]
    assert "a softmax written by hand" in miss.reason and "F.softmax" in miss.reason, miss.reason
    lines, start = inspect.getsourcelines(fn)  # (at the user's softmax: its exp or its division)
    file, line = miss.source.rsplit(":", 1)
    assert file == __file__.replace(".pyc", ".py") and start < int(line) < start + len(lines), miss.source
    for a, b in zip(got, step(fn)):
        assert_close(a, b)


def test_a_softmax_written_by_hand_under_dynamic_shapes_is_a_near_miss_and_no_pass_fails():
    """dynamic=True: the sequence length is symbolic; every pass runs (the RoPE recognizer met a symbolic
    expand in the attention's backward and failed before), the by-hand softmax is reported."""
    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"):
        compiled = torch.compile(by_hand, backend="npu_fuse", dynamic=True)
        for seq in (8, 12):
            compiled(*(torch.randn(2, 4, seq, 16, requires_grad=True) for _ in range(3))).sum().backward()
    reports = nf.get_reports()
    assert not [e for r in reports for e in r.errors], [e for r in reports for e in r.errors]
    assert any("a softmax written by hand" in n.reason for r in reports if r.kind == "backward" for n in r.near_misses)


@pytest.mark.parametrize("x1", ["e / Z / Z", "p / Z"])
def test_the_by_hand_backward_is_found_in_both_spellings_of_its_second_division(x1):
    """aot_eager's partitioner saves exp's output (e / Z / Z), inductor's the forward's p (p / Z)."""
    def backward(g, e, z, p):
        twice = e / z / z if x1 == "e / Z / Z" else p / z
        return (g / z + (-g * twice).sum(-1, keepdim=True)) * e

    e = torch.rand(4, 16) + 0.1
    z = e.sum(-1, keepdim=True)
    args = (torch.randn(4, 16), e, z, e / z)
    gm, report = fused_graph(backward, *args)
    (reason,) = [n.reason for n in report.near_misses]
    assert "a softmax written by hand" in reason
    assert_close(gm(*args), backward(*args))


@pytest.mark.parametrize("fn", [
    lambda g, e, z: (g / z + (g * (e / z / z)).sum(-1, keepdim=True)) * e,  # no negation: not a quotient's gradient
    lambda g, e, z: (g / z + (-g * (e / z / (z + 1))).sum(-1, keepdim=True)) * e,  # another divisor
    lambda g, e, z: (g / z + (-e * (e / z / z)).sum(-1, keepdim=True)) * e,  # the sum of another product
])
def test_look_alikes_of_the_by_hand_backward_are_no_sites(fn):
    e = torch.rand(4, 16) + 0.1
    args = (torch.randn(4, 16), e, e.sum(-1, keepdim=True))
    gm, report = fused_graph(fn, *args)
    assert not report.near_misses and not report.matches
    assert_close(gm(*args), fn(*args))


def top_k_renormalised(x):
    """Mixtral's router: the top-k softmax weights divided by their sum (a division by a row sum, no exp)."""
    weights, _ = torch.softmax(x, -1).topk(2, dim=-1)
    return weights / weights.sum(-1, keepdim=True)


def squares_normalised(x):
    squares = x.pow(2)
    return squares / squares.sum(-1, keepdim=True)


@pytest.mark.parametrize("fn", [top_k_renormalised, squares_normalised])
def test_a_division_by_a_row_sum_that_is_no_softmax_is_not_called_one(fn):
    x = torch.randn(8, 16, requires_grad=True)
    nf.clear_reports()
    with nf.config.patch(fallback="aot_eager"):
        torch.compile(fn, backend="npu_fuse")(x).pow(2).sum().backward()
    reasons = [n.reason for r in nf.get_reports() for n in r.near_misses]
    assert not [r for r in reasons if "written by hand" in r], reasons


# -- inductor: one compile of every attention form ------------------------------------------------------
def by_pattern(q, k, v):
    return torch.softmax((q @ k.transpose(-1, -2)) * 0.25, -1) @ v


def users_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def divided(q, k, v, mask):
    return torch.softmax(torch.matmul(q, k.transpose(2, 3)) / 4.0 + mask, -1) @ v


def shared_probs(q, k, v, mask):
    """Two attentions sharing Q, K and scale: inductor merges their softmaxes and the neg of it."""
    a1 = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    a2 = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return a1 @ v - 0.5 * (a2 @ v.flip(-1))


def sinks(q, k, v, sink, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
    c = torch.cat([w, sink.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    return F.softmax(c, dim=-1, dtype=c.dtype)[..., :-1] @ v


def bf16_attention(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
    return F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def every_attention(q, k, v, sink, mask, qb, kb, vb):
    fp32 = by_pattern(q, k, v) + users_sdpa(q, k, v) + divided(q, k, v, mask) + shared_probs(q, k, v, mask) \
        + sinks(q, k, v, sink, mask) + by_hand(q, k, v)
    return fp32.pow(2).sum() + bf16_attention(qb, kb, vb, mask.bfloat16()).float().pow(2).sum()


def _return_line(fn) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if line.strip().startswith("return"))


def test_on_inductor_every_attention_softmax_backward_is_fused_or_reported():
    torch.manual_seed(0)
    tensors = [torch.randn(2, 4, 8, 16) for _ in range(3)] + [torch.randn(4)]
    mask = torch.zeros(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    tensors_bf16 = [torch.randn(2, 4, 8, 16, dtype=torch.bfloat16) for _ in range(3)]

    def step(fn):
        leaves = [t.detach().requires_grad_() for t in tensors]
        leaves_bf16 = [t.detach().requires_grad_() for t in tensors_bf16]
        loss = fn(*leaves, mask, *leaves_bf16)
        loss.backward()
        return [loss, *(t.grad for t in leaves)], [t.grad for t in leaves_bf16]

    nf.clear_reports()
    with nf.config.patch(fallback="inductor"):
        got, got_bf16 = step(torch.compile(every_attention, backend="npu_fuse"))
    reports = nf.get_reports()
    backward = [r for r in reports if r.kind == "backward"]
    # shared_probs (2, their neg(probs) shared), sinks (scale moved in front of the max shift and sink
    # terms), bf16 (in float32, the cast after it)
    assert [m.op for r in backward for m in r.matches] == ["softmax_grad_ext"] * 4, [r.summary() for r in reports]
    misses = [n for r in reports for n in r.near_misses if n.family == "softmax_grad"]
    (written_by_hand,) = [n for n in misses if "a softmax written by hand" in n.reason]  # (p saved, exp recomputed)
    misses.remove(written_by_hand)
    assert all("taken by inductor's SDPA pattern (attention fused by inductor itself)" in n.reason
               for n in misses), [n.reason for n in misses]
    # the two attentions inductor turned into SDPA, each located at its own code; the user's own SDPA call:
    # no softmax, no record
    here = __file__.replace(".pyc", ".py")
    assert sorted(n.source for n in misses) == sorted(f"{here}:{_return_line(fn)}" for fn in (by_pattern, divided))
    expected, expected_bf16 = step(every_attention)
    for a, b in zip(got, expected):
        assert_close(a, b, torch.float32 if a.dim() else torch.float16)  # the loss: a sum of squares
    for a, b in zip(got_bf16, expected_bf16):
        assert_close(a, b, torch.bfloat16)
