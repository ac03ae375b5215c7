"""inplace_partial_rotary_mul: the op (three ways of calling it) and the partial-RoPE fusion."""

import pytest
import torch
from torch.library import opcheck

import npu_fuse_backend as nf
from conftest import assert_close, assert_no_worse_than_eager, compile_fused, fused_ops, near_miss_reasons
from models import rotate_every_two, rotate_half
from npu_fuse.ops import inplace_partial_rotary_mul

op = torch.ops.npu_fuse.inplace_partial_rotary_mul
op_backward = torch.ops.npu_fuse.inplace_partial_rotary_mul_backward


def eager_partial(x, r1, r2, start, end):
    part = x[..., start:end]
    return torch.cat([x[..., :start], part * r1 + rotate_every_two(part) * r2, x[..., end:]], dim=-1)


def make(shape=(2, 5, 3, 16), r_shape=(2, 5, 1, 8), dtype=torch.float32):
    return torch.randn(shape, dtype=dtype), torch.randn(r_shape, dtype=dtype), torch.randn(r_shape, dtype=dtype)


# -- the op --------------------------------------------------------------------------------
@pytest.mark.parametrize("partial_slice", [[0, 8], [4, 12], [8, 16], [6, 6]])
def test_opcheck(partial_slice):
    x, r1, r2 = make(r_shape=(2, 5, 1, partial_slice[1] - partial_slice[0]))
    kwargs = dict(rotary_mode="interleave", partial_slice=partial_slice)
    opcheck(op.default, (x, r1, r2), kwargs)
    opcheck(op_backward.default, (x, r1, r2), kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("r_shape", [(2, 5, 1, 8), (2, 1, 1, 8), (2, 5, 3, 8), (1, 1, 1, 8), (2, 1, 3, 8)])
def test_plain_call_rotates_only_the_slice(dtype, r_shape):
    x, r1, r2 = make(r_shape=r_shape, dtype=dtype)
    expected = eager_partial(x.float(), r1.float(), r2.float(), 4, 12)
    y = x.clone()
    assert inplace_partial_rotary_mul(y, r1, r2, rotary_mode="interleave", partial_slice=[4, 12]) is None
    assert_close(y, expected, dtype)
    assert torch.equal(y[..., :4], x[..., :4]) and torch.equal(y[..., 12:], x[..., 12:])


def test_empty_slice_and_none_are_no_ops_forward_and_backward():
    x, r1, r2 = make(r_shape=(2, 5, 1, 0))
    y = x.clone()
    inplace_partial_rotary_mul(y, r1, r2, partial_slice=[5, 5])
    inplace_partial_rotary_mul(y, r1, r2)  # partial_slice=None means [0, 0]
    assert torch.equal(y, x)
    g = torch.randn_like(x)
    g2 = g.clone()
    op_backward(g2, r1, r2, partial_slice=[5, 5])
    assert torch.equal(g2, g)


def test_training_gradient_is_the_exact_adjoint_and_tables_get_none():
    x, r1, r2 = make()
    r1.requires_grad_()
    leaf = x.clone().requires_grad_()
    y = leaf * 1.0
    inplace_partial_rotary_mul(y, r1, r2, partial_slice=[4, 12])
    g = torch.randn_like(x)
    y.backward(g)
    ref_leaf = x.clone().requires_grad_()
    (expected_grad,) = torch.autograd.grad(eager_partial(ref_leaf, r1.detach(), r2, 4, 12), ref_leaf, g)
    assert_close(leaf.grad, expected_grad)
    assert r1.grad is None


def test_leaf_that_requires_grad_is_refused():
    x, r1, r2 = make()
    x.requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        inplace_partial_rotary_mul(x, r1, r2, partial_slice=[4, 12])


def test_deterministic():
    x, r1, r2 = make((4, 64, 8, 128), (4, 64, 1, 64))
    a, b = x.clone(), x.clone()
    inplace_partial_rotary_mul(a, r1, r2, partial_slice=[0, 64])
    inplace_partial_rotary_mul(b, r1, r2, partial_slice=[0, 64])
    assert torch.equal(a, b)


@pytest.mark.parametrize("fallback", ["aot_eager", "inductor"])
def test_inside_torch_compile_with_training(fallback):
    def layer(x, r1, r2):
        y = x * 2.0
        inplace_partial_rotary_mul(y, r1, r2, rotary_mode="interleave", partial_slice=[4, 12])
        return y.sin()

    x, r1, r2 = make()
    leaf = x.clone().requires_grad_()
    with nf.config.patch(fallback=fallback):
        out = torch.compile(layer, backend="npu_fuse", fullgraph=True)(leaf, r1, r2)
    out.sum().backward()
    ref = x.clone().requires_grad_()
    expected = eager_partial(ref * 2.0, r1, r2, 4, 12).sin()
    expected.sum().backward()
    assert_close(out, expected)
    assert_close(leaf.grad, ref.grad)


@pytest.mark.parametrize("kwargs, shapes, message", [
    (dict(rotary_mode="half"), {}, "only rotary_mode='interleave'"),
    (dict(partial_slice=[0, 8, 16]), {}, "partial_slice must be \\[start, end\\]"),
    ({}, dict(shape=(5, 3, 16)), "x must be 4-D BSND"),
    ({}, dict(dtype=torch.float64), "x dtype must be"),
    ({}, dict(shape=(2, 0, 3, 16), r_shape=(2, 1, 1, 8)), "every dim of x must be > 0"),
    ({}, dict(shape=(2, 5, 3, 1026), r_shape=(2, 5, 1, 8)), "D must be even and <= 1024"),
    ({}, dict(shape=(2, 5, 3, 15), r_shape=(2, 5, 1, 8)), "D must be even"),
    (dict(partial_slice=[12, 4]), {}, "0 <= start <= end <= D"),
    (dict(partial_slice=[4, 20]), {}, "0 <= start <= end <= D"),
    (dict(partial_slice=[4, 11]), dict(r_shape=(2, 5, 1, 7)), "slice length end - start must be even"),
    ({}, dict(r_shape=(2, 5, 8)), "r1 must be 4-D"),
    ({}, dict(r_shape=(2, 5, 1, 6)), "last dim of r1 must equal the slice length 8"),
    ({}, dict(r_shape=(2, 4, 1, 8)), "does not broadcast"),
])
def test_each_rule_is_enforced_eagerly_and_at_trace_time(kwargs, shapes, message):
    x, r1, r2 = make(**shapes)
    kwargs = {"partial_slice": [4, 12], **kwargs}
    with pytest.raises(ValueError, match=message):
        op(x, r1, r2, **kwargs)
    with torch._subclasses.FakeTensorMode() as fake, pytest.raises(ValueError, match=message):
        op(fake.from_tensor(x), fake.from_tensor(r1), fake.from_tensor(r2), **kwargs)


def test_non_contiguous_x_and_mismatched_table_dtypes_are_refused():
    x, r1, r2 = make()
    with pytest.raises(ValueError, match="x must be contiguous"):
        op(x.transpose(1, 2), r1, r2, partial_slice=[4, 12])
    with pytest.raises(ValueError, match="r1 and r2 must share one float dtype"):
        op(x, r1, r2.half(), partial_slice=[4, 12])


# -- the fusion -----------------------------------------------------------------------------
def gptj_cat(q, cos, sin, r=8):
    q_rot, q_pass = q[:, :, :, :r], q[:, :, :, r:]
    return torch.cat([q_rot * cos + rotate_every_two(q_rot) * sin, q_pass], dim=-1)


def glm_middle(q, cos, sin):
    return torch.cat([q[..., :4], q[..., 4:12] * cos + rotate_every_two(q[..., 4:12]) * sin, q[..., 12:]], -1)


def setitem_in_place(q, cos, sin):
    q = q * 1.0
    q[..., :8] = q[..., :8] * cos + rotate_every_two(q[..., :8]) * sin
    return q


def copy_into_input(q, cos, sin):
    q[..., 8:16].copy_(sin * rotate_every_two(q[..., 8:16]) + cos * q[..., 8:16])
    return q.sum(-1)


STYLES = {"gptj-cat": (gptj_cat, (0, 8)), "glm-middle": (glm_middle, (4, 12)),
          "setitem": (setitem_in_place, (0, 8)), "copy_-into-input": (copy_into_input, (8, 16))}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_partial_interleave_styles_fuse_into_the_in_place_op(style, dtype):
    fn, (start, end) = STYLES[style]
    q, cos, sin = make((2, 5, 3, 16), (2, 5, 1, 8), dtype)
    q_compiled, q_eager = q.clone(), q.clone()
    out, reports = compile_fused(fn, q_compiled, cos, sin)
    expected = fn(q_eager, cos, sin)
    assert fused_ops(reports) == ["inplace_partial_rotary_mul"]
    assert reports[0].matches[0].detail == f"slice=[{start}, {end}]"
    exact = fn(q.double(), cos.double(), sin.double())
    assert_no_worse_than_eager(out, expected, exact)
    assert_no_worse_than_eager(q_compiled, q_eager, q.double() if style != "copy_-into-input" else
                               _mutated_exact(q, cos, sin))


def _mutated_exact(q, cos, sin):
    q = q.double()
    copy_into_input(q, cos.double(), sin.double())
    return q


def test_graph_mutates_exactly_what_the_user_mutated():
    q, cos, sin = make()
    q_in, cos_in, sin_in = q.clone(), cos.clone(), sin.clone()
    _, reports = compile_fused(copy_into_input, q_in, cos_in, sin_in)
    assert fused_ops(reports) == ["inplace_partial_rotary_mul"]
    expected = q.clone()
    copy_into_input(expected, cos, sin)
    assert_close(q_in, expected)
    assert torch.equal(cos_in, cos) and torch.equal(sin_in, sin)


def test_half_mode_partial_rope_becomes_rotary_mul_on_the_slice():
    def neox(q, cos, sin):
        q_rot, q_pass = q[..., :8], q[..., 8:]
        return torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)

    q, cos, sin = make()
    out, reports = compile_fused(neox, q, cos, sin)
    assert fused_ops(reports) == ["rotary_mul"]
    assert_close(out, neox(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_training_through_compile_fuses_forward_and_matches_eager_gradients(dtype):
    q, cos, sin = make(dtype=dtype)

    def grad_of(fn, q, cos, sin):
        leaf = q.clone().requires_grad_()
        fn(leaf, cos, sin).float().pow(2).sum().backward()
        return leaf.grad

    with nf.config.patch(fallback="aot_eager"):
        got = grad_of(torch.compile(gptj_cat, backend="npu_fuse"), q, cos, sin)
    eager = grad_of(gptj_cat, q, cos, sin)
    exact = grad_of(gptj_cat, q.double(), cos.double(), sin.double())
    assert_no_worse_than_eager(got, eager, exact)
    forward = [m.op for r in nf.get_reports() if r.kind == "forward" for m in r.matches]
    assert forward == ["inplace_partial_rotary_mul"]


LAYOUT_CASES = [  # (soc, r shape for x [2, 5, 3, 16], fuses)
    ("Ascend910B", (2, 5, 1, 8), True),    # BS1D
    ("Ascend910B", (2, 1, 1, 8), True),    # B11D
    ("Ascend910_93", (1, 5, 1, 8), False),  # 1S1D
    ("Ascend910B", (2, 5, 3, 8), False),   # BSND
    ("Ascend950", (2, 5, 3, 8), True),     # BSND
    ("Ascend950", (2, 1, 3, 8), True),     # B1ND
    ("Ascend950", (1, 1, 1, 8), True),     # 111D
    ("Ascend950", (2, 5, 1, 8), False),    # BS1D
    ("generic", (1, 5, 3, 8), True),       # any broadcastable layout
]


@pytest.mark.parametrize("soc, r_shape, fuses", LAYOUT_CASES)
def test_broadcast_layouts_per_soc(soc, r_shape, fuses):
    q, cos, sin = make(r_shape=r_shape)
    out, reports = compile_fused(gptj_cat, q, cos, sin, soc=soc)
    assert_close(out, gptj_cat(q, cos, sin))
    if fuses:
        assert fused_ops(reports) == ["inplace_partial_rotary_mul"]
    else:
        assert "inplace_partial_rotary_mul" not in fused_ops(reports)
        assert any(f"that {soc} accepts" in r for r in near_miss_reasons(reports))


def test_cos_without_the_slice_length_as_last_dim_is_a_near_miss():
    q, cos, sin = make(r_shape=(2, 5, 1, 1))  # broadcasts in eager; the op needs last dim = end - start
    _, reports = compile_fused(gptj_cat, q, cos, sin)
    assert "inplace_partial_rotary_mul" not in fused_ops(reports)
    assert any("last dim 1 != the 8 lanes rotated, and the fused ops' tables are full width" in r
               for r in near_miss_reasons(reports)), near_miss_reasons(reports)


def test_intermediate_used_outside_blocks_the_in_place_op():
    def fn(q, cos, sin):
        q_rot = q[..., :8]
        rot = q_rot * cos + rotate_every_two(q_rot) * sin
        return torch.cat([rot, q[..., 8:]], dim=-1), rot.sum()

    q, cos, sin = make()
    _, reports = compile_fused(fn, q, cos, sin)
    assert "inplace_partial_rotary_mul" not in fused_ops(reports)
    assert any("used outside" in r for r in near_miss_reasons(reports))


def test_raw_op_refuses_tensors_that_require_grad():
    """The raw op is invisible to autograd; silently wrong gradients are worse than an error."""
    x, r1, r2 = make()
    y = x.clone().requires_grad_() * 1.0
    with pytest.raises(RuntimeError, match="an input requires grad; call npu_fuse.ops"):
        op(y, r1, r2, partial_slice=[4, 12])
    with torch.no_grad():
        op(y, r1, r2, partial_slice=[4, 12])  # fine without autograd
