"""The ``npu_fuse`` Dynamo backend: AOTAutograd, the fusion passes, then a lowering."""

import logging
from typing import Optional

from torch.fx import GraphModule

from .lowering import fallback, npu

from . import config
from .fusion import PassManager
from .report import GraphReport

log = logging.getLogger("npu_fuse")

LOWERINGS = ("auto", "npu", "fallback")
FALLBACKS = ("inductor", "aot_eager")


def run_fusion_passes(gm: GraphModule, lowering: str = "", unsupported_ops: Optional[dict] = None) -> GraphReport:
    """Run every enabled fusion pass over one aten graph, in place; returns its report.

    ``unsupported_ops`` maps a fused op's name to why the lowering cannot take it (its
    rewrites become near-misses with that reason)."""
    return PassManager()(gm, lowering, unsupported_ops)


def npu_fuse_backend(gm: GraphModule, example_inputs, **kwargs):
    """``torch.compile(model, backend="npu_fuse")``: fuse RoPE & co. for Ascend NPUs.

    With an NPU (torch_npu + torchair, tensors on "npu") the graph goes to torchair's
    GE compiler; elsewhere to ``config.fallback`` (inductor or aot_eager).
    """
    if config.lowering not in LOWERINGS:
        raise ValueError(f"npu_fuse config.lowering={config.lowering!r}: expected one of {LOWERINGS}")
    if config.fallback not in FALLBACKS:
        raise ValueError(f"npu_fuse config.fallback={config.fallback!r}: expected one of {FALLBACKS}")
    use_npu = config.lowering == "npu" or (config.lowering == "auto" and npu.npu_usable(example_inputs))
    if use_npu:
        return npu.compile_with_torchair(gm, example_inputs, run_fusion_passes)
    if config.fallback == "inductor":
        return fallback.compile_with_inductor(gm, example_inputs, run_fusion_passes)
    return fallback.compile_with_aot_eager(gm, example_inputs, run_fusion_passes)
