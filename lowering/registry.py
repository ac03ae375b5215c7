"""What each fused op registers besides its torch.library definition.

- ``@decomposition(op)``: the op written in aten ops, used by lowerings that
  compile aten (inductor) so that a fused op costs nothing where no NPU kernel exists.
  A mutating op's decomposition is functional: it returns ``(outputs, new values of
  the mutated arguments)``.
- ``refuse_autograd(name, why)``: for a mutating op without a derivative, an error
  when an input requires grad, instead of autograd silently not recording the op.
- ``@npu_kernel(op)``: the op's torch_npu kernel, registered for the "npu" device
  only once torch_npu is loaded (the device type does not exist before).
- ``@soc_limits(op)``: ``fn(soc, *args, **kwargs) -> reason or None``, the limits the
  op's NPU kernel has on a SoC ("generic": no SoC known), checked by the pass manager on
  every call a fusion inserts (fake arguments), so a rewrite the SoC cannot run is a
  near-miss naming the limit. An unrecognised NPU, and a SoC where the op has no kernel
  (``unavailable_on``), are refused before ``fn`` is asked.
- ``kernel_size_limits()``: whether an op's checker applies the ranges its NPU kernel takes
  sizes in (a hidden size of 2048..8192, at most 1024 tokens): true but while translation
  validation evaluates a rewrite at shrunk sizes (``size_limits_lifted()``), where the same
  computation runs at other sizes and the call at its real sizes was checked when it was built.
- ``unavailable_on(op, {soc: why})``: the SoCs where the op has no kernel at all, said once:
  the pass manager refuses the op's fusions there and its converter declares no GE op there
  (``converters/common.declare_ge_ops`` takes the reasons from here).

Each op's argument checker (``check_<op>_args``, beside the op) is its one statement of its
contract: its eager, fake and NPU kernels call it, and so every fused-op call a rewrite builds
is checked by it (the builder runs the op's fake kernel), its error being the near-miss reason.

Every module in ``lowering/ops`` is imported by :func:`load_ops`, so adding an op
touches nothing here; the names in each module's ``__all__`` are its public entry
points, re-exported as ``npu_fuse.ops``.
"""

import contextlib
import importlib
import pkgutil
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree

from npu_fuse_backend.soc import unknown_soc_reason

DECOMPOSITIONS: dict = {}
SOC_LIMITS: dict = {}  # op -> fn(soc, *args, **kwargs) -> why the op cannot take the call on soc, or None
UNAVAILABLE: dict = {}  # op -> {soc: why the op has no kernel there}
_autograd_guards = torch.library.Library("npu_fuse", "FRAGMENT")
_npu_kernels: list = []
_npu_kernels_registered = False
_size_limits_lifted = 0


@contextlib.contextmanager
def size_limits_lifted():
    """Ops' checkers skip the size ranges of their NPU kernels (see ``kernel_size_limits``)."""
    global _size_limits_lifted
    _size_limits_lifted += 1
    try:
        yield
    finally:
        _size_limits_lifted -= 1


def kernel_size_limits() -> bool:
    """Whether a checker applies the size ranges only its op's NPU kernel has (not what it computes)."""
    return not _size_limits_lifted


def decomposition(op: torch._ops.OpOverload) -> Callable:
    def register(fn: Callable) -> Callable:
        DECOMPOSITIONS[op] = fn
        return fn

    return register


def soc_limits(op: torch._ops.OpOverload) -> Callable:
    def register(fn: Callable) -> Callable:
        def checked(soc: str, *args, **kwargs):
            return _refused_before_limits(op, soc) or fn(soc, *args, **kwargs)

        SOC_LIMITS[op] = checked
        return fn

    return register


def unavailable_on(op: torch._ops.OpOverload, why: dict[str, str]) -> None:
    UNAVAILABLE[op] = dict(why)


def soc_refusal(op: torch._ops.OpOverload, soc: str, *args, **kwargs) -> Optional[str]:
    """Why the op cannot take this call (fake arguments) on soc: an unrecognised NPU, a SoC without
    its kernel, or its limits there; None when it can. Every fused op is asked, with limits or not."""
    limits = SOC_LIMITS.get(op)
    return limits(soc, *args, **kwargs) if limits is not None else _refused_before_limits(op, soc)


def _refused_before_limits(op: torch._ops.OpOverload, soc: str) -> Optional[str]:
    """An unrecognised NPU, or a SoC where the op has no kernel."""
    return unknown_soc_reason(soc) or UNAVAILABLE.get(op, {}).get(soc)


def refuse_autograd(name: str, why: str) -> None:
    """Register an Autograd kernel for ``npu_fuse::name`` that raises when grad mode is on and
    an input requires grad (torch.library cannot attach derivatives to mutating ops, and
    without this the call would be invisible to autograd)."""
    op = getattr(torch.ops.npu_fuse, name).default

    def guard(*args, **kwargs):
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in pytree.tree_leaves((args, kwargs))):
            raise RuntimeError(f"npu_fuse.{name}: {why}")
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    # replaces the Autograd kernel custom_op registers (torch < 2.13 refuses that without allow_override)
    _autograd_guards.impl(name, guard, "Autograd", allow_override=True)


def npu_kernel(op) -> Callable:
    def register(fn: Callable) -> Callable:
        _npu_kernels.append((op, fn))
        return fn

    return register


def _op_modules() -> list:
    from npu_fuse_backend.lowering import ops

    return [importlib.import_module(f"{ops.__name__}.{info.name}") for info in pkgutil.iter_modules(ops.__path__)]


def load_ops() -> None:
    _op_modules()


def public_entry_points() -> dict:
    """{name: callable} of every op module's ``__all__``."""
    return {name: getattr(module, name) for module in _op_modules() for name in getattr(module, "__all__", ())}


def register_npu_kernels() -> None:
    """Route the fused ops to torch_npu's kernels for NPU tensors (idempotent)."""
    global _npu_kernels_registered
    if _npu_kernels_registered:
        return
    for op, fn in _npu_kernels:
        op.register_kernel("npu", fn)
    _npu_kernels_registered = True


def ops_with_npu_kernels() -> set:
    """Qualified names ("npu_fuse::rotary_mul") of the fused ops that have an eager NPU kernel."""
    return {op._qualname for op, _ in _npu_kernels}
