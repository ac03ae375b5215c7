"""The ``npu_fuse`` Dynamo backend: AOTAutograd, the fusion passes, then a lowering."""

import logging

from torch.fx import GraphModule

from .lowering import fallback, npu

from . import config
from .fusion import PassManager
from .report import GraphReport, drain_cached_reports

log = logging.getLogger("npu_fuse")


def run_fusion_passes(gm: GraphModule, lowering: str = "") -> GraphReport:
    """Run every enabled fusion pass over one aten graph, in place; returns its report."""
    config.validate()
    return PassManager()(gm, lowering)


def npu_fuse_backend(gm: GraphModule, example_inputs, **kwargs):
    """``torch.compile(model, backend="npu_fuse")``: fuse RoPE & co. for Ascend NPUs.

    With an NPU (torch_npu + torchair, tensors on "npu") the graph goes to torchair's
    GE compiler; elsewhere to ``config.fallback`` (inductor or aot_eager).
    """
    config.validate()
    use_npu = config.lowering == "npu" or (config.lowering == "auto" and npu.npu_usable(example_inputs))
    if use_npu:
        compiled = npu.compile_with_torchair(gm, example_inputs, run_fusion_passes)
    elif config.fallback == "inductor":
        compiled = fallback.compile_with_inductor(gm, example_inputs, run_fusion_passes)
    else:
        compiled = fallback.compile_with_aot_eager(gm, example_inputs, run_fusion_passes)
    drain_cached_reports()  # reports replayed by a cache hit (the backward's come with its lazy compile)
    return compiled
