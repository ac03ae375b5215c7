"""The ``npu_fuse`` Dynamo backend: AOTAutograd, the fusion passes, then a lowering."""

import logging
from typing import Optional

from torch.fx import GraphModule

from npu_fuse_backend.lowering import fallback, npu, npugraph_ex

from . import config
from .fusion import FusionSettings, PassManager, check_config
from .report import GraphReport, drain_cached_reports

log = logging.getLogger("npu_fuse")


def run_fusion_passes(gm: GraphModule, lowering: str = "", unsupported_ops: Optional[dict] = None, *,
                      settings: Optional[FusionSettings] = None) -> GraphReport:
    """Run every enabled fusion pass over one aten graph, in place; returns its report.

    ``unsupported_ops`` maps a fused op's name to why the lowering cannot take it (its
    rewrites become near-misses with that reason). ``settings``: the config values to run
    with (default: the config now, checked)."""
    return PassManager(settings=settings)(gm, lowering, unsupported_ops)


def npu_fuse_backend(gm: GraphModule, example_inputs, *, mode: Optional[str] = None,
                     options: Optional[dict] = None):
    """``torch.compile(model, backend="npu_fuse", mode=..., options=...)``: fuse RoPE & co.
    for Ascend NPUs.

    With an NPU (torch_npu + torchair, tensors on "npu") the graph goes to torchair's
    GE compiler, ``mode`` and ``options`` to its ``CompilerConfig`` (``mode="npugraph_ex"``:
    to npugraph_ex, the fused ops as their eager NPU kernels); elsewhere to
    ``config.fallback``: inductor (``mode``/``options`` as for ``backend="inductor"``)
    or aot_eager (neither).
    """
    check_config()
    use_npu = config.lowering == "npu" or (config.lowering == "auto" and npu.npu_usable(example_inputs))
    if use_npu and mode == npugraph_ex.LOWERING:
        compiled = npugraph_ex.compile_with_npugraph_ex(gm, example_inputs, run_fusion_passes, options=options)
    elif use_npu:
        compiled = npu.compile_with_torchair(gm, example_inputs, run_fusion_passes, mode=mode, options=options)
    elif config.fallback == "inductor":
        compiled = fallback.compile_with_inductor(gm, example_inputs, run_fusion_passes, mode=mode, options=options)
    else:
        compiled = fallback.compile_with_aot_eager(gm, example_inputs, run_fusion_passes, mode=mode,
                                                   options=options)
    drain_cached_reports()  # reports replayed by a cache hit (the backward's come with its lazy compile)
    return compiled


def get_npu_backend(*, compiler_config=None, custom_decompositions: Optional[dict] = None):
    """The npu_fuse backend with your own torchair ``CompilerConfig``, the way
    ``torchair.get_npu_backend`` is used::

        cfg = torchair.CompilerConfig()
        cfg.experimental_config.frozen_parameter = True
        model = torch.compile(model, backend=npu_fuse.get_npu_backend(compiler_config=cfg))

    It always lowers through torchair. Each compile works on a copy of ``compiler_config``
    (never modified) with our passes first in its ``post_grad_custom_pre_pass`` and yours
    after them; ``torch.compile``'s ``mode``/``options`` apply on top of the copy.
    """
    torchair = npu.import_torchair()
    if compiler_config is not None and not isinstance(compiler_config, torchair.CompilerConfig):
        raise TypeError(f"npu_fuse.get_npu_backend: compiler_config must be a torchair CompilerConfig, "
                        f"got {type(compiler_config).__name__}")

    def npu_fuse_torchair(gm: GraphModule, example_inputs, *, mode: Optional[str] = None,
                          options: Optional[dict] = None):
        check_config()
        return npu.compile_with_torchair(gm, example_inputs, run_fusion_passes, compiler_config=compiler_config,
                                         custom_decompositions=custom_decompositions, mode=mode, options=options)

    return npu_fuse_torchair


def get_npugraph_ex_backend(*, compiler_config=None, custom_decompositions: Optional[dict] = None):
    """The npu_fuse backend on npugraph_ex with your own npugraph_ex ``CompilerConfig``, the way
    ``npugraph_ex.get_npu_backend`` is used::

        cfg = npugraph_ex.CompilerConfig()
        cfg.frozen_parameter = True
        model = torch.compile(model, backend=npu_fuse.get_npugraph_ex_backend(compiler_config=cfg))

    It always lowers through npugraph_ex (aclgraph capture of eager NPU kernels). Each compile
    works on a copy of ``compiler_config`` (never modified) with our passes first in its
    ``post_grad_custom_pre_pass`` and yours after them; ``torch.compile``'s ``options`` set
    fields of the copy.
    """
    ex = npugraph_ex.import_npugraph_ex()
    if compiler_config is not None and not isinstance(compiler_config, ex.CompilerConfig):
        raise TypeError(f"npu_fuse.get_npugraph_ex_backend: compiler_config must be an npugraph_ex CompilerConfig, "
                        f"got {type(compiler_config).__name__}")

    def npu_fuse_npugraph_ex(gm: GraphModule, example_inputs, *, mode: Optional[str] = None,
                             options: Optional[dict] = None):
        check_config()
        return npugraph_ex.compile_with_npugraph_ex(gm, example_inputs, run_fusion_passes,
                                                    compiler_config=compiler_config,
                                                    custom_decompositions=custom_decompositions, mode=mode,
                                                    options=options)

    return npu_fuse_npugraph_ex
