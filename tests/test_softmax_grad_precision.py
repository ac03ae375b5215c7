"""softmax_grad_ext in mixed-precision training: the casts between a softmax backward and its
scale (``softmax(..., dtype=float32).to(bf16)``, autocast, fp16) stay outside the fused op, which
computes in the softmax backward's own dtype; a cast whose rounding one fused rounding cannot
reproduce is refused, naming it. The zoo's Llama, DeepSeek-V3 and GPT-NeoX train the way models
are trained: bf16 weights, autocast bf16, fp16 weights, dynamic shapes."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import probs

softmax_grad_ext = torch.ops.npu_fuse.softmax_grad_ext.default
sbd = torch.ops.aten._softmax_backward_data


def eager_attention(q, k, v, mask):
    """transformers' eager_attention_forward: the softmax in float32, cast back to q's dtype."""
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5) + mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def plain_attention(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.125 + mask, dim=-1) @ v


def causal_mask(seq, dtype=torch.float32):
    return torch.zeros(seq, seq, dtype=dtype).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -1e4)


def training_step(fn, tensors, autocast=None):
    """fn's output and the gradients of its inputs after ``out.float().pow(2).sum().backward()``."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    with torch.autocast("cpu", autocast) if autocast else contextlib.nullcontext():
        out = fn(*leaves)
    out.float().pow(2).sum().backward()
    return [out, *(t.grad for t in leaves)]


def assert_no_less_accurate(got, eager, exact, slack=1e-3):
    """Each result is about as close to the float64 reference as eager's own result is (relative
    error over the tensor: a fused op rounds once where eager rounds twice)."""
    for g, e, x in zip(got, eager, exact):
        assert g.dtype == e.dtype
        scale = x.double().norm().item() or 1.0
        err_got, err_eager = ((g.double() - x.double()).norm().item() / scale,
                              (e.double() - x.double()).norm().item() / scale)
        assert err_got <= 1.5 * err_eager + slack, f"fused error {err_got:.3g} vs eager error {err_eager:.3g}"


def compiled_step(fn, tensors, autocast=None):
    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"):
        got = training_step(torch.compile(fn, backend="npu_fuse"), tensors, autocast)
    return got, nf.get_reports()


def backward_ops(reports):
    return [m.op for r in reports if r.kind == "backward" for m in r.matches]


# -- training steps with the casts ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_softmax_cast_back_fuses_with_eager_accuracy(dtype):
    """bf16/fp16 weights, softmax in float32: softmax backward (float32) -> cast -> scale."""
    tensors = [torch.randn(2, 4, 16, 32, dtype=dtype) for _ in range(3)] + [causal_mask(16, dtype)]
    got, reports = compiled_step(eager_attention, tensors)
    assert backward_ops(reports) == ["softmax_grad_ext"], [r.summary() for r in reports]
    assert not near_miss_reasons(reports)
    (match,) = [m for r in reports for m in r.matches]
    assert "scale moved in front of _to_copy" in match.detail
    eager = training_step(eager_attention, tensors)
    exact = training_step(eager_attention, [t.double() for t in tensors])
    assert_no_less_accurate(got[:4], eager[:4], exact[:4])


def test_autocast_attention_fuses_with_eager_accuracy():
    """autocast bf16: the matmuls in bf16, the softmax in float32 (autocast's list), the scale in bf16."""
    tensors = [torch.randn(2, 4, 16, 32) for _ in range(3)] + [causal_mask(16)]
    got, reports = compiled_step(plain_attention, tensors, autocast=torch.bfloat16)
    assert backward_ops(reports) == ["softmax_grad_ext"], [r.summary() for r in reports]
    assert not near_miss_reasons(reports)
    eager = training_step(plain_attention, tensors, autocast=torch.bfloat16)
    exact = training_step(plain_attention, [t.double() for t in tensors])
    assert_no_less_accurate(got[:4], eager[:4], exact[:4], slack=2e-3)


def _fused_calls(gm):
    return [n for n in gm.graph.nodes if n.target == softmax_grad_ext]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [0.125, 1 / math.sqrt(80)])
def test_the_fused_op_computes_in_float32_and_the_cast_follows_it(dtype, scale):
    """_softmax_backward_data in float32 on float32 probs, cast down, scaled: the fused op takes the
    float32 grad and probs (no rounding of the probs) and its result is cast as eager's was."""
    def backward(g, p):
        return sbd(g.float(), p, -1, torch.float32).to(dtype) * scale

    g, p = torch.randn(4, 8, 64, dtype=dtype), probs(4, 8, 64)
    gm = make_fx(backward, tracing_mode="fake")(g, p)
    report = nf.run_fusion_passes(gm)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    (call,) = _fused_calls(gm)
    assert [a.meta["val"].dtype for a in call.args[:3]] == [torch.float32] * 3
    assert [u.meta["val"].dtype for u in call.users] == [dtype]
    out = gm(g, p)
    assert out.dtype == dtype
    eager = backward(g, p)
    exact = sbd(g.double(), p.double(), -1, torch.float64) * scale
    assert_close(out, eager, dtype)
    assert (out.double() - exact).abs().max() <= (eager.double() - exact).abs().max() * 1.5 + 1e-6


# -- look-alikes -----------------------------------------------------------------------------------------
def test_a_widening_cast_before_the_scale_is_refused_naming_it():
    """bf16 softmax backward widened to float32 and scaled in float32: eager's bf16 rounding sits before
    the scale; one rounding after it differs by a bf16 ulp, beyond float32's tolerance."""
    def backward(g, p):
        return sbd(g, p, -1, torch.bfloat16).float() * 0.125

    g, p = torch.randn(4, 64, dtype=torch.bfloat16), probs(4, 64, dtype=torch.bfloat16)
    gm = make_fx(backward, tracing_mode="fake")(g, p)
    report = nf.run_fusion_passes(gm)
    assert not report.matches
    (reason,) = [n.reason for n in report.near_misses]
    assert "rounds the softmax backward to bfloat16 before mul" in reason and "float32's tolerance" in reason
    assert torch.equal(gm(g, p), backward(g, p))


def test_a_rounding_inside_the_chain_then_widened_is_refused():
    """float32 -> bf16 -> float32 between the chain and a float32 scale: the bf16 rounding in the middle."""
    def backward(g, p):
        return sbd(g, p, -1, torch.float32).to(torch.bfloat16).float() * 0.125

    gm = make_fx(backward, tracing_mode="fake")(torch.randn(4, 64), probs(4, 64))
    report = nf.run_fusion_passes(gm)
    assert not report.matches
    assert any("rounds the softmax backward to bfloat16" in n.reason for n in report.near_misses)


def test_a_cast_to_integers_is_no_scale_path():
    out, reports = compile_fused(lambda g, p: sbd(g, p, -1, torch.float32).to(torch.int32) * 3,
                                 torch.randn(4, 16), probs(4, 16))
    assert fused_ops(reports) == []
    (reason,) = near_miss_reasons(reports)
    assert "is not multiplied by a scale" in reason and "_to_copy" in reason


def test_a_float32_tensor_scale_of_a_bf16_chain_is_not_rounded_to_bf16():
    """Eager multiplies a bf16 chain by a float32 0-d scale in float32: passing the scale as bf16 would
    round it, so the op's one-dtype rule refuses (here behind a cast too)."""
    def backward(g, p, s):
        return sbd(g, p, -1, torch.float32).to(torch.bfloat16) * s

    g, p, s = torch.randn(4, 64, dtype=torch.bfloat16).float(), probs(4, 64), torch.tensor(0.3)
    gm = make_fx(backward, tracing_mode="fake")(g, p, s)
    report = nf.run_fusion_passes(gm)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]  # float32 chain, float32 scale: one dtype
    assert_close(gm(g, p, s), backward(g, p, s), torch.bfloat16)


# -- the zoo, trained the way models are trained -------------------------------------------------------
transformers = pytest.importorskip("transformers")
from npu_fuse_backend import model_zoo  # noqa: E402

ZOO = {name: model_zoo.BY_NAME[name] for name in ("llama", "deepseek-v3", "gpt-neox")}
PRECISIONS = {"bf16 weights": dict(weights=torch.bfloat16), "autocast bf16": dict(autocast=torch.bfloat16),
              "fp16 weights": dict(weights=torch.float16), "dynamic": dict(dynamic=True)}


def _zoo_step(model, inputs, autocast=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", autocast) if autocast else contextlib.nullcontext():
        logits = model(**inputs).logits
    logits.float().sum().backward()
    return [logits.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", ZOO)
def test_zoo_training_step_fuses_every_attention_softmax_backward(family, precision):
    setting = PRECISIONS[precision]
    model = ZOO[family].build(layers=1).train().to(setting.get("weights", torch.float32))
    inputs = model_zoo.example_inputs(batch=2, seq=8)
    eager = _zoo_step(model, inputs, setting.get("autocast"))
    others = [name for name in nf.fusion.registered_fusions() if name != "softmax_grad"]
    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager", disabled_fusions=others):
        compiled = torch.compile(model, backend="npu_fuse", dynamic=setting.get("dynamic", False))
        got = _zoo_step(compiled, inputs, setting.get("autocast"))
    reports = nf.get_reports()
    reasons = [n.reason for r in reports for n in r.near_misses if n.family == "softmax_grad"]
    if setting.get("dynamic"):
        assert backward_ops(reports) == []
        assert len(reasons) == 1 and "SoftmaxGradExt needs static shapes" in reasons[0], reasons
    else:
        assert backward_ops(reports) == ["softmax_grad_ext"], [r.summary() for r in reports]
        assert reasons == []
    exact_model = ZOO[family].build(layers=1).train().double()
    exact_model.load_state_dict(model.state_dict())
    exact = _zoo_step(exact_model, inputs)
    assert_no_less_accurate(got, eager, exact, slack=2e-3)
