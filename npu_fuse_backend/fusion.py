"""The fusion-pass core: the pass interface, the graph rewriter and the manager.

A fusion pass (see ``passes/``) is a small class: ``anchors`` names the nodes where its
pattern may be rooted and ``match`` looks at one of them, reading the graph only. It
returns a :class:`Rewrite` (a subgraph and how to build its replacement), ``None`` (not
this pattern), or raises :class:`NotFused` with the rule the candidate breaks (a
near-miss, reported with that reason).

The :class:`PassManager` canonicalizes the graph, runs the passes in their declared
order, applies each pass's rewrites through a journal and checks each rewrite before it
stays: a fused-op call the lowering cannot convert, or whose arguments break that op's
argument checks or its limits on the target SoC; a replacement whose strides differ where
a later view reads them; and (``translation_validation``, ``validate.py``) a
replacement that computes something else than the subgraph on random inputs. A failed
check undoes that rewrite and becomes a near-miss. A pass that fails half-way leaves the
graph exactly as it found it, with a warning (or an exception under ``strict``).

Passes register themselves with :func:`register_fusion`; every module in
``npu_fuse_backend/passes`` is imported on first use. The built-in passes run in the order
of :data:`PASS_ORDER`, the one list that says it (adding a family adds one line there); a
pass registered from outside the package runs after all of them, in registration order,
unless it names a pass it must run before (``runs_before``).
"""

import dataclasses
import importlib
import logging
import operator
import pkgutil
import time
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx import Graph, GraphModule, Node

from . import config
from .canonicalize import canonicalize
from .graph_utils import calls_of, is_input_view, shape_eq, size_eq, val
from npu_fuse_backend.lowering.registry import soc_refusal
from .report import GraphReport, Match, NearMiss, graph_frame, involved, log_graph, new_report, publish, where
from .soc import KNOWN_SOCS, resolve_soc
from .validate import check_rewrite

log = logging.getLogger("npu_fuse")

aten = torch.ops.aten
# ops whose result depends on their input's strides, not only its values
STRIDE_SENSITIVE = (aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
                    aten.view_as_complex.default, aten.view_as_real.default)
# views whose result's strides are their input's, rearranged
LAYOUT_VIEWS = (aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
                aten.squeeze.default, aten.expand.default, aten.alias.default, aten.slice.Tensor, aten.select.int,
                aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default, aten.diagonal.default,
                operator.getitem)


def _stride_sensitive_user(node: Node) -> Optional[Node]:
    """A node that reads node's strides, directly or through views that pass them on."""
    frontier, seen = [node], set()
    while frontier:
        for user in frontier.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.target in STRIDE_SENSITIVE:
                return user
            if user.target in LAYOUT_VIEWS:
                frontier.append(user)
    return None


def same_significant_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b lay their elements out alike (strides of size-1 dims do not matter)."""
    if not shape_eq(a.shape, b.shape):
        return True  # a shape change is the validation's to report
    return all(size_eq(size, 1) or size_eq(sa, sb) for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


class FusionError(RuntimeError):
    """An internal failure of a fusion pass (raised only under ``config.strict``)."""


class NotFused(Exception):
    """Raised by :meth:`FusionPass.match`: the candidate looks like the pattern but breaks
    the rule named in the message, so it is not fused (a near-miss). ``near``: nodes that say
    where it is in the user's code when the anchor carries no trace (a node a compiler made)."""

    def __init__(self, reason: str, near: Iterable[Node] = ()):
        super().__init__(reason)
        self.near = tuple(near)


class ArgumentsRefused(Exception):
    """A fused op's argument check refused the call a rewrite was building (a near-miss)."""


def check_op_args(check: Callable, *args, **kwargs) -> None:
    """Run a fused op's own argument checker on the (fake) arguments a rewrite would give it; its
    ValueError, naming the rule, becomes the near-miss. A pass restates no rule of its op: it asks
    the op (and the builder asks it again on every call it emits, see :class:`GraphBuilder`)."""
    try:
        check(*args, **kwargs)
    except ValueError as refused:
        raise NotFused(str(refused)) from None


@dataclasses.dataclass
class PassContext:
    """What a pass may read while matching one graph."""

    graph: Graph
    soc: str  # "generic" or a named SoC
    kind: str  # "forward", "backward" or "inference"
    fake_mode: Any
    # fused op name -> why the lowering cannot take it (e.g. the installed CANN lacks its GE op)
    unsupported_ops: dict = dataclasses.field(default_factory=dict)
    # what a pass computes once per graph and run for the passes after it too (the RoPE recognizer's
    # analysis): one dict for the run's contexts, gone with the run
    memo: dict = dataclasses.field(default_factory=dict)
    # what the fused ops' fake kernels gave in this run (fake_value's ``outcomes``), one dict for the run
    fake_outcomes: dict = dataclasses.field(default_factory=dict)
    _positions: Optional[dict] = None

    def position(self, node: Node) -> int:
        """The node's index in the graph (topological order); recomputed when the graph grew."""
        if self._positions is None or node not in self._positions:
            self._positions = {n: i for i, n in enumerate(self.graph.nodes)}
        return self._positions[node]

    def reaches(self, starts: list, targets: set) -> Optional[Node]:
        """The node of targets that one of starts is computed from, if any (walks back only past the
        earliest target, so its cost is the graph between them)."""
        if not targets:
            return None
        earliest = min(self.position(n) for n in targets)
        stack, seen = list(starts), set()
        while stack:
            node = stack.pop()
            if node in targets:
                return node
            if node in seen or self.position(node) < earliest:
                continue
            seen.add(node)
            stack.extend(node.all_input_nodes)
        return None


class _Emitter:
    """What :class:`GraphBuilder` and :class:`FakeValues` share: the helpers built on ``call``."""

    def call(self, target: Callable, *args, **kwargs) -> Any:
        raise NotImplementedError

    def unsqueeze_to(self, node: Any, rank: int) -> Any:
        """node with leading unit dims added up to ``rank`` dims."""
        while val(node).dim() < rank:
            node = self.call(torch.ops.aten.unsqueeze.default, node, 0)
        return node

    def lifted(self, node: Any, rank: int, dims: tuple) -> Any:
        """node, broadcast right-aligned against a rank-``rank`` tensor, given that tensor's rank
        and then unit dims at ``dims`` (as a fused op that takes 4-D needs x lifted)."""
        node = self.unsqueeze_to(node, rank)
        for dim in dims:
            node = self.call(torch.ops.aten.unsqueeze.default, node, dim)
        return node

    def cast(self, node: Any, dtype: torch.dtype) -> Any:
        """node in dtype (node itself when it already is)."""
        return node if val(node).dtype == dtype else self.call(torch.ops.aten._to_copy.default, node, dtype=dtype)


# Python types an argument of these schema types arrives in when the dispatcher calls a Python kernel
_SCHEMA_SCALARS = {"float": float, "int": int, "bool": bool, "str": str}
_NOT_AS_IS = object()


def _as_dispatched(schema_type: Any, value: Any, fake_mode: Any) -> Any:
    """value as the dispatcher hands it to a Python kernel for an argument of this type; _NOT_AS_IS
    where it would convert it otherwise or refuse it (an int for a float, a SymInt, a bool for an int),
    or where the fake mode would (a tensor not of that mode), or autograd would record the call."""
    kind = str(schema_type)
    if kind == "Optional[Tensor]" and value is None:
        return value
    if kind in ("Tensor", "Optional[Tensor]"):
        ours = isinstance(value, FakeTensor) and value.fake_mode is fake_mode and not value.requires_grad
        return value if ours else _NOT_AS_IS
    if kind == "List[int]" and isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
        return list(value)
    scalar = _SCHEMA_SCALARS.get(kind)
    return value if scalar is not None and type(value) is scalar else _NOT_AS_IS


def _direct_fake_kernel(fake_mode: Any, target: Any, args: tuple, kwargs: dict) -> Optional[Callable]:
    """For a call of a functional fused op whose every argument the dispatcher would pass on as it is:
    ``run(fake_mode)``, which calls the op's registered fake kernel as FakeTensorMode would (the same
    value, for half the cost of the dispatch: the custom op's autograd and dynamo wrappers, the fake
    mode's cache key hashing). None for any other call."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "npu_fuse" or \
            getattr(fake_mode, "propagate_real_tensors", False):  # (that mode runs the real kernel too)
        return None
    schema = target._schema
    if schema.is_mutable or len(args) > len(schema.arguments):
        return None
    formals = {a.name: a for a in schema.arguments}
    if any(k not in formals for k in kwargs):
        return None
    args = tuple(_as_dispatched(a.type, v, fake_mode) for a, v in zip(schema.arguments, args))
    kwargs = {k: _as_dispatched(formals[k].type, v, fake_mode) for k, v in kwargs.items()}
    if any(v is _NOT_AS_IS for v in (*args, *kwargs.values())):
        return None
    try:  # private: where FakeTensorMode itself finds a custom op's fake kernel and sets up its context
        kernel = torch._library.simple_registry.singleton.find(target.name()).fake_impl.kernel
        fake_impl_ctx, set_ctx_getter = torch._library.fake_impl.FakeImplCtx, torch._library.fake_impl.set_ctx_getter
    except AttributeError:  # another torch's internals: the dispatcher path
        return None
    if kernel is None:
        return None

    def run(fake_mode: Any) -> Any:
        context = fake_impl_ctx(fake_mode, target)  # what torch.library.get_ctx() returns in the kernel
        with set_ctx_getter(lambda: context), fake_mode:
            return kernel(*args, **kwargs)

    return run


def _argument_key(value: Any, fake_mode: Any) -> Any:
    """All a fused op's fake kernel (and the dispatcher's choice of path) can read of one argument,
    hashable; _NOT_AS_IS where it could read more (a symbolic size, a constant's values, a tensor
    subclass, autograd) or that is not of fake_mode."""
    if isinstance(value, torch.Tensor):
        if type(value) is not FakeTensor or value.fake_mode is not fake_mode or value.requires_grad or \
                value.constant is not None or value.layout != torch.strided:
            return _NOT_AS_IS
        shape, stride = tuple(value.shape), value.stride()
        if not all(type(d) is int for d in (*shape, *stride)) or type(value.storage_offset()) is not int:
            return _NOT_AS_IS
        return (shape, stride, value.storage_offset(), value.dtype, value.device, value.is_conj(), value.is_neg())
    if value is None or type(value) in (int, bool, str):
        return type(value), value
    if type(value) is float:
        return float, repr(value)  # (-0.0 and nan by their spelling)
    if type(value) is list and all(type(v) is int for v in value):
        return list, tuple(value)
    return _NOT_AS_IS


def _call_key(fake_mode: Any, target: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
    """(target, every argument's :func:`_argument_key`) for a call of a fused op; None for another
    call or where an argument has no key."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "npu_fuse":
        return None
    keys = [_argument_key(v, fake_mode) for v in args]
    for name in sorted(kwargs):
        keys += [name, _argument_key(kwargs[name], fake_mode)]
    return None if any(k is _NOT_AS_IS for k in keys) else (target, tuple(keys))


@dataclasses.dataclass(frozen=True)
class _Refused:
    """A fake kernel's ValueError (the op's argument check): raised again for the same arguments."""

    args: tuple

    def replay(self, fake_mode: Any) -> Any:
        raise ValueError(*self.args)


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """What a fake kernel returned: fresh tensors (each of its own storage, as the kernel's were),
    their shapes, strides, dtypes and devices; the container type, None for one tensor."""

    container: Optional[type]
    tensors: tuple  # (shape, stride, dtype, device) each

    def replay(self, fake_mode: Any) -> Any:
        with in_kernel_invocation_manager(fake_mode):  # (as the fake mode's own cache makes a value)
            fresh = [FakeTensor(fake_mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)
                     for shape, stride, dtype, device in self.tensors]
        return fresh[0] if self.container is None else self.container(fresh)

    @classmethod
    def of(cls, value: Any, fake_mode: Any, inputs: tuple) -> Optional["_Outputs"]:
        """value's outputs, where replay gives the same: plain dense fake tensors of static sizes, none
        aliasing another or an input; else None."""
        container = type(value) if type(value) in (tuple, list) else None
        tensors = list(value) if container else [value]
        storages = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
        specs = []
        for t in tensors:
            if t._base is not None:
                return None
            key = _argument_key(t, fake_mode)
            storage = t.untyped_storage()
            if key is _NOT_AS_IS or key[2] != 0 or key[5] or key[6] or storage._cdata in storages:
                return None
            storages.add(storage._cdata)
            specs.append((key[0], key[1], key[3], key[4], storage.nbytes()))
        outputs = cls(container, tuple(spec[:4] for spec in specs))
        fresh = outputs.replay(fake_mode)
        fresh = list(fresh) if container else [fresh]
        if [(_argument_key(t, fake_mode), t.untyped_storage().nbytes()) for t in fresh] != \
                [(_argument_key(t, fake_mode), spec[4]) for t, spec in zip(tensors, specs)]:
            return None
        return outputs


def fake_value(fake_mode: Any, target: Callable, args: tuple, kwargs: dict, outcomes: Optional[dict] = None) -> Any:
    """target's value on fake arguments under fake_mode. A fused op's fake kernel, and so its argument
    checker, runs as the dispatcher would run it (:func:`_direct_fake_kernel`), without the dispatch.

    ``outcomes`` (one dict per graph's run of the passes): what a fused op's fake kernel gave for the
    metadata of its arguments, so that a call with the same metadata (the same rewrite in every layer)
    gets fresh tensors of the same metadata, or the same refusal, without running it again. A fake
    kernel is a function of that metadata (static sizes only; anything else runs the kernel)."""
    if target is operator.getitem and not kwargs and type(args[0]) in (tuple, list) and type(args[1]) is int:
        return args[0][args[1]]  # an output of a multi-output op: no dispatch to go through
    key = _call_key(fake_mode, target, args, kwargs) if outcomes is not None else None
    known = outcomes.get(key) if key is not None else None
    if known is not None:
        return known.replay(fake_mode)
    direct = _direct_fake_kernel(fake_mode, target, args, kwargs)
    if direct is not None:
        try:
            value = direct(fake_mode)
        except ValueError as refused:  # the op's argument check
            if key is not None and type(refused) is ValueError:
                outcomes[key] = _Refused(refused.args)
            raise
        outputs = _Outputs.of(value, fake_mode, args) if key is not None else None
        if outputs is not None:
            outcomes[key] = outputs
        return value
    with fake_mode:
        return target(*args, **kwargs)


class GraphBuilder(_Emitter):
    """Emits replacement nodes before an anchor and gives each one ``meta["val"]``.

    A fused-op call runs the op's fake kernel, and so its argument checker (or gets what it gave
    for arguments of the same metadata in this run, ``fake_outcomes``; see :func:`fake_value`): a
    refusal undoes the rewrite and is the near-miss reason (:class:`ArgumentsRefused`).

    Arguments that are nodes already replaced by an earlier rewrite of the same
    pass are mapped to their replacements, so chained matches stay consistent.
    """

    def __init__(self, graph: Graph, fake_mode: Any, replaced: dict, inserted: list,
                 fake_outcomes: Optional[dict] = None):
        self.graph = graph
        self.fake_mode = fake_mode
        self._replaced = replaced
        self._inserted = inserted
        self._fake_outcomes = fake_outcomes

    def resolve(self, node: Any) -> Any:
        while isinstance(node, Node) and node in self._replaced:
            node = self._replaced[node]
        return node

    def call(self, target: Callable, *args, **kwargs) -> Node:
        args, kwargs = torch.fx.map_arg((args, kwargs), self.resolve)
        node = self.graph.call_function(target, args, kwargs)
        self._inserted.append(node)
        fake_args, fake_kwargs = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
        try:
            node.meta["val"] = fake_value(self.fake_mode, target, fake_args, fake_kwargs, self._fake_outcomes)
        except ValueError as exc:  # a fused op's argument check: the op cannot take this subgraph
            if fused_calls([node]):
                raise ArgumentsRefused(str(exc)) from exc
            raise
        return node


class FakeValues(_Emitter):
    """The fake values of what a :class:`GraphBuilder` would emit, and nothing emitted: a pass that
    builds a fused op's arguments with ``b.call`` (and its helpers) can compute them at match time
    with this (to ask the op about them, :func:`check_op_args`) and build them later with the same code."""

    def __init__(self, fake_mode: Any):
        self.fake_mode = fake_mode

    def call(self, target: Callable, *args, **kwargs) -> Any:
        args, kwargs = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
        return fake_value(self.fake_mode, target, args, kwargs)


@dataclasses.dataclass
class Rewrite:
    """A matched subgraph and how to build its replacement.

    ``build(builder)`` emits the new nodes (before ``anchor``) and returns the node
    that takes over the uses of ``anchor``, or, for a subgraph with several outputs,
    a dict from each output node to its replacement. ``nodes`` are the other nodes of
    the matched subgraph (never its inputs); with the anchor, those left without users
    are erased.
    """

    anchor: Node
    nodes: list[Node]
    op: str
    build: Callable[[GraphBuilder], Union[Node, dict]]
    detail: str = ""


class FusionPass:
    """One family of subgraphs and the fused op that replaces them."""

    name: str = ""  # the family: its name in the report and in config.disabled_fusions
    anchor_targets: tuple = ()  # the ops a match is rooted at (see ``anchors``)
    # for a pass registered from outside the package: the passes it must run before (it claims
    # larger subgraphs than they do); without any it runs after every built-in pass
    runs_before: Union[str, tuple[str, ...]] = ()

    def anchors(self, ctx: PassContext) -> Iterable[Node]:
        """The nodes ``match`` looks at: by default every call of an ``anchor_targets`` op."""
        return calls_of(ctx.graph, self.anchor_targets)

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        """A Rewrite for the subgraph rooted at anchor, None when it is not this pattern;
        raises NotFused(reason) when it is the pattern but breaks a rule."""
        raise NotImplementedError


# The order the built-in passes run in: each claims subgraphs that contain what later ones match.
PASS_ORDER = (
    "mla_preprocess",  # the whole DeepSeek MLA prologue, with the RoPE sites inside it
    "partial_rope",  # RoPE of a slice of the head dim, before rope takes the slice's rotation alone
    "interleave_rope",  # DeepSeek's de-interleave + half rotation, before rope takes the rotation alone
    "rope",
    "rope_vllm",  # vLLM's _C.rotary_embedding op -> rope's ops
    "softmax_grad",
    "rms_norm",  # after mla_preprocess, whose prologue holds RMSNorms
)
# old fusion names still accepted by config.disabled_fusions, with a DeprecationWarning
RENAMED_FUSIONS = {"rope_interleave": "interleave_rope"}

_registry: dict[str, type] = {}
_discovered = False


def register_fusion(cls: type) -> type:
    """Class decorator: make a :class:`FusionPass` part of every compile."""
    if cls.name in _registry:
        raise ValueError(f"fusion pass {cls.name!r} is registered twice")
    _registry[cls.name] = cls
    return cls


def registered_fusions() -> dict[str, type]:
    global _discovered
    if not _discovered:
        from . import passes

        for info in pkgutil.iter_modules(passes.__path__):
            importlib.import_module(f"{passes.__name__}.{info.name}")
        _discovered = True
    return dict(_registry)


def ordered(fusions: dict[str, type]) -> list[type]:
    """The passes in the order they run: the built-in ones as :data:`PASS_ORDER` lists them, then
    the others in registration order, each moved just before the first pass its ``runs_before``
    names."""
    builtin = [name for name in fusions if _is_builtin(fusions[name])]
    unlisted = [name for name in builtin if name not in PASS_ORDER]
    if unlisted:
        raise ValueError(f"built-in fusion pass(es) {unlisted} missing from fusion.PASS_ORDER")
    order = [name for name in PASS_ORDER if name in fusions]
    pending = [name for name in fusions if name not in order]
    order += [name for name in pending if not _runs_before(fusions[name])]
    pending = [name for name in pending if name not in order]
    while pending:
        placed = []
        for name in pending:
            later = _runs_before(fusions[name])
            unknown = [n for n in later if n not in fusions]
            if unknown:
                raise ValueError(f"fusion pass {name!r} runs before {unknown}, which no registered fusion is "
                                 f"named; registered fusions: {sorted(fusions)}")
            if all(n in order for n in later):
                order.insert(min(order.index(n) for n in later), name)
                placed.append(name)
        if not placed:
            raise ValueError(f"fusion passes {sorted(pending)} have cyclic runs_before constraints")
        pending = [name for name in pending if name not in placed]
    return [fusions[name] for name in order]


def _is_builtin(cls: type) -> bool:
    return cls.__module__.startswith(f"{__package__}.passes.")


def _runs_before(cls: type) -> tuple:
    later = cls.runs_before
    return (later,) if isinstance(later, str) else tuple(later)


def canonical_fusion_names(names: Iterable[str]) -> list[str]:
    """names with each renamed fusion's old name replaced by its new one (a DeprecationWarning each)."""
    result = []
    for name in names:
        if name in RENAMED_FUSIONS:
            new = RENAMED_FUSIONS[name]
            warnings.warn(f"npu_fuse: fusion name {name!r} is deprecated; use {new!r}", DeprecationWarning,
                          stacklevel=3)
            name = new
        result.append(name)
    return result


def check_config() -> None:
    """Check every knob (``config.validate``, and here those whose values the package defines: the
    SoCs, the registered fusions); each error names the knob, the value and what is allowed."""
    config.validate()
    config.require_one_of("soc", config.soc, ("auto", *KNOWN_SOCS))
    disabled = config.disabled_fusions
    known = sorted(registered_fusions())
    if not isinstance(disabled, (list, tuple, set, frozenset)):
        example = [n.strip() for n in disabled.split(",")] if isinstance(disabled, str) else known[:1]
        raise ValueError(f"{config.knob('disabled_fusions', disabled)}: must be a list of fusion names "
                         f"(e.g. {example}), not a {type(disabled).__name__}; registered fusions: {known}")
    unknown = [name for name in canonical_fusion_names(disabled) if name not in known]
    if unknown:
        raise ValueError(f"{config.knob('disabled_fusions', disabled)}: unknown fusion name(s) {unknown}; "
                         f"registered fusions: {known}")


@dataclasses.dataclass(frozen=True)
class FusionSettings:
    """The config values a :class:`PassManager` runs with, taken once: a snapshot, so a
    ``config.patch`` that ends (or begins) later does not change them. Take one with
    :meth:`from_config` where a compile starts and pass it to every graph of that compile."""

    soc: str = "auto"  # config.soc: "auto" (the NPU's own, else "generic"), "generic" or a named SoC
    disabled_fusions: frozenset = frozenset()  # fusion names (current ones; old names are mapped)
    strict: bool = False  # raise instead of warning when a pass fails internally
    translation_validation: bool = True  # check every rewrite on random inputs (validate.py)
    keep_unvalidated_rewrites: bool = False  # keep (with a warning) rewrites validation cannot afford

    @classmethod
    def from_config(cls) -> "FusionSettings":
        """The current config, checked (:func:`check_config`)."""
        check_config()
        return cls(soc=config.soc, disabled_fusions=frozenset(canonical_fusion_names(config.disabled_fusions)),
                   strict=config.strict, translation_validation=config.translation_validation,
                   keep_unvalidated_rewrites=config.keep_unvalidated_rewrites)


def graph_kind(graph: Graph) -> str:
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(name.startswith("tangents") for name in names):
        return "backward"
    if any(name.startswith("primals") for name in names):
        return "forward"
    return "inference"


def _fake_mode_of(graph: Graph) -> Any:
    for node in graph.nodes:
        fake = node.meta.get("val")
        if isinstance(fake, torch.Tensor) and hasattr(fake, "fake_mode"):
            return fake.fake_mode
    return None


class _Journal:
    """Records one pass's edits so that the last rewrite, or all of them, can be undone."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.inserted: list[Node] = []
        self.replaced: dict[Node, Node] = {}
        self.saved_args: dict[Node, dict] = {}  # old -> {user: its args and kwargs before the rewrite}

    def apply(self, rewrite: Rewrite, fake_mode: Any, fake_outcomes: Optional[dict] = None) -> list[Node]:
        """Build the replacement and redirect the subgraph's outputs to it; returns the new nodes."""
        first = len(self.inserted)
        builder = GraphBuilder(self.graph, fake_mode, self.replaced, self.inserted, fake_outcomes)
        with self.graph.inserting_before(rewrite.anchor):
            built = rewrite.build(builder)
        outputs = built if isinstance(built, dict) else {rewrite.anchor: built}
        saved = {user: (user.args, user.kwargs) for old in outputs for user in old.users}
        for old, new in outputs.items():
            new.meta.setdefault("stack_trace", old.meta.get("stack_trace"))
            self.saved_args[old] = saved
            old.replace_all_uses_with(new)
            self.replaced[old] = new
        return self.inserted[first:]

    def outputs_since(self, checkpoint: tuple[int, int]) -> dict:
        """{subgraph output: its replacement} of the rewrites applied after checkpoint."""
        return dict(list(self.replaced.items())[checkpoint[1]:])

    def checkpoint(self) -> tuple[int, int]:
        return len(self.inserted), len(self.replaced)

    def rollback(self, to: tuple[int, int] = (0, 0)) -> None:
        inserted, replaced = to
        for old in reversed(list(self.replaced)[replaced:]):
            for user, (args, kwargs) in self.saved_args.pop(old).items():  # exact, though outputs
                user.args, user.kwargs = args, kwargs  # may share one replacement, users read several
            del self.replaced[old]
        for node in reversed(self.inserted[inserted:]):
            if node.graph is self.graph and not node.users:
                self.graph.erase_node(node)
        del self.inserted[inserted:]


def fused_calls(nodes: Iterable[Node]) -> list[tuple]:
    """(op, args, kwargs) with fake values of every npu_fuse op called by nodes, directly or
    through ``auto_functionalized_v2`` (whose mutated arguments are its ``_all_bases``)."""
    calls = []
    for node in nodes:
        if node.op != "call_function":
            continue
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        op = node.target
        if op is torch.ops.higher_order.auto_functionalized_v2:
            op, args = args[0], ()
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("_")}
            for name in (a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write):
                kwargs[name] = node.kwargs["_all_bases"][node.kwargs[f"_{name}_base_index"]].meta.get("val")
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "npu_fuse":
            calls.append((op, args, kwargs))
    return calls


class PassManager:
    """Runs the enabled fusion passes over one aten graph and reports on it, with the config values
    of ``settings`` (default: the config now); it reads no global config itself."""

    def __init__(self, passes: Optional[list[FusionPass]] = None, settings: Optional[FusionSettings] = None):
        self.settings = settings if settings is not None else FusionSettings.from_config()
        if passes is None:
            passes = [cls() for cls in ordered(registered_fusions()) if cls.name not in self.settings.disabled_fusions]
        self.passes = passes

    def __call__(self, gm: GraphModule, lowering: str = "", unsupported_ops: Optional[dict] = None) -> GraphReport:
        start = time.perf_counter()
        graph = gm.graph
        report = new_report(graph_kind(graph), lowering, len(graph.nodes), frame=graph_frame(graph))
        log_graph("before", gm, report)
        fake_mode = _fake_mode_of(graph)
        if fake_mode is None:
            report.errors.append("graph has no fake-tensor metadata; nothing fused")
        else:
            soc = resolve_soc(self.settings.soc)
            # Each read of a fake tensor's attribute first looks for a __torch_function__ override, which
            # FakeTensor has none of: with subclasses' torch functions off it skips that look-up, and nothing
            # else (canonicalization 2x faster, the passes ~6 %)
            with torch._C.DisableTorchFunctionSubclass():
                changed = self._canonicalize(graph, report)
                memo: dict = {}
                fake_outcomes: dict = {}
                for fusion in self.passes:  # a fresh context each: the previous pass may have edited the graph
                    ctx = PassContext(graph, soc, report.kind, fake_mode, dict(unsupported_ops or {}), memo,
                                      fake_outcomes)
                    changed |= self._run_one(fusion, ctx, report)
            if changed:
                gm.recompile()
        report.pass_seconds = time.perf_counter() - start
        log_graph("after", gm, report)
        publish(report)
        return report

    def _canonicalize(self, graph: Graph, report: GraphReport) -> bool:
        try:
            return canonicalize(graph) > 0
        except Exception as exc:  # semantics-preserving edits; a failure only means fewer of them
            self._fail("canonicalize", exc, report)
            return False

    def _run_one(self, fusion: FusionPass, ctx: PassContext, report: GraphReport) -> bool:
        journal = _Journal(ctx.graph)
        matches: list[Match] = []
        near_misses: list[NearMiss] = []
        try:
            found = []  # matching reads the graph only: every candidate sees the original subgraphs
            for anchor in list(fusion.anchors(ctx)):
                try:
                    rewrite = fusion.match(ctx, anchor)
                except NotFused as miss:
                    near_misses.append(self._near_miss(fusion, anchor, str(miss), miss.near))
                    continue
                if rewrite is not None:
                    found.append(rewrite)
            claimed: set[Node] = set()  # nodes a rewrite replaced: no other rewrite may take them
            shared: set[Node] = set()  # views of a subgraph's inputs, left to their other users
            for rewrite in found:
                subgraph = [rewrite.anchor, *rewrite.nodes]
                inside = set(subgraph)
                views = {n for n in subgraph if is_input_view(n, inside)}
                if claimed.intersection(inside - views):
                    near_misses.append(self._near_miss(fusion, rewrite.anchor,
                                                       "overlaps a subgraph that was already fused"))
                    continue
                checkpoint = journal.checkpoint()
                notes: list = []  # why a rewrite is kept unvalidated (config.keep_unvalidated_rewrites)
                try:
                    inserted = journal.apply(rewrite, ctx.fake_mode, ctx.fake_outcomes)
                    refusal = self._refusal(ctx, inserted) or \
                        self._differs(subgraph, journal.outputs_since(checkpoint), inserted, notes)
                except ArgumentsRefused as refused:
                    refusal = str(refused)
                if refusal:
                    journal.rollback(checkpoint)
                    near_misses.append(self._near_miss(fusion, rewrite.anchor, refusal))
                    continue
                claimed.update(inside - views)
                shared.update(views)
                matches.append(Match(fusion.name, rewrite.op, rewrite.anchor.name,
                                     tuple(n.name for n in subgraph), rewrite.detail,
                                     tuple(n.name for n in inserted), **where(subgraph),
                                     unvalidated="; ".join(notes)))
            dead = _dead(claimed | shared)
            _check_order(ctx.graph, journal.inserted, set(dead))  # (before erasing: a failure undoes the pass whole)
            for node in dead:
                ctx.graph.erase_node(node)
        except Exception as exc:  # a pass must never break the user's compile
            journal.rollback()
            self._fail(f"fusion pass {fusion.name!r}", exc, report)
            return False
        report.matches.extend(matches)
        report.near_misses.extend(near_misses)
        return bool(matches)

    @staticmethod
    def _refusal(ctx: PassContext, inserted: list[Node]) -> Optional[str]:
        """Why the target cannot take a fused-op call the rewrite inserted, if it cannot."""
        for op, args, kwargs in fused_calls(inserted):
            name = op._opname
            if name in ctx.unsupported_ops:
                return ctx.unsupported_ops[name]
            reason = soc_refusal(op, ctx.soc, *args, **kwargs)
            if reason:
                return f"{name} on {ctx.soc}: {reason}"
        return None

    def _differs(self, subgraph: list[Node], outputs: dict, inserted: list[Node], notes: list) -> Optional[str]:
        """Why the replacement does not stand in for the subgraph: a layout a later view relies on,
        or (translation validation) different values on random inputs."""
        for old, new in outputs.items():
            before, after = old.meta.get("val"), new.meta.get("val")
            if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and \
                    not same_significant_strides(before, after):
                viewer = _stride_sensitive_user(new)
                if viewer is not None:
                    return (f"the replacement of {old.name} has strides {list(after.stride())}, not "
                            f"{list(before.stride())}, and {viewer.name} views it")
        if self.settings.translation_validation:
            return check_rewrite(subgraph, outputs, inserted, notes=notes,
                                 keep_unvalidated=self.settings.keep_unvalidated_rewrites)
        return None

    @staticmethod
    def _near_miss(fusion: FusionPass, anchor: Node, reason: str, near: tuple = ()) -> NearMiss:
        return NearMiss(fusion.name, anchor.name, reason, **where([anchor, *near]), nodes=involved(anchor))

    def _fail(self, what: str, exc: Exception, report: GraphReport) -> None:
        message = f"{what} failed and left the graph unfused: {exc!r}"
        if self.settings.strict:
            raise FusionError(message) from exc
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log.warning("%s", message, exc_info=True)
        report.errors.append(message)


def _check_order(graph: Graph, inserted: list[Node], dead: set[Node]) -> None:
    """What ``graph.lint()`` checks of the nodes a pass inserted (its only edits besides redirecting uses
    to them), once the ``dead`` nodes are erased: each is in the graph after its inputs and before its
    users. (A scan of these nodes, not of the graph.)"""
    for node in inserted:
        if node._erased:
            continue
        for arg in node._input_nodes:
            if arg.graph is not graph or arg._erased or not arg < node:
                raise RuntimeError(f"inserted node {node.name} reads {arg.name}, which is not before it in the graph")
        for user in node.users:
            if user not in dead and not node < user:
                raise RuntimeError(f"inserted node {node.name} is read by {user.name}, which is not after it")


def _dead(nodes: set[Node]) -> list[Node]:
    """The replaced nodes left without users once the dead among them are erased, and the constants (a
    shared zeros) only they used; each after its users, the order to erase them in. (From the nodes
    without users up to their inputs, no scan of the graph.)"""
    impure: dict = {}  # an op's purity, asked once per op (of a call_function, a property of its target)

    def pure(node: Node) -> bool:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return not node.is_impure()
        found = impure.get(node.target)
        if found is None:
            found = impure[node.target] = node.is_impure()
        return not found

    users_left: dict = {}

    def left(node: Node) -> int:
        if node not in users_left:
            users_left[node] = len(node.users)
        return users_left[node]

    dead, erased, constants = [], set(), set()
    pending = [node for node in nodes if not node.users]
    while pending:
        node = pending.pop()
        if node in erased or left(node) or not pure(node):
            continue
        erased.add(node)
        dead.append(node)
        for n in node._input_nodes:
            users_left[n] = left(n) - 1
            if n in nodes:
                pending.append(n)
            elif n.op == "call_function" and not n._input_nodes:
                constants.add(n)
    return dead + [n for n in constants if not left(n) and pure(n)]
