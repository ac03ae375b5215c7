"""The npu_fuse::rms_norm, add_rms_norm and rms_norm_backward ops, directly: CANN's formula, the
contract's errors, opcheck, autograd against eager."""

import pytest
import torch
from torch.library import opcheck

import npu_fuse  # noqa: F401  (defines the npu_fuse:: ops)
from conftest import assert_close
from npu_fuse.ops import add_rms_norm, rms_norm, rms_norm_backward

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cann_rms_norm(x, gamma, epsilon):
    """ops-nn norm/rms_norm/tests/assets/golden.py: float32 statistics over gamma's dims,
    y = (x * rstd) * gamma in float32, rounded once."""
    xf = x.float()
    dims = list(range(x.dim() - gamma.dim(), x.dim()))
    rstd = 1 / torch.sqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma_shape", [(16,), (4, 16)])
def test_rms_norm_is_canns_formula(dtype, gamma_shape):
    x, gamma = torch.randn(2, 3, 4, 16, dtype=dtype), torch.randn(gamma_shape, dtype=dtype)
    y, rstd = rms_norm(x, gamma, 1e-5)
    want_y, want_rstd = cann_rms_norm(x, gamma, 1e-5)
    assert y.dtype == dtype and rstd.dtype == torch.float32
    assert rstd.shape == ((2, 3, 4, 1) if len(gamma_shape) == 1 else (2, 3, 1, 1))
    assert_close(y, want_y, dtype)
    torch.testing.assert_close(rstd, want_rstd)


def test_a_float32_gamma_with_a_half_x_keeps_xs_dtype():
    x, gamma = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16)
    y, _ = rms_norm(x, gamma)
    assert y.dtype == torch.bfloat16
    assert_close(y, cann_rms_norm(x, gamma, 1e-6)[0], torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_normalizes_the_sum_and_returns_it(dtype):
    x1, x2, gamma = torch.randn(2, 5, 16, dtype=dtype), torch.randn(2, 5, 16, dtype=dtype), torch.randn(16, dtype=dtype)
    y, rstd, x = add_rms_norm(x1, x2, gamma, 1e-6)
    total = x1.float() + x2.float()  # ops-nn add_rms_norm golden (950): the sum in float32
    want_y, want_rstd = cann_rms_norm(total, gamma.float(), 1e-6)
    assert_close(x, total.to(dtype), dtype)
    assert_close(y, want_y.to(dtype), dtype)
    torch.testing.assert_close(rstd, want_rstd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x, gamma = torch.randn(2, 3, 16, dtype=dtype, requires_grad=True), torch.randn(16, dtype=dtype, requires_grad=True)
    opcheck(torch.ops.npu_fuse.rms_norm.default, (x, gamma, 1e-6))
    x2 = torch.randn(2, 3, 16, dtype=dtype, requires_grad=True)
    opcheck(torch.ops.npu_fuse.add_rms_norm.default, (x, x2, gamma, 1e-6))
    with torch.no_grad():
        _, rstd = rms_norm(x, gamma)
    opcheck(torch.ops.npu_fuse.rms_norm_backward.default, (torch.randn_like(x), x.detach(), gamma.detach(), rstd))


def eager_rms_norm(x, gamma, epsilon=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()).to(x.dtype)


def test_autograd_of_both_ops_is_eagers():
    x = torch.randn(3, 4, 16, dtype=torch.float64).float().requires_grad_()
    x2 = torch.randn(3, 4, 16).requires_grad_()
    gamma = torch.randn(16).requires_grad_()
    dy = torch.randn(3, 4, 16)
    torch.autograd.backward(eager_rms_norm(x + x2, gamma), dy)
    expected = [t.grad.clone() for t in (x, x2, gamma)]
    for t in (x, x2, gamma):
        t.grad = None
    y, rstd, total = add_rms_norm(x, x2, gamma)
    assert not rstd.requires_grad
    torch.autograd.backward([y, total], [dy, torch.ones_like(total)])  # the sum's own use adds its gradient
    for got, want, extra in zip((x.grad, x2.grad, gamma.grad), expected, (1, 1, 0)):
        assert_close(got, want + extra)
    x.grad = gamma.grad = None
    y, _ = rms_norm(x, gamma)
    y.backward(dy)
    x_ref, g_ref = x.detach().clone().requires_grad_(), gamma.detach().clone().requires_grad_()
    eager_rms_norm(x_ref, g_ref).backward(dy)
    assert_close(x.grad, x_ref.grad)
    assert_close(gamma.grad, g_ref.grad)


def test_backward_op_gives_float32_dgamma_and_dx_in_xs_dtype():
    x, gamma = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16)
    _, rstd = rms_norm(x, gamma)
    dx, dgamma = rms_norm_backward(torch.randn_like(x), x, gamma, rstd)
    assert dx.dtype == torch.bfloat16 and dgamma.dtype == torch.float32 and dgamma.shape == (16,)


X, G = torch.randn(2, 8), torch.randn(8)


@pytest.mark.parametrize("call, message", [
    (lambda: rms_norm(X.double(), G.double()), r"npu_fuse\.rms_norm: x dtype must be float16, bfloat16 or float32"),
    (lambda: rms_norm(X.half(), G.bfloat16()), r"gamma dtype must be float16 or float32 with a float16 x"),
    (lambda: rms_norm(X, G.half()), r"gamma dtype must be float32 with a float32 x"),
    (lambda: rms_norm(X, torch.randn(4)), r"gamma shape \(4,\) must be the last dims of x, \(8,\)"),
    (lambda: rms_norm(X, torch.randn(3, 2, 8)), r"gamma must be 1-D to 2-D"),
    (lambda: rms_norm(torch.randn(*[1] * 9), torch.randn(1)), r"x must be 1-D to 8-D"),
    (lambda: rms_norm(torch.randn(2, 0), torch.randn(0)), r"the normalized dims \(0,\) must not be empty"),
    (lambda: rms_norm(X, G, -1e-6), r"epsilon must be a number >= 0"),
    (lambda: rms_norm(X, G.to("meta")), r"gamma is on meta but x is on cpu"),
    (lambda: add_rms_norm(X, X.half(), G), r"npu_fuse\.add_rms_norm: x1 and x2 must have one shape and dtype"),
    (lambda: add_rms_norm(X.bfloat16(), X.bfloat16(), G), r"gamma dtype must be bfloat16 with a bfloat16 x1"),
    (lambda: rms_norm_backward(X, X, G, torch.ones(2, 1).double()), r"rstd must be float32 of shape \(2, 1\)"),
])
def test_argument_errors_name_the_rule(call, message):
    with pytest.raises(ValueError, match=message):
        call()
