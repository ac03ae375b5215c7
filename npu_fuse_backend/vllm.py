"""npu_fuse's fusion passes inside vLLM's compile.

vLLM compiles its model itself; a pass of ours joins that compile through
``compilation_config["inductor_compile_config"][<the platform's pass key>]``::

    from vllm import LLM
    import npu_fuse.vllm

    llm = LLM(model, compilation_config=npu_fuse.vllm.compilation_config({"custom_ops": ["all"]}))

Where it runs (vLLM 0.32.0 and vllm-ascend sources):

- CPU (``vllm/platforms/cpu.py``): vLLM calls ``torch.compile(..., backend="inductor",
  options=inductor_compile_config)``, so the pass is inductor's ``post_grad_custom_post_pass``
  and nothing of vLLM's own pass manager is involved.
- CUDA and other in-tree platforms (``vllm/compilation/backends.py``,
  ``VllmBackend.configure_post_pass``): the entry under ``current_platform.pass_key``
  ("post_grad_custom_post_pass") must be an ``InductorPass``; vLLM adds it to its
  ``PostGradPassManager`` (``vllm/compilation/passes/pass_manager.py``), after its own
  fusions and before its clean-up and ``fix_functionalization``.
- vllm-ascend (``vllm_ascend/platform.py``): ``pass_key`` is "graph_fusion_manager" and
  ``get_pass_manager_cls`` its ``GraphFusionPassManager``
  (``vllm_ascend/compilation/graph_fusion_pass_manager.py``), which takes only a
  ``VllmInductorPass`` and hands it the GraphModule of the forward graph. It runs where
  vllm-ascend's ``AscendCompiler`` does not use npugraph_ex (``fusion_pass_compile`` in
  ``vllm_ascend/compilation/compiler_interface.py``); its npugraph_ex route never calls the
  pass manager.

So :class:`NpuFusePass` is a ``VllmInductorPass`` when vLLM is installed (a plain inductor
``CustomGraphPass`` otherwise) and :func:`compilation_config` puts it under the running
platform's key. Its ``uuid()`` is :class:`~npu_fuse_backend.lowering.fallback.FusionPrePass`'s
(our sources, the registered fusions, the config), taken under the config it carries: the
config is captured when the pass is made and travels with it (pickled) into vLLM's worker
process, where ``npu_fuse.config.patch`` of the parent never reaches. On inductor the fused
ops are lowered through their decompositions, as in ``backend="npu_fuse"``; on an NPU
(tensors on "npu") they stay, for their torch_npu kernels.

The worker is another process, so its reports come out there: one line per graph through
vLLM's logger (``vllm.npu_fuse``, printed with vLLM's own messages), the whole report through
the ``npu_fuse`` logger (``TORCH_LOGS="npu_fuse"``), and, with ``report_file`` (or
``NPU_FUSE_REPORT_FILE``), one JSON line per graph appended to that file, read back with
:func:`read_reports`. vLLM is inference-only: these are inference graphs.
"""

import collections
import hashlib
import importlib.util
import json
import logging
import os
from typing import Optional

from torch.fx import Graph, GraphModule

from . import config
from .backend import run_fusion_passes
from .fusion import check_config
from npu_fuse_backend.lowering.fallback import FusionPrePass, decompose_fused_ops
from .report import GraphReport, stash_for_compile_cache

REPORT_FILE_ENV = "NPU_FUSE_REPORT_FILE"
# a child of vLLM's "vllm" logger, which vLLM's logging config prints (vllm/logger.py)
vllm_log = logging.getLogger("vllm.npu_fuse")

if importlib.util.find_spec("vllm") is not None:
    # vLLM's PostGradPassManager takes an InductorPass, vllm-ascend's GraphFusionPassManager a VllmInductorPass
    from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass

    _BASES: tuple = (FusionPrePass, VllmInductorPass)
else:
    _BASES = (FusionPrePass,)


class NpuFusePass(*_BASES):
    """npu_fuse's fusion passes as a vLLM compile pass (see the module docstring).

    ``NpuFusePass(report_file=None, **config)``: ``config`` are ``npu_fuse.config`` knobs
    (``soc="Ascend910B"``, ``disabled_fusions=["rope"]``, ...) applied on top of the
    config as it is now; ``report_file`` (default: ``$NPU_FUSE_REPORT_FILE``) collects one
    JSON report per compiled graph from every worker."""

    def __init__(self, report_file: Optional[str] = None, **config_patches):
        FusionPrePass.__init__(self, run_fusion_passes)  # vLLM's __init__ needs a VllmConfig it does not have yet
        self.pass_name = type(self).__name__
        self.config = {**config.save_config_portable(), **config_patches}
        with config.patch(**self.config):
            check_config()  # a bad knob fails here, not in the worker
        self.report_file = report_file if report_file is not None else os.environ.get(REPORT_FILE_ENV) or None

    def __call__(self, graph) -> None:
        """Fuse one graph in place: a torch.fx Graph (inductor, vLLM) or a GraphModule (vllm-ascend)."""
        gm = graph if isinstance(graph, GraphModule) else graph.owning_module
        on_npu = _on_npu(gm.graph)
        with config.patch(**self.config):
            report = self.graph_pass(gm, "vllm (npu)" if on_npu else "vllm (inductor)")
            if not on_npu:
                decompose_fused_ops(gm)  # inductor compiles what plain inductor would, fused
            stash_for_compile_cache(report)
        self._emit(report)

    def uuid(self) -> str:
        with config.patch(**self.config):
            identity = [FusionPrePass.uuid(self), type(self).__qualname__]
        return hashlib.sha256(json.dumps(identity).encode()).hexdigest()

    def _emit(self, report: GraphReport) -> None:
        vllm_log.info("%s", one_line(report))
        if self.report_file:
            with open(self.report_file, "a", encoding="utf-8") as out:  # one write per report: workers append
                out.write(report.to_json() + "\n")

    def __repr__(self) -> str:
        return f"NpuFusePass(report_file={self.report_file!r}, config={self.config!r})"


def _on_npu(graph: Graph) -> bool:
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if getattr(value, "device", None) is not None and value.device.type == "npu":
            return True
    return False


def one_line(report: GraphReport) -> str:
    """A graph's report in one line: what fused, how many near-misses and their reasons."""
    fused = ", ".join(f"{op} x{count}" for op, count in sorted(report.fused_counts().items())) or "nothing"
    reasons = collections.Counter(f"{n.family}: {n.reason}" for n in report.near_misses)
    misses = "; ".join(f"{reason}{f' (x{count})' if count > 1 else ''}" for reason, count in reasons.items())
    errors = f"; pass errors: {'; '.join(report.errors)}" if report.errors else ""
    return (f"npu_fuse: graph {report.graph_id} ({report.kind}, {report.node_count} nodes, pid {os.getpid()}): "
            f"fused {fused}; {len(report.near_misses)} near-misses{': ' + misses if misses else ''}{errors}; "
            f"passes {report.pass_seconds * 1e3:.1f} ms")


def compilation_config(base: Optional[dict] = None, *, report_file: Optional[str] = None,
                       **config_patches) -> dict:
    """``base``, a vLLM compilation config (a dict, as ``LLM(compilation_config=...)`` takes it), with an
    :class:`NpuFusePass` under the running vLLM platform's pass key (``current_platform.pass_key``:
    "post_grad_custom_post_pass" in vLLM, "graph_fusion_manager" in vllm-ascend)."""
    from vllm.platforms import current_platform

    result = dict(base or {})
    inductor = dict(result.get("inductor_compile_config") or {})
    key = current_platform.pass_key
    if key in inductor:
        raise ValueError(f"npu_fuse.vllm.compilation_config: inductor_compile_config[{key!r}] is already set "
                         f"({inductor[key]!r}); vLLM takes one pass there")
    inductor[key] = NpuFusePass(report_file=report_file, **config_patches)
    result["inductor_compile_config"] = inductor
    return result


def read_reports(path: str) -> list[GraphReport]:
    """The reports a :class:`NpuFusePass` appended to ``path``, oldest first (every worker's)."""
    with open(path, encoding="utf-8") as lines:
        return [GraphReport.from_json(line) for line in lines if line.strip()]
