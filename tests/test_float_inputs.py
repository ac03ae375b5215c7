"""Python floats that ``dynamic=True`` passes as graph inputs are specialized again, guarded
(float_inputs.py), so the fusions that need a constant epsilon fuse under dynamic=True too."""

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close, fused_ops, near_miss_reasons
from models import LlamaRMSNorm
from npu_fuse_backend import float_inputs

D = 16


def compiled_calls(fn, calls, between=None, **patches):
    """fn compiled with dynamic=True and called on each argument tuple (``between(i)`` before call i):
    (compiled outputs, eager outputs, reports)."""
    nf.clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="npu_fuse", dynamic=True)
    got, expected = [], []
    with nf.config.patch(fallback="aot_eager", **patches), torch.no_grad():
        for i, args in enumerate(calls):
            if between:
                between(i)
            got.append(compiled(*args))
            expected.append(fn(*args))
    return got, expected, nf.get_reports()


def test_an_epsilon_attribute_is_specialized_and_one_graph_serves_every_shape():
    norm = LlamaRMSNorm(D)
    got, expected, reports = compiled_calls(norm, [(torch.randn(2, s, D),) for s in (5, 7, 9)])
    assert fused_ops(reports) == ["rms_norm"] and len(reports) == 1  # one symbolic graph, fused
    for g, e in zip(got, expected):
        assert_close(g, e)


def test_a_new_value_recompiles_and_a_float_that_varies_stays_an_input():
    norm, x = LlamaRMSNorm(D), torch.randn(2, 5, D) * 0.01  # (small: each eps gives another result)
    epsilons = (1e-6, 1e-3, 0.5, 1e-6)
    got, expected, reports = compiled_calls(norm, [(x,)] * 4,
                                            between=lambda i: setattr(norm, "variance_epsilon", epsilons[i]))
    assert len(reports) == 2  # 1e-3 fails the first graph's guard; the recompile keeps eps an input (no guard)
    assert fused_ops(reports) == ["rms_norm"]
    assert any("is a runtime value" in r and "changed between compiles" in r for r in near_miss_reasons(reports))
    assert not torch.allclose(expected[0], expected[2])
    for g, e in zip(got, expected):
        assert_close(g, e)


def test_a_float_argument_is_specialized_as_an_attribute_is():
    weight = 1 + 0.1 * torch.randn(D)

    def norm(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    got, expected, reports = compiled_calls(norm, [(torch.randn(3, D), 1e-5), (torch.randn(4, D), 1e-5)])
    assert fused_ops(reports) == ["rms_norm"] and len(reports) == 1
    for g, e in zip(got, expected):
        assert_close(g, e)


@pytest.mark.parametrize("eps, patches", [(0.0, {}), (1e-6, {"specialize_floats": False})],
                         ids=["zero, whose sign a guard does not see", "off"])
def test_a_float_left_an_input_is_a_near_miss_naming_why(eps, patches):
    norm = LlamaRMSNorm(D, eps=eps)
    got, expected, reports = compiled_calls(norm, [(torch.randn(2, 5, D),)], **patches)
    assert fused_ops(reports) == []
    assert any("is a runtime value" in r and "specialize_floats is off" in r and "or it is 0" in r
               for r in near_miss_reasons(reports))
    assert_close(got[0], expected[0])


def test_a_training_step_with_dynamic_true_fuses_the_norm_and_keeps_eager_gradients():
    norm = LlamaRMSNorm(D)
    x = torch.randn(2, 5, D, requires_grad=True)
    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"):
        out = torch.compile(norm, backend="npu_fuse", dynamic=True)(x)
        out.square().sum().backward()
    got = (out.detach(), x.grad.clone(), norm.weight.grad.clone())
    x.grad = norm.weight.grad = None
    eager = norm(x)
    eager.square().sum().backward()
    assert "rms_norm" in fused_ops(nf.get_reports())
    for g, e in zip(got, (eager.detach(), x.grad, norm.weight.grad)):
        assert_close(g, e)


def test_other_frames_floats_are_not_specialized_by_our_request():
    """A request is withdrawn when its frame's compile ends: the next frame's float (the same symbol
    name, zf0, in its own shape environment) stays an input unless requested for it."""
    from torch._dynamo.symbolic_convert import TensorifyState

    norm = LlamaRMSNorm(D)
    compiled_calls(norm, [(torch.randn(2, 5, D),)])
    assert not (TensorifyState.force_specializations & {"zf0"})


def test_an_internal_error_leaves_the_floats_inputs_with_a_warning_or_raises_under_strict(monkeypatch):
    def broken(gm):  # (the step that specializes)
        raise KeyError("grapharg")

    monkeypatch.setattr(float_inputs, "_specialize", broken)
    norm, x = LlamaRMSNorm(D), torch.randn(2, 5, D)
    with pytest.warns(RuntimeWarning, match="specializing the graph's float inputs failed and left them inputs"):
        got, expected, reports = compiled_calls(norm, [(x,)])
    assert fused_ops(reports) == [] and len(reports) == 1
    assert_close(got[0], expected[0])
    with pytest.raises(Exception, match="specializing the graph's float inputs failed"):
        compiled_calls(norm, [(x,)], strict=True)
