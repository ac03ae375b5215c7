"""The ``npu_fuse`` Dynamo backend: AOTAutograd, the fusion passes, then a lowering.

The Python floats that ``dynamic=True`` makes graph inputs are specialized first (``float_inputs``).

Config is captured at compile time: the config in force when a frame is first compiled
governs every graph of it, the forward, the backward AOTAutograd compiles lazily at the first
``.backward()`` (outside any ``config.patch`` block the forward ran in), and the recompiles
of that frame (a new shape, a failed guard), until ``torch.compiler.reset()``.
"""

import functools
import logging
from typing import Callable, Optional

import torch
from torch.fx import GraphModule

from npu_fuse_backend.lowering import fallback, npu, npugraph_ex

from . import config, float_inputs
from .fusion import FusionSettings, PassManager, check_config
from .report import GraphReport, clear_reports, drain_cached_reports

log = logging.getLogger("npu_fuse")


def run_fusion_passes(gm: GraphModule, lowering: str = "", unsupported_ops: Optional[dict] = None, *,
                      settings: Optional[FusionSettings] = None) -> GraphReport:
    """Run every enabled fusion pass over one aten graph, in place; returns its report.

    ``unsupported_ops`` maps a fused op's name to why the lowering cannot take it (its
    rewrites become near-misses with that reason). ``settings``: the config values to run
    with (default: the config now, checked)."""
    return PassManager(settings=settings)(gm, lowering, unsupported_ops)


# Dynamo's frame id -> the config its first compile ran with (recompiles of the frame reuse it)
_frame_configs: dict = {}


def captured_config() -> dict:
    """The config this compile runs with: the one the frame's first compile ran with, else the
    current one, checked (a bad value is an error now, and never captured)."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    frame = getattr(compile_id, "frame_id", None)
    if frame in _frame_configs:
        return _frame_configs[frame]
    snapshot = config.get_config_copy()
    with config.patch(snapshot):
        check_config()
    if frame is not None:
        _frame_configs[frame] = snapshot
    return snapshot


def reset() -> None:
    """What ``torch.compiler.reset()`` does to us (it calls the ``reset`` of every backend compiled
    with since the last reset): reports and counters cleared, captured configs forgotten (Dynamo's
    frame ids start again)."""
    clear_reports()
    _frame_configs.clear()
    float_inputs.reset()


def under_config(snapshot: dict, graph_pass: Callable) -> Callable:
    """``graph_pass`` run under ``snapshot`` whenever it is called (the lazy backward too)."""
    @functools.wraps(graph_pass)
    def run(*args, **kwargs):
        with config.patch(snapshot):
            return graph_pass(*args, **kwargs)

    run.config_snapshot = snapshot  # the compile cache key reads the knobs the pass will run with
    return run


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
    snapshot = captured_config()
    with config.patch(snapshot):
        float_inputs.specialize_floats(gm)
        graph_pass = under_config(snapshot, run_fusion_passes)
        use_npu = config.lowering == "npu" or (config.lowering == "auto" and npu.npu_usable(example_inputs))
        if use_npu and mode == npugraph_ex.LOWERING:
            compiled = npugraph_ex.compile_with_npugraph_ex(gm, example_inputs, graph_pass, options=options)
        elif use_npu:
            compiled = npu.compile_with_torchair(gm, example_inputs, graph_pass, mode=mode, options=options)
        elif config.fallback == "inductor":
            compiled = fallback.compile_with_inductor(gm, example_inputs, graph_pass, mode=mode, options=options)
        else:
            compiled = fallback.compile_with_aot_eager(gm, example_inputs, graph_pass, mode=mode, options=options)
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

    return _route_backend("npu_fuse_torchair", npu.compile_with_torchair, compiler_config, custom_decompositions)


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

    return _route_backend("npu_fuse_npugraph_ex", npugraph_ex.compile_with_npugraph_ex, compiler_config,
                          custom_decompositions)


def _route_backend(name: str, compile_with: Callable, compiler_config, custom_decompositions: Optional[dict]):
    """A Dynamo backend lowering through one route (``compile_with``) with the user's compiler config,
    each compile under the config captured when it starts (as ``npu_fuse_backend`` itself)."""

    def backend(gm: GraphModule, example_inputs, *, mode: Optional[str] = None, options: Optional[dict] = None):
        snapshot = captured_config()
        with config.patch(snapshot):
            float_inputs.specialize_floats(gm)
            return compile_with(gm, example_inputs, under_config(snapshot, run_fusion_passes),
                                compiler_config=compiler_config, custom_decompositions=custom_decompositions,
                                mode=mode, options=options)

    backend.__name__ = backend.__qualname__ = name
    backend.reset = reset
    return backend


npu_fuse_backend.reset = reset
