"""npu_fuse: a torch.compile backend that fuses RoPE, softmax backward and the MLA
prologue into Ascend NPU ops, with a fallback lowering everywhere else.

    torch.compile(model, backend="npu_fuse")

``get_reports()`` says, per compiled graph, what fused and why near-misses did not.
"""

__version__ = "0.2.0"

from . import lowering  # noqa: F401  (defines the npu_fuse:: ops)
from . import config
from .backend import get_npu_backend, npu_fuse_backend, run_fusion_passes
from .fusion import FusionPass, Rewrite, register_fusion
from .report import GraphReport, Match, NearMiss, clear_reports, get_reports

__all__ = [
    "__version__", "FusionPass", "GraphReport", "Match", "NearMiss", "Rewrite", "clear_reports", "config",
    "get_npu_backend", "get_reports", "npu_fuse_backend", "register_fusion", "run_fusion_passes",
]
