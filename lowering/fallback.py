"""Lowerings for machines without an NPU: inductor (default) or aot_eager.

Inductor gets the rewritten graph with every fused op replaced by its registered
decomposition, traced in place by inductor's own ``replace_by_example``, so the
compiled code is what plain inductor makes of the original subgraph: being a
drop-in costs nothing. aot_eager runs the fused ops' reference kernels.

On inductor the passes run as its ``post_grad_custom_pre_pass``, a
:class:`~torch._inductor.custom_graph_pass.CustomGraphPass` whose ``uuid()`` is part
of the AOTAutograd and FX-graph cache keys: a warm start reuses the compiled graphs,
and a change to our code or config misses.
"""

import difflib
import functools
import hashlib
import importlib.util
import inspect
import json
import marshal
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, GraphModule, Node

from npu_fuse_backend.lowering.registry import DECOMPOSITIONS
from npu_fuse_backend.torch_compat import INDUCTOR_TAKES_PASS_LISTS, concrete_hint, custom_graph_passes

GraphPass = Callable[[GraphModule, str], Any]

_decompose_pass = None


def _decompose_fused_ops_pass():
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, PatternMatcherPass, register_graph_pattern

    global _decompose_pass
    if _decompose_pass is None:
        patterns = PatternMatcherPass(pass_name="npu_fuse_decompose_fused_ops")
        for op, decomp in DECOMPOSITIONS.items():
            if not _mutated_args(op):  # mutating ops only appear inside auto_functionalized_v2
                register_graph_pattern(CallFunctionVarArgs(op), pass_dict=patterns)(_decompose_with(decomp))
        register_graph_pattern(CallFunctionVarArgs(torch.ops.higher_order.auto_functionalized_v2),
                               extra_check=_is_fused_in_place_op, pass_dict=patterns)(_decompose_in_place)
        _decompose_pass = patterns
    return _decompose_pass


def _mutated_args(op) -> list:
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _is_fused_in_place_op(match) -> bool:
    """An auto_functionalized_v2 of one of our mutating ops, each mutated arg a whole base."""
    node = match.nodes[0]
    op = node.args[0]
    return op in DECOMPOSITIONS and all(
        f"_{name}_base_index" in node.kwargs and f"_{name}_size" not in node.kwargs for name in _mutated_args(op))


def _decompose_in_place(match, op, **kwargs) -> None:
    """auto_functionalized_v2(op, ...) -> its functional decomposition, for inductor to fuse.

    A mutating op's decomposition takes the op's arguments (mutated ones as values) and
    returns ``(outputs, new values of the mutated args)``; auto_functionalized_v2's result
    is those outputs (or a None when there are none) followed by the new values."""
    names = _mutated_args(op)
    op_kwargs = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    for name in names:
        op_kwargs[name] = kwargs["_all_bases"][kwargs[f"_{name}_base_index"]]
    traced_names = [k for k, v in op_kwargs.items() if isinstance(v, Node)]
    decomp = DECOMPOSITIONS[op]

    def replacement(*traced):
        outputs, mutated = decomp(**{**op_kwargs, **dict(zip(traced_names, traced))})
        return (*(outputs or (None,)), *mutated)

    match.replace_by_example(replacement, [op_kwargs[k] for k in traced_names], run_functional_passes=False)


def _decompose_with(decomp: Callable) -> Callable:
    def handler(match, *args, **kwargs) -> None:
        # Trace only over the tensor (node) arguments, nested in lists too; the rest stays constant.
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, Node)]

        def call(values):
            filled = list(flat)
            for i, value in zip(positions, values):
                filled[i] = value
            call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
            return decomp(*call_args, **call_kwargs)

        fakes = [flat[i].meta["val"] for i in positions]
        with torch._guards.detect_fake_mode(fakes):
            if call(fakes) is NotImplemented:  # the decomposition declines these arguments
                return
        match.replace_by_example(lambda *traced: call(traced), [flat[i] for i in positions])

    return handler


def _decompose_glue(gm: GraphModule) -> int:
    """Decompose the aten ops a fusion inserted around its fused op (``stack``, ``arange``...)
    that inductor only accepts decomposed. AOTAutograd already applied inductor's table to
    everything else, so only such inserted nodes can still have an entry in it."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, PatternMatcherPass, register_graph_pattern

    table = select_decomp_table()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in table}
    if not targets:
        return 0
    patterns = PatternMatcherPass(pass_name="npu_fuse_decompose_glue")
    for target in targets:
        register_graph_pattern(CallFunctionVarArgs(target), pass_dict=patterns)(_decompose_with(table[target]))
    return patterns.apply(gm.graph)


def decompose_fused_ops(gm: GraphModule) -> int:
    """Replace every fused-op call in gm by its decomposition (and make what the fusions
    inserted around them inductor-legal); returns how many fused ops were decomposed."""
    count = _decompose_fused_ops_pass().apply(gm.graph)
    if count:
        _decompose_glue(gm)
        gm.graph.lint()
        gm.recompile()
    return count


class FusionPrePass(CustomGraphPass):
    """The fusion passes, then the decomposition of the fused ops, then the user's own post-grad pre
    passes where inductor takes no list of them (``then``, torch 2.10), as inductor's
    ``post_grad_custom_pre_pass`` (forward, backward and inference graphs alike)."""

    def __init__(self, graph_pass: GraphPass, then: tuple = ()):
        self.graph_pass = graph_pass
        self.then = tuple(then)

    def __call__(self, graph: Graph) -> None:
        from npu_fuse_backend.report import stash_for_compile_cache

        gm = graph.owning_module
        report = self.graph_pass(gm, "inductor")
        decompose_fused_ops(gm)
        stash_for_compile_cache(report)  # so that a cache hit can still report it
        for user_pass in self.then:
            user_pass(graph)

    def uuid(self) -> str:
        """Changes whenever the rewritten graph could: our source, any registered fusion's
        source, the graph pass, and every config knob but the report-only ones (as the pass
        will run them: the config captured when the graph's compile started)."""
        from npu_fuse_backend import config
        from npu_fuse_backend.fusion import registered_fusions
        from npu_fuse_backend.soc import resolve_soc

        user_uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.then]
        if not all(user_uuids):
            return None  # a user pass inductor cannot key: it bypasses the cache, as for that pass alone
        with config.patch(getattr(self.graph_pass, "config_snapshot", {})):
            knobs = {**config.save_config_portable(), "soc": resolve_soc()}
        fusions = {name: fusion_digest(cls) for name, cls in registered_fusions().items()}
        pass_name = f"{self.graph_pass.__module__}.{self.graph_pass.__qualname__}"
        identity = json.dumps([_package_digest(), fusions, pass_name, knobs, user_uuids], sort_keys=True,
                              default=repr)
        return hashlib.sha256(identity.encode()).hexdigest()


def fusion_digest(cls: type) -> str:
    """What identifies a registered fusion's code: its source file, or where it has none (a class
    defined in ``python -c``, stdin, a REPL or a notebook cell) its methods' bytecode and its
    attributes, so that such a fusion still keys the cache instead of breaking the compile."""
    try:
        return _source_digest(inspect.getsourcefile(cls))
    except (OSError, TypeError):
        pass
    digest = hashlib.sha256()
    for klass in cls.__mro__:
        if klass.__module__.startswith(__name__.rsplit(".", 2)[0]) or klass is object:
            continue  # our own base classes are in the package digest
        for name, value in sorted(vars(klass).items()):
            function = getattr(value, "__func__", value)
            code = getattr(function, "__code__", None)
            digest.update(name.encode() + b"\0" + (marshal.dumps(code) if code is not None else repr(value).encode()))
    return digest.hexdigest()


def _package_sources() -> dict:
    """{module name: path} of every source file of npu_fuse_backend and its subpackages,
    found through the import system (an editable install maps lowering/ and converters/
    from elsewhere, a wheel nests them)."""
    root = __name__.rsplit(".", 2)[0]  # npu_fuse_backend
    files = {}
    for package in (root, f"{root}.lowering", f"{root}.converters"):
        for folder in importlib.util.find_spec(package).submodule_search_locations:
            for path in Path(folder).rglob("*.py"):
                files[".".join([package, *path.relative_to(folder).with_suffix("").parts])] = path
    return files


@functools.lru_cache(None)
def _package_digest() -> str:
    digest = hashlib.sha256()
    for name, path in sorted(_package_sources().items()):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(None)
def _source_digest(path: Optional[str]) -> str:
    if not path:
        raise OSError("no source file")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class NpuSettingIgnored(UserWarning):
    """A torch.compile mode or option that only an NPU lowering takes, ignored by the fallback."""


def npu_only_setting(kind: str, name: str) -> Optional[str]:
    """What an NPU lowering makes of mode (``kind`` "mode") or option ``name``; None if none takes it."""
    from npu_fuse_backend.lowering.npu import TORCH_COMPILE_MODES, TORCHAIR_MODES, TORCHAIR_OPTIONS
    from npu_fuse_backend.lowering.npugraph_ex import LOWERING, NPUGRAPH_EX_OPTIONS

    if kind == "mode":
        if name == LOWERING:
            return "npugraph_ex's aclgraph capture"
        return "a torchair mode" if name in TORCHAIR_MODES or name in TORCH_COMPILE_MODES else None
    owners = [owner for owner, names in (("torchair", TORCHAIR_OPTIONS), ("npugraph_ex", NPUGRAPH_EX_OPTIONS))
              if name in names]
    return f"a field of {' and '.join(owners)}'s CompilerConfig" if owners else None


def split_npu_settings(mode: Optional[str], options: Optional[dict], takes_mode: Callable[[str], bool],
                       takes_option: Callable[[str], bool]) -> tuple:
    """(mode, options) left for the fallback, and a description of each NPU-only one it does not
    take (dropped). A name no lowering takes stays, for the fallback's own check to refuse."""
    ignored = []
    if mode is not None and not takes_mode(mode) and npu_only_setting("mode", mode):
        ignored.append(f"mode={mode!r} ({npu_only_setting('mode', mode)})")
        mode = None
    kept = {}
    for key, value in (options or {}).items():
        if not takes_option(key) and npu_only_setting("option", key):
            ignored.append(f"options[{key!r}] ({npu_only_setting('option', key)})")
        else:
            kept[key] = value
    return mode, kept, ignored


def ignore_npu_settings(lowering: str, example_inputs, ignored: list) -> None:
    """One warning naming every NPU-only setting the fallback ignores, and why it is the fallback
    that compiles; an error under ``config.strict``."""
    if not ignored:
        return
    from npu_fuse_backend import config
    from npu_fuse_backend.lowering.npu import why_not_npu

    message = (f"npu_fuse: {why_not_npu(example_inputs)}, so the fallback {lowering} compiles this graph and "
               f"ignores what only an NPU lowering takes: {', '.join(ignored)}")
    if config.strict:
        raise ValueError(f"{message} (an error under config.strict)")
    warnings.warn(message, NpuSettingIgnored, stacklevel=3)


def _npu_names() -> list:
    from npu_fuse_backend.lowering.npu import TORCHAIR_OPTIONS
    from npu_fuse_backend.lowering.npugraph_ex import NPUGRAPH_EX_OPTIONS

    return sorted(TORCHAIR_OPTIONS | NPUGRAPH_EX_OPTIONS)


def inductor_config_patches(mode: Optional[str], options: Optional[dict]) -> dict:
    """``torch.compile``'s mode and options as inductor config patches, checked the way
    inductor's own wrapper checks them."""
    import torch._inductor
    from torch._inductor import config as inductor_config

    from npu_fuse_backend.lowering.npu import TORCH_COMPILE_MODES, TORCHAIR_MODES

    modes = torch._inductor.list_mode_options()
    if mode is not None and mode not in modes:
        npu_modes = sorted((set(TORCHAIR_MODES) | set(TORCH_COMPILE_MODES)) - set(modes))
        raise ValueError(f"npu_fuse: mode={mode!r} is not an inductor mode; expected one of {sorted(modes)} "
                         f"(or an NPU lowering's, ignored here: {npu_modes})")
    patches = dict(modes[mode or "default"])
    known = torch._inductor.list_options()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            from npu_fuse_backend import config

            if name in config.get_config_copy() and not name.startswith("_"):
                raise ValueError(f"npu_fuse: options[{key!r}] is a setting of npu_fuse, not an inductor option: "
                                 f"set it with npu_fuse.config.patch({name}=...) around the compile (or "
                                 f"npu_fuse_backend.config.{name} = ...); options go to inductor")
            close = difflib.get_close_matches(name, [*known, *_npu_names()], n=5)
            raise ValueError(f"npu_fuse: options[{key!r}] is not an inductor option"
                             f"{f' (did you mean {close}?)' if close else ''}; the options are "
                             "torch._inductor.list_options(), documented in torch/_inductor/config.py, and the "
                             "fields of torchair's and npugraph_ex's CompilerConfig (ignored here)")
        expected = inductor_config.get_type(name)
        plain_type = typing.get_origin(expected) is None and isinstance(expected, type)  # generics: unchecked
        if plain_type and not isinstance(value, expected):
            raise ValueError(f"npu_fuse: options[{key!r}]={value!r} must be a {expected.__name__} "
                             f"(inductor config {name})")
        patches[name] = value
    return patches


def compile_with_inductor(gm: GraphModule, example_inputs, graph_pass: GraphPass,
                          mode: Optional[str] = None, options: Optional[dict] = None):
    """Inductor with ``mode``/``options`` applied and our passes first among the
    post-grad pre passes (a user's own, from inductor's config or ``options``, run after).
    NPU-only modes and options are ignored, with a warning."""
    import torch._inductor
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    modes, known = torch._inductor.list_mode_options(), set(torch._inductor.list_options())
    mode, options, ignored = split_npu_settings(mode, options, modes.__contains__,
                                                lambda key: key.replace("-", "_") in known)
    patches = inductor_config_patches(mode, options)
    ignore_npu_settings("inductor", example_inputs, ignored)
    user_passes = custom_graph_passes(patches.get("post_grad_custom_pre_pass",
                                                  inductor_config.post_grad_custom_pre_pass))
    patches["post_grad_custom_pre_pass"] = ([FusionPrePass(graph_pass), *user_passes] if INDUCTOR_TAKES_PASS_LISTS
                                            else FusionPrePass(graph_pass, then=user_passes))
    # compile_fx applies the patches again around the backward, which compiles lazily
    return compile_fx(gm, example_inputs, inner_compile=_reporting_inner_compile, config_patches=patches)


def _reporting_inner_compile(*args, **kwargs):
    """Inductor's compile of one graph (forward, lazy backward, inference), then the reports it
    stashed or a cache hit replayed taken out of ``counters["inductor"]`` and published at once:
    counters and reports agree after every compile, and no report is left in inductor's counters."""
    from torch._inductor.compile_fx import compile_fx_inner

    from npu_fuse_backend.report import drain_cached_reports

    try:
        return compile_fx_inner(*args, **kwargs)
    finally:
        drain_cached_reports()


def compile_with_aot_eager(gm: GraphModule, example_inputs, graph_pass: GraphPass,
                           mode: Optional[str] = None, options: Optional[dict] = None):
    """aot_eager, which has nothing to configure: NPU-only modes and options are ignored with a
    warning, any other is an error."""
    mode, options, ignored = split_npu_settings(mode, options, lambda m: m == "default", lambda key: False)
    if mode not in (None, "default") or options:
        raise ValueError(f"npu_fuse: the aot_eager fallback has no compiler to configure, so it takes only the "
                         f"default mode and no options besides an NPU lowering's, which it ignores (got "
                         f"mode={mode!r}, options={options!r}); use config.fallback='inductor' for inductor's "
                         "modes and options")
    ignore_npu_settings("aot_eager", example_inputs, ignored)

    def run_fused(aten_gm: GraphModule, inputs):
        traced = output_layouts(aten_gm)
        graph_pass(aten_gm, "aot_eager")
        keep_output_layouts(aten_gm, traced)
        return make_boxed_func(aten_gm.forward)

    backend = aot_autograd(fw_compiler=run_fused, bw_compiler=run_fused,
                           keep_inference_input_mutations=True)
    return backend(gm, example_inputs)


def output_layouts(gm: GraphModule) -> list:
    """Each graph output's dims in the order of its traced strides (None for a non-tensor)."""
    (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return [_dense_order(o.meta.get("val")) if isinstance(o, Node) else None for o in outputs]


def keep_output_layouts(gm: GraphModule, traced: list) -> None:
    """Lay every graph output whose layout the passes changed out as eager (and the traced graph)
    does, so that user code viewing an output of the compiled call still can. aot_eager runs the
    graph as it is (inductor restores output strides itself)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = list(output.args[0])
    changed = False
    for i, (node, order) in enumerate(zip(outputs, traced)):
        if not isinstance(node, Node) or order is None or _dense_order(node.meta.get("val")) == order:
            continue
        with gm.graph.inserting_before(output):
            restrided = gm.graph.call_function(_in_dim_order, (node, order))
        restrided.meta = dict(node.meta)
        outputs[i] = restrided
        changed = True
    if changed:
        output.args = (type(output.args[0])(outputs),)
        gm.recompile()


def _dense_order(value) -> Optional[list]:
    """A tensor's dims from outermost to innermost (size-1 and broadcast dims left out)."""
    if not isinstance(value, torch.Tensor):
        return None
    dims = [d for d in range(value.dim())
            if concrete_hint(value.shape[d]) != 1 and concrete_hint(value.stride()[d]) != 0]
    return sorted(dims, key=lambda d: -concrete_hint(value.stride()[d]))


def _in_dim_order(tensor: torch.Tensor, order: list) -> torch.Tensor:
    """tensor, copied (if needed) to a dense layout whose dims go outermost-first in ``order``."""
    if _dense_order(tensor) == order:
        return tensor
    rest = [d for d in range(tensor.dim()) if d not in order]
    permutation = rest + list(order)
    return tensor.permute(permutation).contiguous().permute([permutation.index(d) for d in range(tensor.dim())])
