"""Which SoC the fusion passes and converters target (``config.soc``), and the SoC families.

"generic" means *no NPU known* (no torch_npu device, or ``config.soc="generic"``): the
fused ops' shape contracts apply but no SoC's limits, and a GE graph built for it uses only
GE ops that every supported SoC has. It is never a guess on a real device: an NPU this
module does not recognise resolves to its own device name, a SoC no fused op claims, so
every fusion becomes a near-miss saying so (set ``config.soc`` to target it explicitly).
"""

import logging
import sys
from typing import Optional

from . import config
from .graph_utils import size_eq

log = logging.getLogger("npu_fuse")

GENERIC = "generic"
ASCEND910B = "Ascend910B"
ASCEND910_93 = "Ascend910_93"
ASCEND950 = "Ascend950"
KNOWN_SOCS = (GENERIC, ASCEND910B, ASCEND910_93, ASCEND950)
NPU_SOCS = (ASCEND910B, ASCEND910_93, ASCEND950)

# Atlas A2/A3: the Ascend910B family.
A2_A3 = (ASCEND910B, ASCEND910_93)

# torch_npu device-name prefixes of each SoC (get_device_name(): "Ascend910B3", "Ascend910_9391",
# "Ascend950PR_...", older 950 builds "Ascend910_95..."; torchair's is_arch35 reads the same names)
_DEVICE_PREFIXES = ((ASCEND910B, ("Ascend910B",)), (ASCEND910_93, ("Ascend910_93",)),
                    (ASCEND950, ("Ascend950", "Ascend910_95")))
_warned: set = set()


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
    """The SoC of a device name: "" -> generic (no NPU); an unrecognised NPU -> its own name."""
    if not name:
        return GENERIC
    for soc, prefixes in _DEVICE_PREFIXES:
        if name.startswith(prefixes):
            return soc
    if name not in _warned:
        _warned.add(name)
        log.warning("npu_fuse: unrecognised NPU %r: no fused op is known to run on it, nothing will fuse; set "
                    "npu_fuse.config.soc to one of %s if it is one of them", name, NPU_SOCS)
    return name


def resolve_soc(soc: Optional[str] = None) -> str:
    """The SoC to target for the ``config.soc`` value ``soc`` (default: the current config's)."""
    soc = config.soc if soc is None else soc
    if soc == "auto":
        return soc_from_device_name(npu_device_name())
    if soc not in KNOWN_SOCS:
        raise ValueError(f"npu_fuse config.soc={soc!r}: expected 'auto' or one of {KNOWN_SOCS}")
    return soc


def unknown_soc_reason(soc: str) -> str:
    """Why nothing targets a SoC that is not one of KNOWN_SOCS ("" for a known one)."""
    if soc in KNOWN_SOCS:
        return ""
    return f"unrecognised NPU {soc!r}: no fused op is known to run on it (set npu_fuse.config.soc to target one " \
           f"of {', '.join(NPU_SOCS)})"


def fits_layout(table_shape, x_shape, layout: str) -> bool:
    """Does a broadcast table (cos/sin) of ``table_shape`` have ``layout`` against x?

    ``layout`` names the table's dims by x's: a letter is x's size there, "1" is a size-1 dim
    (e.g. "BS1D" against BSND x). Symbolic sizes fit only when known equal.
    """
    if len(table_shape) != len(layout) or len(x_shape) != len(layout):
        return False
    return all(size_eq(t, 1) if letter == "1" else size_eq(t, x)
               for t, x, letter in zip(table_shape, x_shape, layout))
