"""npu_fuse: a torch.compile backend that fuses RoPE, softmax backward and the MLA
prologue into Ascend NPU ops, with a fallback lowering everywhere else.

    torch.compile(model, backend="npu_fuse")      # no import needed: an entry point

The public API, in one place:

- ``npu_fuse.ops.<op>``: the fused ops' Python entry points (``rotary_mul``,
  ``inplace_partial_rotary_mul``, ``softmax_grad_ext``, ``mla_preprocess``, ...);
- ``npu_fuse.config``: the backend's knobs (``config.patch(...)``);
- ``npu_fuse.get_npu_backend(compiler_config=...)``: the backend with your own torchair
  ``CompilerConfig`` (``torch.compile``'s ``mode=``/``options=`` work with the plain backend too);
- ``npu_fuse.get_npugraph_ex_backend(compiler_config=...)``: the backend on npugraph_ex with your own
  npugraph_ex ``CompilerConfig`` (or ``mode="npugraph_ex"`` with the plain backend);
- ``npu_fuse.npugraph_ex_pre_pass``: our fusions as npugraph_ex's ``post_grad_custom_pre_pass``, for
  ``backend="npugraph_ex"``;
- ``npu_fuse.get_reports()`` / ``clear_reports()``: what each compiled graph fused, and why not;
- ``npu_fuse.register_fusion`` / ``FusionPass`` / ``Rewrite``: adding a fusion pass;
- ``npu_fuse.vllm``: the passes as a vLLM compile pass (loaded on first use: vLLM is optional).

The implementation lives in ``npu_fuse_backend`` (the package this one re-exports);
importing ``npu_fuse`` also makes ``TORCH_LOGS="+npu_fuse"`` a valid log name.
"""

from npu_fuse_backend import (
    FusionPass, GraphReport, Match, NearMiss, Rewrite, __version__, clear_reports, config, get_npu_backend,
    get_npugraph_ex_backend, get_reports, npu_fuse_backend, npugraph_ex_pre_pass, register_fusion,
    run_fusion_passes,
)

from . import ops

__all__ = [
    "FusionPass", "GraphReport", "Match", "NearMiss", "Rewrite", "__version__", "clear_reports", "config",
    "get_npu_backend", "get_npugraph_ex_backend", "get_reports", "npu_fuse_backend", "npugraph_ex_pre_pass",
    "ops", "register_fusion", "run_fusion_passes",
]


def __getattr__(name: str):
    if name == "vllm":  # on first use only: it imports vLLM's pass classes
        import importlib

        return importlib.import_module("npu_fuse.vllm")
    raise AttributeError(f"module 'npu_fuse' has no attribute {name!r}")
