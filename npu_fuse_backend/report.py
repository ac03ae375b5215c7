"""The match report: what each compiled graph fused, and why near-misses did not.

Counts go to ``torch._dynamo.utils.counters["npu_fuse"]`` keyed by fused-op name;
the details of every graph are kept here and returned by :func:`get_reports`.
Everything is also logged to the ``npu_fuse`` logger (``TORCH_LOGS="+npu_fuse"``).
"""

import collections
import dataclasses
import itertools
import logging

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

    def fused_counts(self) -> dict[str, int]:
        return dict(collections.Counter(m.op for m in self.matches))

    def summary(self) -> str:
        lines = [
            f"graph {self.graph_id} ({self.kind}, {self.node_count} nodes, lowering={self.lowering}): "
            f"{len(self.matches)} fused, {len(self.near_misses)} near-misses, "
            f"passes took {self.pass_seconds * 1e3:.2f} ms"
        ]
        lines += [f"  fused {m.op} at {m.anchor} ({m.family}{', ' + m.detail if m.detail else ''}): "
                  f"replaced {', '.join(m.nodes_replaced)}" for m in self.matches]
        lines += [f"  not fused ({n.family}) at {n.anchor}: {n.reason}" for n in self.near_misses]
        lines += [f"  pass error: {e}" for e in self.errors]
        return "\n".join(lines)


_reports: collections.deque = collections.deque()
_graph_ids = itertools.count()


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


def get_reports() -> list[GraphReport]:
    """Per compiled graph, oldest first: its matches and near-misses with reasons."""
    return list(_reports)


def clear_reports() -> None:
    """Forget stored reports and reset the ``npu_fuse`` counters."""
    _reports.clear()
    counters["npu_fuse"].clear()
    counters["npu_fuse_near_miss"].clear()
