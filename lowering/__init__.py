"""Fused custom ops and the hand-off of rewritten graphs to a compiler."""

from .registry import load_ops

load_ops()
