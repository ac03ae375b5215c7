"""The fusion-pass core: the pass interface, the graph rewriter and the manager.

A fusion pass is a small class (see ``passes/``): ``find`` walks the graph once
without touching it and yields either a :class:`Rewrite` (a subgraph to replace)
or a :class:`~npu_fuse_backend.report.NearMiss` (a subgraph that broke a rule).
The :class:`PassManager` applies the rewrites through a journal, so that a pass
that fails half-way leaves the graph exactly as it found it, with a warning (or
an exception under ``config.strict``).

New passes register themselves with :func:`register_fusion`; every module in
``npu_fuse_backend/passes`` is imported on first use, so adding a fusion touches
nothing here.
"""

import dataclasses
import importlib
import logging
import pkgutil
import time
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.fx import Graph, GraphModule, Node

from . import config
from .report import GraphReport, Match, NearMiss, new_report, publish
from .soc import resolve_soc

log = logging.getLogger("npu_fuse")


class FusionError(RuntimeError):
    """An internal failure of a fusion pass (raised only under ``config.strict``)."""


@dataclasses.dataclass
class PassContext:
    """What a pass may read while matching one graph."""

    graph: Graph
    soc: str  # "generic" or a named SoC
    kind: str  # "forward", "backward" or "inference"
    fake_mode: Any
    _positions: Optional[dict] = None

    def position(self, node: Node) -> int:
        """The node's index in the graph (topological order), computed once per graph."""
        if self._positions is None:
            self._positions = {n: i for i, n in enumerate(self.graph.nodes)}
        return self._positions[node]


class GraphBuilder:
    """Emits replacement nodes before an anchor and gives each one ``meta["val"]``.

    Arguments that are nodes already replaced by an earlier rewrite of the same
    pass are mapped to their replacements, so chained matches stay consistent.
    """

    def __init__(self, graph: Graph, fake_mode: Any, replaced: dict, inserted: list):
        self.graph = graph
        self.fake_mode = fake_mode
        self._replaced = replaced
        self._inserted = inserted

    def resolve(self, node: Any) -> Any:
        while isinstance(node, Node) and node in self._replaced:
            node = self._replaced[node]
        return node

    def call(self, target: Callable, *args, **kwargs) -> Node:
        args, kwargs = torch.fx.map_arg((args, kwargs), self.resolve)
        node = self.graph.call_function(target, args, kwargs)
        self._inserted.append(node)
        fake_args, fake_kwargs = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node


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

    name: str = ""  # the name used by config.disabled_fusions
    family: str = ""  # the family named in the report
    order: int = 100  # passes run in ascending order (a pass that claims a larger subgraph goes first)

    def find(self, ctx: PassContext) -> Iterable[Union[Rewrite, NearMiss]]:
        raise NotImplementedError

    def near_miss(self, anchor: Node, reason: str) -> NearMiss:
        return NearMiss(self.family, anchor.name, reason)


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
    """Records one pass's edits so they can be undone as a whole."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.inserted: list[Node] = []
        self.replaced: dict[Node, Node] = {}

    def apply(self, rewrite: Rewrite, fake_mode: Any) -> None:
        builder = GraphBuilder(self.graph, fake_mode, self.replaced, self.inserted)
        with self.graph.inserting_before(rewrite.anchor):
            built = rewrite.build(builder)
        outputs = built if isinstance(built, dict) else {rewrite.anchor: built}
        for old, new in outputs.items():
            new.meta.setdefault("stack_trace", old.meta.get("stack_trace"))
            old.replace_all_uses_with(new)
            self.replaced[old] = new

    def rollback(self) -> None:
        for old, new in reversed(list(self.replaced.items())):
            new.replace_all_uses_with(old)
        for node in reversed(self.inserted):
            if node.graph is self.graph and not node.users:
                self.graph.erase_node(node)


class PassManager:
    """Runs the enabled fusion passes over one aten graph and reports on it."""

    def __init__(self, passes: Optional[list[FusionPass]] = None):
        if passes is None:
            passes = [cls() for name, cls in sorted(registered_fusions().items(), key=lambda kv: kv[1].order)
                      if name not in config.disabled_fusions]
        self.passes = passes

    def __call__(self, gm: GraphModule, lowering: str = "") -> GraphReport:
        start = time.perf_counter()
        graph = gm.graph
        report = new_report(graph_kind(graph), lowering, len(graph.nodes))
        fake_mode = _fake_mode_of(graph)
        if fake_mode is None:
            report.errors.append("graph has no fake-tensor metadata; nothing fused")
        else:
            soc, changed = resolve_soc(), False
            for fusion in self.passes:  # a fresh context each: the previous pass may have edited the graph
                changed |= self._run_one(fusion, PassContext(graph, soc, report.kind, fake_mode), report)
            if changed:
                graph.lint()
                gm.recompile()
        report.pass_seconds = time.perf_counter() - start
        publish(report)
        return report

    def _run_one(self, fusion: FusionPass, ctx: PassContext, report: GraphReport) -> bool:
        journal = _Journal(ctx.graph)
        matches: list[Match] = []
        near_misses: list[NearMiss] = []
        try:
            found = list(fusion.find(ctx))
            claimed: set[Node] = set()
            for item in found:
                if isinstance(item, NearMiss):
                    near_misses.append(item)
                    continue
                subgraph = [item.anchor, *item.nodes]
                if claimed.intersection(subgraph):
                    near_misses.append(fusion.near_miss(
                        item.anchor, "overlaps a subgraph that was already fused"))
                    continue
                journal.apply(item, ctx.fake_mode)
                claimed.update(subgraph)
                matches.append(Match(fusion.family, item.op, item.anchor.name,
                                     tuple(n.name for n in subgraph), item.detail))
            _erase_dead(ctx.graph, claimed)
        except Exception as exc:  # a pass must never break the user's compile
            journal.rollback()
            message = f"fusion pass {fusion.name!r} failed and left the graph unfused: {exc!r}"
            if config.strict:
                raise FusionError(message) from exc
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            log.warning("%s", message, exc_info=True)
            report.errors.append(message)
            return False
        report.matches.extend(matches)
        report.near_misses.extend(near_misses)
        return bool(matches)


def _erase_dead(graph: Graph, nodes: set[Node]) -> None:
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(nodes, key=order.__getitem__, reverse=True):
        if not node.users and not node.is_impure():
            graph.erase_node(node)
