"""npu_fuse: a torch.compile backend that fuses RoPE, softmax backward and the MLA
prologue into Ascend NPU ops, with a fallback lowering everywhere else.

    torch.compile(model, backend="npu_fuse")

``get_reports()`` says, per compiled graph, what fused and why near-misses did not.
"""

__version__ = "0.2.0"

import importlib.util as _importlib_util

if _importlib_util.find_spec(f"{__name__}.lowering") is None:  # else: a misleading "circular import"
    raise ImportError(
        f"{__name__}.lowering is not installed: the repository's lowering/ and converters/ folders become "
        f"{__name__}.lowering and {__name__}.converters only when the project is installed (setup.cfg "
        "package_dir). Run `pip install -e .` (or `make .venv/.installed`) in the checkout instead of "
        "importing it from its folder.")

from . import lowering  # noqa: E402, F401  (defines the npu_fuse:: ops)
from . import config
from .backend import get_npu_backend, get_npugraph_ex_backend, npu_fuse_backend, run_fusion_passes
from .lowering.npugraph_ex import npugraph_ex_pre_pass
from .fusion import FusionPass, Rewrite, register_fusion
from .report import GraphReport, Match, NearMiss, clear_reports, get_reports

__all__ = [
    "__version__", "FusionPass", "GraphReport", "Match", "NearMiss", "Rewrite", "clear_reports", "config",
    "get_npu_backend", "get_npugraph_ex_backend", "get_reports", "npu_fuse_backend", "npugraph_ex_pre_pass",
    "register_fusion", "run_fusion_passes",
]
