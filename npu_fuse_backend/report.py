"""The match report: what each compiled graph fused, and why near-misses did not.

Counts go to ``torch._dynamo.utils.counters["npu_fuse"]`` keyed by fused-op name;
the details of every graph are kept here and returned by :func:`get_reports`. Each match
and near-miss names where it is in the user's code: the file:line of the model code
(from the node's ``stack_trace``), the module path (``model.layers.3.self_attn``, from
``nn_module_stack``) and the graph's frame (Dynamo's compile id and code name: the graphs
of one function split by graph breaks are each tied to theirs).

``torch.compiler.reset()`` clears the reports and counters with Dynamo's caches (it calls
the ``reset`` of every backend compiled with since the last reset).

Logging: ``TORCH_LOGS="+npu_fuse"`` logs each report (and, at debug level, the nodes of each
near-miss); ``TORCH_LOGS="npu_fuse_backend.graphs"`` logs each graph before and after the passes (a
graph replayed from the compile cache was not passed through them now: one line says so).

Reports survive inductor's caches: a pass compiled for inductor also stashes its
report in ``counters["inductor"]``, whose per-compile deltas inductor stores with the
compiled graph and replays on every FX-graph-cache and AOTAutograd-cache hit. The
backend drains those keys again (:func:`drain_cached_reports`); a replayed report is
published with ``from_cache=True``.
"""

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import re
import typing
import uuid
from typing import Iterable, Iterator, Optional

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from . import config

# TORCH_LOGS="+npu_fuse" names the logger through the top-level module ``npu_fuse``;
# TORCH_LOGS="npu_fuse_backend.graphs" turns on the graphs (as "post_grad_graphs" does for inductor): torch
# parses TORCH_LOGS at its own import, when only module names (npu_fuse_backend/graphs.py) can be valid.
# The artifact "npu_fuse_graphs" (older spelling) works only after npu_fuse is imported.
torch._logging._internal.register_log("npu_fuse", "npu_fuse")
torch._logging._internal.register_artifact(
    "npu_fuse_graphs", "The aten graph before and after npu_fuse's fusion passes", off_by_default=True)
log = logging.getLogger("npu_fuse")
graphs_log = logging.getLogger("npu_fuse_backend.graphs")
_graphs_artifact = torch._logging.getArtifactLogger("npu_fuse", "npu_fuse_graphs")


@dataclasses.dataclass(frozen=True)
class Match:
    """One subgraph replaced by one fused-op call."""

    family: str
    op: str
    anchor: str
    nodes_replaced: tuple[str, ...]
    detail: str = ""
    nodes_inserted: tuple[str, ...] = ()  # the replacement's nodes (the fused call and its glue)
    source: str = ""  # file:line of the model code
    module: str = ""  # module path, e.g. "model.layers.3.self_attn"
    frame: str = ""  # the graph's frame: "[compile id] code name"
    unvalidated: str = ""  # why translation validation could not check it (config.keep_unvalidated_rewrites)


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A subgraph that looked like a family's pattern but broke one of its rules."""

    family: str
    anchor: str
    reason: str
    source: str = ""
    module: str = ""
    frame: str = ""
    nodes: tuple[str, ...] = ()  # the candidate's nodes, as FX prints them (logged at debug level)


@dataclasses.dataclass
class GraphReport:
    """Everything the fusion passes did to one compiled graph."""

    graph_id: int
    kind: str  # "forward", "backward" or "inference"
    lowering: str
    frame: str = ""
    matches: list[Match] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    pass_seconds: float = 0.0
    node_count: int = 0
    from_cache: bool = False  # replayed from inductor's compile cache; the passes did not run now

    def fused_counts(self) -> dict[str, int]:
        return dict(collections.Counter(m.op for m in self.matches))

    def summary(self) -> str:
        """The report as text: the graph, then its matches and near-misses grouped by module."""
        frame = f"{self.frame}, " if self.frame else ""
        lines = [
            f"graph {self.graph_id} ({frame}{self.kind}, {self.node_count} nodes, lowering={self.lowering}"
            f"{', from the compile cache' if self.from_cache else ''}): "
            f"{len(self.matches)} fused, {len(self.near_misses)} near-misses, "
            f"passes took {self.pass_seconds * 1e3:.2f} ms{' when first compiled' if self.from_cache else ''}"
        ]
        for module, records in by_module([*self.matches, *self.near_misses]).items():
            lines.append(f"  {module or '(top level)'}:")
            for r in records:
                at = f"{r.anchor}{' ' + r.source if r.source else ''}"
                if isinstance(r, Match):
                    lines.append(f"    fused {r.op} at {at} ({r.family}{', ' + r.detail if r.detail else ''}): "
                                 f"replaced {', '.join(r.nodes_replaced)}"
                                 f"{'; UNVALIDATED: ' + r.unvalidated if r.unvalidated else ''}")
                else:
                    lines.append(f"    not fused ({r.family}) at {at}: {r.reason}")
        lines += [f"  pass error: {e}" for e in self.errors]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GraphReport":
        return _from_plain(cls, json.loads(text))


def _from_plain(hint, value):
    """Rebuild a value of type ``hint`` from its JSON form (dataclasses, lists, tuples), so
    fields added to the report's dataclasses round-trip without changes here."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: _from_plain(hints[f.name], value[f.name])
                       for f in dataclasses.fields(hint) if f.name in value})
    if origin is list:
        return [_from_plain(args[0], item) for item in value]
    if origin is tuple:
        item_hints = args[:1] * len(value) if args[1:] == (Ellipsis,) else args
        return tuple(_from_plain(h, item) for h, item in zip(item_hints, value))
    return value


def by_module(records: Iterable) -> dict:
    """{module path: records}, modules in the order they first appear."""
    groups: dict = {}
    for record in records:
        groups.setdefault(record.module, []).append(record)
    return groups


# -- where a subgraph is in the user's code ------------------------------------------------------
_FRAME_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<code>\S+)')


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _frames(node: Node) -> tuple:
    return _parsed_trace(node.meta.get("stack_trace") or "")


@functools.lru_cache(maxsize=4096)
def _parsed_trace(trace: str) -> tuple:
    """(file, line, code) of each frame (once per trace: the layers of a model share their traces)."""
    return tuple(_FRAME_LINE.findall(trace))


def _users_frame(frames: list) -> tuple:
    """The innermost frame outside torch itself: the user's ``F.rms_norm(...)`` call, not the line in
    torch/nn/functional.py that runs it (the innermost frame when every one is torch's)."""
    return next((f for f in reversed(frames) if not f[0].startswith(_TORCH_DIR)), frames[-1])


def _module_stack(node: Node) -> dict:
    return node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}


@functools.lru_cache(maxsize=4096)
def module_path(dynamo_path: str, cls: type = None) -> str:
    """Dynamo's ``L['self'].model.layers[3]._modules['self_attn']`` as ``model.layers.3.self_attn``
    (relative to the compiled module; a module passed as an argument keeps the argument's name).
    (Once per path: every subgraph of a layer has its path.)"""
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", dynamo_path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"^[LG]\['([^']+)'\]", r"\1", path)
    return path or (cls.__name__ if isinstance(cls, type) else "")


def where(nodes: list) -> dict:
    """source, module and frame of a subgraph (``nodes[0]`` its anchor), for Match/NearMiss."""
    traced = [n for n in nodes if _frames(n)]
    # autograd's gradient-accumulation adds carry the trace of some other use of the tensor
    own = [n for n in traced if "Gradient addition node" not in n.meta["stack_trace"]] or traced
    source = frame = ""
    if own:
        file, line, _ = _users_frame(_frames(own[0]))
        source = f"{file}:{line}"
    if traced:
        frame = graph_frame_name(_frames(traced[0])[0][2])
    module = ""
    for node in nodes:
        stack = _module_stack(node)
        if stack:
            module = module_path(*list(stack.values())[-1])
            break
    return dict(source=source, module=module, frame=frame)


def involved(anchor: Node) -> tuple:
    """The anchor of a near-miss and its inputs, as FX prints them."""
    return tuple(n.format_node() for n in (*anchor.all_input_nodes, anchor))


def graph_frame_name(code_name: str) -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    return f"[{compile_id}] {code_name}" if compile_id is not None else code_name


def graph_frame(graph: Graph) -> str:
    """Dynamo's compile id and the compiled frame's code name (the outermost frame of any
    node's stack trace), e.g. ``[1/0] torch_dynamo_resume_in_forward_at_12``."""
    for node in graph.nodes:
        frames = _frames(node)
        if frames:
            return graph_frame_name(frames[0][2])
    compile_id = torch._guards.CompileContext.current_compile_id()
    return f"[{compile_id}]" if compile_id is not None else ""


def _graphs_logger() -> Optional[tuple]:
    """(logger, level) where graphs go: ``npu_fuse_backend.graphs`` when its own level is set
    (TORCH_LOGS names it; a parent's level is not enough, so ``TORCH_LOGS="npu_fuse"`` alone logs
    no graphs), or the artifact; None when neither is on."""
    if graphs_log.level != logging.NOTSET and graphs_log.isEnabledFor(logging.INFO):
        return graphs_log, logging.INFO
    return (_graphs_artifact, logging.DEBUG) if _graphs_artifact.isEnabledFor(logging.DEBUG) else None


def log_graph(when: str, gm: GraphModule, report: "GraphReport") -> None:
    """The graph to ``TORCH_LOGS="npu_fuse_backend.graphs"``."""
    target = _graphs_logger()
    if target is not None:
        target[0].log(target[1], "graph %d %s npu_fuse's passes (%s, %s):\n%s", report.graph_id, when,
                      report.frame, report.kind, gm.print_readable(print_output=False))


_reports: collections.deque = collections.deque()
_graph_ids = itertools.count()
_collectors: list = []
# The inductor counter keys that carry reports through the compile cache: prefix + token + " " + JSON.
CACHED_REPORT_PREFIX = "npu_fuse_report:"
# Tokens of reports published live in this process whose stash was not drained yet.
_live_tokens: set = set()


def new_report(kind: str, lowering: str, node_count: int, frame: str = "") -> GraphReport:
    return GraphReport(graph_id=next(_graph_ids), kind=kind, lowering=lowering, node_count=node_count, frame=frame)


def publish(report: GraphReport) -> None:
    """Store a finished report, bump the counters and log it."""
    _reports.append(report)
    for collected in _collectors:
        collected.append(report)
    while len(_reports) > config.max_reports:
        _reports.popleft()
    for match in report.matches:
        counters["npu_fuse"][match.op] += 1
    counters["npu_fuse_near_miss"].update(n.family for n in report.near_misses)
    log.info("%s", report.summary())
    if log.isEnabledFor(logging.DEBUG):
        for miss in report.near_misses:
            log.debug("near-miss (%s) at %s %s: %s; nodes:\n  %s", miss.family, miss.anchor, miss.source, miss.reason,
                      "\n  ".join(miss.nodes))


@contextlib.contextmanager
def collect() -> Iterator[list]:
    """Every report published inside the block, in order, whatever resets happen meanwhile
    (``npu-fuse explain`` runs user scripts that may call ``torch.compiler.reset()``)."""
    collected: list = []
    _collectors.append(collected)
    try:
        yield collected
    finally:
        _collectors.remove(collected)


def stash_for_compile_cache(report: GraphReport) -> None:
    """Record a just-published report in ``counters["inductor"]``: inductor saves the counter
    deltas of a compile with the compiled graph and replays them on each cache hit."""
    token = uuid.uuid4().hex
    _live_tokens.add(token)
    counters["inductor"][f"{CACHED_REPORT_PREFIX}{token} {report.to_json()}"] += 1


def drain_cached_reports() -> None:
    """Take our keys out of ``counters["inductor"]``: a report's own live stash is dropped
    (it was published when its passes ran), every replay is published as from the cache."""
    for key in [k for k in counters["inductor"] if k.startswith(CACHED_REPORT_PREFIX)]:
        count = counters["inductor"].pop(key)
        token, _, text = key[len(CACHED_REPORT_PREFIX):].partition(" ")
        if token in _live_tokens:
            _live_tokens.discard(token)
            count -= 1
        for _ in range(count):
            report = dataclasses.replace(GraphReport.from_json(text), graph_id=next(_graph_ids), from_cache=True)
            target = _graphs_logger()
            if target is not None:
                target[0].log(target[1], "graph %d (%s, %s) comes from the compile cache: npu_fuse's passes did "
                              "not run on it now, so there is no graph to log (its report follows; a cold compile: "
                              "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1)", report.graph_id, report.frame, report.kind)
            publish(report)


def get_reports() -> list[GraphReport]:
    """Per compiled graph, oldest first: its matches and near-misses with reasons."""
    drain_cached_reports()
    return list(_reports)


def clear_reports() -> None:
    """Forget stored reports and reset the ``npu_fuse`` counters (``torch.compiler.reset()`` does too)."""
    drain_cached_reports()
    _reports.clear()
    counters["npu_fuse"].clear()
    counters["npu_fuse_near_miss"].clear()
