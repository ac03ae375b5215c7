"""Hand-off to torchair's GE compiler when torch_npu, torchair and an NPU are present.

The fusion passes run as torchair's ``post_grad_custom_pre_pass``: on the
functionalized aten graph, before torchair's own FX passes and before the FX->GE
conversion, where our converters (``converters/``) turn each fused op into its GE op.
Around them (``torchair_pre_pass``):

- version tolerance: a fused op whose GE ops the installed CANN lacks (its converter
  declares them per SoC, ``converters/common.py``) is passed to the passes as unsupported,
  so its fusions become near-misses naming the missing op and the compile goes on;
- no copies of mutated graph inputs: in GE mode, a fused in-place op on a graph input is
  re-inplaced (``reinplace_graph_inputs``; the evidence is in
  ``converters/partial_rope.py``).

``torch.compile``'s ``mode`` picks torchair's mode and its ``options`` set fields of the
``CompilerConfig`` by dotted name (``"debug.run_eagerly"``), always on a copy of the
caller's config.
"""

import copy
import difflib
import functools
import importlib
import inspect
import operator
import pkgutil
import sys
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule, Node

from npu_fuse_backend.soc import resolve_soc, unknown_soc_reason
from npu_fuse_backend.lowering.registry import register_npu_kernels
from npu_fuse_backend.torch_compat import torch_npu_install_hint

GE_MODE = "max-autotune"  # torchair's GE graph mode (reduce-overhead runs aclgraph, with eager kernels)


# torch.compile's modes -> torchair's CompilerConfig.mode: GE graph mode ("max-autotune")
# or aclgraph capture ("reduce-overhead"). torchair's own mode names are accepted as well
# ("npugraph_ex" goes to npugraph_ex itself: lowering/npugraph_ex.py).
TORCH_COMPILE_MODES = {"default": "max-autotune", "max-autotune": "max-autotune",
                       "max-autotune-no-cudagraphs": "max-autotune", "reduce-overhead": "reduce-overhead"}


# torchair's CompilerConfig fields by dotted name (those of torch_npu 2.10.0.post4 to 2.14.0 together;
# ``mode`` is set through mode=), what ``options=`` may set on this lowering (the installed torchair's
# own config checks each name there); the fallback lowerings ignore them with a warning.
# tests/test_configuration.py checks the list against the wheel's config (compiler_config_fields).
TORCHAIR_OPTIONS = frozenset((
    "aclgraph_config.use_custom_pool", "aoe_config.aoe_config_file", "aoe_config.aoe_mode",
    "aoe_config.work_path", "debug.aclgraph.clone_input", "debug.aclgraph.disable_mempool_reuse_in_same_fx",
    "debug.aclgraph.disable_reinplace_inplaceable_ops_pass",
    "debug.aclgraph.disable_reinplace_input_mutated_ops_pass", "debug.aclgraph.enable_output_clone",
    "debug.aclgraph.remove_cat_ops", "debug.aclgraph.static_capture_size_limit", "debug.data_dump.filter",
    "debug.data_dump.path", "debug.data_dump.type", "debug.deadlock_check", "debug.fx_summary._path",
    "debug.fx_summary.skip_compile", "debug.fx_summary.type", "debug.graph_dump.path", "debug.graph_dump.type",
    "debug.run_eagerly", "dump_config.data_dump_stage", "dump_config.dump_config_path", "dump_config.dump_data",
    "dump_config.dump_layer", "dump_config.dump_mode", "dump_config.dump_path", "dump_config.dump_step",
    "dump_config.enable_dump", "dump_config.quant_dumpable",
    "experimental_config.aclgraph._aclnn_static_shape_kernel",
    "experimental_config.aclgraph._aclnn_static_shape_kernel_build_dir",
    "experimental_config.aclgraph._aclnn_static_shape_kernel_sym_index",
    "experimental_config.aclgraph._aclnn_static_shape_kernel_sym_value_range",
    "experimental_config.aclgraph._super_kernel_debug_options",
    "experimental_config.aclgraph._super_kernel_optimize",
    "experimental_config.aclgraph._super_kernel_optimize_options",
    "experimental_config.aot_config_enable_joint_graph", "experimental_config.aot_config_output_loss_index",
    "experimental_config.cc_parallel_enable", "experimental_config.enable_ref_data",
    "experimental_config.enable_view_optimize", "experimental_config.frozen_parameter",
    "experimental_config.jit_compile", "experimental_config.keep_inference_input_mutations",
    "experimental_config.memory_efficiency", "experimental_config.npu_fx_pass",
    "experimental_config.pattern_fusion_pass", "experimental_config.remove_noop_ops",
    "experimental_config.static_model_ops_lower_limit", "experimental_config.tiling_schedule_optimize",
    "experimental_config.topology_sorting_strategy", "export.experimental.auto_atc_config_generated",
    "export.experimental.enable_lite_export", "export.experimental.enable_record_nn_module_stack",
    "export.export_mode", "export.export_name", "export.export_path_dir", "export.inputs_name",
    "export.weight_name", "fusion_config.fusion_switch_file", "ge_config.aicore_num",
    "ge_config.enable_single_stream", "ge_config.export_compile_stat", "ge_config.multistream_parallel_mode",
    "ge_config.oo_constant_folding", "ge_config.oo_dead_code_elimination", "ge_config.oo_level",
    "ge_config.optimization_switch", "inference_config.dynamic_gears_merge_policy",
    "post_grad_custom_post_pass", "post_grad_custom_pre_pass",
))
TORCHAIR_MODES = ("max-autotune", "reduce-overhead", "npugraph_ex")  # CompilerConfig.mode's values


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
                f"failed: {exc}. To use it, {torch_npu_install_hint()}; or compile without an NPU: "
                "backend='npu_fuse' with config.lowering='auto' or 'fallback' (config.fallback picks inductor "
                "or aot_eager)") from exc
    return torchair


def npu_usable(example_inputs) -> bool:
    """True when torch_npu is loaded and the graph's tensors live on an NPU."""
    if "torch_npu" not in sys.modules:
        return False
    return any(isinstance(t, torch.Tensor) and t.device.type == "npu" for t in example_inputs)


def why_not_npu(example_inputs) -> str:
    """Why a graph goes to the fallback lowering, in words."""
    from npu_fuse_backend import config

    if config.lowering == "fallback":
        return "config.lowering='fallback'"
    if "torch_npu" not in sys.modules:
        return "no NPU found (torch_npu is not loaded)"
    return "no NPU found (the graph's tensors are not on an NPU)"


def load_converters() -> None:
    """Register every GE converter in ``converters/`` with torchair (idempotent)."""
    from npu_fuse_backend import converters

    for info in pkgutil.iter_modules(converters.__path__):
        importlib.import_module(f"{converters.__name__}.{info.name}")


def unsupported_ops(soc: str) -> dict:
    """{fused op name: why the torchair lowering cannot take it on ``soc`` with the installed CANN}."""
    from torchair.core import _torchair

    from npu_fuse_backend.converters.common import GE_OPS

    load_converters()
    reasons = {}
    for fused_op, per_soc in GE_OPS.items():
        needed = per_soc.get(soc, unknown_soc_reason(soc) or f"no GE lowering of {fused_op} for {soc}")
        if isinstance(needed, str):
            reasons[fused_op] = needed
            continue
        for ge_op in needed:
            status = _torchair.get_registered_ir_def(ge_op)[0]
            if status != "SUCCESS":
                reasons[fused_op] = (f"the installed CANN has no GE op {ge_op} (needed by {fused_op} on {soc}; "
                                     f"get_registered_ir_def: {status})")
                break
    return reasons


def _mutated_args(op) -> list:
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _write_back_only(node: Node) -> dict:
    """For an auto_functionalized_v2 node whose every mutated argument is a whole graph input
    that nothing else reads and whose new value only goes back into it (``copy_``):
    {argument name: (placeholder, its getitem, its copy_)}; else {}."""
    op = node.args[0]
    names = _mutated_args(op)
    n_outputs = max(1, len(op._schema.returns))  # a () op still has one (None) result slot
    found = {}
    for i, name in enumerate(names):
        if f"_{name}_base_index" not in node.kwargs or f"_{name}_size" in node.kwargs:
            return {}
        base = node.kwargs["_all_bases"][node.kwargs[f"_{name}_base_index"]]
        gets = [u for u in node.users if u.target is operator.getitem and u.args[1] == n_outputs + i]
        if base.op != "placeholder" or len(gets) != 1 or len(gets[0].users) != 1:
            return {}
        (copy_,) = gets[0].users
        if copy_.target is not torch.ops.aten.copy_.default or copy_.args[0] is not base or copy_.users:
            return {}
        if set(base.users) != {node, copy_}:
            return {}
        found[name] = (base, gets[0], copy_)
    if len(node.users) != len(found):  # another result of the op is read
        return {}
    return found


def reinplace_graph_inputs(gm: GraphModule) -> int:
    """``auto_functionalized_v2(op, x)`` + ``copy_(x, new x)`` -> ``op(x)`` on the graph input itself.

    The pattern torchair's own ``recover_view_inplace_pattern`` turns back into its in-place
    scatter ops, for the fused ops whose converter declares it can convert them in place
    (``declare_in_place_on_graph_inputs``): the GE op then updates the input's memory and
    torchair's TensorMove copy of it never appears. Only where nothing else reads the input.
    Returns how many calls were re-inplaced.
    """
    from npu_fuse_backend.converters.common import IN_PLACE_ON_GRAPH_INPUTS

    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.higher_order.auto_functionalized_v2 or \
                node.args[0] not in IN_PLACE_ON_GRAPH_INPUTS:
            continue
        found = _write_back_only(node)
        if not found:
            continue
        op = node.args[0]
        kwargs = {k: v for k, v in node.kwargs.items() if not k.startswith("_")}
        kwargs.update({name: base for name, (base, _, _) in found.items()})
        with graph.inserting_before(node):
            in_place = graph.call_function(op, kwargs=kwargs)
        in_place.meta["val"] = None
        for base, get, copy_ in found.values():
            graph.erase_node(copy_)
            graph.erase_node(get)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def torchair_pre_pass(graph_pass: Callable[..., Any]) -> Callable:
    """What runs as torchair's ``post_grad_custom_pre_pass``: the fusion passes (told which fused
    ops the installed CANN cannot take) and, in GE mode, the re-inplacing of graph inputs."""
    def pre_pass(aten_gm: GraphModule, inputs, config) -> None:
        graph_pass(aten_gm, "torchair", unsupported_ops=unsupported_ops(resolve_soc()))
        if config.mode.value == GE_MODE:
            reinplace_graph_inputs(aten_gm)

    return pre_pass


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


def install_pre_pass(cfg, fuse: Callable) -> None:
    """``fuse`` first in the ``post_grad_custom_pre_pass`` of a torchair or npugraph_ex CompilerConfig
    (a copy), the pass already there after it."""
    user_pre_pass = cfg.post_grad_custom_pre_pass.value

    def pre_pass(aten_gm: GraphModule, inputs, config):
        fuse(aten_gm, inputs, config)
        if user_pre_pass is not None:
            user_pre_pass(aten_gm, inputs, config)

    cfg.post_grad_custom_pre_pass = pre_pass


def compile_with_torchair(gm: GraphModule, example_inputs, graph_pass: Callable[[GraphModule, str], Any],
                          compiler_config=None, custom_decompositions: Optional[dict] = None,
                          mode: Optional[str] = None, options: Optional[dict] = None):
    torchair = import_torchair()
    # a copy: installing our pre-pass must not change (and stack up on) the caller's config
    cfg = configured_copy(torchair, compiler_config, mode, options)
    load_converters()
    if "torch_npu" in sys.modules:
        register_npu_kernels()
    install_pre_pass(cfg, torchair_pre_pass(graph_pass))
    backend = torchair.get_npu_backend(compiler_config=cfg, custom_decompositions=custom_decompositions or {})
    return backend(gm, example_inputs)
