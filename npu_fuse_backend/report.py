"""The match report: what each compiled graph fused, and why near-misses did not.

Counts go to ``torch._dynamo.utils.counters["npu_fuse"]`` keyed by fused-op name;
the details of every graph are kept here and returned by :func:`get_reports`.
Everything is also logged to the ``npu_fuse`` logger (``TORCH_LOGS="+npu_fuse"``).

Reports survive inductor's caches: a pass compiled for inductor also stashes its
report in ``counters["inductor"]``, whose per-compile deltas inductor stores with the
compiled graph and replays on every FX-graph-cache and AOTAutograd-cache hit. The
backend drains those keys again (:func:`drain_cached_reports`); a replayed report is
published with ``from_cache=True``.
"""

import collections
import dataclasses
import itertools
import json
import logging
import typing
import uuid

import torch
from torch._dynamo.utils import counters

from . import config

log = logging.getLogger("npu_fuse")

# TORCH_LOGS="+npu_fuse" names the logger through the top-level module ``npu_fuse``.
torch._logging._internal.register_log("npu_fuse", "npu_fuse")


@dataclasses.dataclass(frozen=True)
class Match:
    """One subgraph replaced by one fused-op call."""

    family: str
    op: str
    anchor: str
    nodes_replaced: tuple[str, ...]
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A subgraph that looked like a family's pattern but broke one of its rules."""

    family: str
    anchor: str
    reason: str


@dataclasses.dataclass
class GraphReport:
    """Everything the fusion passes did to one compiled graph."""

    graph_id: int
    kind: str  # "forward", "backward" or "inference"
    lowering: str
    matches: list[Match] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    pass_seconds: float = 0.0
    node_count: int = 0
    from_cache: bool = False  # replayed from inductor's compile cache; the passes did not run now

    def fused_counts(self) -> dict[str, int]:
        return dict(collections.Counter(m.op for m in self.matches))

    def summary(self) -> str:
        lines = [
            f"graph {self.graph_id} ({self.kind}, {self.node_count} nodes, lowering={self.lowering}"
            f"{', from the compile cache' if self.from_cache else ''}): "
            f"{len(self.matches)} fused, {len(self.near_misses)} near-misses, "
            f"passes took {self.pass_seconds * 1e3:.2f} ms{' when first compiled' if self.from_cache else ''}"
        ]
        lines += [f"  fused {m.op} at {m.anchor} ({m.family}{', ' + m.detail if m.detail else ''}): "
                  f"replaced {', '.join(m.nodes_replaced)}" for m in self.matches]
        lines += [f"  not fused ({n.family}) at {n.anchor}: {n.reason}" for n in self.near_misses]
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


_reports: collections.deque = collections.deque()
_graph_ids = itertools.count()
# The inductor counter keys that carry reports through the compile cache: prefix + token + " " + JSON.
CACHED_REPORT_PREFIX = "npu_fuse_report:"
# Tokens of reports published live in this process whose stash was not drained yet.
_live_tokens: set = set()


def new_report(kind: str, lowering: str, node_count: int) -> GraphReport:
    return GraphReport(graph_id=next(_graph_ids), kind=kind, lowering=lowering, node_count=node_count)


def publish(report: GraphReport) -> None:
    """Store a finished report, bump the counters and log it."""
    _reports.append(report)
    while len(_reports) > config.max_reports:
        _reports.popleft()
    for match in report.matches:
        counters["npu_fuse"][match.op] += 1
    counters["npu_fuse_near_miss"].update(n.family for n in report.near_misses)
    log.info("%s", report.summary())


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
            publish(dataclasses.replace(GraphReport.from_json(text), graph_id=next(_graph_ids), from_cache=True))


def get_reports() -> list[GraphReport]:
    """Per compiled graph, oldest first: its matches and near-misses with reasons."""
    drain_cached_reports()
    return list(_reports)


def clear_reports() -> None:
    """Forget stored reports and reset the ``npu_fuse`` counters."""
    drain_cached_reports()
    _reports.clear()
    counters["npu_fuse"].clear()
    counters["npu_fuse_near_miss"].clear()
