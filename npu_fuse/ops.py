"""The fused ops' Python entry points: ``npu_fuse.ops.rotary_mul(x, cos, sin)`` and so on.

Collected from the ``__all__`` of every op module, so a new op appears here by itself.
Each is also a ``torch.ops.npu_fuse.*`` operator where torch.library defines one; here it is a
plain function with the op's own signature and docstring (``help()``, ``inspect.signature``),
which a ``torch.library.custom_op`` object hides behind ``(*args, **kwargs)``.
"""

import functools
import inspect

from torch._library.custom_ops import CustomOpDef

from npu_fuse_backend.lowering.registry import public_entry_points


def _entry_point(name: str, op):
    """A custom op as a function with the signature and docstring of the function it was defined by."""
    if not isinstance(op, CustomOpDef):
        return op
    defined_by = op._init_fn

    @functools.wraps(defined_by)
    def call(*args, **kwargs):
        return op(*args, **kwargs)

    call.__signature__ = inspect.signature(defined_by)
    call.__module__ = __name__
    call.__qualname__ = name
    call.__wrapped__ = defined_by
    call.__doc__ = (f"{inspect.cleandoc(defined_by.__doc__ or '')}\n\n"
                    f"The operator: ``torch.ops.{op._qualname.replace('::', '.')}``.").lstrip()
    return call


globals().update({name: _entry_point(name, op) for name, op in public_entry_points().items()})
__all__ = sorted(public_entry_points())
