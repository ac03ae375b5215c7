"""Translation validation: every rewrite's replacement is run against the subgraph it
replaces on random inputs; a difference is a near-miss, never a rewrite."""

import dataclasses
import math

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
import models
from models import rope, rotate_every_two
from npu_fuse_backend import fusion, validate
from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig
from npu_fuse_backend.lowering.common import half_matmul
from npu_fuse_backend.passes.mla_preprocess import MlaPreprocessFusion
from npu_fuse_backend.passes.partial_rope import PartialRopeFusion
from npu_fuse_backend.passes.rope import RopeFusion
from npu_fuse_backend.passes.softmax_grad import SoftmaxGradFusion
from test_mla_preprocess import decode, projections_and_rope, relative_error

aten = torch.ops.aten
DIFFERS = "replacement differs from the subgraph"


def rope_args(seq=5):
    return models.rope_args(seq=seq, heads=3)


def tally():
    return {k: v for k, v in counters["npu_fuse_validation"].items() if k != "evaluations"}


@pytest.fixture(autouse=True)
def fresh_tally():
    counters["npu_fuse_validation"].clear()


def perturb(monkeypatch, cls, output=0, only_op=None):
    """Make cls's rewrites build a wrong replacement: one output (of a multi-output rewrite, the
    ``output``-th) times 1.25, as a subtly wrong pass would."""
    match = cls.match

    def wrong_match(self, ctx, anchor):
        rewrite = match(self, ctx, anchor)
        if rewrite is None or (only_op and rewrite.op != only_op):
            return rewrite
        build = rewrite.build

        def wrong(b):
            built = build(b)
            if isinstance(built, dict):
                key = list(built)[output]
                return {**built, key: b.call(aten.mul.Tensor, built[key], 1.25)}
            return b.call(aten.mul.Tensor, built, 1.25)

        return dataclasses.replace(rewrite, build=wrong)

    monkeypatch.setattr(cls, "match", wrong_match)


# -- a wrong replacement is refused, in every family --------------------------------------------
def partial_cat(q, cos, sin):
    return torch.cat([q[..., :8] * cos + rotate_every_two(q[..., :8]) * sin, q[..., 8:]], -1)


def partial_written_back(q, cos, sin):
    q = q.clone()
    q[..., 4:12] = q[..., 4:12] * cos + rotate_every_two(q[..., 4:12]) * sin
    return q


def complex_rope(q, freqs):
    pairs = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(3)


def softmax_chain(g, p):
    return (p * (g - (g * p).sum(-1, keepdim=True))) * 0.125


HALF_TABLES = (torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8))
CASES = {
    "rope": (RopeFusion, rope, lambda: rope_args()),
    "rope complex": (RopeFusion, complex_rope,
                     lambda: (torch.randn(2, 5, 3, 16), torch.polar(torch.ones(5, 1, 8), torch.randn(5, 1, 8)))),
    "partial cat": (PartialRopeFusion, partial_cat, lambda: (torch.randn(2, 5, 3, 16), *HALF_TABLES)),
    "partial written back": (PartialRopeFusion, partial_written_back,
                             lambda: (torch.randn(2, 5, 3, 16), *HALF_TABLES)),
    "softmax_grad": (SoftmaxGradFusion, softmax_chain,
                     lambda: (torch.randn(2, 4, 8), torch.randn(2, 4, 8).softmax(-1))),
}


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_replacement_is_a_near_miss_and_eager_numerics_stay(monkeypatch, case):
    cls, fn, make_args = CASES[case]
    args = make_args()
    perturb(monkeypatch, cls)
    out, reports = compile_fused(fn, *args)
    assert cls.op not in fused_ops(reports)  # (a partial RoPE's rotation may still become rotary_mul)
    assert any(r.startswith(DIFFERS) for r in near_miss_reasons(reports)), near_miss_reasons(reports)
    assert_close(out, fn(*args))


@pytest.mark.parametrize("case", CASES)
def test_the_same_wrong_replacement_would_ship_without_validation(monkeypatch, case):
    cls, fn, make_args = CASES[case]
    args = make_args()
    perturb(monkeypatch, cls)
    out, reports = compile_fused(fn, *args, translation_validation=False)
    assert len(fused_ops(reports)) == 1
    assert not torch.allclose(out.float(), fn(*args).float(), atol=1e-3)


def test_a_wrong_backward_rewrite_is_refused_in_a_training_graph(monkeypatch):
    perturb(monkeypatch, RopeFusion, only_op="rotary_mul_backward")
    q, cos, sin = rope_args()
    leaf = q.clone().requires_grad_()
    with nf.config.patch(fallback="aot_eager"):
        out = torch.compile(rope, backend="npu_fuse")(leaf, cos, sin)
        out.pow(2).sum().backward()
    reports = nf.get_reports()
    assert [m.op for r in reports for m in r.matches] == ["rotary_mul"]  # the forward, unperturbed
    backward = [n.reason for r in reports if r.kind == "backward" for n in r.near_misses]
    assert backward and backward[0].startswith(DIFFERS)
    expected = q.clone().requires_grad_()
    rope(expected, cos, sin).pow(2).sum().backward()
    assert_close(leaf.grad, expected.grad)


def test_every_rewrite_of_a_training_step_is_validated():
    q, cos, sin = rope_args()
    leaf = q.clone().requires_grad_()
    with nf.config.patch(fallback="aot_eager"):
        torch.compile(rope, backend="npu_fuse")(leaf, cos, sin).sum().backward()
    assert sorted(m.op for r in nf.get_reports() for m in r.matches) == ["rotary_mul", "rotary_mul_backward"]
    assert tally() == {"equal": 2}


# -- the MLA prologue: several outputs, an in-place cache, integer slots ----------------------
MLA = MLAConfig()


def mla_variant(write):
    class Variant(DeepSeekMLA):
        def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
            q_nope, q_pe, kv_c, k_pe = projections_and_rope(self, x, cos, sin)
            q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            write(self, kv_cache.view(-1, 576), slot_mapping, torch.cat([self.kv_a_layernorm(kv_c), k_pe], -1))
            return torch.cat([q_nope, q_pe], dim=-1).float().sum(-1)

    torch.manual_seed(0)
    return Variant(MLA).to(torch.bfloat16).eval()


def mla_reasons(model, steps=1):
    eager, eager_cache, _ = decode(model, MLA, steps=steps)
    outs, cache, reports = decode(model, MLA, steps=steps, compile_=True)
    assert "mla_preprocess" not in fused_ops(reports)
    for got, expected in zip(outs, eager):
        torch.testing.assert_close(got, expected)  # the unfused graph computes what eager does
    torch.testing.assert_close(cache, eager_cache)
    return [n.reason for r in reports for n in r.near_misses if n.family == "mla_preprocess"]


def mla_fuses_validated(model):
    """The prologue fuses, with eager's numerics, and every rewrite was shown equal."""
    eager, eager_cache, _ = decode(model, MLA)
    outs, cache, reports = decode(model, MLA, compile_=True)
    assert set(fused_ops(reports)) == {"mla_preprocess"}
    assert all(relative_error(got, expected) < 0.01 for got, expected in zip(outs, eager))
    assert relative_error(cache, eager_cache) < 0.01
    assert tally().get("equal", 0) >= 1 and "differs" not in tally() and "unvalidated" not in tally()


def slots_rewritten(monkeypatch, rewrite):
    """Make the MLA rewrite pass ``rewrite(builder, slots, cache)`` to the op instead of its slots."""
    call = fusion.GraphBuilder.call

    def call_with(self, target, *args, **kwargs):
        if target is torch.ops.higher_order.auto_functionalized_v2 and "slotmapping" in kwargs:
            kwargs["slotmapping"] = rewrite(self, kwargs["slotmapping"], kwargs["_all_bases"][0])
        return call(self, target, *args, **kwargs)

    monkeypatch.setattr(fusion.GraphBuilder, "call", call_with)


def test_mla_a_fused_projection_weight_shrinks_with_the_sizes_it_is_the_sum_of(monkeypatch):
    """q_a and kv_a in one weight: its 2112 = 1536 + 512 + 64 rows follow the 1536 and 512 that shrink
    (split sizes, the kv cat); at 2112 rows every evaluation of the shrunk problem would read ~4M weights."""
    seen = problems_seen(monkeypatch)
    mla_fuses_validated(DeepSeekMLA(MLA).to(torch.bfloat16).eval())
    (shrunk,) = [shapes for label, shapes, _ in seen if label == "shrunk"]
    confirmed = [shapes for label, shapes, _ in seen if label.startswith("confirming")]
    (weight,) = [name for name, shape in shrunk.items() if len(shape) == 2 and
                 any(shapes[name][0] == 2112 for shapes in confirmed)]
    rows, columns = shrunk[weight]
    assert MLA.rope < rows < 2112 and columns < MLA.hidden
    # each of its dims at its real length in a confirmation, never both at once (that is the real compute)
    assert any(shapes[weight][1] == MLA.hidden for shapes in confirmed)
    assert all(shapes[weight] != (2112, MLA.hidden) for shapes in confirmed)


def test_mla_slots_out_of_range_raise_on_both_sides_so_the_rewrite_is_validated():
    mla_fuses_validated(DeepSeekMLA(MLA).to(torch.bfloat16).eval())


def test_mla_a_replacement_wrapping_out_of_range_slots_is_refused(monkeypatch):
    def wrap(b, slots, cache):
        rows = cache.meta["val"].shape[0] * cache.meta["val"].shape[1]
        return b.call(aten.remainder.Scalar, slots, rows)

    slots_rewritten(monkeypatch, wrap)
    reasons = mla_reasons(DeepSeekMLA(MLA).to(torch.bfloat16).eval())
    assert reasons and all(DIFFERS in r and "out-of-range index (too large" in r and "IndexError" in r
                           for r in reasons)


def test_mla_index_copy_refuses_a_negative_slot_and_so_does_the_rewrite():
    mla_fuses_validated(mla_variant(lambda m, flat, slots, rows: flat.index_copy_(0, slots, rows)))


def test_mla_a_replacement_taking_a_negative_slot_index_copy_refuses_is_refused(monkeypatch):
    """Without the pass's masking, the op counts slot -1 from the end where index_copy raises."""
    call = fusion.GraphBuilder.call
    monkeypatch.setattr(fusion.GraphBuilder, "call", lambda self, target, *args, **kwargs:
                        args[0] if target == aten.masked_fill.Scalar else call(self, target, *args, **kwargs))
    reasons = mla_reasons(mla_variant(lambda m, flat, slots, rows: flat.index_copy_(0, slots, rows)))
    assert reasons and all(DIFFERS in r and "too negative: -1" in r for r in reasons)


def test_mla_accumulating_cache_write_is_refused():
    reasons = mla_reasons(mla_variant(lambda m, flat, slots, rows: flat.index_put_((slots,), rows,
                                                                                  accumulate=True)))
    assert reasons and all("accumulate=True" in r for r in reasons)


def test_mla_rms_norm_over_the_wrong_dim_is_not_fused():
    def write(m, flat, slots, rows):
        xf = rows[:, :512].float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + 1e-6)).to(rows.dtype)
        flat[slots] = torch.cat([m.kv_a_layernorm.weight * normed, rows[:, 512:]], -1)

    assert mla_reasons(mla_variant(write))


@pytest.mark.parametrize("output", [0, 1], ids=["q_out", "cache"])
def test_mla_a_wrong_output_of_the_replacement_is_found_on_valid_slots(monkeypatch, output):
    perturb(monkeypatch, MlaPreprocessFusion, output=output)
    reasons = mla_reasons(DeepSeekMLA(MLA).to(torch.bfloat16).eval())
    assert reasons and all(DIFFERS in r and "(uniform inputs" in r for r in reasons)


# -- how inputs are drawn -------------------------------------------------------------------------
def run_pass(fn, args, replacement, target, inside=lambda anchor: []):
    """Fuse fn's ``target`` node (and the nodes ``inside`` gives) into ``replacement(b, *node.args)``
    with a one-off pass."""
    class OneOff(fusion.FusionPass):
        name = "one_off"
        anchor_targets = (target,)

        def match(self, ctx, anchor):
            return fusion.Rewrite(anchor, inside(anchor), "test", lambda b: replacement(b, *anchor.args))

    gm = make_fx(fn, tracing_mode="fake")(*args)
    report = fusion.PassManager([OneOff()])(gm)
    return report, gm


def test_index_inputs_are_drawn_in_range_and_just_out_of_range():
    def fn(cache, slots, rows):
        return cache.index_put((slots,), rows)

    args = torch.randn(10, 4), torch.tensor([1, 2, 3]), torch.randn(3, 4)
    same = lambda b, cache, idx, rows: b.call(aten.index_put.default, cache, idx, rows)  # noqa: E731
    report, _ = run_pass(fn, args, same, aten.index_put.default)
    assert len(report.matches) == 1
    wrapped = lambda b, cache, idx, rows: b.call(  # noqa: E731
        aten.index_put.default, cache, [b.call(aten.remainder.Scalar, idx[0], 10)], rows)
    report, _ = run_pass(fn, args, wrapped, aten.index_put.default)
    assert report.matches == []
    assert "too large: 10 into 10 rows" in report.near_misses[0].reason


def mm_calls_of_the_subgraph(monkeypatch, replacement, write=aten.index_put.default) -> tuple:
    """(the report, how often the subgraph's own mm ran in the validation's evaluations) for a cache
    write of a projection, ``cache.index_put((slots,), x @ w)`` (``write``: that op)."""
    def fn(cache, slots, x, w):
        return write(cache.clone() if write is aten.index_put_.default else cache, [slots], x @ w)

    ran, subgraph_mm = [], []
    call = validate._call
    monkeypatch.setattr(validate, "_call", lambda node, args, kwargs, problem, meta: (
        ran.append(node) if not meta else None) or call(node, args, kwargs, problem, meta))
    args = torch.zeros(10, 4), torch.tensor([1, 2, 3]), torch.randn(3, 5), torch.randn(5, 4)
    report, gm = run_pass(fn, args, replacement, write,
                          inside=lambda anchor: subgraph_mm.append(anchor.args[2]) or [anchor.args[2]])
    return report, ran.count(subgraph_mm[0])


def rebuilt(b, cache, idx, rows, write=aten.index_put.default):
    return b.call(write, cache, idx, b.call(aten.mm.default, *rows.args))


def test_probes_that_change_only_integers_reuse_what_the_uniform_probe_computed_from_floats(monkeypatch):
    """The projection runs once for uniform, repeated-indices and both out-of-range probes (its float
    inputs are the same tensors, untouched), then once per probe that changes floats."""
    report, runs = mm_calls_of_the_subgraph(monkeypatch, rebuilt)
    assert len(report.matches) == 1, report.summary()
    assert runs == 1 + 3  # uniform (reused by 3 integer-only probes), magnitudes, NaN, infinities


@pytest.mark.parametrize("writes_in_place", ["subgraph", "replacement"])
def test_a_rewrite_that_writes_in_place_reuses_nothing(monkeypatch, writes_in_place):
    """(a reused value could be one the write changed: the replacement reads the subgraph's values)"""
    in_place = aten.index_put_.default

    def replacement(b, cache, idx, rows):
        if writes_in_place == "replacement":
            cache = b.call(aten.clone.default, cache)
        return rebuilt(b, cache, idx, rows, write=in_place)

    write = in_place if writes_in_place == "subgraph" else aten.index_put.default
    report, runs = mm_calls_of_the_subgraph(monkeypatch, replacement, write=write)
    assert len(report.matches) == 1, report.summary()
    assert runs == 7  # every probe computes it


def test_a_replacement_wrong_only_on_repeated_slots_is_still_refused_when_floats_are_reused(monkeypatch):
    def first_write_wins(b, cache, idx, rows):
        values = b.call(aten.mm.default, *rows.args)
        flipped = b.call(aten.flip.default, idx[0], [0])
        return b.call(aten.index_put.default, cache, [flipped], b.call(aten.flip.default, values, [0]))

    report, _ = mm_calls_of_the_subgraph(monkeypatch, first_write_wins)
    assert report.matches == [] and "repeated indices" in report.near_misses[0].reason


def test_a_read_computed_from_another_read_is_computed_not_drawn():
    """The replacement reads x where the subgraph reads x.unsqueeze(0): one random x serves both."""
    def fn(x):
        return x.unsqueeze(0) * 2

    def replacement(b, unsqueezed, two):
        return b.call(aten.unsqueeze.default, b.call(aten.mul.Tensor, unsqueezed.args[0], two), 0)

    report, gm = run_pass(fn, (torch.randn(3, 4),), replacement, aten.mul.Tensor)
    assert len(report.matches) == 1, report.summary()


def problems_seen(monkeypatch) -> list:
    """(label, {leaf name: shape}, probes) of every problem validation evaluates from now on."""
    seen = []
    compare = validate._Validation._compare

    def recording(self, problem):
        seen.append((problem.label, {n.name: problem.shapes[n] for n in self.leaves if n in problem.shapes},
                     problem.probes))
        return compare(self, problem)

    monkeypatch.setattr(validate._Validation, "_compare", recording)
    return seen


def test_evaluations_dispatch_as_a_compiled_program_runs_without_the_python_dispatcher(monkeypatch):
    """A compile enables the Python dispatcher (every op call ~6x slower under it); the validator's
    evaluations run without it, and without autograd, as the compiled program's run does."""
    states = []
    call = validate._call

    def recording(node, args, kwargs, problem, meta):
        keys = torch._C._dispatch_tls_local_include_set()
        states.append((meta, keys.has(torch._C.DispatchKey.PythonDispatcher), torch.is_grad_enabled()))
        return call(node, args, kwargs, problem, meta)

    monkeypatch.setattr(validate, "_call", recording)
    callers = []
    check = fusion.check_rewrite

    def entered(*args, **kwargs):
        callers.append(torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.PythonDispatcher))
        return check(*args, **kwargs)

    monkeypatch.setattr(fusion, "check_rewrite", entered)
    out, reports = compile_fused(rope, *rope_args(seq=64))
    assert fused_ops(reports) == ["rotary_mul"]
    assert callers and all(callers)  # (the compile calls the validator with it on)
    real = [s for s in states if not s[0]]
    assert real and not any(python or grad for _, python, grad in real)


def test_confirmations_group_sizes_up_to_confirm_elements_and_sample_a_size_too_large_alone(monkeypatch):
    """Sizes are confirmed together while the inputs stay within CONFIRM_ELEMENTS; a size whose real
    length alone exceeds it is confirmed on sampled rows (in a group where one has room), and a kernel
    wrong only past the shrunk rows is still refused there."""
    seen = problems_seen(monkeypatch)
    monkeypatch.setattr(validate, "FULL_ELEMENTS", 2000)
    args = rope_args(seq=256)  # x [2, 256, 3, 16], cos/sin [256, 16]
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == ["rotary_mul"]
    (confirmation,) = [label for label, _, _ in seen if label.startswith("confirming")]
    assert "size 256" in confirmation and "real length" in confirmation  # (all of them in one evaluation)
    seen.clear()
    validate.forget_shown_equal()
    monkeypatch.setattr(validate, "CONFIRM_ELEMENTS", 3000)  # the 256 rows alone: ~7K input elements
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == ["rotary_mul"]
    confirmations = [(label, shapes) for label, shapes, _ in seen if label.startswith("confirming")]
    sampled = [shapes for label, shapes in confirmations if "size 256" in label and "sampled rows" in label]
    assert sampled and sampled[0]["arg0_1"][1] < 256
    assert all(sum(math.prod(shape) for shape in shapes.values()) <= 3000 for _, shapes in confirmations)


def test_large_inputs_run_shrunk_then_each_size_at_its_real_length(monkeypatch):
    seen = problems_seen(monkeypatch)
    monkeypatch.setattr(validate, "FULL_ELEMENTS", 2000)
    args = rope_args(seq=64)  # x [2, 64, 3, 16]: 6144 elements
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == ["rotary_mul"]
    labels = [label for label, _, _ in seen]
    assert labels[0] == "shrunk" and seen[0][1]["arg0_1"][1] < 64
    assert "uniform" in seen[0][2] and "NaN" in seen[0][2]
    # (magnitudes runs where each size is at its real length, the others shrunk: in every confirmation)
    assert "magnitudes" not in seen[0][2] and all(probes == ("magnitudes",) for _, _, probes in seen[1:])
    confirmations = [shapes for label, shapes, _ in seen if label.startswith("confirming size 64")]
    assert confirmations and confirmations[0]["arg0_1"][1] == 64  # the sequence dim at its real length
    perturb(monkeypatch, RopeFusion)
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == [] and near_miss_reasons(reports)[0].startswith(DIFFERS)
    assert near_miss_reasons(reports)[0].endswith("shrunk)")  # found on the shrunk problem already


def shrink_tries(monkeypatch) -> list:
    """({size's real value: its length} of every shrink tried, whether it was used) from now on."""
    tries = []
    try_shrink = validate._Plan._try_shrink

    def recording(self, sizes, primes, probes):
        problem = try_shrink(self, sizes, primes, probes)
        tries.append((sorted(s.real for s in sizes), problem is not None))
        return problem

    monkeypatch.setattr(validate._Plan, "_try_shrink", recording)
    return tries


def test_a_shrink_that_breaks_drops_the_size_the_broken_shapes_point_to(monkeypatch):
    """rotate_half halves the head dim (a literal 8 for 16): 16 cannot become a prime, the sequence can.
    The first shrink fails where the halves are sliced, blames the head dim, and the second is used."""
    tries = shrink_tries(monkeypatch)
    seen = problems_seen(monkeypatch)
    monkeypatch.setattr(validate, "FULL_ELEMENTS", 2000)
    out, reports = compile_fused(rope, *rope_args(seq=64))
    assert fused_ops(reports) == ["rotary_mul"]
    assert tries == [([16, 64], False), ([64], True)]
    (shrunk,) = [shapes for label, shapes, _ in seen if label == "shrunk"]
    assert shrunk["arg0_1"][1] < 64 and shrunk["arg0_1"][3] == 16


def test_two_sizes_of_one_value_each_get_the_integers_that_name_them(monkeypatch):
    """An MLA's block size and nope dim are both 128: the cache's view follows the block size, the
    split of q and the absorbed bmm the nope dim, each found by trying the other where one breaks."""
    tries = shrink_tries(monkeypatch)
    seen = problems_seen(monkeypatch)
    cfg = MLAConfig(block_size=128, num_blocks=16)
    model = DeepSeekMLA(cfg).to(torch.bfloat16).eval()
    eager, eager_cache, _ = decode(model, cfg, steps=1)
    outs, cache, reports = decode(model, cfg, steps=1, compile_=True)
    assert set(fused_ops(reports)) == {"mla_preprocess"} and tally() == {"equal": 1}
    assert relative_error(outs[0], eager[0]) < 0.01 and relative_error(cache, eager_cache) < 0.01
    (shrunk,) = [shapes for label, shapes, _ in seen if label == "shrunk"]
    cache_shape = next(shape for shape in shrunk.values() if len(shape) == 4)
    wuk_shape = next(shape for shape in shrunk.values() if len(shape) == 3)
    assert cache_shape[1] < 128 and wuk_shape[1] < 128 and cache_shape[1] != wuk_shape[1]
    assert len(tries) <= 3 and tries[-1][1]


def test_a_product_that_unchanged_sizes_also_make_keeps_its_value():
    """2 heads * a 128-wide dim, in a view's size list, and 16 blocks * 16 slots, the dims of a cache,
    are both 256: with the 128 shrunk, an integer 256 (the slot count a replacement fills negative slots
    with) may be either, so it stays 256; alone, the product follows."""
    graph = torch.fx.Graph()
    view = graph.call_function(aten.view.default, (graph.placeholder("q"), [-1, 2, 128]))
    nope = validate._Size(128, [])
    both = ({16, 128}, [((2, 128), 256, view), ((16, 16), 256, None)], [], frozenset())
    values, derived, _, _ = validate._value_map(both, {nope: 5}, {})
    assert values == {128: 5} and 256 not in derived
    alone = ({16, 128}, [((2, 128), 256, view)], [], frozenset())
    values, _, _, _ = validate._value_map(alone, {nope: 5}, {})
    assert values == {128: 5, 256: 10}


def test_a_shrink_on_which_the_subgraph_raises_leaves_the_proof_to_the_real_shapes(monkeypatch):
    """A rule no meta kernel checks (an opaque kernel's: vLLM's rotary op wants one position per row)
    can make the subgraph raise at the shrunk sizes: that is not the same program, so the rewrite is
    evaluated at its real shapes instead (it is not refused as different)."""
    seen = problems_seen(monkeypatch)
    monkeypatch.setattr(validate, "FULL_ELEMENTS", 2000)
    call = validate._call

    def rows_of_their_own(node, args, kwargs, problem, meta):
        if not meta and node.target is aten.mul.Tensor and problem.lengths:
            raise RuntimeError("this kernel wants its 64 rows")
        return call(node, args, kwargs, problem, meta)

    monkeypatch.setattr(validate, "_call", rows_of_their_own)
    args = rope_args(seq=64)
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == ["rotary_mul"] and tally() == {"equal": 1}
    assert [label for label, _, _ in seen] == ["shrunk", ""]
    assert_close(out, rope(*args))


def test_a_confirmation_derives_its_shapes_from_the_shrunk_problem(monkeypatch):
    """Only the shrunk problem runs on meta tensors; each confirmation's shapes follow from it (the
    one size that changes is a prime of its own), and the confirmation still runs."""
    seen = problems_seen(monkeypatch)
    meta_runs = []
    meta_run = validate._Plan._meta_run
    monkeypatch.setattr(validate._Plan, "_meta_run", lambda self, problem: meta_runs.append(problem.label)
                        or meta_run(self, problem))
    monkeypatch.setattr(validate, "FULL_ELEMENTS", 2000)
    out, reports = compile_fused(rope, *rope_args(seq=64))
    assert fused_ops(reports) == ["rotary_mul"]
    confirmations = [label for label, _, _ in seen if label.startswith("confirming")]
    assert confirmations and meta_runs and set(meta_runs) == {"shrunk"}


def test_each_problem_starts_from_the_uniform_draw_whatever_the_last_probe_planted(monkeypatch):
    """The batch's confirmation reuses the shrunk problem's draws of the inputs whose shape it keeps
    (the tables, shrunk in the sequence): the infinities the shrunk problem's last probe planted there are gone by then."""
    inputs_seen = []
    samples = validate._Draws.samples

    def recording(self):
        for probe, values in samples(self):
            floats = [v for v in values.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
            inputs_seen.append((self.problem.label, probe, all(bool(v.isfinite().all()) for v in floats)))
            yield probe, values

    monkeypatch.setattr(validate._Draws, "samples", recording)
    monkeypatch.setattr(validate, "FULL_ELEMENTS", 2000)
    out, reports = compile_fused(rope, *models.rope_args(seq=32, heads=3, batch=64))
    assert fused_ops(reports) == ["rotary_mul"]
    shrunk = [probe for label, probe, _ in inputs_seen if label == "shrunk"]
    assert shrunk[-1] == "infinities"  # (no index input: the last probe plants infinities)
    confirmations = [finite for label, probe, finite in inputs_seen if label.startswith("confirming")]
    assert confirmations and all(confirmations)


def test_a_derived_shape_is_checked_as_the_node_runs():
    graph = torch.fx.symbolic_trace(lambda x: x * 2).graph
    x, doubled = [n for n in graph.nodes if n.op != "output"]
    size = validate._Size(64, [(x, 0)])
    base = validate._Problem("shrunk", {size: 5}, {}, ("uniform",), shapes={x: (5, 16), doubled: (5, 16)})
    confirming = validate._Problem("confirming size 64", {size: 64}, {}, ("magnitudes",), shapes={x: (64, 16)})
    assert validate._derive_shapes(confirming, base, [x])
    assert confirming.derived and confirming.shapes[doubled] == (64, 16)
    validate._shape_checked(doubled, torch.empty(64, 16), confirming)
    with pytest.raises(validate.Unvalidatable, match=r"\[63, 16\] on the confirming size 64 problem, not the "
                                                      r"\[64, 16\] the shrunk problem predicts"):
        validate._shape_checked(doubled, torch.empty(63, 16), confirming)
    disagreeing = validate._Problem("confirming size 64", {size: 64}, {}, ("magnitudes",), shapes={x: (64, 17)})
    assert not validate._derive_shapes(disagreeing, base, [x])  # (then the problem runs on meta tensors)


def test_a_rewrite_no_problem_of_the_budget_fits_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(validate, "MEMORY_BUDGET", 1000)  # bytes: not even the shrunk problem fits
    args = rope_args()
    out, reports = compile_fused(rope, *args)
    assert fused_ops(reports) == []
    (reason,) = near_miss_reasons(reports)
    assert reason.startswith("replacement could not be validated within the budget: ") and "> 0 MB" in reason
    assert tally() == {"over_budget": 1}
    assert_close(out, rope(*args))


def test_a_documented_knob_keeps_unvalidated_rewrites_with_a_warning_and_a_mark(monkeypatch):
    monkeypatch.setattr(validate, "MEMORY_BUDGET", 1000)
    args = rope_args()
    with pytest.warns(RuntimeWarning, match="kept unvalidated"):
        out, reports = compile_fused(rope, *args, keep_unvalidated_rewrites=True)
    (match,) = [m for r in reports for m in r.matches]
    assert match.op == "rotary_mul" and "within the budget" not in match.unvalidated
    assert match.unvalidated.startswith("kept unvalidated (config.keep_unvalidated_rewrites): ")
    assert "UNVALIDATED" in reports[0].summary()
    assert tally() == {"kept_unvalidated": 1}
    assert_close(out, rope(*args))


def test_symbolic_shapes_are_validated_at_several_values_of_the_symbols(monkeypatch):
    seen = problems_seen(monkeypatch)
    args = rope_args(seq=40)
    for t in args:
        torch._dynamo.mark_dynamic(t, 1)
    compiled = torch.compile(rope, backend="npu_fuse")
    with nf.config.patch(fallback="aot_eager"):
        out = compiled(*args)
        longer = rope_args(seq=9)
        assert_close(compiled(*longer), rope(*longer))
    assert fused_ops(nf.get_reports()) == ["rotary_mul"]  # one graph for both lengths: a symbolic one
    assert tally() == {"equal": 1}
    assert_close(out, rope(*args))
    lengths = sorted({shape[1] for _, shapes, _ in seen for shape in shapes.values() if shape[0] == 2})
    assert len(lengths) >= 3 and 40 in lengths  # shrunk, at the hint, and a second value


def test_a_difference_on_shrunk_shapes_refuses(monkeypatch):
    monkeypatch.setattr(validate, "FULL_ELEMENTS", 2000)
    perturb(monkeypatch, RopeFusion)
    out, reports = compile_fused(rope, *rope_args(seq=64))  # 6144 + 2048 input elements
    assert fused_ops(reports) == []
    assert near_miss_reasons(reports)[0].startswith(DIFFERS) and near_miss_reasons(reports)[0].endswith(
        "shrunk)")


def test_an_internal_error_of_the_validator_refuses_the_rewrite_never_the_compile(monkeypatch):
    def broken(self):
        raise RuntimeError("validator bug")

    monkeypatch.setattr(validate._Validation, "run", broken)
    args = rope_args()
    out, reports = compile_fused(rope, *args, strict=True)
    assert fused_ops(reports) == []
    assert near_miss_reasons(reports) == ["replacement could not be validated: RuntimeError: validator bug"]
    assert_close(out, rope(*args))


def test_a_rewrite_identical_to_one_shown_equal_is_not_evaluated_again(monkeypatch):
    runs = []
    run = validate._Validation.run
    monkeypatch.setattr(validate._Validation, "run", lambda self: runs.append(1) or run(self))
    q, cos, sin = rope_args()
    k, k_gqa = torch.randn_like(q), torch.randn(2, 5, 1, 16)
    out, reports = compile_fused(lambda q, k, g: (rope(q, cos, sin), rope(k, cos, sin), rope(g, cos, sin)), q, k, k_gqa)
    assert fused_ops(reports) == ["rotary_mul"] * 3
    assert len(runs) == 2  # q and k are the same rewrite on inputs of one layout; the GQA k is not
    assert tally() == {"equal": 3, "equal_by_identical_rewrite": 1}


def test_the_signature_tells_structurally_different_rewrites_apart():
    """Equal only for the same ops, constants, wiring and input metadata: what skips an evaluation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    x, y, z = (graph.placeholder(name) for name in "xyz")
    calls = {name: graph.call_function(aten.mul.Tensor, args) for name, args in
             {"x*2": (x, 2.0), "y*2": (y, 2.0), "x*3": (x, 3.0), "x*y": (x, y), "x*x": (x, x), "z*2": (z, 2.0),
              "x*-0.": (x, -0.0), "x*0.": (x, 0.0), "x*1.": (x, 1.0), "x*1": (x, 1), "x*True": (x, True)}.items()}
    replacements = {name: graph.call_function(aten.add.Tensor, (node.args[0], node.args[0])) for name, node in
                    calls.items()}
    with FakeTensorMode() as mode:
        x.meta["val"], y.meta["val"] = mode.from_tensor(torch.empty(4, 8)), mode.from_tensor(torch.empty(4, 8))
        z.meta["val"] = mode.from_tensor(torch.empty(8, 4).t())  # x's shape, other strides
        for node in [*calls.values(), *replacements.values()]:
            node.meta["val"] = node.target(*torch.fx.map_arg(node.args, lambda n: n.meta["val"]))
    found = {name: validate._Validation([node], {node: replacements[name]}, [replacements[name]], 0).signature()
             for name, node in calls.items()}
    assert found["x*2"] == found["y*2"]  # one structure on inputs of one layout
    distinct = ["x*2", "x*3", "x*y", "x*x", "z*2", "x*-0.", "x*0.", "x*1.", "x*1", "x*True"]  # (1 == 1.0 == True)
    assert len({found[name] for name in distinct}) == len(distinct)


# -- tolerance: the scale of the values an element is computed with --------------------------------
def test_a_row_of_large_values_carries_their_rounding_but_a_wrong_element_is_found():
    """An updated cache: rows of small values, one written row of large ones where an element computed
    by cancellation carries its operands' bf16 rounding (w8a8 MLA's k_rope)."""
    cache = torch.rand(64, 576, dtype=torch.float32).sub_(0.5).to(torch.bfloat16)
    cache[7] = torch.randn(576).mul_(1e5).to(torch.bfloat16)
    rounded = cache.clone()
    rounded[7, 3] = cache[7, 3].float() + 512  # one bf16 ulp of the row's values
    assert validate._difference(cache, rounded) is None
    misplaced = cache.clone()
    misplaced[7], misplaced[8] = cache[8], cache[7]  # the row written at the wrong slot
    assert int(validate._difference(cache, misplaced).split()[2]) > 1000  # "differs at N of": most of 2 x 576
    sign = cache.clone()
    largest = int(cache[7].float().abs().argmax())
    sign[7, largest] = -cache[7, largest]  # a sign error in the large row
    assert "differs at 1 of" in validate._difference(cache, sign)


def test_a_large_output_is_compared_on_the_rows_that_differ_with_the_whole_outputs_counts_and_scale():
    """An updated cache past COMPARE_ELEMENTS: only its rows that are not bit for bit the same are
    compared, with what a comparison of the whole would find (element counts of the whole, NaN where
    both have it equal, a row of small values held to the whole output's rms outside magnitudes)."""
    rows, width = 2 * validate.COMPARE_ELEMENTS // 576, 576
    cache = torch.rand(rows, width).sub_(0.5).to(torch.bfloat16)
    cache[3, 5] = float("nan")  # the same NaN on both sides, in a row no side writes
    total = cache.numel()
    written = cache.clone()
    written[100] = cache[100].float() + torch.rand(width) * 2 ** -12  # a written row: rounding-sized changes
    assert validate._difference(cache, written) is None
    wrong = written.clone()
    wrong[rows - 1, 7] += 1
    assert validate._difference(cache, wrong).startswith(f"differs at 1 of {total} elements")
    lost = written.clone()
    lost[rows - 2, 0] = float("inf")
    assert validate._difference(cache, lost) == f"is finite at 1 of {total} elements where the replacement is not"
    unplanted = written.clone()
    unplanted[3, 5] = 0.0
    assert "NaN or infinite where the replacement is not" in validate._difference(cache, unplanted)
    tiny = cache.clone()
    tiny[9] = 2 ** -20  # a row of tiny values: its rounding is judged against the whole output's scale
    rounded = tiny.clone()
    rounded[9, 0] = 2 ** -20 * 1.5  # half of it off: tiny beside the whole output
    assert validate._difference(tiny, rounded) is None
    assert validate._difference(tiny, rounded, probe="magnitudes") is not None  # (each row its own scale there)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_sees_every_special_value(dtype):
    values = torch.rand(1000, dtype=torch.float32).to(dtype)
    assert validate._all_finite(values) and validate._all_finite(values[:0])
    for special in (float("nan"), float("inf"), -float("inf")):
        planted = values.clone()
        planted[417] = special
        assert not validate._all_finite(planted), special
    if dtype == torch.float32:
        assert validate._all_finite(torch.full((4,), 3e38))  # the sum overflows, every element is finite


# -- inputs the validator computes, or records ------------------------------------------------------
def test_an_rng_state_input_is_a_recorded_state_never_random_bytes():
    """Inductor's recomputation of checkpointed code replays dropout from a saved RNG state: a read
    computed from that state is computed from a valid generator state (the same on both sides)."""
    import operator

    from torch._subclasses.fake_tensor import FakeTensorMode

    replay = torch.ops.higher_order.run_with_rng_state
    graph = torch.fx.Graph()
    state, x = graph.placeholder("rng_state"), graph.placeholder("x")

    def dropped(g):
        drop = g.call_function(replay, (state, aten.native_dropout.default, x, 0.5, True))
        return g.call_function(operator.getitem, (drop, 0))

    y = dropped(graph)
    out = graph.call_function(aten.mul.Tensor, (y, 2.0))
    graph.output(out)
    new = graph.call_function(aten.add.Tensor, (dropped(graph), y))  # the replacement recomputes the dropout
    inserted = [n for n in graph.nodes if n.op == "call_function" and n not in (y, y.args[0], out)]
    with FakeTensorMode() as mode:
        state.meta["val"] = mode.from_tensor(torch.get_rng_state())
        x.meta["val"] = torch.empty(4, 8)
        for node in graph.nodes:
            if node.op == "call_function":
                args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)
    before = torch.get_rng_state()
    assert validate.check_rewrite([out], {out: new}, inserted) is None
    assert torch.equal(torch.get_rng_state(), before)  # the user's generator is untouched


def dynamic_aten_graph(fn, *args):
    """The forward aten graph AOTAutograd makes of fn with dynamic shapes."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=aot_autograd(fw_compiler=capture), dynamic=True)(*args)
    return graphs[0]


def test_zeros_of_symbolic_sizes_are_computed_not_drawn():
    """Inductor's backward adds into ``full([s0, ...], 0)`` buffers whose sizes are SymInt inputs;
    drawing them as data made correct RoPE backward rewrites differ "by up to 1" (issue 15)."""
    gm = dynamic_aten_graph(lambda x: x + torch.zeros(x.shape[0], x.shape[1]), torch.randn(6, 8))
    (add,) = [n for n in gm.graph.nodes if n.target == aten.add.Tensor]
    assert any(isinstance(a, torch.fx.Node) and a.op == "placeholder" for a in add.args[1].args[0])

    class ZeroAdd(fusion.FusionPass):
        name = family = "zero_add"
        anchor_targets = (aten.add.Tensor,)

        def match(self, ctx, anchor):
            return fusion.Rewrite(anchor, [], "clone",  # the zeros stay outside: read, as inductor shares them
                                  lambda b: b.call(aten.clone.default, anchor.args[0]))

    report = fusion.PassManager([ZeroAdd()])(gm)
    assert [m.op for m in report.matches] == ["clone"], report.summary()


def test_sampled_rows_keep_their_real_positions():
    """Positions made by an ``arange`` in the graph: a replacement computing them in bfloat16 is
    exact for the shrunk positions 0..4 and wrong past 256; the confirmation (on sampled rows, the
    last one included, where the real length is over the budget) sees the real positions."""
    rows = 32768

    def positions(x):
        return x * torch.arange(rows, dtype=torch.float32)[:, None]

    def bf16_positions(b, x, *_):
        pos = b.call(aten.arange.default, rows, dtype=torch.float32, device=torch.device("cpu"), pin_memory=False)
        pos = b.call(aten._to_copy.default, b.call(aten._to_copy.default, pos, dtype=torch.bfloat16),
                     dtype=torch.float32)
        return b.call(aten.mul.Tensor, x, b.call(aten.unsqueeze.default, pos, 1))

    args = (torch.randn(rows, 16),)  # over FULL_ELEMENTS: shrunk first
    report, _ = run_pass(positions, args, bf16_positions, aten.mul.Tensor)
    assert report.matches == [] and "real length" in report.near_misses[0].reason  # (with the 16 columns)
    validate.forget_shown_equal()
    old_budget = validate.MEMORY_BUDGET
    validate.MEMORY_BUDGET = 1 << 20
    try:
        report, _ = run_pass(positions, args, bf16_positions, aten.mul.Tensor)
    finally:
        validate.MEMORY_BUDGET = old_budget
    assert report.matches == [] and "sampled rows" in report.near_misses[0].reason


# -- the shapes of a shrunk problem ----------------------------------------------------------------
@pytest.mark.parametrize("op, shapes, extra", [
    (torch.ops.aten.mul.Tensor, [(3, 1, 5), (4, 1)], ()),  # broadcast both ways
    (torch.ops.aten.add.Tensor, [(2, 3, 5), ()], ()),  # a 0-dim tensor
    (torch.ops.aten.where.self, [(1, 5), (3, 5), (3, 1)], ()),
    (torch.ops.aten._softmax.default, [(3, 7)], (-1, False)),
    (torch.ops.aten._softmax_backward_data.default, [(3, 7), (3, 7)], (-1, torch.float32)),
])
def test_a_meta_run_gives_pointwise_ops_and_softmaxes_the_shape_their_meta_kernel_gives(op, shapes, extra):
    """A shrunk problem's shapes come from a run on meta tensors; these ops' shapes come from a rule
    (their meta kernels are Python and slow): the rule's shape is the kernel's, in the traced layout."""
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(len(shapes))]
    node = graph.call_function(op, (*inputs, *extra))
    args = [torch.empty(s, device="meta") if op is not torch.ops.aten.where.self or i else
            torch.empty(s, dtype=torch.bool, device="meta") for i, s in enumerate(shapes)]
    node.meta["val"] = op(*args, *extra)
    ruled = validate._meta_by_rule(node, (*args, *extra), {})
    assert ruled is not None and ruled.shape == node.meta["val"].shape and ruled.dtype == node.meta["val"].dtype
    assert ruled.stride() == node.meta["val"].stride()


def test_a_meta_run_by_rule_raises_where_the_shrunk_shapes_do_not_fit():
    """Shapes a shrink made inconsistent (a broadcast of 5 against 7) raise as the meta kernel would, so
    the shrink is not used; an op with no rule (a matmul) runs its kernel."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    mul, mm = graph.call_function(torch.ops.aten.mul.Tensor, (a, b)), graph.call_function(torch.ops.aten.mm.default, (a, b))
    mul.meta["val"] = torch.empty(3, 5, device="meta")
    mm.meta["val"] = torch.empty(3, 3, device="meta")
    with pytest.raises(RuntimeError, match="do not broadcast"):
        validate._meta_by_rule(mul, (torch.empty(3, 5, device="meta"), torch.empty(3, 7, device="meta")), {})
    sbd = graph.call_function(torch.ops.aten._softmax_backward_data.default, (a, b, -1, torch.float32))
    sbd.meta["val"] = torch.empty(3, 5, device="meta")
    with pytest.raises(RuntimeError, match="differ"):
        validate._meta_by_rule(sbd, (torch.empty(3, 5, device="meta"), torch.empty(3, 7, device="meta"), -1,
                                     torch.float32), {})
    assert validate._meta_by_rule(mm, (torch.empty(3, 4, device="meta"), torch.empty(4, 3, device="meta")), {}) is None
    cat = graph.call_function(torch.ops.aten.cat.default, ([a, b], -1))
    cat.meta["val"] = torch.empty(3, 12, device="meta")
    with pytest.raises(RuntimeError, match="must match except in dimension 1"):
        validate._meta_by_rule(cat, ([torch.empty(3, 5, device="meta"), torch.empty(4, 7, device="meta")], -1), {})
    with pytest.raises(IndexError, match="out of range"):
        validate._meta_by_rule(cat, ([torch.empty(3, 5, device="meta"), torch.empty(3, 7, device="meta")], 2), {})


@pytest.mark.parametrize("op, shapes, args, kwargs", [
    (torch.ops.aten.cat.default, [(3, 5), (3, 7)], (-1,), {}),
    (torch.ops.aten.cat.default, [(2, 5), (4, 5), (1, 5)], (), {}),
    (torch.ops.aten.cat.default, [(2, 5), (0,)], (), {}),  # (a legacy empty input: left to the kernel)
    (torch.ops.aten.mean.dim, [(3, 5, 7)], ([-1], True), {}),
    (torch.ops.aten.mean.dim, [(3, 5, 7)], ([0, 2],), {}),
    (torch.ops.aten.sum.dim_IntList, [(3, 5, 7)], ([],), {"keepdim": True}),  # [] is every dim
    (torch.ops.aten.sum.dim_IntList, [(3, 5, 7)], (None,), {}),
    (torch.ops.aten.amax.default, [(3, 5)], ([1],), {}),
])
def test_a_meta_run_gives_cats_and_reductions_the_shape_their_meta_kernel_gives(op, shapes, args, kwargs):
    graph = torch.fx.Graph()
    tensors = [torch.empty(s, device="meta") for s in shapes]
    node = graph.call_function(op, ([graph.placeholder(f"x{i}") for i in range(len(shapes))], *args)
                               if op is torch.ops.aten.cat.default else (graph.placeholder("x"), *args), kwargs)
    call = ((tensors, *args) if op is torch.ops.aten.cat.default else (tensors[0], *args))
    node.meta["val"] = op(*call, **kwargs)
    ruled = validate._meta_by_rule(node, call, kwargs)
    if shapes[-1] == (0,):
        assert ruled is None
    else:
        assert ruled is not None and ruled.shape == node.meta["val"].shape and ruled.dtype == node.meta["val"].dtype
        assert ruled.stride() == node.meta["val"].stride()


def test_a_meta_run_by_rule_keeps_the_traced_dim_order_of_a_permuted_result():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.neg.default, (x,))
    transposed = torch.empty(3, 5, device="meta").t()  # [5, 3], strides (1, 5): neg keeps that order
    node.meta["val"] = torch.ops.aten.neg.default(transposed)
    ruled = validate._meta_by_rule(node, (transposed,), {})
    assert ruled.shape == (5, 3) and ruled.stride() == node.meta["val"].stride() == (1, 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op, shapes", [(torch.mm, [(4, 23), (23, 100)]), (torch.bmm, [(7, 4, 13), (7, 13, 17)])])
def test_small_16_bit_matmuls_run_in_float32_rounded_once_as_onednn_computes_them(op, shapes, dtype):
    """The validator's (and the MLA kernel's) 16-bit matmuls: small operands multiplied in float32 and
    rounded once (oneDNN's 16-bit kernels accumulate in float32 too, but build a kernel per new shape);
    large ones, other dtypes and what eager refuses go to the op itself."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=g).to(dtype) for s in shapes)
    got, eager = half_matmul(op, a, b), op(a, b)
    assert torch.equal(got, op(a.float(), b.float()).to(dtype))
    assert (got.shape, got.dtype, got.stride()) == (eager.shape, eager.dtype, eager.stride())
    exact = op(a.double(), b.double())
    eps = torch.finfo(dtype).eps
    assert ((got.double() - exact).abs() <= eps * exact.abs() + 1e-6).all()  # (one rounding of the exact sum)
    large = torch.randn(*shapes[0][:-1], 1 << 16, generator=g).to(dtype), \
        torch.randn(*shapes[1][:-2], 1 << 16, shapes[1][-1], generator=g).to(dtype)
    assert torch.equal(half_matmul(op, *large), op(*large))
    with pytest.raises(RuntimeError) as expected:
        op(a, b.float())
    with pytest.raises(RuntimeError) as raised:
        half_matmul(op, a, b.float())
    assert str(raised.value) == str(expected.value)
