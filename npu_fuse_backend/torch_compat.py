"""What differs between the torch minors npu_fuse supports (2.10 to 2.14), written once.

Each difference is found by what the installed torch has, never by its version number, so a
patch release that backports a name needs nothing here. Graph-level differences (aten spellings,
decompositions) are read in ``canonicalize``; this module holds the API differences only.
"""

import torch

try:  # torch >= 2.11
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as _guarding_hint
except ImportError:
    _guarding_hint = None

try:  # torch >= 2.11: post_grad_custom_pre_pass may be a list (torch 2.10 takes one pass)
    from torch._inductor.custom_graph_pass import get_custom_graph_passes as _get_custom_graph_passes
except ImportError:
    _get_custom_graph_passes = None

INDUCTOR_TAKES_PASS_LISTS = _get_custom_graph_passes is not None


def concrete_hint(x):
    """The value a symbolic int, float or bool had when traced (a plain value as it is); raises where
    it has none (a data-dependent size)."""
    if _guarding_hint is not None:
        return _guarding_hint(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.require_hint()
    return x


def custom_graph_passes(value) -> tuple:
    """inductor's ``post_grad_custom_pre_pass`` setting (None, one pass, or a list) as a tuple."""
    if not value:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)




def torch_npu_install_hint() -> str:
    """How to install the torch_npu that goes with the installed torch (each torch_npu pins one
    torch minor, so no extra of ours can pick it)."""
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (f"install the torch_npu built for your torch {torch.__version__} (torch_npu {minor}.*, from PyPI "
            "or Ascend's index; it needs the CANN toolkit and an Ascend NPU), and torchair's Python "
            "dependencies with `pip install protobuf packaging` (the `npu` extra of npu-fuse)")
