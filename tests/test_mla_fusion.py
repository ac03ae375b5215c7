"""The MLA prologue fusion on a DeepSeek-style attention module (serving-engine style)."""

import pytest
import torch

import npu_fuse_backend as nf
from conftest import fused_ops, near_miss_reasons
from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs


def relative_error(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def decode(model, cfg, steps=3, tokens=4, compile_=False, dynamic=False, **patches):
    """Run a few decode steps; returns (outputs, cache, reports)."""
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, cfg.kv_lora + cfg.rope, dtype=torch.bfloat16)
    fn = model
    if compile_:
        torch._dynamo.reset()
        nf.clear_reports()
        fn = torch.compile(model, backend="npu_fuse", dynamic=dynamic)
    outs = []
    with nf.config.patch(**{"fallback": "aot_eager", **patches}), torch.no_grad():
        for step in range(steps):
            n = tokens if isinstance(tokens, int) else tokens[step]
            x, cos, sin, slots, ctx = mla_decode_inputs(cfg, n, step)
            outs.append(fn(x, cos, sin, slots, cache, ctx))
    return outs, cache, nf.get_reports() if compile_ else []


def build(quant, style="half", **cfg_kw):
    cfg = MLAConfig(rope_style=style, **cfg_kw)
    torch.manual_seed(0)
    return DeepSeekMLA(cfg, quant=quant).to(torch.bfloat16).eval(), cfg


@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "w8a8"])
@pytest.mark.parametrize("style", ["half", "interleave"])
def test_prologue_fuses_with_outputs_and_cache_close_to_eager(quant, style):
    model, cfg = build(quant, style)
    eager_outs, eager_cache, _ = decode(model, cfg)
    outs, cache, reports = decode(model, cfg, compile_=True)
    assert set(fused_ops(reports)) == {"mla_preprocess"}  # one per compiled step, RoPE included
    tolerance = 0.05 if quant else 0.01  # w8a8: an int8 rounding step may flip (eager rounds bf16 twice)
    for got, expected in zip(outs, eager_outs):
        assert relative_error(got, expected) < tolerance
    assert relative_error(cache, eager_cache) < tolerance
    written = eager_cache.abs().flatten(1).sum(1) != 0
    assert torch.equal(cache.abs().flatten(1).sum(1) != 0, written)  # the same slots were written


def test_dynamic_token_counts():
    """Token count and context length marked dynamic: one symbolic graph serves every step."""
    model, cfg = build(False)
    tokens = [4, 3, 5, 2]
    cache_e = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576, dtype=torch.bfloat16)
    cache_c = cache_e.clone()
    compiled = torch.compile(model, backend="npu_fuse")
    with nf.config.patch(fallback="aot_eager"), torch.no_grad():
        for step, n in enumerate(tokens, start=1):  # size-1 dims would be specialized
            x, cos, sin, slots, ctx = mla_decode_inputs(cfg, n, step)
            for t in (x, cos, sin, slots, ctx):
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(ctx, 1)
            expected = model(x, cos, sin, slots, cache_e, ctx)
            assert relative_error(compiled(x, cos, sin, slots, cache_c, ctx), expected) < 0.01
    reports = nf.get_reports()
    assert len(reports) == 1 and fused_ops(reports) == ["mla_preprocess"]
    assert relative_error(cache_c, cache_e) < 0.01


@pytest.mark.parametrize("soc, fuses, reason", [
    ("Ascend910B", True, None),
    ("Ascend910_93", True, None),
    ("Ascend950", False, "Ascend910B family (Atlas 800I A2/A3) only, not Ascend950"),
])
def test_soc_gate(soc, fuses, reason):
    model, cfg = build(False)
    _, _, reports = decode(model, cfg, steps=1, compile_=True, soc=soc)
    assert ("mla_preprocess" in fused_ops(reports)) == fuses
    if reason:
        assert any(reason in r for r in near_miss_reasons(reports))
        assert fused_ops(reports).count("rotary_mul") == 2  # the RoPE sites still fuse alone


def test_block_size_limit_is_a_near_miss():
    model, cfg = build(False, block_size=200, num_blocks=4)
    _, _, reports = decode(model, cfg, steps=1, compile_=True)
    assert "mla_preprocess" not in fused_ops(reports)
    assert any("block size in [1, 128] or 256" in r for r in near_miss_reasons(reports))


def test_hidden_size_outside_the_op_range_is_a_near_miss():
    model, cfg = build(False, hidden=1024)
    _, _, reports = decode(model, cfg, steps=1, compile_=True)
    assert any("hidden size 1024 is outside 2048..8192" in r for r in near_miss_reasons(reports))


def projections_and_rope(m, x, cos, sin):
    """Stages 2-7 of m's prologue, written out for the variants below."""
    c = m.cfg
    q_c, kv = m.fused_qkv_a_proj(x).split([c.q_lora, c.kv_lora + c.rope], dim=-1)
    q = m.q_b_proj(m.q_a_layernorm(q_c)).view(-1, c.heads, c.nope + c.rope)
    q_nope, q_pe = q.split([c.nope, c.rope], dim=-1)
    kv_c, k_pe = kv.split([c.kv_lora, c.rope], dim=-1)
    half = lambda t: torch.cat([-t[..., 32:], t[..., :32]], -1)  # noqa: E731
    q_pe = q_pe * cos.unsqueeze(1) + half(q_pe) * sin.unsqueeze(1)
    return q_nope, q_pe, kv_c, k_pe * cos + half(k_pe) * sin


class TrainingStyleMLA(DeepSeekMLA):
    """Hugging Face's DeepSeek attention shape: no absorption and no paged cache write."""

    def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
        q_nope, q_pe, kv_c, k_pe = projections_and_rope(self, x, cos, sin)
        return torch.cat([q_nope, q_pe], -1).sum() + self.kv_a_layernorm(kv_c).sum() + k_pe.sum()


def test_training_style_code_is_a_near_miss_naming_the_missing_stage_and_still_fuses_rope():
    cfg = MLAConfig()
    torch.manual_seed(0)
    model = TrainingStyleMLA(cfg).to(torch.bfloat16).eval()
    eager, _, _ = decode(model, cfg, steps=1)
    outs, _, reports = decode(model, cfg, steps=1, compile_=True)
    assert fused_ops(reports) == ["rotary_mul", "rotary_mul"]
    assert any("stage 9 (KV-cache write" in r or "stage 8 (weight absorption" in r for r in near_miss_reasons(reports))
    assert relative_error(outs[0], eager[0]) < 0.01


@pytest.mark.parametrize("how", ["index_copy_", "scatter_"])
def test_other_cache_write_forms(how):
    cfg = MLAConfig()

    class Variant(DeepSeekMLA):
        def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
            q_nope, q_pe, kv_c, k_pe = projections_and_rope(self, x, cos, sin)
            q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            rows = torch.cat([self.kv_a_layernorm(kv_c), k_pe], dim=-1)
            flat = kv_cache.view(-1, 576)
            if how == "index_copy_":
                flat.index_copy_(0, slot_mapping, rows)
            else:
                flat.scatter_(0, slot_mapping.unsqueeze(-1).expand(-1, 576), rows)
            return torch.cat([q_nope, q_pe], dim=-1).float().sum(-1)

    torch.manual_seed(0)
    model = Variant(cfg).to(torch.bfloat16).eval()
    eager, eager_cache, _ = decode(model, cfg, steps=2)
    outs, cache, reports = decode(model, cfg, steps=2, compile_=True)
    assert set(fused_ops(reports)) == {"mla_preprocess"}
    assert all(relative_error(g, e) < 0.01 for g, e in zip(outs, eager))
    assert relative_error(cache, eager_cache) < 0.01


@pytest.mark.parametrize("quant, style", [(False, "interleave"), (True, "half")], ids=["bf16-interleave", "w8a8"])
def test_inductor_lowering_fuses_the_prologue(quant, style):
    """Inductor's decompositions rewrite transposes, casts and clamps; the match survives
    and the op's functional decomposition compiles. (w8a8 numerics: plain inductor itself
    drifts from eager on int8 rounding, so only the bf16 case is compared.)"""
    model, cfg = build(quant, style)
    eager, eager_cache, _ = decode(model, cfg, steps=2)
    outs, cache, reports = decode(model, cfg, steps=2, compile_=True, fallback="inductor")
    assert set(fused_ops(reports)) == {"mla_preprocess"}
    assert {r.lowering for r in reports} == {"inductor"}
    if not quant:
        assert all(relative_error(g, e) < 0.01 for g, e in zip(outs, eager))
        assert relative_error(cache, eager_cache) < 0.01


def test_w8a8_input_norm_without_beta():
    """A gamma-only input RMSNorm before quantization: the op gets beta0 = 0, not anything else."""
    from npu_fuse_backend.demo_models import RMSNorm

    model, cfg = build(True)
    model.input_layernorm = RMSNorm(cfg.hidden, cfg.eps).to(torch.bfloat16)
    with torch.no_grad():
        model.input_layernorm.weight.uniform_(0.5, 1.5)
    eager, eager_cache, _ = decode(model, cfg, steps=2)
    outs, cache, reports = decode(model, cfg, steps=2, compile_=True)
    assert set(fused_ops(reports)) == {"mla_preprocess"}
    # step 0 attends to one cache entry; later steps' near one-hot softmax over random
    # weights would amplify a single int8 rounding flip, so the cache carries the check
    assert relative_error(outs[0], eager[0]) < 0.05
    assert relative_error(cache, eager_cache) < 0.05
