"""The rms_norm fusion: RMSNorm and Add+RMSNorm in the spellings real code uses, every dtype and
training mode, and the look-alikes that must not fuse."""

import pytest
import torch
import torch.nn.functional as F

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import LlamaRMSNorm
from npu_fuse_backend import fusion

D = 16


def rms(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# -- spellings that must fuse -----------------------------------------------------------------
W = 1 + 0.1 * torch.randn(D)
FORMS = {
    "pow-mean-rsqrt": lambda x: rms(x) * W,
    "weight on the left": lambda x: W * rms(x),
    "x*x": lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * W,
    "square": lambda x: x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + 1e-5) * W,
    "1/sqrt": lambda x: x * (1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * W,
    "divide by sqrt": lambda x: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * W,
    "sum / D": lambda x: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[-1] + 1e-6) * W,
    "eps first": lambda x: x * torch.rsqrt(1e-6 + x.pow(2).mean(-1, keepdim=True)) * W,
    "positive dim": lambda x: x * torch.rsqrt(x.pow(2).mean(2, keepdim=True) + 1e-6) * W,
    "F.rms_norm": lambda x: F.rms_norm(x, (D,), W, 1e-6),
    "F.rms_norm, no weight": lambda x: F.rms_norm(x, (D,)),
    "no weight": lambda x: rms(x),
    "weight [1, 1, D]": lambda x: rms(x) * W.view(1, 1, D),
    "gemma (1 + w)": lambda x: (rms(x.float()) * (1.0 + W.float())).type_as(x),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_spelling_fuses_with_eager_numerics(form):
    fn, x = FORMS[form], torch.randn(2, 5, D)
    out, reports = compile_fused(fn, x)
    assert fused_ops(reports) == ["rms_norm"], [r.summary() for r in reports]
    assert near_miss_reasons(reports) == []
    assert_close(out, fn(x))


def test_torch_nn_rmsnorm_and_transformers_llama_rmsnorm_fuse():
    x = torch.randn(2, 5, D)
    for module in (torch.nn.RMSNorm(D, eps=1e-6), LlamaRMSNorm(D)):
        with torch.no_grad():
            out, reports = compile_fused(module, x)
        assert [(m.op, m.detail) for r in reports for m in r.matches] == [("rms_norm", "from float32, weight")]
        assert_close(out, module(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_llama_rmsnorm_fuses_within_the_dtypes_tolerance(dtype):
    norm, x = LlamaRMSNorm(D, dtype=dtype), torch.randn(2, 5, D, dtype=dtype)
    with torch.no_grad():
        out, reports = compile_fused(norm, x)
        expected = norm(x)
    assert fused_ops(reports) == ["rms_norm"] and out.dtype == dtype
    assert_close(out, expected, dtype)  # one rounding (the NPU kernel's) where eager rounds twice


def test_a_float32_weight_on_a_half_activation_keeps_eagers_float32_multiply():
    """``w_fp32 * h.to(bf16)`` multiplies in float32 after eager rounded h: the op normalizes (gamma 1) and
    the multiply stays, so the result is eager's exactly."""
    norm, x = LlamaRMSNorm(D), torch.randn(2, 5, D, dtype=torch.bfloat16)
    with torch.no_grad():
        out, reports = compile_fused(norm, x)
        expected = norm(x)
    assert [(m.op, m.detail) for r in reports for m in r.matches] == [("rms_norm", "from bfloat16, no weight")]
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def t5_layer_norm(x, weight):
    """transformers' T5LayerNorm: the variance of x cast to float32, times x itself (promoted exactly)."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + 1e-6)).to(weight.dtype)


def test_t5s_variance_of_the_upcast_times_x_itself_fuses():
    x, weight = torch.randn(2, 5, D, dtype=torch.bfloat16), W.to(torch.bfloat16)
    out, reports = compile_fused(t5_layer_norm, x, weight)
    assert [(m.op, m.detail) for r in reports for m in r.matches] == [("rms_norm", "from bfloat16, weight")]
    assert_close(out, t5_layer_norm(x, weight), torch.bfloat16)


def test_the_rms_of_an_upcast_times_a_rounded_copy_is_a_near_miss():
    fn = lambda x: x.to(torch.float16) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    x = torch.randn(2, 5, D)
    out, reports = compile_fused(fn, x)
    assert fused_ops(reports) == [] and any("by the RMS of another tensor" in r for r in near_miss_reasons(reports))
    assert_close(out, fn(x))


def test_autocast_bf16_fuses():
    proj, norm = torch.nn.Linear(D, D), LlamaRMSNorm(D)
    x = torch.randn(2, 5, D)

    def fn(x):
        return norm(proj(x))

    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        out, reports = compile_fused(fn, x)
        expected = fn(x)
    assert fused_ops(reports) == ["rms_norm"]
    assert torch.equal(out, expected)


def cohere_layer_norm(x):
    """transformers' CohereLayerNorm: a LayerNorm without bias, ``x - mean`` written twice."""
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return W * ((x - mean) * torch.rsqrt(variance + 1e-5))


def test_a_layer_norm_written_as_the_rms_of_x_minus_mean_fuses_forward_and_in_training():
    x = torch.randn(2, 5, D, requires_grad=True)
    out, _ = compile_fused(cohere_layer_norm, x)
    out.pow(2).sum().backward()
    got = x.grad.clone()
    x.grad = None
    cohere_layer_norm(x).pow(2).sum().backward()
    assert {r.kind: fused_ops([r]) for r in nf.get_reports()} == {"forward": ["rms_norm"], "backward": []}
    assert near_miss_reasons(nf.get_reports()) == []
    assert_close(got, x.grad)  # the backward reads x - mean, computed again by the replacement


# -- Add + RMSNorm --------------------------------------------------------------------------------
def decoder_residual(h, attn, norm):
    """transformers' decoder layer: the residual sum goes to the next norm and on to the next residual."""
    h = h + attn
    return norm(h), h * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_add_before_a_norm_fuses_into_add_rms_norm(dtype):
    norm = LlamaRMSNorm(D, dtype=dtype)
    h, attn = torch.randn(2, 5, D, dtype=dtype), torch.randn(2, 5, D, dtype=dtype)
    with torch.no_grad():
        (normed, residual), reports = compile_fused(lambda a, b: decoder_residual(a, b, norm), h, attn)
        expected = decoder_residual(h, attn, norm)
    assert fused_ops(reports) == ["add_rms_norm"]
    assert_close(normed, expected[0], dtype)
    assert torch.equal(residual, expected[1])  # the op's sum output, eager's add bit for bit


def test_autocast_residual_stream_of_float32_plus_bfloat16_fuses_into_add_rms_norm():
    """Under autocast the residual stays float32 and the projection is bfloat16: their sum is float32."""
    proj, norm = torch.nn.Linear(D, D), LlamaRMSNorm(D)
    h, x = torch.randn(2, 5, D), torch.randn(2, 5, D)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        (normed, residual), reports = compile_fused(lambda a, b: decoder_residual(a, proj(b), norm), h, x)
        expected = decoder_residual(h, proj(x), norm)
    assert fused_ops(reports) == ["add_rms_norm"], [r.summary() for r in reports]
    assert residual.dtype == torch.float32 and torch.equal(residual, expected[1])
    assert torch.equal(normed, expected[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_half_precision_training_the_residual_add_stays_and_its_norm_fuses(dtype):
    """The backward reads the float32 rstd of the sum eager rounded to the half dtype; add_rms_norm's
    rstd is that of the float32 sum, so only the norm of the rounded sum is the op's."""
    norm = LlamaRMSNorm(D, dtype=dtype)
    h, attn = (torch.randn(2, 5, D, dtype=dtype, requires_grad=True) for _ in range(2))
    (normed, residual), reports = compile_fused(lambda a, b: decoder_residual(a, b, norm), h, attn)
    (normed.float().pow(2).sum() + residual.float().sum()).backward()
    got = [h.grad, attn.grad, norm.weight.grad]
    h.grad = attn.grad = norm.weight.grad = None
    expected = decoder_residual(h, attn, norm)
    (expected[0].float().pow(2).sum() + expected[1].float().sum()).backward()
    forward = [r for r in nf.get_reports() if r.kind == "forward"]
    assert fused_ops(forward) == ["rms_norm"] and near_miss_reasons(nf.get_reports()) == []
    assert torch.equal(normed, expected[0])
    for a, b in zip(got, [h.grad, attn.grad, norm.weight.grad]):
        assert_close(a, b, dtype)


def test_an_addend_wider_than_the_sum_is_no_addend_of_add_rms_norm():
    """float64 + float32 under a float32 norm: the sum is float64, rounded by the norm's cast; not the op's."""
    norm = LlamaRMSNorm(D)
    fn = lambda a, b: norm((a + b).float())  # noqa: E731
    a, b = torch.randn(2, 5, D, dtype=torch.float64), torch.randn(2, 5, D)
    out, reports = compile_fused(fn, a, b)
    assert "add_rms_norm" not in fused_ops(reports)
    assert_close(out, fn(a, b))


def test_a_broadcasting_add_stays_an_add_before_rms_norm():
    bias = torch.randn(D)
    fn = lambda x: rms(x + bias) * W  # noqa: E731
    x = torch.randn(2, 5, D)
    out, reports = compile_fused(fn, x)
    assert fused_ops(reports) == ["rms_norm"]
    assert_close(out, fn(x))


# -- training, dynamic shapes ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_fuses_the_forward_whose_rstd_the_backward_reads(dtype):
    norm = LlamaRMSNorm(D, dtype=dtype)
    x = torch.randn(2, 5, D, dtype=dtype, requires_grad=True)
    ref_norm = LlamaRMSNorm(D, dtype=dtype)
    ref_norm.load_state_dict(norm.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    ref_norm(x_ref).float().pow(2).sum().backward()
    out, _ = compile_fused(norm, x)
    out.float().pow(2).sum().backward()
    reports = nf.get_reports()
    matches = {r.kind: [(m.op, m.detail) for m in r.matches] for r in reports}
    assert matches == {"forward": [("rms_norm", f"from {str(dtype)[6:]}, no weight, rstd for the backward")],
                       "backward": []}
    assert near_miss_reasons(reports) == []
    assert_close(x.grad, x_ref.grad, dtype)
    assert_close(norm.weight.grad, ref_norm.weight.grad, dtype)


def test_dynamic_sequence_length_fuses_once_for_every_length():
    norm = LlamaRMSNorm(D)
    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"), torch.no_grad():
        compiled = torch.compile(norm, backend="npu_fuse")
        for seq in (5, 7, 9):
            x = torch.randn(2, seq, D)
            torch._dynamo.mark_dynamic(x, 1)
            assert_close(compiled(x), norm(x))
    assert fused_ops(nf.get_reports()) == ["rms_norm"]  # one symbolic graph


def test_dynamic_true_fuses_with_the_epsilon_specialized():
    """dynamic=True passes self.variance_epsilon as a graph input; the backend has Dynamo specialize
    it (float_inputs.py; tests/test_float_inputs.py has its rules)."""
    norm, x = LlamaRMSNorm(D), torch.randn(2, 5, D)
    with torch.no_grad():
        out, reports = compile_fused(norm, x, dynamic=True)
        assert fused_ops(reports) == ["rms_norm"]
        assert_close(out, norm(x))
        _, reports = compile_fused(norm, x, dynamic=True, specialize_floats=False)
    assert fused_ops(reports) == []
    assert any("is a runtime value" in r and "specialize_floats is off" in r for r in near_miss_reasons(reports))


# -- look-alikes that must not fuse ------------------------------------------------------------------
LOOK_ALIKES = {
    "mean over another dim": (lambda x: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * W,
                              "not over the last dim only"),
    "sum instead of mean": (lambda x: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) * W,
                            "sums the squares over the last dim without dividing by its size"),
    "sum over the wrong count": (lambda x: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / 8 + 1e-6) * W,
                                 "without dividing by its size"),
    "missing eps": (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * W, "no epsilon added"),
    "rsqrt of another tensor": (lambda x: (x + 1) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * W,
                                "by the RMS of another tensor"),
    "variance (LayerNorm's)": (lambda x: x * torch.rsqrt((x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
                                                         + 1e-6) * W, "by the RMS of another tensor"),
    "negative eps": (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + -1e-6) * W,
                     "npu_fuse.rms_norm: epsilon must be a number >= 0"),
    "float64 statistics": (lambda x: (rms(x.double()) * W.double()).float(),
                           "the RMS is computed in torch.float64"),
}


@pytest.mark.parametrize("case", LOOK_ALIKES)
def test_look_alikes_do_not_fuse_and_say_why(case):
    fn, reason = LOOK_ALIKES[case]
    x = torch.randn(2, 5, D)
    out, reports = compile_fused(fn, x)
    assert "rms_norm" not in fused_ops(reports)
    assert any(reason in r for r in near_miss_reasons(reports)), near_miss_reasons(reports)
    assert_close(out, fn(x))


def test_a_weight_that_is_not_one_value_per_lane_is_not_taken_as_gamma():
    """A full-shape multiply after the norm is no RMSNorm weight: the normalisation fuses, the multiply stays."""
    scale = torch.randn(5, D)
    fn = lambda x: rms(x) * scale  # noqa: E731
    x = torch.randn(2, 5, D)
    out, reports = compile_fused(fn, x)
    assert [(m.op, m.detail) for r in reports for m in r.matches] == [("rms_norm", "from float32, no weight")]
    assert_close(out, fn(x))


def test_a_weight_computed_from_x_is_not_taken_as_gamma():
    fn = lambda x: rms(x) * x.mean(0).mean(0)  # noqa: E731
    x = torch.randn(2, 5, D)
    out, reports = compile_fused(fn, x)
    assert [m.detail for r in reports for m in r.matches] == ["from float32, no weight"]
    assert_close(out, fn(x))


def test_an_intermediate_used_elsewhere_is_a_near_miss():
    def fn(x):
        mean = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(mean + 1e-6) * W, mean

    _, reports = compile_fused(fn, torch.randn(2, 5, D))
    assert fused_ops(reports) == []
    assert any("is used outside the normalisation" in r for r in near_miss_reasons(reports))


def test_disabled_by_name():
    _, reports = compile_fused(FORMS["pow-mean-rsqrt"], torch.randn(2, 5, D), disabled_fusions=["rms_norm"])
    assert fused_ops(reports) == []


# -- its place among the families ----------------------------------------------------------------
def test_it_runs_after_the_mla_prologue_whose_rmsnorms_that_pass_claims():
    order = list(fusion.PASS_ORDER)
    assert order.index("mla_preprocess") < order.index("rms_norm")


def test_the_mla_prologue_still_fuses_whole_and_its_norms_fuse_when_it_does_not():
    from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs

    cfg = MLAConfig()
    torch.manual_seed(0)
    model = DeepSeekMLA(cfg).to(torch.bfloat16).eval()
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576, dtype=torch.bfloat16)
    x, cos, sin, slots, ctx = mla_decode_inputs(cfg, 4, 1)
    with torch.no_grad():
        _, reports = compile_fused(model, x, cos, sin, slots, cache.clone(), ctx)
        assert "mla_preprocess" in fused_ops(reports) and "rms_norm" not in fused_ops(reports)
        _, reports = compile_fused(model, x, cos, sin, slots, cache.clone(), ctx, disabled_fusions=["mla_preprocess"])
    assert fused_ops(reports).count("rms_norm") == 2  # the q latent's and the kv latent's


def test_through_inductor():
    """The one inductor compile of this file: the fused op is lowered through its decomposition."""
    norm, x = LlamaRMSNorm(D, dtype=torch.bfloat16), torch.randn(2, 5, D, dtype=torch.bfloat16)
    with torch.no_grad():
        out, reports = compile_fused(lambda a, b: decoder_residual(a, b, norm), x, x * 0.5, fallback="inductor")
        expected = decoder_residual(x, x * 0.5, norm)
    assert fused_ops(reports) == ["add_rms_norm"]
    assert_close(out[0], expected[0], torch.bfloat16)
    assert torch.equal(out[1], expected[1])
