"""Configuration of the npu_fuse backend, in the style of ``torch._inductor.config``.

Change a knob for a block of code with ``config.patch``::

    with npu_fuse_backend.config.patch(fallback="aot_eager", strict=True):
        torch.compile(model, backend="npu_fuse")(x)

The main knobs also read environment variables (shown beside each) when the
module is first imported. torch's config module has no per-knob validator, so the
backend checks every value when a compile starts (:func:`validate`, and ``fusion.check_config``
for the knobs whose values the package defines). This module imports nothing from the package.
"""

import os
import sys

from torch.utils._config_module import install_config_module

def _env(name: str, default: str) -> str:
    """A string environment variable; unset or empty means the default."""
    return os.environ.get(name, "").strip() or default


def _env_list(name: str) -> list:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _env_flag(name: str) -> bool:
    """A boolean environment variable; a value that is no usual spelling of true or false
    is an error rather than silently off."""
    on, off = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if word and word not in on + off:
        raise ValueError(f"npu_fuse: environment variable {name}={raw!r} is not a boolean; "
                         f"use one of {on} (on) or {off} (off)")
    return word in on


# Target SoC. "auto": the NPU's own SoC when torch_npu sees a device, else "generic".
# "generic" applies only the shape contract of each fused op, no per-SoC gates.
# Named SoCs: "Ascend910B", "Ascend910_93", "Ascend950".   [NPU_FUSE_SOC]
soc: str = _env("NPU_FUSE_SOC", "auto")

# Where the rewritten graph goes when there is no NPU: "inductor" (fused ops are
# lowered through their decompositions, so inductor fuses them as before) or
# "aot_eager" (the fused ops' reference kernels run).   [NPU_FUSE_FALLBACK]
fallback: str = _env("NPU_FUSE_FALLBACK", "inductor")

# Force a lowering: "auto" (torchair when torch_npu, torchair and an NPU are
# present, else the fallback), "npu" or "fallback".   [NPU_FUSE_LOWERING]
lowering: str = _env("NPU_FUSE_LOWERING", "auto")

# Names of fusion passes to skip, e.g. ["rope"].   [NPU_FUSE_DISABLE=rope,...]
disabled_fusions: list = _env_list("NPU_FUSE_DISABLE")

# Raise instead of warning when a fusion pass fails internally.   [NPU_FUSE_STRICT=1|true|yes|on]
strict: bool = _env_flag("NPU_FUSE_STRICT")

# Run each rewrite's subgraph and replacement on random inputs; a difference refuses it (validate.py).
translation_validation: bool = True

# Keep a rewrite that translation validation cannot evaluate within its budget (64 MB per
# evaluation; validate.py), with a warning and a mark in its report. Off: such a rewrite is refused.
keep_unvalidated_rewrites: bool = False

# Specialize the Python floats that dynamic=True passes as graph inputs (an RMSNorm's self.eps):
# guarded constants, until one changes between compiles of a frame (float_inputs.py). A fused
# op's epsilon or scale must be a constant.
specialize_floats: bool = True

# Keep at most this many per-graph reports for get_reports() (oldest dropped).
max_reports: int = 256

# Knobs that only shape the report, not the rewritten graph: left out of the compile-cache
# key (every other knob is in it, so a new knob invalidates cached graphs by default).
_cache_config_ignore_prefix: list = ["max_reports"]

def validate() -> None:
    """Check the knobs whose allowed values this module knows; each error names the knob (and its
    environment variable), the bad value and what is allowed. The knobs whose values the rest of the
    package defines (``soc``: the SoCs; ``disabled_fusions``: the registered fusions) are checked where
    they are used, by ``fusion.check_config``, so that this module imports nothing from the package."""
    config = sys.modules[__name__]
    require_one_of("fallback", config.fallback, ("inductor", "aot_eager"))
    require_one_of("lowering", config.lowering, ("auto", "npu", "fallback"))
    for name in ("strict", "translation_validation", "keep_unvalidated_rewrites", "specialize_floats"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{knob(name, getattr(config, name))}: must be True or False")
    if isinstance(config.max_reports, bool) or not isinstance(config.max_reports, int) \
            or config.max_reports < 0:
        raise ValueError(f"{knob('max_reports', config.max_reports)}: must be an int >= 0 "
                         "(how many per-graph reports get_reports() keeps)")


def knob(name: str, value) -> str:
    """How an error names a knob: ``npu_fuse config.NAME=VALUE (env VARIABLE)``."""
    env = {"soc": "NPU_FUSE_SOC", "fallback": "NPU_FUSE_FALLBACK", "lowering": "NPU_FUSE_LOWERING",
           "disabled_fusions": "NPU_FUSE_DISABLE", "strict": "NPU_FUSE_STRICT"}.get(name)
    return f"npu_fuse config.{name}={value!r}" + (f" (env {env})" if env else "")


def require_one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{knob(name, value)}: expected one of {allowed}")


install_config_module(sys.modules[__name__])
