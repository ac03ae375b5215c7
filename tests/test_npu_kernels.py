"""The eager NPU kernels (``@npu_kernel``) of the fused ops, against torch_npu's registered schemas.

torch_npu cannot be imported here, so its schemas are read from the wheel
(``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``) and defined in a scratch
namespace that stands in for ``torch.ops.npu``, with CPU reference implementations: the
dispatcher then checks every call a kernel makes against torch_npu's schema (argument
order, types, optionality: no None where a Tensor is required), and the kernel's result is
compared with the op's own reference.
"""

import re

import pytest
import torch

import npu_fuse  # noqa: F401  (defines the npu_fuse:: ops)
from conftest import assert_close
from npu_fuse_backend.lowering import registry
from npu_fuse_backend.lowering.common import rotate
from torchair_offline import TORCH_NPU_DIR

SCHEMAS = TORCH_NPU_DIR / "torch_npu" / "csrc" / "aten" / "npu_native_functions_by_codegen.yaml"
pytestmark = pytest.mark.skipif(not SCHEMAS.is_file(), reason="torch_npu not fetched: run `make test`")

fused = torch.ops.npu_fuse
WITH_KERNELS = {fused.rotary_mul.default, fused.rotary_mul_backward.default, fused.softmax_grad_ext.default,
                fused.inplace_partial_rotary_mul.default, fused.inplace_partial_rotary_mul_backward.default,
                fused.interleave_rope.default, fused.mla_preprocess.default,  # mla's: tests/test_mla_preprocess_op.py
                fused.rms_norm.default, fused.add_rms_norm.default, fused.rms_norm_backward.default}


def torch_npu_schemas() -> dict:
    """{op name (with overload): schema string} of every ``func:`` in the wheel's yaml."""
    found = {}
    for line in SCHEMAS.read_text().splitlines():
        match = re.match(r"\s*-?\s*func:\s*(([\w.]+)\(.*)$", line)
        if match:
            found[match.group(2)] = match.group(1)
    return found


def _rotary_mul(x, r1, r2, rotary_mode="half", rotate_=None):
    return x * r1 + rotate(x, rotary_mode) * r2


def _rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    dx = grad * r1 - rotate(grad * r2, rotary_mode)
    return dx, (grad * x).sum_to_size(r1.shape), (grad * rotate(x, rotary_mode)).sum_to_size(r2.shape)


def _interleave_rope(x, cos, sin):  # README of InterleaveRope: de-interleave the pairs, then rotate halves
    pairs = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return pairs * cos + rotate(pairs, "half") * sin


def _rms_norm(x, gamma, epsilon=1e-6):  # ops-nn RmsNorm golden
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def _add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    y, rstd = _rms_norm(x1 + x2, gamma, epsilon)
    return y, rstd, x1 + x2


def _rms_norm_backward(dy, x, gamma, rstd):
    xf, g = x.float(), dy.float() * gamma.float()
    dx = rstd * g - xf * rstd.pow(3) * (g * xf).mean(-1, keepdim=True)
    return dx.to(x.dtype), (dy.float() * xf * rstd).sum_to_size(gamma.shape)


REFERENCES = {"npu_rotary_mul": _rotary_mul, "npu_rotary_mul_backward": _rotary_mul_backward,
              "npu_interleave_rope": _interleave_rope, "npu_rms_norm": _rms_norm, "npu_add_rms_norm": _add_rms_norm,
              "npu_rms_norm_backward": _rms_norm_backward}
SCALAR_TYPES = {"str": str, "int": int, "bool": bool, "float": (float, int)}


def checked(schema: str, impl):
    """impl, after checking its arguments against the schema as torch_npu's kernel would need
    them: the dispatcher lets None through as an undefined Tensor, torch_npu's kernels do not."""
    parsed = torch._C.parse_schema(f"npu::{schema}")

    def call(*args, **kwargs):
        for i, arg in enumerate(parsed.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
            kind = str(arg.type)
            if kind == "Tensor" and not isinstance(value, torch.Tensor):
                raise TypeError(f"{parsed.name}: argument {arg.name} ({kind}) got {value!r}")
            if kind in SCALAR_TYPES and not isinstance(value, SCALAR_TYPES[kind]):
                raise TypeError(f"{parsed.name}: argument {arg.name} ({kind}) got {value!r}")
        return impl(*args, **kwargs)

    return call


@pytest.fixture(scope="module")
def npu_namespace():
    """torch.ops.<scratch> with torch_npu's schemas of the ops the kernels may call."""
    schemas = torch_npu_schemas()
    lib = torch.library.Library("npu_fuse_wheel_schemas", "DEF")
    for name, impl in REFERENCES.items():
        lib.define(schemas[name])
        lib.impl(name, checked(schemas[name], impl), "CompositeExplicitAutograd")
    yield torch.ops.npu_fuse_wheel_schemas, schemas
    del lib


def overload(op):
    return getattr(op, "_opoverload", op)


@pytest.fixture
def as_npu(npu_namespace, monkeypatch):
    namespace, _ = npu_namespace
    monkeypatch.setattr(torch.ops, "npu", namespace)
    return dict(registry._npu_kernels)


def test_every_fused_op_has_an_npu_kernel():
    assert {overload(op) for op, _ in registry._npu_kernels} == WITH_KERNELS


def test_the_schemas_the_kernels_call_are_torch_npus(npu_namespace):
    _, schemas = npu_namespace
    assert schemas["npu_rotary_mul"].startswith("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, "
                                                "str rotary_mode='half', Tensor? rotate=None)")
    # self (x) is required: a kernel must not pass None for it
    assert schemas["npu_rotary_mul_backward"].startswith(
        "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half')")


def test_the_dispatcher_refuses_a_call_that_breaks_the_schema(npu_namespace):
    namespace, _ = npu_namespace
    g, x, r = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(1, 3, 1, 8)
    with pytest.raises(TypeError, match="argument self"):
        namespace.npu_rotary_mul_backward(g, None, r, r, "half")  # what the old kernel did
    with pytest.raises(RuntimeError):
        namespace.npu_rotary_mul(x, r, r, "half", None, 3)  # one argument too many


def kernel(as_npu, op):
    return next(fn for o, fn in as_npu.items() if overload(o) == op)


def tables(shape=(2, 5, 3, 8), r_shape=(1, 5, 1, 8)):
    return torch.randn(shape), torch.randn(r_shape), torch.randn(r_shape)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_kernel(as_npu, mode):
    x, r1, r2 = tables()
    got = kernel(as_npu, fused.rotary_mul.default)(x, r1, r2, mode)
    assert_close(got, fused.rotary_mul(x, r1, r2, mode))


@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("with_x", [True, False])
def test_rotary_mul_backward_kernel(as_npu, mode, with_x):
    x, r1, r2 = tables()
    g = torch.randn_like(x)
    need = with_x
    got = kernel(as_npu, fused.rotary_mul_backward.default)(g, x if with_x else None, r1, r2, mode, need)
    expected = fused.rotary_mul_backward(g, x if with_x else None, r1, r2, mode, need)
    for a, b in zip(got, expected):
        assert_close(a, b)


def test_softmax_grad_ext_kernel(as_npu):
    g, p = torch.randn(2, 4, 8), torch.softmax(torch.randn(2, 4, 8), -1)
    for x2 in (torch.full((1,), 0.125), torch.randn(2, 4, 8)):
        got = kernel(as_npu, fused.softmax_grad_ext.default)(g, p, x2, [-1], True)
        assert_close(got, fused.softmax_grad_ext(g, p, x2, [-1], True))


@pytest.mark.parametrize("backward", [False, True])
def test_inplace_partial_rotary_mul_kernels(as_npu, backward):
    op = fused.inplace_partial_rotary_mul_backward if backward else fused.inplace_partial_rotary_mul
    x, r1, r2 = tables(shape=(2, 5, 3, 16), r_shape=(2, 5, 1, 8))
    got, expected = x.clone(), x.clone()
    assert kernel(as_npu, op.default)(got, r1, r2, rotary_mode="interleave", partial_slice=[4, 12]) is None
    op(expected, r1, r2, rotary_mode="interleave", partial_slice=[4, 12])
    assert_close(got, expected)
    assert torch.equal(got[..., :4], x[..., :4]) and torch.equal(got[..., 12:], x[..., 12:])


def test_kernels_check_their_arguments_like_the_op(as_npu):
    x, r1, r2 = tables()
    with pytest.raises(ValueError, match="rotary_mode"):
        kernel(as_npu, fused.rotary_mul.default)(x, r1, r2, "quarter")
    with pytest.raises(ValueError, match="partial_slice"):
        kernel(as_npu, fused.inplace_partial_rotary_mul.default)(x, r1, r2, partial_slice=[0, 9, 1])


@pytest.mark.parametrize("soc", ["Ascend910B", "generic"])
def test_interleave_rope_kernel(as_npu, npu_namespace, soc, monkeypatch):
    """On A2/A3, inside InterleaveRope's limits, the kernel is torch_npu's npu_interleave_rope
    (x, cos, sin in that order); elsewhere the op's reference."""
    import npu_fuse_backend as nf

    namespace, _ = npu_namespace
    calls = []
    real = namespace.npu_interleave_rope
    monkeypatch.setattr(namespace, "npu_interleave_rope", lambda *a: calls.append(a) or real(*a), raising=False)
    x = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16), torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    with nf.config.patch(soc=soc):
        got = kernel(as_npu, fused.interleave_rope.default)(x, cos, sin)
    assert len(calls) == (1 if soc == "Ascend910B" else 0)
    assert_close(got, fused.interleave_rope(x, cos, sin), torch.bfloat16)


def test_the_rms_norm_kernels_call_torch_npus_ops_with_their_schemas(as_npu, npu_namespace):
    _, schemas = npu_namespace
    assert schemas["npu_rms_norm"] == "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)"
    assert schemas["npu_add_rms_norm"].startswith("npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon")
    assert schemas["npu_rms_norm_backward"] == ("npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, "
                                                "Tensor rstd) -> (Tensor, Tensor)")
    x, x2, gamma = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(16)
    for got, want in zip(kernel(as_npu, fused.rms_norm.default)(x, gamma, 1e-5), fused.rms_norm(x, gamma, 1e-5)):
        assert_close(got, want)
    for got, want in zip(kernel(as_npu, fused.add_rms_norm.default)(x, x2, gamma), fused.add_rms_norm(x, x2, gamma)):
        assert_close(got, want)
    _, rstd = fused.rms_norm(x, gamma)
    dy = torch.randn_like(x)
    for got, want in zip(kernel(as_npu, fused.rms_norm_backward.default)(dy, x, gamma, rstd),
                         fused.rms_norm_backward(dy, x, gamma, rstd)):
        assert_close(got, want)
    with pytest.raises(ValueError, match="gamma dtype"):
        kernel(as_npu, fused.rms_norm.default)(x, gamma.half())
