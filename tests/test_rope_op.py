"""The npu_fuse::rotary_mul op and its backward, directly."""

import pytest
import torch
from torch.library import opcheck

import npu_fuse  # noqa: F401  (defines the npu_fuse:: ops)
from conftest import assert_close
from models import rotate_every_two, rotate_half

rotary_mul = torch.ops.npu_fuse.rotary_mul
rotary_mul_backward = torch.ops.npu_fuse.rotary_mul_backward


def eager_rope(x, cos, sin, mode):
    return x * cos + (rotate_half(x) if mode == "half" else rotate_every_two(x)) * sin


def inputs(shape=(2, 5, 3, 8), r_shape=(1, 5, 1, 8), dtype=torch.float32, grad=False):
    x = torch.randn(shape, dtype=dtype, requires_grad=grad)
    cos = torch.randn(r_shape, dtype=dtype, requires_grad=grad)
    sin = torch.randn(r_shape, dtype=dtype, requires_grad=grad)
    return x, cos, sin


@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("r_shape", [(1, 5, 1, 8), (2, 5, 3, 8), (1, 1, 1, 8), (2, 1, 3, 8)])
def test_opcheck(mode, r_shape):
    x, cos, sin = inputs(r_shape=r_shape, grad=True)
    opcheck(rotary_mul.default, (x, cos, sin, mode))
    g = torch.randn(2, 5, 3, 8)
    opcheck(rotary_mul_backward.default, (g, x.detach(), cos.detach(), sin.detach(), mode, True))
    opcheck(rotary_mul_backward.default, (g, None, cos.detach(), sin.detach(), mode, False))


@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_matches_eager(mode, dtype):
    x, cos, sin = inputs(dtype=dtype)
    expected = eager_rope(x.float(), cos.float(), sin.float(), mode)
    got = rotary_mul(x, cos, sin, mode)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_autograd_matches_eager_for_x_and_both_tables(mode):
    x, cos, sin = inputs(grad=True)
    g = torch.randn(2, 5, 3, 8)
    expected = torch.autograd.grad(eager_rope(x, cos, sin, mode), (x, cos, sin), g)
    got = torch.autograd.grad(rotary_mul(x, cos, sin, mode), (x, cos, sin), g)
    for a, b in zip(got, expected):
        assert_close(a, b)


def test_backward_without_x_gives_dx_only():
    x, cos, sin = inputs()
    g = torch.randn_like(x)
    dx_full, _, _ = rotary_mul_backward(g, x, cos, sin, "half", True)
    dx, dr1, dr2 = rotary_mul_backward(g, None, cos, sin, "half", False)
    assert_close(dx, dx_full)
    assert not dr1.any() and not dr2.any()


def test_gradcheck_against_finite_differences():
    x, cos, sin = (t.double().detach().requires_grad_() for t in inputs())
    # float64 is outside the op's contract; check the math through the reference kernel
    from npu_fuse_backend.lowering.ops.rope import rotary_mul_reference
    assert torch.autograd.gradcheck(lambda a, b, c: rotary_mul_reference(a, b, c, "interleave"), (x, cos, sin))


@pytest.mark.parametrize("args, message", [
    (dict(mode="quarter"), "rotary_mode must be one of"),
    (dict(shape=(5, 3, 8), r_shape=(5, 1, 8)), "x must be 4-D"),
    (dict(dtype=torch.float64), "x dtype must be float16, bfloat16 or float32"),
    (dict(shape=(2, 5, 3, 7), r_shape=(1, 5, 1, 7)), "head dim (last dim of x) must be even"),
    (dict(r_shape=(5, 1, 8)), "r1 must be 4-D"),
    (dict(r_shape=(1, 5, 1, 4)), "last dim of r1 must equal head dim 8"),
    (dict(r_shape=(1, 4, 1, 8)), "does not broadcast to x shape"),
])
def test_argument_errors_name_the_rule(args, message):
    mode = args.pop("mode", "half")
    x, cos, sin = inputs(**args)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rotary_mul(x, cos, sin, mode)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")), \
            torch._subclasses.FakeTensorMode() as mode_ctx:
        fx, fc, fs = (mode_ctx.from_tensor(t) for t in (x, cos, sin))
        rotary_mul(fx, fc, fs, mode)


def test_dtype_mismatch_is_refused():
    x, cos, sin = inputs()
    with pytest.raises(ValueError, match="must share one dtype"):
        rotary_mul(x, cos.half(), sin.half())


def test_backward_needs_x_for_table_gradients():
    x, cos, sin = inputs()
    with pytest.raises(ValueError, match="need_backward=True .* needs x"):
        rotary_mul_backward(torch.randn_like(x), None, cos, sin, "half", True)
