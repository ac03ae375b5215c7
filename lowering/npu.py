"""Hand-off to torchair's GE compiler when torch_npu, torchair and an NPU are present.

The fusion passes run as torchair's ``post_grad_custom_pre_pass``: on the
functionalized aten graph, before torchair's own FX passes and before the FX->GE
conversion, where our converters (``converters/``) turn each fused op into its GE op.
"""

import copy
import importlib
import pkgutil
import sys
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from .registry import register_npu_kernels


def import_torchair():
    """torchair as shipped inside torch_npu (top-level ``torchair`` when it is on the path)."""
    try:
        import torchair
    except ImportError:
        from torch_npu.dynamo import torchair
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


def compile_with_torchair(gm: GraphModule, example_inputs, graph_pass: Callable[[GraphModule, str], Any],
                          compiler_config=None):
    torchair = import_torchair()
    from torchair.configs.compiler_config import CompilerConfig

    load_converters()
    if "torch_npu" in sys.modules:
        register_npu_kernels()
    # a copy: installing our pre-pass must not change (and stack up on) the caller's config
    cfg = copy.deepcopy(compiler_config) if compiler_config is not None else CompilerConfig()
    user_pre_pass = cfg.post_grad_custom_pre_pass.value

    def pre_pass(aten_gm: GraphModule, inputs, config):
        graph_pass(aten_gm, "torchair")
        if user_pre_pass is not None:
            user_pre_pass(aten_gm, inputs, config)

    cfg.post_grad_custom_pre_pass = pre_pass
    return torchair.get_npu_backend(compiler_config=cfg)(gm, example_inputs)
