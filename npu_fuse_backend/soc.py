"""Which SoC the fusion passes target (``config.soc``), and the SoC families.

"generic" means no NPU is targeted: passes check only the shape contract of each
fused op. A named SoC also applies the gates the spec lists for that SoC.
"""

import sys

from . import config

GENERIC = "generic"
ASCEND910B = "Ascend910B"
ASCEND910_93 = "Ascend910_93"
ASCEND950 = "Ascend950"
KNOWN_SOCS = (GENERIC, ASCEND910B, ASCEND910_93, ASCEND950)

# Atlas A2/A3: the Ascend910B family.
A2_A3 = (ASCEND910B, ASCEND910_93)


def npu_device_name() -> str:
    """The device name torch_npu reports, or "" when there is no usable NPU."""
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return ""
    try:
        if not torch_npu.npu.is_available():
            return ""
        return torch_npu.npu.get_device_name()
    except Exception:  # a broken driver means no NPU, not a failed compile
        return ""


def soc_from_device_name(name: str) -> str:
    if "Ascend950" in name or "Ascend910_95" in name:
        return ASCEND950
    if "Ascend910_93" in name:
        return ASCEND910_93
    if name.startswith("Ascend910B"):
        return ASCEND910B
    return GENERIC


def resolve_soc() -> str:
    soc = config.soc
    if soc == "auto":
        return soc_from_device_name(npu_device_name())
    if soc not in KNOWN_SOCS:
        raise ValueError(f"npu_fuse config.soc={soc!r}: expected 'auto' or one of {KNOWN_SOCS}")
    return soc
