"""Fused custom ops and the hand-off of rewritten graphs to a compiler."""

from npu_fuse_backend.lowering.registry import load_ops

load_ops()
