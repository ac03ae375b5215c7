"""Fault injection into the fused ops' CPU kernels: for every blind spot translation validation
had (issue 16), a deliberately wrong kernel that validation must refuse, and the right kernel,
which it accepts. A fault swaps the reference function an op's implementation calls (what both
the validator and the aot_eager fallback run) for a subtly wrong one, so a refusal also keeps the
compiled program equal to eager."""

import pytest
import torch
from torch._dynamo.utils import counters

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from npu_fuse_backend import validate
from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs
from npu_fuse_backend.lowering.ops import mla_preprocess as mla_op
from npu_fuse_backend.lowering.ops import rope as rope_op
from npu_fuse_backend.lowering.ops import softmax_grad as softmax_op

DIFFERS = "replacement differs from the subgraph"


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), -1)


def rope(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def softmax_chain(g, p, scale):
    return (p * (g - (g * p).sum(-1, keepdim=True))) * scale


def faulty(monkeypatch, module, name: str, wrong):
    """Make ``module.name`` compute ``wrong(right, *args)`` (right: the real kernel)."""
    right = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: wrong(right, *args, **kwargs))


def tally() -> dict:
    return {k: v for k, v in counters["npu_fuse_validation"].items() if k != "evaluations"}


@pytest.fixture(autouse=True)
def fresh_tally():
    counters["npu_fuse_validation"].clear()


def refused(fn, args, probe: str) -> str:
    """fn compiled: nothing fused, eager's result, and a refusal found by ``probe``."""
    out, reports = compile_fused(fn, *args)
    assert fused_ops(reports) == [], reports[0].summary()
    (reason,) = [r for r in near_miss_reasons(reports) if r.startswith(DIFFERS)]
    assert f"({probe} inputs" in reason, reason
    assert_close(out, fn(*args))
    return reason


def accepted(fn, args, op: str) -> None:
    out, reports = compile_fused(fn, *args)
    assert fused_ops(reports) == [op], near_miss_reasons(reports)
    assert "differs" not in tally() and "unvalidated" not in tally()
    assert_close(out, fn(*args))


def rope_args(b=2, s=5, n=3, d=16):
    return torch.randn(b, s, n, d), torch.randn(1, s, 1, d), torch.randn(1, s, 1, d)


# -- values outside [-1, 1] -------------------------------------------------------------------------
RoPE_FAULTS = {
    "wrong only where |x| > 1":
        lambda right, x, r1, r2, mode="half": torch.where(x.abs() > 1, right(x, r1, r2, mode) * 1.01,
                                                          right(x, r1, r2, mode)),
    "wrong only for large values":
        lambda right, x, r1, r2, mode="half": torch.where(x.abs() > 1e4, right(x, r1, r2, mode) * 1.001,
                                                          right(x, r1, r2, mode)),
    "saturating at the float16 range (an fp16 intermediate)":
        lambda right, x, r1, r2, mode="half": right(x, r1, r2, mode).clamp(-65504, 65504),
    "clamping the tables to [-1, 1] (assumes plain cos/sin; YaRN/NTK tables are scaled)":
        lambda right, x, r1, r2, mode="half": right(x, r1.clamp(-1, 1), r2.clamp(-1, 1), mode),
}


@pytest.mark.parametrize("fault", RoPE_FAULTS)
def test_a_kernel_wrong_outside_minus_one_one_is_refused_by_the_magnitudes_probe(monkeypatch, fault):
    args = rope_args()
    args = (args[0].clamp(-1, 1), args[1].clamp(-1, 1), args[2].clamp(-1, 1))  # the user's data hides it
    faulty(monkeypatch, rope_op, "rotary_mul_reference", RoPE_FAULTS[fault])
    refused(rope, args, "magnitudes")


def test_the_right_rope_kernel_is_accepted():
    accepted(rope, rope_args(), "rotary_mul")


def test_a_kernel_wrong_for_a_scale_above_one_is_refused(monkeypatch):
    """A temperature-scaled softmax backward (the scale a 0-d tensor input); the fault assumes
    1/sqrt(d) <= 1."""
    args = torch.randn(2, 4, 8), torch.randn(2, 4, 8).softmax(-1), torch.tensor(0.5)
    faulty(monkeypatch, softmax_op, "softmax_grad_ext_reference",
           lambda right, g, p, s, axes=(-1,), keep=True: right(g, p, s.clamp(max=1), axes, keep))
    refused(softmax_chain, args, "magnitudes")


def test_the_right_softmax_grad_kernel_is_accepted_with_a_scale_above_one():
    accepted(softmax_chain, (torch.randn(2, 4, 8), torch.randn(2, 4, 8).softmax(-1), torch.tensor(8.0)),
             "softmax_grad_ext")


# -- NaN and infinities ------------------------------------------------------------------------------
def test_a_kernel_turning_nan_into_zero_is_refused(monkeypatch):
    faulty(monkeypatch, rope_op, "rotary_mul_reference",
           lambda right, x, r1, r2, mode="half": right(x, r1, r2, mode).nan_to_num(nan=0.0, posinf=float("inf"),
                                                                                    neginf=float("-inf")))
    refused(rope, rope_args(), "NaN")


def test_a_kernel_turning_infinities_into_finite_values_is_refused(monkeypatch):
    faulty(monkeypatch, softmax_op, "softmax_grad_ext_reference",
           lambda right, *args: right(*args).nan_to_num(nan=float("nan")))
    refused(lambda g, p: softmax_chain(g, p, 0.125), (torch.randn(2, 4, 8), torch.randn(2, 4, 8).softmax(-1)),
            "infinities")


# -- sizes past the shrunk shape --------------------------------------------------------------------
def rows_wrong_from(dim: int, start: int):
    def wrong(right, x, r1, r2, mode="half"):
        out = right(x, r1, r2, mode).clone()
        if out.shape[dim] > start:
            out.narrow(dim, start, out.shape[dim] - start).mul_(1.01)
        return out

    return wrong


LARGE = dict(b=20, s=48, n=4, d=64)  # 245760 + 2 * 3072 input elements: shrunk, then confirmed
SMALL_ENOUGH = 4096  # FULL_ELEMENTS here: both the batch and the sequence dim shrink


@pytest.mark.parametrize("dim, start, size", [(1, 16, "48 (dim -3)"), (0, 16, "20 (dim -4)")],
                         ids=["sequence rows >= 16", "batch rows >= 16"])
def test_a_kernel_wrong_past_the_shrunk_sizes_is_refused_by_the_confirmation_at_real_length(
        monkeypatch, dim, start, size):
    monkeypatch.setattr(validate, "FULL_ELEMENTS", SMALL_ENOUGH)
    faulty(monkeypatch, rope_op, "rotary_mul_reference", rows_wrong_from(dim, start))
    reason = refused(rope, rope_args(**LARGE), "magnitudes")
    assert "real length" in reason and size in reason.split("confirming ")[1]  # (alone or with the other size)


def test_a_long_sequence_is_confirmed_on_sampled_rows_that_reach_past_the_shrunk_size(monkeypatch):
    monkeypatch.setattr(validate, "FULL_ELEMENTS", SMALL_ENOUGH)
    monkeypatch.setattr(validate, "MEMORY_BUDGET", 2 << 20)  # the real length does not fit: sampled rows
    faulty(monkeypatch, rope_op, "rotary_mul_reference", rows_wrong_from(1, 16))
    reason = refused(rope, rope_args(**LARGE), "magnitudes")
    assert f"confirming size 48 (dim -3) on {validate.SAMPLE_ROWS} sampled rows" in reason


def test_the_right_kernel_is_accepted_on_large_inputs(monkeypatch):
    monkeypatch.setattr(validate, "FULL_ELEMENTS", SMALL_ENOUGH)
    accepted(rope, rope_args(**LARGE), "rotary_mul")


# -- repeated indices and serving-sized caches (MLA) --------------------------------------------------
def mla_step(cfg: MLAConfig, tokens: int = 4, compile_=False, dtype=torch.bfloat16, **patches):
    """One decode step of DeepSeekMLA: (output, cache, reports)."""
    torch.manual_seed(0)
    model = DeepSeekMLA(cfg).to(dtype).eval()
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, cfg.kv_lora + cfg.rope, dtype=dtype)
    x, cos, sin, slots, ctx = mla_decode_inputs(cfg, tokens, 1, dtype)
    nf.clear_reports()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="npu_fuse") if compile_ else model
    with nf.config.patch(**{"fallback": "aot_eager", **patches}), torch.no_grad():
        out = fn(x, cos, sin, slots, cache, ctx)
    return out, cache, nf.get_reports() if compile_ else []


def mla_refused(cfg, probe):
    eager, eager_cache, _ = mla_step(cfg)
    out, cache, reports = mla_step(cfg, compile_=True)
    assert "mla_preprocess" not in fused_ops(reports)
    reasons = [n.reason for r in reports for n in r.near_misses if n.family == "mla_preprocess"]
    assert reasons and all(DIFFERS in r and f"({probe}" in r for r in reasons), reasons
    assert relative_error(out, eager) < 0.01 and relative_error(cache, eager_cache) < 0.01


def relative_error(got, expected) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def first_write_wins(right, cache, rows, slots, nz):
    return right(cache, rows.flip(0), slots.flip(0), nz)  # of two writes to one slot, the first one stays


def test_a_kernel_whose_first_write_wins_is_refused_on_repeated_slots(monkeypatch):
    """``cache.view(-1, D)[slots] = rows`` keeps the last of duplicate writes (index_put)."""
    faulty(monkeypatch, mla_op, "write_cache", first_write_wins)
    mla_refused(MLAConfig(), "repeated indices")


def test_the_right_mla_kernel_is_accepted_with_repeated_slots_drawn(monkeypatch):
    seen = []
    samples = validate._Draws.samples
    monkeypatch.setattr(validate._Draws, "samples",
                        lambda self: (seen.append(probe) or (probe, values) for probe, values in samples(self)))
    out, cache, reports = mla_step(MLAConfig(), compile_=True)
    assert fused_ops(reports) == ["mla_preprocess"]
    assert "repeated indices" in seen and tally().get("equal") and "differs" not in tally()


def test_index_copy_writes_draw_no_repeated_slots_as_their_order_is_undefined(monkeypatch):
    seen = []
    samples = validate._Draws.samples
    monkeypatch.setattr(validate._Draws, "samples",
                        lambda self: (seen.append(probe) or (probe, values) for probe, values in samples(self)))

    class IndexCopy(DeepSeekMLA):
        def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
            q_nope, q_pe, kv_c, k_pe = self.projections(x)
            from npu_fuse_backend.demo_models import rope_tokens
            q_pe, k_pe = rope_tokens(q_pe, cos, sin, "half"), rope_tokens(k_pe, cos, sin, "half")
            q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            kv_cache.view(-1, 576).index_copy_(0, slot_mapping, torch.cat([self.kv_a_layernorm(kv_c), k_pe], -1))
            return torch.cat([q_nope, q_pe], dim=-1)

    cfg = MLAConfig()
    torch.manual_seed(0)
    model = IndexCopy(cfg).to(torch.bfloat16).eval()
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576, dtype=torch.bfloat16)
    x, cos, sin, slots, ctx = mla_decode_inputs(cfg, 4, 1)
    with nf.config.patch(fallback="aot_eager"), torch.no_grad():
        torch.compile(model, backend="npu_fuse")(x, cos, sin, slots, cache, ctx)
    assert fused_ops(nf.get_reports()) == ["mla_preprocess"]
    assert "repeated indices" not in seen and any(p.startswith("out-of-range index (too large") for p in seen)


def test_a_kernel_wrong_only_past_the_shrunk_hidden_size_is_refused(monkeypatch):
    """The hidden size shrinks (its NPU range lifted while validating), so the confirmation at its
    real length is what finds a projection that drops the input's last lanes."""
    def short_projection(right, a):
        if a["input"].shape[1] > 1000:
            a = {**a, "input": torch.cat([a["input"][:, :1000], a["input"][:, 1000:] * 0], dim=1)}
        return right(a)

    faulty(monkeypatch, mla_op, "mla_preprocess_stages", short_projection)
    mla_refused(MLAConfig(), "magnitudes")


def test_the_mla_hidden_size_is_shrunk_and_confirmed_at_its_real_length(monkeypatch):
    hidden = MLAConfig().hidden
    seen = []
    compare = validate._Validation._compare

    def recording(self, problem):
        seen.append({size.real: n for size, n in problem.lengths.items()})
        return compare(self, problem)

    monkeypatch.setattr(validate._Validation, "_compare", recording)
    out, cache, reports = mla_step(MLAConfig(), compile_=True)
    assert fused_ops(reports) == ["mla_preprocess"] and set(tally()) == {"equal"}
    assert seen[0].get(hidden, hidden) < hidden // 64  # the shrunk problem's weights are read at a small hidden size
    assert any(lengths.get(hidden) == hidden for lengths in seen[1:])  # and once at the real one


SERVING = MLAConfig(block_size=128, num_blocks=920)  # a cache of 920 * 128 * 576 = 67.8M elements (> 64M)


def test_a_cache_write_one_slot_off_is_refused_past_64m_cache_elements(monkeypatch):
    def one_slot_off(right, cache, rows, slots, nz):
        return right(cache, rows, (slots + 1) % (cache.shape[0] * cache.shape[1]), nz)

    faulty(monkeypatch, mla_op, "write_cache", one_slot_off)
    mla_refused(SERVING, "uniform")


def test_the_right_kernel_is_validated_past_64m_cache_elements_without_copying_the_cache(monkeypatch):
    caches = []
    compare = validate._Validation._compare

    def recording(self, problem):
        caches.extend(problem.shapes[n] for n in self.leaves if len(problem.shapes.get(n, ())) == 4)
        return compare(self, problem)

    monkeypatch.setattr(validate._Validation, "_compare", recording)
    eager, eager_cache, _ = mla_step(SERVING)
    out, cache, reports = mla_step(SERVING, compile_=True)
    assert fused_ops(reports) == ["mla_preprocess"]
    assert tally().get("equal") == 1 and set(tally()) == {"equal"}
    whole = SERVING.num_blocks * SERVING.block_size
    assert caches and all(shape[0] * shape[1] <= whole // 8 for shape in caches)  # never the whole cache
    assert any(shape[0] == SERVING.num_blocks for shape in caches)  # every block index at its real place,
    assert any(shape[1] == SERVING.block_size for shape in caches)  # and every slot of a block, in turn
    assert relative_error(out, eager) < 0.01 and relative_error(cache, eager_cache) < 0.01


# -- near the float16 range -----------------------------------------------------------------------------
def lowerings(monkeypatch) -> list:
    """Filled with the magnitudes probe's lowerings as validation draws them (see _Draws.lower_magnitudes)."""
    seen = []
    lower = validate._Draws.lower_magnitudes

    def recording(self):
        lowered = lower(self)
        if lowered:
            seen.append(self.lowered)
        return lowered

    monkeypatch.setattr(validate._Draws, "lower_magnitudes", recording)
    return seen


def fp16_rope_args():
    """float16 RoPE: on the magnitudes probe (up to 2^12 in q and in the tables) eager's q * cos overflows."""
    return tuple(t.half() for t in rope_args())


def test_a_right_float16_kernel_is_accepted_where_eager_overflows_on_the_magnitudes_probe(monkeypatch):
    """Near 65504 a kernel that rounds once overflows where eager, rounding twice, does not (and the
    other way round): the probe is drawn lower until eager is finite, and compared strictly there."""
    seen = lowerings(monkeypatch)
    args = fp16_rope_args()
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == ["rotary_mul"], near_miss_reasons(reports)
    assert seen and set(tally()) == {"equal"}
    assert_close(out, rope(*args), torch.float16)


def overflowing_at(limit: float):
    """An intermediate of a quarter of float16's range (its values times 4) overflows: inf past ``limit``."""
    def wrong(right, x, r1, r2, mode="half"):
        out = right(x, r1, r2, mode)
        return torch.where(out.abs() > limit, out * float("inf"), out)

    return wrong


FLOAT16_FAULTS = {  # the fault, and where the probe finds it
    "wrong only where |x| > 1": (RoPE_FAULTS["wrong only where |x| > 1"], "magnitudes inputs"),
    "clamping the tables to [-1, 1]": (RoPE_FAULTS["clamping the tables to [-1, 1] (assumes plain cos/sin; "
                                                   "YaRN/NTK tables are scaled)"], "magnitudes inputs"),
    "wrong only where |x| > 1000": (lambda right, x, r1, r2, mode="half": torch.where(
        x.abs() > 1000, right(x, r1, r2, mode) * 1.01, right(x, r1, r2, mode)), "where both sides are finite"),
    # not compared where it overflows at the full levels, found where eager is finite on the lower ones
    "overflowing past 16384": (overflowing_at(16384.0), "lowered"),
}


@pytest.mark.parametrize("fault", FLOAT16_FAULTS)
def test_a_float16_kernel_wrong_for_large_values_is_refused_where_eager_overflows(monkeypatch, fault):
    wrong, found = FLOAT16_FAULTS[fault]
    faulty(monkeypatch, rope_op, "rotary_mul_reference", wrong)
    args = tuple(t.clamp(-1, 1) for t in fp16_rope_args())
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == []
    (reason,) = [r for r in near_miss_reasons(reports) if r.startswith(DIFFERS)]
    assert "(magnitudes inputs" in reason and found in reason, reason
    assert torch.equal(out, rope(*args))


def test_a_float16_mla_step_fuses_though_its_projections_overflow_on_the_magnitudes_probe(monkeypatch):
    """Three contractions of scaled inputs reach float16's range (hidden 2048: already at 2^6)."""
    seen = lowerings(monkeypatch)
    eager, eager_cache, _ = mla_step(MLAConfig(), dtype=torch.float16)
    out, cache, reports = mla_step(MLAConfig(), compile_=True, dtype=torch.float16)
    assert fused_ops(reports) == ["mla_preprocess"], near_miss_reasons(reports)
    assert seen and set(tally()) == {"equal"}
    assert relative_error(out, eager) < 0.01 and relative_error(cache, eager_cache) < 0.01
