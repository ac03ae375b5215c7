"""softmax_grad_ext through layout-only ops: Falcon's in-place ``scores /= sqrt(d)`` and the
views, clones, copies and expanded scalars real backward graphs put between the softmax
gradient and its scale; and the look-alikes whose ops reorder values."""

import math

import pytest
import torch
import torch.nn.functional as F

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons


def falcon_attention(q, k, v, mask):
    """transformers' FalconAttention (eager, rotary): 3-D bmm scores scaled in place."""
    b, n, s, d = q.shape
    scores = q.reshape(b * n, s, d) @ k.reshape(b * n, s, d).transpose(-1, -2)
    scores /= math.sqrt(d)
    probs = F.softmax(scores.view(b, n, s, s) + mask, dim=-1, dtype=q.dtype)
    return probs @ v


def scale_after_reshape_and_clone(q, k, v, mask):
    scores = q @ k.transpose(-1, -2)
    flat = scores.reshape(-1, scores.shape[-1]).clone() * 0.125
    return (flat.view(scores.shape) + mask).softmax(-1) @ v


def scale_through_expanded_scalar(q, k, v, mask):
    scores = q @ k.transpose(-1, -2)
    scale = torch.full((), 0.125, dtype=q.dtype).expand(scores.shape)
    return (scores * scale + mask).softmax(-1) @ v


FORMS = {"falcon /= sqrt(d)": falcon_attention, "reshape + clone": scale_after_reshape_and_clone,
         "expanded scalar": scale_through_expanded_scalar}


def qkv(dtype=torch.float32):
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.zeros(8, 8, dtype=dtype).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    return q, k, v, mask


def train(fn, *args):
    out, _ = compile_fused(fn, *args)
    out.backward(torch.ones_like(out))
    grads = [a.grad.clone() for a in args if a.requires_grad]
    for a in args:
        a.grad = None
    return out, grads, nf.get_reports()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_found_through_layout_ops_with_eager_numerics(form, dtype):
    fn = FORMS[form]
    args = qkv(dtype)
    out, grads, reports = train(fn, *args)
    assert fused_ops(reports).count("softmax_grad_ext") == 1, [r.summary() for r in reports]
    expected = fn(*args)
    expected.backward(torch.ones_like(expected))
    assert_close(out, expected, dtype)
    for got, arg in zip(grads, args):
        assert_close(got, arg.grad, dtype)


def test_the_copy_writing_y_back_into_the_view_is_replaced_too():
    args = qkv()
    _, _, reports = train(falcon_attention, *args)
    (match,) = [m for r in reports for m in r.matches if m.op == "softmax_grad_ext"]
    assert "through layout ops" in match.detail
    assert any(name.startswith("copy") for name in match.nodes_replaced)


def reorders_values(q, k, v, mask):
    """A transpose between the scale and the softmax reorders the values: not layout-only, but linear,
    so a scalar scale moves in front of it (the fused op's result is transposed as the chain's was)."""
    scores = (q @ k.transpose(-1, -2)).transpose(-1, -2) * 0.125
    return (scores.transpose(-1, -2) + mask).softmax(-1) @ v


def test_a_scalar_scale_moves_across_a_transpose():
    args = qkv()
    out, grads, reports = train(reorders_values, *args)
    (match,) = [m for r in reports for m in r.matches if m.op == "softmax_grad_ext"]
    assert "scale moved in front of transpose" in match.detail
    expected = reorders_values(*args)
    expected.backward(torch.ones_like(expected))
    assert_close(out, expected)
    for got, arg in zip(grads, args):
        assert_close(got, arg.grad)


def full_tensor_scale_across_a_view(q, k, v, mask):
    scores = q @ k.transpose(-1, -2)
    scale = torch.linspace(0.5, 1.5, scores.numel(), dtype=q.dtype).view(-1, scores.shape[-1])
    return ((scores.reshape(-1, scores.shape[-1]) * scale).view(scores.shape) + mask).softmax(-1) @ v


@pytest.mark.parametrize("fn, reason", [(full_tensor_scale_across_a_view, "x2 must be a scalar, shape (1,) or grad's shape")])
def test_look_alikes_do_not_fuse(fn, reason):
    args = qkv()
    out, grads, reports = train(fn, *args)
    assert "softmax_grad_ext" not in fused_ops(reports)
    expected = fn(*args)
    expected.backward(torch.ones_like(expected))
    assert_close(out, expected)
    for got, arg in zip(grads, args):
        assert_close(got, arg.grad)
    if reason:
        assert any(reason in r for r in near_miss_reasons(reports)), near_miss_reasons(reports)


def test_scale_expanded_from_one_element_is_passed_as_that_element():
    from torch.fx.experimental.proxy_tensor import make_fx

    def backward_like(g, p):
        sbd = torch.ops.aten._softmax_backward_data(g, p, -1, torch.float32)
        flat = sbd.view(-1, 8).clone()
        return flat * torch.full((), 0.125).expand(flat.shape)

    g, p = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8).softmax(-1)
    gm = make_fx(backward_like, tracing_mode="fake")(g, p)
    expected = backward_like(g, p)
    report = nf.run_fusion_passes(gm)
    assert [m.op for m in report.matches] == ["softmax_grad_ext"]
    (call,) = [n for n in gm.graph.nodes if n.target == torch.ops.npu_fuse.softmax_grad_ext.default]
    assert call.args[2].meta["val"].numel() == 1
    assert_close(gm(g, p), expected)
