"""The MLA prologue fusion on a DeepSeek-style attention module (serving-engine style)."""

import pytest
import torch

import npu_fuse_backend as nf
from conftest import fused_ops, near_miss_reasons
from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs, rope_tokens


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


def test_dynamic_true_fuses_for_every_token_count():
    """dynamic=True passes the RMSNorms' eps as graph inputs: specialized (float_inputs.py). (Step 0's
    context of length 1 is a size-1 dim, which dynamic=True specializes: steps 1 and 2 share a graph.)"""
    model, cfg = build(False)
    tokens = [4, 3, 5]
    eager_outs, eager_cache, _ = decode(model, cfg, steps=3, tokens=tokens)
    outs, cache, reports = decode(model, cfg, steps=3, tokens=tokens, compile_=True, dynamic=True)
    assert len(reports) == 2 and fused_ops(reports) == ["mla_preprocess"] * 2
    assert not near_miss_reasons(reports)
    for got, expected in zip(outs, eager_outs):
        assert relative_error(got, expected) < 0.01
    assert relative_error(cache, eager_cache) < 0.01


@pytest.mark.parametrize("soc, heads, reason", [
    ("Ascend910B", 16, None),
    ("Ascend910_93", 32, None),
    ("Ascend950", 8, None),  # no MlaPreprocess there: the GE conversion spells the stages out
    ("Ascend910B", 8, "mla_preprocess on Ascend910B: 8 heads: MlaPreprocess takes 16, 32, 64, 128"),
])
def test_soc_limits_of_the_op_gate_the_rewrite(soc, heads, reason):
    model, cfg = build(False, heads=heads)
    _, _, reports = decode(model, cfg, steps=1, compile_=True, soc=soc)
    assert ("mla_preprocess" in fused_ops(reports)) == (reason is None)
    if reason:
        assert reason in near_miss_reasons(reports)
        assert fused_ops(reports).count("rotary_mul") == 2  # the RoPE sites still fuse alone


def test_symbolic_token_count_is_a_near_miss_on_atlas_a2():
    model, cfg = build(False)
    reasons = []
    for soc in ("generic", "Ascend910B"):
        torch._dynamo.reset()
        nf.clear_reports()
        compiled = torch.compile(model, backend="npu_fuse")
        cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576, dtype=torch.bfloat16)
        with nf.config.patch(fallback="aot_eager", soc=soc), torch.no_grad():
            for step, n in enumerate((3, 5), start=1):
                x, cos, sin, slots, ctx = mla_decode_inputs(cfg, n, step)
                for t in (x, cos, sin, slots, ctx):
                    torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(ctx, 1)
                compiled(x, cos, sin, slots, cache, ctx)
        reasons.append((fused_ops(nf.get_reports()), near_miss_reasons(nf.get_reports())))
    assert reasons[0][0] == ["mla_preprocess"]  # one symbolic graph
    assert "mla_preprocess" not in reasons[1][0]
    assert any("token count is symbolic" in r and "at most 256" in r for r in reasons[1][1])


def test_block_size_limit_is_a_near_miss():
    model, cfg = build(False, block_size=200, num_blocks=4)
    _, _, reports = decode(model, cfg, steps=1, compile_=True)
    assert "mla_preprocess" not in fused_ops(reports)
    assert "npu_fuse.mla_preprocess: block_size must be in [1, 128] or 256, got 200" in near_miss_reasons(reports)


def test_hidden_size_outside_the_op_range_is_a_near_miss():
    model, cfg = build(False, hidden=1024)
    _, _, reports = decode(model, cfg, steps=1, compile_=True)
    assert "npu_fuse.mla_preprocess: hidden size must be 7168 or in 2048..8192, got 1024" in \
        near_miss_reasons(reports)


def projections_and_rope(m, x, cos, sin):
    """Stages 2-7 of m's prologue, with half RoPE written out, for the variants below."""
    q_nope, q_pe, kv_c, k_pe = m.projections(x)
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
    assert fused_ops(reports) == ["rotary_mul", "rotary_mul", "rms_norm", "rms_norm"]  # and its latents' norms
    assert any("stage 9 (KV-cache write" in r or "stage 8 (weight absorption" in r for r in near_miss_reasons(reports))
    assert relative_error(outs[0], eager[0]) < 0.01


def test_autocast_over_a_float32_model_is_a_near_miss_naming_the_cast_and_stays_exact():
    """autocast runs the projections and the absorption in bf16 but keeps the norms' weights, the RoPE
    tables and the cache float32: the absorbed q_nope is cast back to float32 before its cat, which
    the op (outputs in its input's dtype, a bf16 cache) cannot do."""
    cfg = MLAConfig()
    torch.manual_seed(0)
    model = DeepSeekMLA(cfg).eval()
    x, cos, sin, slots, ctx = mla_decode_inputs(cfg, 4, 0, torch.float32)
    caches = [torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576) for _ in range(2)]
    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"), torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        eager = model(x, cos, sin, slots, caches[0], ctx)
        out = torch.compile(model, backend="npu_fuse")(x, cos, sin, slots, caches[1], ctx)
    reports = nf.get_reports()
    assert "mla_preprocess" not in fused_ops(reports)
    assert any("stage 8: the absorbed q_nope (bfloat16) is cast to float32" in r for r in near_miss_reasons(reports))
    assert torch.equal(out, eager) and torch.equal(caches[1], caches[0])


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


# -- issue 10: the forms real models write ------------------------------------------------
class InOutWeightsMLA(DeepSeekMLA):
    """A serving module that keeps its projections as [in, out] tensors and writes ``x @ w``."""

    def __init__(self, cfg, quant=False):
        super().__init__(cfg, quant=quant)
        for name in ("fused_qkv_a_proj", "q_b_proj"):
            weight = getattr(self, name).weight
            setattr(self, f"{name}_in_out", torch.nn.Parameter(weight.t().contiguous(), requires_grad=False))

    def project(self, name, x):
        proj, w = getattr(self, name), getattr(self, f"{name}_in_out")
        if not self.quant:
            return x @ w
        q = torch.clamp(torch.round(x.float() / proj.input_scale.float() + proj.input_offset.float()), -128, 127)
        acc = torch._int_mm(q.to(torch.int8), w)
        return ((acc + proj.quant_bias).float() * proj.deq_scale).to(x.dtype)

    def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
        c = self.cfg
        if self.quant:
            x = self.input_layernorm(x)
        q_c, kv = self.project("fused_qkv_a_proj", x).split([c.q_lora, c.kv_lora + c.rope], dim=-1)
        q = self.project("q_b_proj", self.q_a_layernorm(q_c)).view(-1, c.heads, c.nope + c.rope)
        q_nope, q_pe = q.split([c.nope, c.rope], dim=-1)
        kv_c, k_pe = kv.split([c.kv_lora, c.rope], dim=-1)
        q_pe, k_pe = rope_tokens(q_pe, cos, sin, c.rope_style), rope_tokens(k_pe, cos, sin, c.rope_style)
        q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        kv_cache.view(-1, c.kv_lora + c.rope)[slot_mapping] = torch.cat([self.kv_a_layernorm(kv_c), k_pe], dim=-1)
        return torch.cat([q_nope, q_pe], dim=-1)


@pytest.mark.parametrize("quant, style", [(False, "half"), (True, "interleave")], ids=["bf16", "w8a8-interleave"])
def test_weights_kept_in_out_fuse_with_eager_numerics(quant, style):
    torch.manual_seed(0)
    model = InOutWeightsMLA(MLAConfig(rope_style=style), quant=quant).to(torch.bfloat16).eval()
    eager, eager_cache, _ = decode(model, model.cfg, steps=2)
    outs, cache, reports = decode(model, model.cfg, steps=2, compile_=True)
    assert set(fused_ops(reports)) == {"mla_preprocess"}
    assert all("[in, out] weights" in m.detail for r in reports for m in r.matches)
    tolerance = 0.05 if quant else 0.01
    assert all(relative_error(g, e) < tolerance for g, e in zip(outs, eager))
    assert relative_error(cache, eager_cache) < tolerance


def test_single_token_decode_fuses():
    """T = 1: the written value reaches index_put as view(cat, [576])."""
    model, cfg = build(False)
    eager, eager_cache, _ = decode(model, cfg, steps=2, tokens=1)
    outs, cache, reports = decode(model, cfg, steps=2, tokens=1, compile_=True)
    assert set(fused_ops(reports)) == {"mla_preprocess"}
    assert all(relative_error(g, e) < 0.01 for g, e in zip(outs, eager))
    assert relative_error(cache, eager_cache) < 0.01


@pytest.mark.parametrize("dims, reason", [
    (dict(hidden=64, q_lora=32, kv_lora=16, rope=8, nope=16, v_head=16, heads=2),
     "stage 7: q rope dim 8 (of a 24-wide q head); the op takes 64"),
    (dict(nope=64), "stage 5: q nope dim 64 (of a 128-wide q head); the op takes 128"),
    (dict(q_lora=512), "stage 3: q latent width 512; the op takes 1536"),
    (dict(kv_lora=256), "stage 2: fused wdqkv projection width 1856; the op takes 2112 (1536 + 512 + 64)"),
])
def test_sizes_the_op_cannot_take_are_near_misses_naming_stage_and_value(dims, reason):
    model, cfg = build(False, **dims)
    eager, _, _ = decode(model, cfg, steps=1)
    outs, _, reports = decode(model, cfg, steps=1, compile_=True)
    assert "mla_preprocess" not in fused_ops(reports)
    assert reason in near_miss_reasons(reports)
    assert relative_error(outs[0], eager[0]) < 0.01


class PairRotationMLA(DeepSeekMLA):
    """RoPE on the interleaved pairs themselves (GPT-J's rotate_every_two), not DeepSeek's
    de-interleave-then-halves: the op cannot compute it."""

    def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
        c = self.cfg
        q_c, kv = self.fused_qkv_a_proj(x).split([c.q_lora, c.kv_lora + c.rope], dim=-1)
        q = self.q_b_proj(self.q_a_layernorm(q_c)).view(-1, c.heads, c.nope + c.rope)
        q_nope, q_pe = q.split([c.nope, c.rope], dim=-1)
        kv_c, k_pe = kv.split([c.kv_lora, c.rope], dim=-1)
        pairs = lambda t: torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)  # noqa: E731
        q_pe = q_pe * cos.unsqueeze(1) + pairs(q_pe) * sin.unsqueeze(1)
        k_pe = k_pe * cos + pairs(k_pe) * sin
        q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        kv_cache.view(-1, 576)[slot_mapping] = torch.cat([self.kv_a_layernorm(kv_c), k_pe], dim=-1)
        return torch.cat([q_nope, q_pe], dim=-1)


def test_a_pairwise_rope_is_a_near_miss_and_its_sites_still_fuse():
    cfg = MLAConfig()
    torch.manual_seed(0)
    model = PairRotationMLA(cfg).to(torch.bfloat16).eval()
    eager, _, _ = decode(model, cfg, steps=1)
    outs, _, reports = decode(model, cfg, steps=1, compile_=True)
    assert "mla_preprocess" not in fused_ops(reports)
    assert any(r.startswith("stage 7: the q RoPE rotates interleaved pairs") for r in near_miss_reasons(reports))
    assert relative_error(outs[0], eager[0]) < 0.01


def test_float32_is_a_dtype_near_miss():
    cfg = MLAConfig()
    torch.manual_seed(0)
    model = DeepSeekMLA(cfg).float().eval()
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576)
    torch._dynamo.reset()
    nf.clear_reports()
    with nf.config.patch(fallback="aot_eager"), torch.no_grad():
        x, cos, sin, slots, ctx = mla_decode_inputs(cfg, 4, 1, dtype=torch.float32)
        torch.compile(model, backend="npu_fuse")(x, cos, sin, slots, cache, ctx)
    assert "npu_fuse.mla_preprocess: input must be [tokens, hidden] float16/bfloat16, got (4, 2048) torch.float32" \
        in near_miss_reasons(nf.get_reports())


# -- issue 9: look-alikes that must not fuse, slots keep eager's meaning ----------------------
class CacheWriteVariant(DeepSeekMLA):
    """The prologue with its cache write (and optionally its kv norm) spelled by the caller."""

    def __init__(self, cfg, write, kv_norm=None):
        super().__init__(cfg)
        self.write, self.kv_norm = write, kv_norm

    def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
        q_nope, q_pe, kv_c, k_pe = projections_and_rope(self, x, cos, sin)
        q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        ctkv = self.kv_norm(self, kv_c) if self.kv_norm else self.kv_a_layernorm(kv_c)
        self.write(kv_cache.view(-1, 576), slot_mapping, torch.cat([ctkv, k_pe], dim=-1))
        return torch.cat([q_nope, q_pe], dim=-1)


def put(flat, slots, rows):
    flat[slots] = rows


def run_variant(model, cfg, tokens=4, slots=None):
    """(eager outputs, cache) and (compiled outputs, cache, reports), or the exceptions raised."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        nf.clear_reports()
        cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576, dtype=torch.bfloat16)
        x, cos, sin, s, ctx = mla_decode_inputs(cfg, tokens, 1)
        fn = torch.compile(model, backend="npu_fuse") if compiled else model
        with nf.config.patch(fallback="aot_eager"), torch.no_grad():
            try:
                out = fn(x, cos, sin, s if slots is None else slots, cache, ctx)
            except Exception as exc:  # noqa: BLE001 - compared below
                out = exc
        results.append((out, cache, nf.get_reports()))
    return results


def test_accumulating_index_put_is_not_fused_as_an_overwrite():
    cfg = MLAConfig()
    torch.manual_seed(0)
    model = CacheWriteVariant(cfg, lambda flat, s, rows: flat.index_put_((s,), rows, accumulate=True))
    model = model.to(torch.bfloat16).eval()
    (eager, eager_cache, _), (out, cache, reports) = run_variant(model, cfg)
    assert "mla_preprocess" not in fused_ops(reports)
    assert any("accumulate=True" in r for r in near_miss_reasons(reports))
    assert relative_error(cache, eager_cache) < 0.01 and relative_error(out, eager) < 0.01


def _mean_over_dim0(m, kv_c):
    xf = kv_c.float()
    return m.kv_a_layernorm.weight * (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + 1e-6)).to(kv_c.dtype)


def _mean_without_keepdim(m, kv_c):  # broadcasts only for one token
    xf = kv_c.float()
    return m.kv_a_layernorm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1) + 1e-6)).to(kv_c.dtype)


@pytest.mark.parametrize("norm, tokens", [(_mean_over_dim0, 4), (_mean_without_keepdim, 1)],
                         ids=["mean-dim0", "mean-no-keepdim"])
def test_an_rms_norm_over_the_wrong_dim_is_not_the_kv_norm(norm, tokens):
    cfg = MLAConfig()
    torch.manual_seed(0)
    model = CacheWriteVariant(cfg, put, kv_norm=norm).to(torch.bfloat16).eval()
    (eager, eager_cache, _), (out, cache, reports) = run_variant(model, cfg, tokens=tokens)
    assert "mla_preprocess" not in fused_ops(reports)
    assert "stage 6 (RMSNorm over the last dim of the kv latent) not found" in near_miss_reasons(reports)
    assert relative_error(cache, eager_cache) < 0.01 and relative_error(out, eager) < 0.01


@pytest.mark.parametrize("slot, write", [(-1, put), (-256, put), (256, put), (-257, put), (-1, "index_copy_"),
                                         (300, "index_copy_"), (-1, "scatter_")])
def test_slots_keep_eager_meaning(slot, write):
    """Negative in-range slots count from the end as eager's index_put does; what eager refuses
    (out of range, or any negative index_copy_/scatter_ index) the fused program refuses too."""
    cfg = MLAConfig()
    writes = {"index_copy_": lambda flat, s, rows: flat.index_copy_(0, s, rows),
              "scatter_": lambda flat, s, rows: flat.scatter_(0, s.unsqueeze(-1).expand(-1, 576), rows)}
    torch.manual_seed(0)
    model = CacheWriteVariant(cfg, writes.get(write, write)).to(torch.bfloat16).eval()
    slots = torch.tensor([3, slot, 40, 70])
    (eager, eager_cache, _), (out, cache, reports) = run_variant(model, cfg, slots=slots)
    assert fused_ops(reports) == ["mla_preprocess"]
    if isinstance(eager, Exception):
        assert isinstance(out, (IndexError, RuntimeError)) and "out of range" in str(out)
        assert not cache.any()  # nothing written
    else:
        assert torch.equal(cache.flatten(0, 1).abs().sum(-1) != 0, eager_cache.flatten(0, 1).abs().sum(-1) != 0)
        assert relative_error(cache, eager_cache) < 0.01 and relative_error(out, eager) < 0.01


def test_scatter_into_part_of_the_row_is_not_a_cache_write():
    cfg = MLAConfig()

    def partial_scatter(flat, s, rows):  # the index covers 512 columns only: the rope part is never written
        flat.scatter_(0, s.unsqueeze(-1).expand(-1, 512), rows)

    torch.manual_seed(0)
    model = CacheWriteVariant(cfg, partial_scatter).to(torch.bfloat16).eval()
    (eager, eager_cache, _), (out, cache, reports) = run_variant(model, cfg)
    assert "mla_preprocess" not in fused_ops(reports)
    assert any("not one slot per token for every column" in r for r in near_miss_reasons(reports))
    assert relative_error(cache, eager_cache) < 0.01


def _rms_graph_output(norm, shape=(4, 512)):
    """The output node of ``norm(x, gamma)`` traced to aten with fake values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(norm, tracing_mode="fake")(torch.randn(shape, dtype=torch.bfloat16),
                                            torch.randn(shape[-1], dtype=torch.bfloat16))
    return next(n for n in gm.graph.nodes if n.op == "output").args[0][0], gm


def _rms(x, gamma, dims=(-1,), keepdim=True, power=2, other=None):
    xf = x.float()
    sq = (other if other is not None else xf).pow(power).mean(list(dims), keepdim=keepdim)
    return (gamma * (xf * torch.rsqrt(sq + 1e-6)).to(x.dtype),)


@pytest.mark.parametrize("norm, accepted, tokens", [
    (lambda x, g: _rms(x, g), True, 4),
    (lambda x, g: _rms(x, g, dims=(1,)), True, 4),
    (lambda x, g: _rms(x, g, dims=(0,)), False, 4),
    (lambda x, g: _rms(x, g, dims=(0, 1)), False, 4),
    (lambda x, g: _rms(x, g, keepdim=False), False, 1),  # broadcasts for one row only
    (lambda x, g: _rms(x, g, power=3), False, 4),
    (lambda x, g: _rms(x, g, other=x.float() * 2), False, 4),
], ids=["last-dim", "dim-1-of-2", "dim-0", "both-dims", "no-keepdim", "cube", "mean-of-another-tensor"])
def test_match_rms_norm_accepts_only_a_per_row_rms_over_the_last_dim(norm, accepted, tokens):
    from npu_fuse_backend.matchers import match_rms_norm

    out, gm = _rms_graph_output(norm, (tokens, 512))
    found = match_rms_norm(out)
    assert (found is not None) == accepted
    if accepted:
        x, gamma = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert found.x is x and found.gamma is gamma and found.eps == 1e-6
