"""The fused ops' Python entry points: ``npu_fuse.ops.rotary_mul(x, cos, sin)`` and so on.

Collected from the ``__all__`` of every op module, so a new op appears here by itself.
Each is also a ``torch.ops.npu_fuse.*`` operator where torch.library defines one.
"""

from npu_fuse_backend.lowering.registry import public_entry_points

globals().update(public_entry_points())
__all__ = sorted(public_entry_points())
