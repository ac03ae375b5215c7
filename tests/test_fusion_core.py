"""The fusion core: canonicalization, pass order, and the per-op checks of every rewrite."""

import gc
import weakref

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import rope, rope_args
from npu_fuse_backend import fusion
from npu_fuse_backend.canonicalize import canonicalize
from npu_fuse_backend.lowering import registry

aten = torch.ops.aten


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# -- canonicalization ---------------------------------------------------------------------
def test_noop_slices_views_and_casts_are_removed_but_real_ones_stay():
    def fn(x):
        a = x[:, :, :]                          # no-op slice
        b = a.view(x.shape).to(torch.float32)   # no-op view, no-op cast (x is fp32)
        c = b[..., :4]                          # a real slice
        return (c.reshape(2, 3, 4) * 2).to(torch.float16)  # no-op reshape, real cast

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(2, 3, 8))
    x = torch.randn(2, 3, 8)
    expected = fn(x)
    removed = canonicalize(gm.graph)
    gm.recompile()
    assert removed >= 2
    remaining = targets(gm)
    assert remaining.count(aten.slice.Tensor) == 1  # the real slice
    assert aten._to_copy.default in remaining        # the real cast
    torch.testing.assert_close(gm(x), expected)


def test_duplicate_views_of_one_tensor_become_one_node():
    def fn(x):
        return x[..., :4] * 2 + x[..., :4].exp()

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 8))
    assert targets(gm).count(aten.slice.Tensor) == 2
    canonicalize(gm.graph)
    gm.recompile()
    assert targets(gm).count(aten.slice.Tensor) == 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm(x), fn(x))


def test_a_graph_output_is_never_canonicalized_away():
    def fn(x):
        return x[:, :], x.view(x.shape) * 2

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 8))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    kept = output.args[0][0]
    canonicalize(gm.graph)
    assert kept.graph is gm.graph and output.args[0][0] is kept


def test_a_duplicate_view_that_is_a_graph_output_stays_for_the_output_alone():
    """A training forward saves both copies of a view written twice (ChatGLM's cache[..., 0], once per term):
    the output keeps its own node, every other user reads the first copy."""
    def fn(x):
        first, second = x[..., 0], x[..., 0]
        return first * 2 + second.exp(), first, second

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 8, 2))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first, second = output.args[0][1:]
    assert canonicalize(gm.graph) == 1
    gm.recompile()
    assert output.args[0][1:] == (first, second) and list(second.users) == [output]
    assert targets(gm).count(aten.select.int) == 2
    x = torch.randn(3, 8, 2)
    for got, expected in zip(gm(x), fn(x)):
        torch.testing.assert_close(got, expected)


def test_scalar_overloads_become_the_tensor_overloads_every_matcher_reads():
    def fn(x):
        return aten.div.Scalar(aten.mul.Scalar(x, 0.125), 3)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 8))
    assert canonicalize(gm.graph) == 2
    gm.recompile()
    assert targets(gm) == [aten.mul.Tensor, aten.div.Tensor]
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm(x), fn(x), rtol=0, atol=0)


def test_clone_that_changes_strides_stays():
    def fn(x):
        return x.transpose(0, 1).clone(memory_format=torch.contiguous_format).view(-1) + 1

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 8))
    canonicalize(gm.graph)
    gm.recompile()
    assert aten.clone.default in targets(gm)
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm(x), fn(x))


# -- pass order ---------------------------------------------------------------------------------
def _pass(name, before=()):
    return type(name, (fusion.FusionPass,), {"name": name, "runs_before": before})


def test_the_built_in_passes_run_in_the_order_of_the_one_list():
    names = [cls.name for cls in fusion.ordered(fusion.registered_fusions())]
    assert names == list(fusion.PASS_ORDER)
    # each claims subgraphs that contain what the later ones match
    assert names.index("mla_preprocess") < names.index("partial_rope") < names.index("interleave_rope") \
        < names.index("rope")


def test_a_registered_pass_runs_after_the_built_in_ones_in_registration_order():
    fusions = {**fusion.registered_fusions(), "z_user": _pass("z_user"), "a_user": _pass("a_user")}
    names = [cls.name for cls in fusion.ordered(fusions)]
    assert names == [*fusion.PASS_ORDER, "z_user", "a_user"]


def test_a_registered_pass_runs_just_before_the_first_pass_its_runs_before_names():
    fusions = {**fusion.registered_fusions(), "mine": _pass("mine", ("softmax_grad", "rope"))}
    names = [cls.name for cls in fusion.ordered(fusions)]
    assert names.index("mine") == names.index("rope") - 1 and len(names) == len(fusion.PASS_ORDER) + 1
    order = fusion.ordered({"b": _pass("b"), "a": _pass("a", ("c",)), "c": _pass("c", "b")})
    assert [cls.name for cls in order] == ["a", "c", "b"]


def test_cyclic_order_is_an_error_naming_the_passes():
    with pytest.raises(ValueError, match="cyclic runs_before"):
        fusion.ordered({"a": _pass("a", ("b",)), "b": _pass("b", ("a",))})


def test_runs_before_an_unknown_pass_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"runs before \['ropee'\]"):
        fusion.ordered({"a": _pass("a", "ropee")})


def test_a_built_in_pass_missing_from_the_order_list_is_an_error(monkeypatch):
    unlisted = type("Unlisted", (fusion.FusionPass,), {"name": "unlisted", "__module__": "npu_fuse_backend.passes.x"})
    with pytest.raises(ValueError, match=r"\['unlisted'\] missing from fusion.PASS_ORDER"):
        fusion.ordered({**fusion.registered_fusions(), "unlisted": unlisted})


def test_the_old_name_of_interleave_rope_disables_it_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="'rope_interleave' is deprecated; use 'interleave_rope'"):
        assert fusion.canonical_fusion_names(["rope", "rope_interleave"]) == ["rope", "interleave_rope"]


# -- the config a manager runs with ------------------------------------------------------------
def test_the_manager_runs_with_the_settings_it_receives_not_the_config_now():
    gm = make_fx(rope, tracing_mode="fake")(*rope_args())
    disabled = fusion.FusionSettings(disabled_fusions=frozenset({"rope"}))
    with nf.config.patch(disabled_fusions=[]):
        assert nf.run_fusion_passes(gm, settings=disabled).matches == []
    with nf.config.patch(disabled_fusions=["rope"]):
        manager = fusion.PassManager(settings=fusion.FusionSettings())
        assert fused_ops([manager(gm)]) == ["rotary_mul"]


def test_a_match_names_the_nodes_of_its_replacement():
    gm = make_fx(rope, tracing_mode="fake")(*rope_args())
    (match,) = nf.run_fusion_passes(gm).matches
    nodes = {n.name: n for n in gm.graph.nodes}
    assert set(match.nodes_inserted) <= set(nodes) and not set(match.nodes_replaced) & set(nodes)
    assert [nodes[n].target for n in match.nodes_inserted if nodes[n].target == torch.ops.npu_fuse.rotary_mul.default]


def scaled_softmax_backward(g, p):
    return aten._softmax_backward_data(g, p, -1, torch.float32) * 0.25


@pytest.mark.parametrize("fn, args, op", [
    (rope, rope_args(), "rotary_mul"),
    (scaled_softmax_backward, (torch.randn(4, 16), torch.randn(4, 16).softmax(-1)), "softmax_grad_ext"),
], ids=["rope", "softmax_grad"])
def test_a_graph_the_passes_ran_on_is_freed_with_its_module(fn, args, op):
    """What a pass keeps for the passes after it (the RoPE recognizer's analysis, softmax_grad's
    covered sites) goes with the run."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert fused_ops([nf.run_fusion_passes(gm)]) == [op]
    graph = weakref.ref(gm.graph)
    del gm
    gc.collect()
    assert graph() is None


def test_settings_from_config_are_a_checked_snapshot():
    with nf.config.patch(soc="Ascend950", disabled_fusions=["rope_interleave"], strict=True,
                         translation_validation=False), pytest.warns(DeprecationWarning):
        settings = fusion.FusionSettings.from_config()
    assert settings == fusion.FusionSettings(soc="Ascend950", disabled_fusions=frozenset({"interleave_rope"}),
                                             strict=True, translation_validation=False)
    with nf.config.patch(soc="Ascend9000"), pytest.raises(ValueError, match=r"config.soc='Ascend9000' \(env "
                                                                            r"NPU_FUSE_SOC\): expected one of"):
        fusion.FusionSettings.from_config()


# -- the checks every rewrite goes through ------------------------------------------------------
def test_a_soc_limit_of_the_fused_op_turns_the_rewrite_into_a_near_miss(monkeypatch):
    seen = []

    def limit(soc, x, r1, r2, rotary_mode="half"):
        seen.append((soc, tuple(x.shape), rotary_mode))
        return "head dim 16 is below this test's limit"

    monkeypatch.setitem(registry.SOC_LIMITS, torch.ops.npu_fuse.rotary_mul.default, limit)
    args = rope_args()
    out, reports = compile_fused(rope, *args, soc="Ascend910B")
    assert fused_ops(reports) == []
    assert near_miss_reasons(reports) == ["rotary_mul on Ascend910B: head dim 16 is below this test's limit"]
    assert seen == [("Ascend910B", (2, 3, 4, 16), "half")]  # called with the fake arguments of the call
    assert_close(out, rope(*args))


def test_an_op_the_lowering_cannot_take_is_a_near_miss_and_the_graph_is_untouched():
    gm = make_fx(rope, tracing_mode="fake")(*rope_args())
    canonicalize(gm.graph)
    before = str(gm.graph)
    report = nf.run_fusion_passes(gm, "torchair", unsupported_ops={"rotary_mul": "the installed CANN lacks RotaryMul"})
    assert report.matches == [] and [n.reason for n in report.near_misses] == ["the installed CANN lacks RotaryMul"]
    assert str(gm.graph) == before


def test_negative_slice_bounds_are_read_as_python_reads_them():
    def fn(q, cos, sin):  # cat(-x[..., -D/2:], x[..., :-D/2])
        return q * cos + torch.cat((-q[..., -8:], q[..., :-8]), -1) * sin

    args = rope_args()
    out, reports = compile_fused(fn, *args)
    assert fused_ops(reports) == ["rotary_mul"]
    assert_close(out, fn(*args))


def test_a_refused_rewrite_whose_outputs_share_one_replacement_restores_every_user():
    """Two outputs taken over by one node: undoing it gives each output back its own users."""
    def fn(x):
        a, b = x * 2, x * 3
        return a + 1, b - 1, a * b

    class Shared(fusion.FusionPass):
        name = "shared_outputs"
        op = "test"
        anchor_targets = (aten.mul.Tensor,)

        def match(self, ctx, anchor):
            if anchor.args[1] != 3:
                return None
            a = anchor.prev
            def build(b):
                six = b.call(aten.mul.Tensor, a.args[0], 6)
                return {a: six, anchor: six}

            return fusion.Rewrite(anchor, [a], self.op, build)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4))
    before = str(gm.graph)
    with nf.config.patch(translation_validation=True):  # 6x is neither 2x nor 3x: refused
        report = fusion.PassManager([Shared()])(gm)
    assert report.matches == [] and "differs" in report.near_misses[0].reason
    assert str(gm.graph) == before
    x = torch.randn(4)
    for got, expected in zip(gm(x), fn(x)):
        torch.testing.assert_close(got, expected)


# -- fake values of the calls a rewrite emits -------------------------------------------------------
def _fake_mode_and(*tensors):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode, [mode.from_tensor(t) for t in tensors]


def _meta(value):
    values = value if isinstance(value, tuple) else (value,)
    return [(type(v), tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad)
            for v in values]


@pytest.mark.parametrize("op, args", [
    (torch.ops.npu_fuse.rotary_mul.default, lambda x, w, t: (x, t, t, "half")),
    (torch.ops.npu_fuse.add_rms_norm.default, lambda x, w, t: (x, x, w, 1e-6)),
    (torch.ops.npu_fuse.rms_norm.default, lambda x, w, t: (x.transpose(1, 2), w, 1e-5)),
    (torch.ops.npu_fuse.rotary_mul_backward.default, lambda x, w, t: (x, None, t, t, "half", False)),
])
def test_a_fused_op_fake_value_without_the_dispatch_is_the_dispatchers(op, args):
    """The builder calls a fused op's fake kernel directly: the same value as through the dispatcher."""
    mode, (x, w, t) = _fake_mode_and(torch.randn(2, 4, 8, 16), torch.randn(16), torch.randn(2, 1, 8, 16))
    call = args(x, w, t)
    assert fusion._direct_fake_kernel(mode, op, call, {}) is not None  # (the fast path is taken)
    with mode:
        expected = op(*call)
    value = fusion.fake_value(mode, op, call, {})
    assert _meta(value) == _meta(expected)
    assert all(v.fake_mode is mode for v in (value if isinstance(value, tuple) else (value,)))


def test_a_fused_op_fake_value_without_the_dispatch_still_runs_the_ops_argument_checks():
    mode, (x, t) = _fake_mode_and(torch.randn(2, 4, 8, 15), torch.randn(2, 1, 8, 15))
    op = torch.ops.npu_fuse.rotary_mul.default
    assert fusion._direct_fake_kernel(mode, op, (x, t, t, "half"), {}) is not None
    with pytest.raises(ValueError) as direct:
        fusion.fake_value(mode, op, (x, t, t, "half"), {})
    with pytest.raises(ValueError) as dispatched, mode:
        op(x, t, t, "half")
    assert str(direct.value) == str(dispatched.value) and "even" in str(direct.value)


def _static_fake_mode_and(*tensors):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    return mode, [mode.from_tensor(t) for t in tensors]


def test_a_fused_op_call_of_known_metadata_gets_fresh_values_of_the_kernels_metadata(monkeypatch):
    """The outcomes of one run: a second call with the same argument metadata (the next layer's
    rewrite) does not run the kernel, and gets new tensors (no alias of the first call's outputs)."""
    mode, (x, w, y) = _static_fake_mode_and(torch.randn(2, 4, 16), torch.randn(16), torch.randn(2, 4, 16))
    op, outcomes = torch.ops.npu_fuse.add_rms_norm.default, {}
    first = fusion.fake_value(mode, op, (x, y, w, 1e-6), {}, outcomes)
    assert len(outcomes) == 1
    with mode:
        expected = op(x, y, w, 1e-6)
    calls, direct = [], fusion._direct_fake_kernel
    monkeypatch.setattr(fusion, "_direct_fake_kernel", lambda *a: calls.append(a) or direct(*a))
    again = fusion.fake_value(mode, op, (y, x, w, 1e-6), {}, outcomes)
    other_eps = fusion.fake_value(mode, op, (x, y, w, 1e-5), {}, outcomes)
    assert len(calls) == 1 and len(outcomes) == 2  # (another epsilon is another call)
    assert type(again) is tuple and _meta(again) == _meta(first) == _meta(expected) == _meta(other_eps)
    storages = {t.untyped_storage()._cdata for t in (*first, *again, x, y, w)}
    assert len(storages) == 9 and all(t.fake_mode is mode for t in again)


def test_a_refused_fused_op_call_is_refused_again_with_the_same_reason():
    mode, (x, t) = _static_fake_mode_and(torch.randn(2, 4, 8, 15), torch.randn(2, 1, 8, 15))
    op, outcomes = torch.ops.npu_fuse.rotary_mul.default, {}
    reasons = []
    for _ in range(2):
        with pytest.raises(ValueError) as refused:
            fusion.fake_value(mode, op, (x, t, t, "half"), {}, outcomes)
        reasons.append(str(refused.value))
    assert len(outcomes) == 1 and reasons[0] == reasons[1] and "even" in reasons[0]


def test_a_fused_op_call_of_symbolic_sizes_always_runs_the_kernel():
    mode, (x, w) = _fake_mode_and(torch.randn(4, 16), torch.randn(16))
    outcomes = {}
    y, rstd = fusion.fake_value(mode, torch.ops.npu_fuse.rms_norm.default, (x, w, 1e-6), {}, outcomes)
    assert outcomes == {} and isinstance(y.shape[0], torch.SymInt) and rstd.shape[0] == y.shape[0]


@pytest.mark.parametrize("call", [
    (torch.ops.npu_fuse.rms_norm.default, lambda x, w: ((x, w, 1), {})),  # an int for a float: converted
    (torch.ops.npu_fuse.rms_norm.default, lambda x, w: ((x, w, True), {})),  # a bool for a float: converted
    (torch.ops.npu_fuse.rms_norm.default, lambda x, w: ((x, w), {"eps": 1e-6})),  # no such argument
    (torch.ops.npu_fuse.rms_norm.default, lambda x, w: ((x, w.requires_grad_()), {})),  # autograd records it
    (torch.ops.npu_fuse.rms_norm.default, lambda x, w: ((x, torch.ones(16)), {})),  # not of the fake mode
    (torch.ops.npu_fuse.inplace_partial_rotary_mul.default, lambda x, w: ((x, w, w), {})),  # mutates x
    (aten.mul.Tensor, lambda x, w: ((x, w), {})),  # not a fused op
])
def test_a_call_the_dispatcher_would_convert_or_refuse_goes_through_the_dispatcher(call):
    mode, (x, w) = _fake_mode_and(torch.randn(2, 16), torch.randn(16))
    op, arguments = call
    args, kwargs = arguments(x, w)
    assert fusion._direct_fake_kernel(mode, op, args, kwargs) is None
    try:
        with mode:
            expected = _meta(op(*args, **kwargs))
    except Exception as exc:  # the dispatcher's own refusal, the same way
        with pytest.raises(type(exc)):
            fusion.fake_value(mode, op, args, kwargs)
    else:
        assert _meta(fusion.fake_value(mode, op, args, kwargs)) == expected
