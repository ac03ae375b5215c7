"""npu_fuse::rms_norm / npu_fuse::add_rms_norm — RMSNorm and Add+RMSNorm, as torch_npu's
``npu_rms_norm`` / ``npu_add_rms_norm`` (GE ``RmsNorm`` / ``AddRmsNorm``), and the backward
``rms_norm_backward`` (torch_npu ``npu_rms_norm_backward``, GE ``RmsNormGrad``).

The contract (CANN ops-nn ``norm/rms_norm`` and ``norm/add_rms_norm``: op-defs, protos,
aclnnRmsNorm.md, the goldens; transcribed in tests/cann_ir.py):

- ``rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``: over the last ``gamma.dim()`` dims of x,
  whose sizes are gamma's (``gamma.shape == x.shape[-gamma.dim():]``),
  ``rstd = rsqrt(mean(x^2) + epsilon)`` (float32, x's shape with the normalized dims 1) and
  ``y = x * rstd * gamma`` computed in float32 and rounded once to x's dtype.
- ``add_rms_norm(x1, x2, gamma, epsilon=1e-6) -> (y, rstd, x)``: ``x = x1 + x2`` (float32, rounded to
  x1's dtype as the output x) and y, rstd of that sum (Ascend950's kernel, as its golden; Atlas A2/A3's
  kernel normalizes the rounded sum, and for bfloat16 rounds ``x * rstd`` before gamma: the same
  values within the dtype's rounding).
- Dtypes: x float16, bfloat16 or float32; gamma x's dtype, or float32 with a float16/bfloat16 x
  (RmsNorm's op-def columns); add_rms_norm: x1, x2 and gamma one dtype (AddRmsNorm's columns).
- x 1-D to 8-D and not empty along the normalized dims, gamma 1..x.dim() dims; epsilon >= 0;
  every tensor on one device.
- ``rms_norm_backward(dy, x, gamma, rstd) -> (dx, dgamma)``: dx in x's dtype, dgamma float32
  (torch_npu's meta); autograd of both forward ops uses it, rstd being no differentiable output.

GE: ``RmsNorm`` / ``AddRmsNorm`` exist on ascend910b, ascend910_93 and ascend950 (their op-defs'
AICore configs): no SoC without a kernel, no per-SoC limits beyond the contract.
"""

import torch
from torch import Tensor

from npu_fuse_backend.lowering.common import FLOAT_DTYPES, HALF_DTYPES, check_one_device, like
from npu_fuse_backend.lowering.registry import decomposition, npu_kernel

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_backward"]  # public entry points (npu_fuse.ops)

MAX_RANK = 8  # aclnnRmsNorm: x, gamma 1-8-D


def check_rms_norm_args(x: Tensor, gamma: Tensor, epsilon: float, op: str = "npu_fuse.rms_norm",
                        x_name: str = "x", gamma_dtypes: str = "rms_norm") -> None:
    """Raise ValueError naming the op, the argument and the first rule of the contract it breaks
    (``gamma_dtypes``: "rms_norm" takes float32 gamma with a half x, "add_rms_norm" one dtype only)."""
    check_one_device(op, {x_name: x, "gamma": gamma})
    if not 1 <= x.dim() <= MAX_RANK:
        raise ValueError(f"{op}: {x_name} must be 1-D to {MAX_RANK}-D, got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {x_name} dtype must be float16, bfloat16 or float32, got {x.dtype}")
    allowed = (x.dtype, torch.float32) if gamma_dtypes == "rms_norm" and x.dtype in HALF_DTYPES else (x.dtype,)
    if gamma.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{op}: gamma dtype must be {names} with a {str(x.dtype).removeprefix('torch.')} "
                         f"{x_name}, got {gamma.dtype}")
    if not 1 <= gamma.dim() <= x.dim():
        raise ValueError(f"{op}: gamma must be 1-D to {x.dim()}-D ({x_name}'s rank), got {gamma.dim()}-D")
    normalized = tuple(x.shape[x.dim() - gamma.dim():])
    if tuple(gamma.shape) != normalized:
        raise ValueError(f"{op}: gamma shape {tuple(gamma.shape)} must be the last dims of {x_name}, "
                         f"{normalized} ({x_name} {tuple(x.shape)})")
    if gamma.numel() == 0:
        raise ValueError(f"{op}: the normalized dims {normalized} must not be empty")
    if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or not epsilon >= 0:
        raise ValueError(f"{op}: epsilon must be a number >= 0, got {epsilon!r}")


def check_add_rms_norm_args(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> None:
    op = "npu_fuse.add_rms_norm"
    check_one_device(op, {"x1": x1, "x2": x2, "gamma": gamma})
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise ValueError(f"{op}: x1 and x2 must have one shape and dtype, got {tuple(x1.shape)} {x1.dtype} and "
                         f"{tuple(x2.shape)} {x2.dtype}")
    check_rms_norm_args(x1, gamma, epsilon, op, "x1", gamma_dtypes="add_rms_norm")


def _normalized_dims(x: Tensor, gamma: Tensor) -> list:
    return list(range(x.dim() - gamma.dim(), x.dim()))


def _rstd_shape(x: Tensor, gamma: Tensor) -> list:
    return [*x.shape[: x.dim() - gamma.dim()], *[1] * gamma.dim()]


def _normalize(xf: Tensor, gamma: Tensor, epsilon: float, dtype: torch.dtype) -> tuple:
    """(y in dtype, rstd) of a float32 x."""
    rstd = torch.rsqrt(xf.pow(2).mean(_normalized_dims(xf, gamma), keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(dtype), rstd


# -- rms_norm ---------------------------------------------------------------------------------
@torch.library.custom_op("npu_fuse::rms_norm", mutates_args=())
def rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(y, rstd): RMSNorm of x over gamma's dims, as torch_npu's ``npu_rms_norm``."""
    check_rms_norm_args(x, gamma, epsilon)
    return rms_norm_reference(x, gamma, epsilon)


@decomposition(torch.ops.npu_fuse.rms_norm.default)
def rms_norm_reference(x: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple:
    y, rstd = _normalize(x.float(), gamma, epsilon, x.dtype)
    return like(y, x), rstd


@rms_norm.register_fake
def _(x, gamma, epsilon=1e-6):
    check_rms_norm_args(x, gamma, epsilon)
    return torch.empty_like(x), x.new_empty(_rstd_shape(x, gamma), dtype=torch.float32)


# -- add_rms_norm -------------------------------------------------------------------------------
@torch.library.custom_op("npu_fuse::add_rms_norm", mutates_args=())
def add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """(y, rstd, x): x = x1 + x2, and the RMSNorm of x, as torch_npu's ``npu_add_rms_norm``."""
    check_add_rms_norm_args(x1, x2, gamma, epsilon)
    return add_rms_norm_reference(x1, x2, gamma, epsilon)


@decomposition(torch.ops.npu_fuse.add_rms_norm.default)
def add_rms_norm_reference(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6) -> tuple:
    xf = x1.float() + x2.float()
    y, rstd = _normalize(xf, gamma, epsilon, x1.dtype)
    return like(y, x1), rstd, like(xf.to(x1.dtype), x1)


@add_rms_norm.register_fake
def _(x1, x2, gamma, epsilon=1e-6):
    check_add_rms_norm_args(x1, x2, gamma, epsilon)
    return torch.empty_like(x1), x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32), torch.empty_like(x1)


# -- rms_norm_backward and autograd --------------------------------------------------------------
def check_rms_norm_backward_args(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor) -> None:
    op = "npu_fuse.rms_norm_backward"
    check_rms_norm_args(x, gamma, 0.0, op)
    check_one_device(op, {"x": x, "dy": dy, "rstd": rstd})
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"{op}: dy must have x's shape and dtype {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(dy.shape)} {dy.dtype}")
    if list(rstd.shape) != _rstd_shape(x, gamma) or rstd.dtype != torch.float32:
        raise ValueError(f"{op}: rstd must be float32 of shape {tuple(_rstd_shape(x, gamma))}, got "
                         f"{tuple(rstd.shape)} {rstd.dtype}")


@torch.library.custom_op("npu_fuse::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dgamma) of ``y = x * rstd * gamma``, given the forward's rstd; dgamma in float32."""
    check_rms_norm_backward_args(dy, x, gamma, rstd)
    return rms_norm_backward_reference(dy, x, gamma, rstd)


@decomposition(torch.ops.npu_fuse.rms_norm_backward.default)
def rms_norm_backward_reference(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor) -> tuple:
    dims = _normalized_dims(x, gamma)
    g, xf = dy.float() * gamma.float(), x.float()
    # y = x * r * gamma, r = (mean(x^2) + eps)^-1/2:  dx = r * g - x * r^3 * mean(g * x)
    dx = rstd * g - xf * rstd.pow(3) * (g * xf).mean(dims, keepdim=True)
    dgamma = (dy.float() * xf * rstd).sum_to_size(gamma.shape)
    return like(dx.to(x.dtype), x), dgamma


@rms_norm_backward.register_fake
def _(dy, x, gamma, rstd):
    check_rms_norm_backward_args(dy, x, gamma, rstd)
    return torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=torch.float32)


def _setup_rms_norm(ctx, inputs, output):
    x, gamma, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, gamma, rstd)


def _rms_norm_grad(ctx, dy, _):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu_fuse.rms_norm_backward(dy, x, gamma, rstd)
    return dx, dgamma.to(gamma.dtype), None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_setup_rms_norm)


def _setup_add_rms_norm(ctx, inputs, output):
    x1, x2, gamma, _ = inputs
    _, rstd, x = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, gamma, rstd)
    ctx.dtypes = x1.dtype, x2.dtype


def _add_rms_norm_grad(ctx, dy, _, dx_out):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu_fuse.rms_norm_backward(dy, x, gamma, rstd)
    if dx_out is not None:
        dx = dx + dx_out
    return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dgamma.to(gamma.dtype), None


add_rms_norm.register_autograd(_add_rms_norm_grad, setup_context=_setup_add_rms_norm)


# -- eager NPU kernels: torch_npu's ops (schemas: W torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml)
@npu_kernel(rms_norm)
def _rms_norm_npu(x, gamma, epsilon=1e-6):
    check_rms_norm_args(x, gamma, epsilon)
    # npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
    return torch.ops.npu.npu_rms_norm(x, gamma, epsilon)


@npu_kernel(add_rms_norm)
def _add_rms_norm_npu(x1, x2, gamma, epsilon=1e-6):
    check_add_rms_norm_args(x1, x2, gamma, epsilon)
    # npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)
    return torch.ops.npu.npu_add_rms_norm(x1, x2, gamma, epsilon)


@npu_kernel(rms_norm_backward)
def _rms_norm_backward_npu(dy, x, gamma, rstd):
    check_rms_norm_backward_args(dy, x, gamma, rstd)
    # npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)
    return torch.ops.npu.npu_rms_norm_backward(dy, x, gamma, rstd)
