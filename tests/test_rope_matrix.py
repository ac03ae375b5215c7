"""RoPE with its rotation written as a matrix product, ``x * cos + (x @ R) * sin``, R a [D, D] signed
permutation matrix: a product by a matrix whose values the compile computes (built in forward: zeros with
entries put in, a literal tensor) is a lane move like a slice or a gather, so it fuses as the other spellings
do; a matrix of unknown values (a module's buffer, what the forward saved for the backward) or one that is no
signed permutation (a general linear map) is a near-miss saying so; any other matmul stays silent."""

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons

D = 16


def half_matrix(d=D, dtype=torch.float32):
    """rotate_half as a matrix: (x @ R)[..., i] = -x[..., i + h], (x @ R)[..., i + h] = x[..., i]."""
    h = d // 2
    r = torch.zeros(d, d, dtype=dtype)
    idx = torch.arange(h)
    r[idx + h, idx] = -1.0
    r[idx, idx + h] = 1.0
    return r


def pairs_matrix(d=D, dtype=torch.float32):
    """The interleave rotation as a matrix: (x @ R)[..., 2k] = -x[..., 2k + 1], (x @ R)[..., 2k + 1] = x[..., 2k]."""
    r = torch.zeros(d, d, dtype=dtype)
    even = torch.arange(0, d, 2)
    r[even + 1, even] = -1.0
    r[even, even + 1] = 1.0
    return r


def literal(matrix):
    """A matrix as a literal tensor in the code (the trace captures it as a constant)."""
    values = matrix.tolist()
    return lambda: torch.tensor(values)


def rope_by(make_matrix):
    def fn(q, c, s):
        return q * c + (q @ make_matrix().to(q)) * s
    return fn


def _tables(shape, d=D):
    return torch.randn(*shape, d), torch.randn(*shape, d)


FORMS = {  # name: (fn(q, cos, sin), q, its mode)
    "rotate_half by a matrix built in forward": (rope_by(half_matrix), torch.randn(2, 4, 6, D), "mode=half"),
    "interleave by a matrix built in forward": (rope_by(pairs_matrix), torch.randn(2, 4, 6, D), "mode=interleave"),
    "rotate_half by a literal matrix": (rope_by(literal(half_matrix())), torch.randn(2, 4, 6, D), "mode=half"),
    "the matrix transposed (x @ R.T, F.linear's form)": (
        lambda q, c, s: q * c + torch.nn.functional.linear(q, half_matrix().t()) * s, torch.randn(2, 4, 6, D),
        "mode=half"),
    "[T, N, D] x": (rope_by(half_matrix), torch.randn(6, 4, D), "mode=half"),
    "[T, D] x (one mm, no views)": (rope_by(pairs_matrix), torch.randn(6, D), "mode=interleave"),
    "BSND x transposed to BNSD first": (
        lambda q, c, s: rope_by(half_matrix)(q.transpose(1, 2), c, s), torch.randn(2, 6, 4, D), "mode=half"),
}


@pytest.mark.parametrize("name", FORMS)
def test_rotation_by_a_constant_matrix_fuses_with_eager_numerics(name):
    fn, q, mode = FORMS[name]
    c, s = _tables((6, 1) if q.dim() == 3 else (6,) if q.dim() == 2 else (1, 1, 6))
    with torch.no_grad():
        out, reports = compile_fused(fn, q, c, s)
    assert [(m.op, m.detail) for r in reports for m in r.matches] == [("rotary_mul", mode)], \
        [r.summary() for r in reports]
    assert not near_miss_reasons(reports), near_miss_reasons(reports)
    assert_close(out, fn(q, c, s))


def test_the_adjoint_by_the_transposed_matrix_fuses():
    """Autograd's backward of ``(x @ R) * sin`` is ``(g * sin) @ R^T``: written so, with R known, it fuses."""
    def fn(g, c, s):
        return g * c + (g * s) @ half_matrix().t()
    g, (c, s) = torch.randn(2, 4, 6, D), _tables((1, 1, 6))
    with torch.no_grad():
        out, reports = compile_fused(fn, g, c, s)
    assert fused_ops(reports) in (["rotary_mul"], ["rotary_mul_backward"]), [r.summary() for r in reports]
    assert not near_miss_reasons(reports)
    assert_close(out, fn(g, c, s))


def test_a_nan_or_inf_spreads_over_its_row_as_the_matrix_product_spreads_it():
    """``inf * 0`` in the product makes eager's whole row NaN; the fused result keeps that."""
    fn = rope_by(half_matrix)
    q, (c, s) = torch.randn(2, 4, 6, D), _tables((1, 1, 6))
    q[0, 1, 2, 3], q[1, 0, 4, 0] = float("inf"), float("nan")
    with torch.no_grad():
        out, reports = compile_fused(fn, q, c, s)
    assert fused_ops(reports) == ["rotary_mul"], [r.summary() for r in reports]
    expected = fn(q, c, s)
    assert torch.equal(out.isfinite(), expected.isfinite())
    assert_close(out[expected.isfinite()], expected[expected.isfinite()])


def test_training_fuses_the_forward_and_the_backward_names_the_saved_matrix():
    """The partitioner saves R for the backward (``g @ R^T``), where it is a graph input of unknown values:
    the forward fuses, the backward is a near-miss saying so, the gradients are eager's."""
    fn = rope_by(half_matrix)
    q, (c, s) = torch.randn(2, 4, 6, D, requires_grad=True), _tables((1, 1, 6))
    out, _ = compile_fused(fn, q, c, s)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    reports = nf.get_reports()
    assert {r.kind: fused_ops([r]) for r in reports} == {"forward": ["rotary_mul"], "backward": []}, \
        [r.summary() for r in reports]
    reasons = [n.reason for r in reports if r.kind == "backward" for n in r.near_misses]
    assert len(reasons) == 1 and "the forward computed and saved it" in reasons[0], reasons
    grad, q.grad = q.grad, None
    fn(q, c, s).backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    assert_close(grad, q.grad)


class BufferRotation(torch.nn.Module):
    def __init__(self, matrix):
        super().__init__()
        self.register_buffer("rotation", matrix)

    def forward(self, q, c, s):
        return q * c + (q @ self.rotation) * s


def test_a_matrix_in_a_buffer_is_a_near_miss_forward_and_backward():
    """A buffer is a graph input: its values may change after the compile, so they are not read."""
    module = BufferRotation(half_matrix())
    q, (c, s) = torch.randn(2, 4, 6, D, requires_grad=True), _tables((1, 1, 6))
    out, _ = compile_fused(module, q, c, s)
    out.sum().backward()
    reports = nf.get_reports()
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    reasons = {r.kind: [n.reason for n in r.near_misses] for r in reports}
    assert set(reasons) == {"forward", "backward"}
    for kind, found in reasons.items():
        assert len(found) == 1 and "is a graph input" in found[0] and "not known at compile time" in found[0], found
    assert_close(out, module(q, c, s))


def _with(matrix, i, j, value):
    matrix = matrix.clone()
    matrix[i, j] = value
    return matrix


LOOK_ALIKES = {  # name: (the matrix, built in forward, a phrase of the reason)
    "a 2 in place of a 1": (literal(_with(half_matrix(), 0, D // 2, 2.0)), "is 2.0, not 0, 1 or -1"),
    "a random matrix": (literal(torch.randn(D, D)), "no signed permutation"),
    "a permutation with a lane dropped": (literal(_with(half_matrix(), 0, D // 2, 0.0)), "has 0 nonzero entries"),
    "a matrix drawn at run time": (lambda: torch.randn(D, D), "not a constant the compile can compute"),
    "halves swapped without a sign": (lambda: half_matrix().abs(), "a reflection, not a rotation"),
    "every sign negative": (lambda: -half_matrix().abs(), "a reflection, not a rotation"),
    "a signed cyclic shift by one lane": (lambda: torch.roll(torch.eye(D), 1, 1) * torch.cat(
        [-torch.ones(1), torch.ones(D - 1)]), "not an involution"),
    "quarters rotated in place": (lambda: torch.block_diag(half_matrix(D // 2), half_matrix(D // 2)),
                                  "no GE RoPE mode pairs lanes so"),
}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_a_matrix_that_is_no_rotation_is_a_near_miss(name):
    make, phrase = LOOK_ALIKES[name]
    fn = rope_by(make)
    q, (c, s) = torch.randn(2, 4, 6, D), _tables((1, 1, 6))
    with torch.no_grad():
        out, reports = compile_fused(fn, q, c, s)
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    reasons = near_miss_reasons(reports)
    assert len(reasons) == 1 and phrase in reasons[0], reasons
    if name != "a matrix drawn at run time":
        assert_close(out, fn(q, c, s))


ROPE_FAMILIES = ("rope", "partial_rope", "interleave_rope")
SILENT = {  # matmuls that are no rotation: not fused, and no near-miss either
    "a residual around a square projection": lambda x, w, c: x + x @ w,
    "a gated square projection": lambda x, w, c: x * c + x @ w,
    "attention": lambda x, w, c: torch.softmax(x @ x.transpose(-1, -2), -1) @ x + x * c,
    "a square MLP": lambda x, w, c: x + torch.relu(x @ w) @ w.t() * c,
}


@pytest.mark.parametrize("name", SILENT)
def test_other_matmuls_stay_silent(name):
    fn = SILENT[name]
    x, w, c = torch.randn(2, 4, D, D, requires_grad=True), torch.randn(D, D, requires_grad=True), torch.randn(D)
    out, _ = compile_fused(fn, x, w, c)
    out.sum().backward()
    reports = nf.get_reports()
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    assert [n.reason for r in reports for n in r.near_misses if n.family in ROPE_FAMILIES] == []
    assert_close(out, fn(x, w, c))
