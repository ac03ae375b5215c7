"""Hand-off to npugraph_ex: torch_npu's capture of eager NPU kernels into aclgraphs.

npugraph_ex (``torch_npu/dynamo/npugraph_ex``, the Ascend default since 2026) has no GE: it
runs AOTAutograd, its own FX passes, then captures the FX graph's kernels as they run. So on
this route a fused op is its eager NPU kernel (``@npu_kernel`` beside each op), and only the
fused ops that have one may fuse; the others become near-misses saying so.

The fusion passes run as npugraph_ex's ``post_grad_custom_pre_pass``
(:func:`npugraph_ex_pre_pass`, the hook's signature ``(gm, example_inputs, config)``), before
npugraph_ex's passes. Its own re-inplacing (``input_inplace_pass``) then calls a fused in-place
op on a mutated graph input itself, with no copy of the input, as inductor does.

Forward and backward graphs alike are compiled by npugraph_ex's compiler and handed to its
aclgraph (``npu_fx_compiler._compile_graph_with_aot``: ``bw_compiler`` is the same compiler);
only ``npugraph_ex.inference.cache_compile`` refuses backward graphs.
"""

import copy
import difflib
import sys
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule

from npu_fuse_backend.lowering.npu import import_torchair, install_pre_pass
from npu_fuse_backend.lowering.registry import ops_with_npu_kernels, register_npu_kernels
from npu_fuse_backend.torch_compat import torch_npu_install_hint

LOWERING = "npugraph_ex"
# npugraph_ex's CompilerConfig fields (those of torch_npu 2.10.0.post4 to 2.14.0 together; its mode is
# fixed), what ``options=`` may set on this lowering; tests/test_configuration.py checks the list against
# the installed wheel (compiler_config_fields).
NPUGRAPH_EX_OPTIONS = frozenset((
    "capture_error_mode", "capture_limit", "clone_input", "clone_output", "data_dump_dir", "data_dump_stage",
    "deadlock_check", "disable_static_kernel_compile_cache", "dump_tensor_data", "force_eager", "force_recapture",
    "frozen_parameter", "inplace_pass", "input_inplace_pass", "pattern_fusion_pass", "post_grad_custom_post_pass",
    "post_grad_custom_pre_pass", "record_statistics_debug_info", "remove_cat_ops", "remove_noop_ops",
    "reuse_graph_pool_in_same_fx", "static_kernel_compile", "super_kernel_debug_options", "super_kernel_optimize",
    "super_kernel_optimize_options", "unsafe_skip_npugraph_capture_validation", "use_graph_pool",
))


def _torchair_first() -> None:
    """torchair (when there is one) imported and its process-wide patches applied before npugraph_ex
    is used, as if the GE route had run first. Each defines what the other may have defined, and only
    torchair fails on finding it done (torch_npu 2.13.0): imported after npugraph_ex, its converters
    cannot import their ``npu_define::broadcast`` (ImportError: cannot import name 'op_broadcast'), and
    its first compile after npugraph_ex's registers ``aten::to.other``'s AutogradPrivateUse1 kernel again
    (RuntimeError: Trying to override a python impl). Either would break the GE route of a process
    that used this route first."""
    try:
        torchair = import_torchair()
    except ImportError:
        return
    from torchair._utils import add_npu_patch  # run once; what torchair.get_npu_backend applies

    add_npu_patch({}, torchair.CompilerConfig())


def import_npugraph_ex():
    """npugraph_ex as shipped inside torch_npu (top-level ``npugraph_ex`` when it is on the path),
    torchair first (:func:`_torchair_first`)."""
    _torchair_first()
    try:
        import npugraph_ex
    except ImportError:
        try:
            from torch_npu.dynamo import npugraph_ex
        except ImportError as exc:
            raise ImportError(
                f"npu_fuse: the npugraph_ex lowering (mode='npugraph_ex' on an NPU, or "
                f"npu_fuse.get_npugraph_ex_backend) needs npugraph_ex, which ships inside torch_npu, but "
                f"importing it failed: {exc}. To use it, {torch_npu_install_hint()}; or compile without an "
                "NPU: backend='npu_fuse' with config.lowering='auto' or 'fallback'") from exc
    return npugraph_ex


def unsupported_ops() -> dict:
    """{fused op name: why npugraph_ex cannot take it}: the fused ops without an eager NPU kernel."""
    with_kernel = ops_with_npu_kernels()
    names = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("npu_fuse::"))
    return {name.split("::")[1]: f"{name} has no eager NPU kernel, and npugraph_ex captures eager NPU kernels "
                                 "(no GE converter on this route)"
            for name in names if name not in with_kernel}


def _factory_calls_as_new_full(gm: GraphModule, before: set) -> int:
    """Turn each ``aten.full`` the passes inserted into ``new_full`` of a tensor its first user reads.

    npugraph_ex's converter evaluates every node twice: under the graph's fake mode and again on
    the values it got (fake tensors). A backward graph is compiled with no fake mode active
    (AOTAutograd compiles it under ``unset_fake_temporarily``), so there a factory op gives a real
    tensor, and the fused op that reads it beside fake tensors fails the compile. ``new_full`` of a
    fake tensor is fake; dtype, layout and device are given, so it is the same tensor as ``full``.
    """
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    count = 0
    for node in list(gm.graph.nodes):
        if node in before or node.target is not torch.ops.aten.full.default or not node.users:
            continue
        first = min(node.users, key=position.__getitem__)
        like = next((a for a in first.all_input_nodes if a is not node and
                     isinstance(a.meta.get("val"), torch.Tensor)), None)
        if like is None:
            continue
        size, fill = node.args[:2]
        with gm.graph.inserting_before(first):  # after like, which first reads
            new = gm.graph.call_function(torch.ops.aten.new_full.default, (like, size, fill), dict(node.kwargs))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def fusion_pre_pass(graph_pass: Callable[..., Any]) -> Callable:
    """``graph_pass`` (the fusion passes) as npugraph_ex's ``post_grad_custom_pre_pass``."""
    def pre_pass(gm: GraphModule, example_inputs, config) -> None:
        if "torch_npu" in sys.modules:
            register_npu_kernels()  # the fused ops' eager kernels are what npugraph_ex captures
        before = set(gm.graph.nodes)
        graph_pass(gm, LOWERING, unsupported_ops=unsupported_ops())
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
            _factory_calls_as_new_full(gm, before)

    return pre_pass


def npugraph_ex_pre_pass(gm: GraphModule, example_inputs, config) -> None:
    """npu_fuse's fusions as npugraph_ex's ``post_grad_custom_pre_pass``, for ``backend="npugraph_ex"``::

        torch.compile(model, backend="npugraph_ex",
                      options={"post_grad_custom_pre_pass": npu_fuse.npugraph_ex_pre_pass})

    Rewrites ``gm`` in place (RoPE, softmax backward, the MLA prologue -> fused ops whose eager
    NPU kernels npugraph_ex captures); ``npu_fuse.get_reports()`` says what fused and why not.
    ``example_inputs`` and ``config`` are npugraph_ex's and are not read.
    """
    from npu_fuse_backend.backend import run_fusion_passes

    fusion_pre_pass(run_fusion_passes)(gm, example_inputs, config)


def compiler_config_fields(cfg) -> list:
    """The option names of an npugraph_ex CompilerConfig (a flat object; ``mode`` is fixed)."""
    return sorted({name for name in cfg._fixed_attrs if not name.startswith("_") and name != "mode"})


def configured_copy(npugraph_ex, compiler_config=None, mode: Optional[str] = None, options: Optional[dict] = None):
    """A copy of ``compiler_config`` (a default CompilerConfig when None) with torch.compile's
    ``options`` set by field name; the caller's object is never modified."""
    if mode not in (None, "default", LOWERING):
        raise ValueError(f"npu_fuse: mode={mode!r} is no npugraph_ex mode; npugraph_ex has one, 'npugraph_ex' "
                         "(torchair's modes, 'max-autotune' and 'reduce-overhead', are for npu_fuse.get_npu_backend)")
    cfg = copy.deepcopy(compiler_config) if compiler_config is not None else npugraph_ex.CompilerConfig()
    fields = compiler_config_fields(cfg)
    for name, value in (options or {}).items():
        if name not in fields:
            last = name.rpartition(".")[2]
            close = [last] if last in fields else difflib.get_close_matches(name, fields, n=3)
            raise ValueError(f"npu_fuse: options[{name!r}] is not an npugraph_ex CompilerConfig field"
                             f"{f' (did you mean {close}?)' if close else ''}; the fields are {fields}")
        try:
            setattr(cfg, name, value)
        except (TypeError, ValueError, FileNotFoundError) as exc:
            reason = str(exc).splitlines()[0]  # npugraph_ex appends an error code to its messages
            raise ValueError(f"npu_fuse: npugraph_ex rejects options[{name!r}]={value!r}: {reason}") from None
    return cfg


def compile_with_npugraph_ex(gm: GraphModule, example_inputs, graph_pass: Callable[..., Any],
                             compiler_config=None, custom_decompositions: Optional[dict] = None,
                             mode: Optional[str] = None, options: Optional[dict] = None):
    """npugraph_ex's backend on a copy of ``compiler_config``, our passes first in its
    ``post_grad_custom_pre_pass`` and the caller's own after them."""
    npugraph_ex = import_npugraph_ex()
    cfg = configured_copy(npugraph_ex, compiler_config, mode, options)  # a copy: the caller's stays as it is
    install_pre_pass(cfg, fusion_pre_pass(graph_pass))
    backend = npugraph_ex.get_npu_backend(compiler_config=cfg, custom_decompositions=custom_decompositions or {})
    return backend(gm, example_inputs)
