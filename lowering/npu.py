"""Hand-off to torchair's GE compiler when torch_npu, torchair and an NPU are present.

The fusion passes run as torchair's ``post_grad_custom_pre_pass``: on the
functionalized aten graph, before torchair's own FX passes and before the FX->GE
conversion, where our converters (``converters/``) turn each fused op into its GE op.

``torch.compile``'s ``mode`` picks torchair's mode and its ``options`` set fields of the
``CompilerConfig`` by dotted name (``"debug.run_eagerly"``), always on a copy of the
caller's config.
"""

import copy
import difflib
import functools
import importlib
import inspect
import pkgutil
import sys
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule

from .registry import register_npu_kernels


# torch.compile's modes -> torchair's CompilerConfig.mode: GE graph mode ("max-autotune")
# or aclgraph capture ("reduce-overhead"). torchair's own mode names are accepted as well.
TORCH_COMPILE_MODES = {"default": "max-autotune", "max-autotune": "max-autotune",
                       "max-autotune-no-cudagraphs": "max-autotune", "reduce-overhead": "reduce-overhead"}


def import_torchair():
    """torchair as shipped inside torch_npu (top-level ``torchair`` when it is on the path)."""
    try:
        import torchair
    except ImportError:
        try:
            from torch_npu.dynamo import torchair
        except ImportError as exc:
            raise ImportError(
                f"npu_fuse: the NPU lowering (config.lowering='npu', NPU_FUSE_LOWERING=npu, or "
                f"npu_fuse.get_npu_backend) needs torchair, which ships inside torch_npu, but importing it "
                f"failed: {exc}. Install it with `pip install 'npu-fuse[npu]'` (torch_npu==2.13.0; it needs "
                "the CANN toolkit and an Ascend NPU), or compile without an NPU: backend='npu_fuse' with "
                "config.lowering='auto' or 'fallback' (config.fallback picks inductor or aot_eager)") from exc
    return torchair


def npu_usable(example_inputs) -> bool:
    """True when torch_npu is loaded and the graph's tensors live on an NPU."""
    if "torch_npu" not in sys.modules:
        return False
    return any(isinstance(t, torch.Tensor) and t.device.type == "npu" for t in example_inputs)


def load_converters() -> None:
    """Register every GE converter in ``converters/`` with torchair (idempotent)."""
    from .. import converters

    for info in pkgutil.iter_modules(converters.__path__):
        importlib.import_module(f"{converters.__name__}.{info.name}")


def compiler_config_fields(cfg) -> dict:
    """{dotted name: setter} for every field of a torchair CompilerConfig, found by walking
    the object: option values (set through their validating ``.value``), plain attributes,
    and properties with a setter (which stand for the private option behind them)."""
    from torchair.configs._option_base import OptionValue

    fields = {}

    def walk(node, prefix: str) -> None:
        properties = [name for name, attr in inspect.getmembers(type(node), lambda a: isinstance(a, property))
                      if attr.fset is not None]
        for name in properties:
            fields[prefix + name] = functools.partial(setattr, node, name)
        for name, value in vars(node).items():
            if name == "_fixed_attrs" or name.lstrip("_") in properties:
                continue
            if isinstance(value, OptionValue):
                fields[prefix + name] = functools.partial(setattr, value, "value")
            elif hasattr(value, "__dict__") and not callable(value):  # a nested config
                walk(value, f"{prefix}{name}.")
            else:
                fields[prefix + name] = functools.partial(setattr, node, name)

    walk(cfg, "")
    return fields


def configured_copy(torchair, compiler_config=None, mode: Optional[str] = None, options: Optional[dict] = None):
    """A copy of ``compiler_config`` (a default CompilerConfig when None) with torch.compile's
    ``mode`` and ``options`` applied; the caller's object is never modified."""
    cfg = copy.deepcopy(compiler_config) if compiler_config is not None else torchair.CompilerConfig()
    if mode is not None:
        torchair_modes = cfg.mode.optional
        if mode not in TORCH_COMPILE_MODES and mode not in torchair_modes:
            raise ValueError(f"npu_fuse: mode={mode!r} has no torchair equivalent; expected a torch.compile "
                             f"mode {sorted(TORCH_COMPILE_MODES)} or a torchair CompilerConfig.mode {torchair_modes}")
        cfg.mode = TORCH_COMPILE_MODES.get(mode, mode)
    fields = compiler_config_fields(cfg)
    del fields["mode"]  # set through mode=, not options
    for name, value in (options or {}).items():
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=3)
            raise ValueError(f"npu_fuse: options[{name!r}] is not a torchair CompilerConfig field"
                             f"{f' (did you mean {close}?)' if close else ''}; the fields are {sorted(fields)}")
        try:
            fields[name](value)
        except (TypeError, ValueError, FileNotFoundError) as exc:
            reason = str(exc).splitlines()[0]  # torchair appends a traceback to its messages
            raise ValueError(f"npu_fuse: torchair rejects options[{name!r}]={value!r}: {reason}") from None
    return cfg


def compile_with_torchair(gm: GraphModule, example_inputs, graph_pass: Callable[[GraphModule, str], Any],
                          compiler_config=None, custom_decompositions: Optional[dict] = None,
                          mode: Optional[str] = None, options: Optional[dict] = None):
    torchair = import_torchair()
    # a copy: installing our pre-pass must not change (and stack up on) the caller's config
    cfg = configured_copy(torchair, compiler_config, mode, options)
    load_converters()
    if "torch_npu" in sys.modules:
        register_npu_kernels()
    user_pre_pass = cfg.post_grad_custom_pre_pass.value

    def pre_pass(aten_gm: GraphModule, inputs, config):
        graph_pass(aten_gm, "torchair")
        if user_pre_pass is not None:
            user_pre_pass(aten_gm, inputs, config)

    cfg.post_grad_custom_pre_pass = pre_pass
    backend = torchair.get_npu_backend(compiler_config=cfg, custom_decompositions=custom_decompositions or {})
    return backend(gm, example_inputs)
