"""Configuration of the npu_fuse backend, in the style of ``torch._inductor.config``.

Change a knob for a block of code with ``config.patch``::

    with npu_fuse_backend.config.patch(fallback="aot_eager", strict=True):
        torch.compile(model, backend="npu_fuse")(x)

The main knobs also read environment variables (shown beside each) when the
module is first imported.
"""

import os
import sys

from torch.utils._config_module import install_config_module


def _env_list(name: str) -> list:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


# Target SoC. "auto": the NPU's own SoC when torch_npu sees a device, else "generic".
# "generic" applies only the shape contract of each fused op, no per-SoC gates.
# Named SoCs: "Ascend910B", "Ascend910_93", "Ascend950".   [NPU_FUSE_SOC]
soc: str = os.environ.get("NPU_FUSE_SOC", "auto")

# Where the rewritten graph goes when there is no NPU: "inductor" (fused ops are
# lowered through their decompositions, so inductor fuses them as before) or
# "aot_eager" (the fused ops' reference kernels run).   [NPU_FUSE_FALLBACK]
fallback: str = os.environ.get("NPU_FUSE_FALLBACK", "inductor")

# Force a lowering: "auto" (torchair when torch_npu, torchair and an NPU are
# present, else the fallback), "npu" or "fallback".   [NPU_FUSE_LOWERING]
lowering: str = os.environ.get("NPU_FUSE_LOWERING", "auto")

# Names of fusion passes to skip, e.g. ["rope"].   [NPU_FUSE_DISABLE=rope,...]
disabled_fusions: list = _env_list("NPU_FUSE_DISABLE")

# Raise instead of warning when a fusion pass fails internally.   [NPU_FUSE_STRICT=1]
strict: bool = os.environ.get("NPU_FUSE_STRICT", "0") == "1"

# Run each rewrite's subgraph and replacement on random inputs; a difference refuses it (validate.py).
translation_validation: bool = True

# Keep at most this many per-graph reports for get_reports() (oldest dropped).
max_reports: int = 256

install_config_module(sys.modules[__name__])
