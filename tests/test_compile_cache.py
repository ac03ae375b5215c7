"""Inductor's caches stay on under npu_fuse: a warm start reuses the compiled graphs
(AOTAutograd and FX-graph caches), the report still comes back (from the cache), and
nothing is shared with plain inductor or served after a config change.

The end-to-end tests are fresh processes sharing one TORCHINDUCTOR_CACHE_DIR, the way a
second run of a training script meets the cache; the rest checks the cache key and the
report's round trip in process, without compiling.
"""

import json
import os
import subprocess
import sys

import pytest
from torch._dynamo.utils import counters

import npu_fuse_backend as nf
from npu_fuse_backend import report as report_module
from npu_fuse_backend.fusion import FusionPass, _registry
from npu_fuse_backend.lowering.fallback import FusionPrePass, _package_sources
from npu_fuse_backend.report import GraphReport, Match, NearMiss

# Compiles in a fresh process, one per step; prints what the tests assert on as JSON.
CHILD = r"""
import json, sys
import torch
import npu_fuse
from npu_fuse_backend.report import CACHED_REPORT_PREFIX
from torch._dynamo.utils import counters

def rope(q, cos, sin):
    return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

def stash_keys():
    return sum(k.startswith(CACHED_REPORT_PREFIX) for k in counters["inductor"])

def step(backend, train, config):
    torch._dynamo.reset()
    npu_fuse.clear_reports()
    counters["aot_autograd"].clear()
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 16, requires_grad=train)
    cos, sin = torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16)
    with npu_fuse.config.patch(**config):
        out = torch.compile(rope, backend=backend)(q, cos, sin)
        keys_after_compile = stash_keys()
        ok = torch.allclose(out, rope(q, cos, sin), atol=1e-5)
        if train:
            out.sum().backward()
            grad, q.grad = q.grad, None
            rope(q, cos, sin).sum().backward()
            ok = ok and torch.allclose(grad, q.grad, atol=1e-5)
    keys_after_step = stash_keys()
    counted = {k: v for k, v in counters["npu_fuse"].items() if v}  # before get_reports() drains anything
    reports = npu_fuse.get_reports()
    return {"reports": [{"kind": r.kind, "fused": [m.op for m in r.matches], "from_cache": r.from_cache}
                        for r in reports],
            "aot": dict(counters["aot_autograd"]), "stash_keys_after_compile": keys_after_compile,
            "stash_keys_after_step": keys_after_step, "counted": counted,
            "stash_keys_after_reports": stash_keys(), "ok": ok}

print(json.dumps([step(**spec) for spec in json.loads(sys.argv[1])]))
"""


def compile_in_fresh_process(cache_dir, steps: list, **env_extra) -> list:
    """Each step: {"backend", "train", "config"}; its result: reports, AOTAutograd counters...
    (the process's stderr with the last one, under "stderr")."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), NPU_FUSE_FALLBACK="inductor", **env_extra)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(steps)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(r["ok"] for r in results), "a compiled result differs from eager"
    results[-1]["stderr"] = done.stderr
    return results


def step(backend="npu_fuse", train=False, **config) -> dict:
    return {"backend": backend, "train": train, "config": config}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A cold process (plain inductor, then npu_fuse inference and training), then a warm one
    on the same cache directory (the same compiles, and two config changes)."""
    cache = tmp_path_factory.mktemp("inductor_cache")
    cold = compile_in_fresh_process(cache, [step("inductor"), step(), step(train=True), step(train=True)])
    warm = compile_in_fresh_process(cache, [step(), step(soc="Ascend950"), step(disabled_fusions=["rope"]),
                                            step(train=True)], TORCH_LOGS="npu_fuse_backend.graphs")
    return {"plain_cold": cold[0], "cold": cold[1], "train_cold": cold[2], "train_in_process": cold[3],
            "warm": warm[0], "soc_changed": warm[1], "rope_disabled": warm[2], "train_warm": warm[3]}


def hits(result) -> tuple:
    return result["aot"].get("autograd_cache_hit", 0), result["aot"].get("autograd_cache_miss", 0)


def test_plain_inductor_artifacts_are_not_served_to_npu_fuse(runs):
    assert runs["plain_cold"]["reports"] == [] and hits(runs["plain_cold"]) == (0, 1)
    assert hits(runs["cold"]) == (0, 1)
    assert runs["cold"]["reports"] == [{"kind": "inference", "fused": ["rotary_mul"], "from_cache": False}]


def test_warm_start_hits_the_aot_cache_and_reports_from_it(runs):
    warm = runs["warm"]
    assert hits(warm) == (1, 0)
    assert warm["reports"] == [{"kind": "inference", "fused": ["rotary_mul"], "from_cache": True}]
    assert warm["stash_keys_after_compile"] == 0, "counters['inductor'] keeps our report keys"


@pytest.mark.parametrize("run, fused", [("soc_changed", ["rotary_mul"]), ("rope_disabled", [])])
def test_a_config_change_misses_the_cache(runs, run, fused):
    assert hits(runs[run]) == (0, 1)
    # a stale fused graph would come with a from-cache report of rotary_mul
    assert runs[run]["reports"] == [{"kind": "inference", "fused": fused, "from_cache": False}]


def test_training_warm_start_reports_forward_and_backward_from_the_cache(runs):
    expected = [{"kind": "forward", "fused": ["rotary_mul"]}, {"kind": "backward", "fused": ["rotary_mul_backward"]}]
    for run, from_cache in (("train_cold", False), ("train_warm", True)):
        assert [{k: r[k] for k in ("kind", "fused")} for r in runs[run]["reports"]] == expected
        assert [r["from_cache"] for r in runs[run]["reports"]] == [from_cache] * 2
    assert hits(runs["train_cold"]) == (0, 1) and hits(runs["train_warm"]) == (1, 0)
    assert runs["train_warm"]["stash_keys_after_reports"] == 0


def uuid() -> str:
    return FusionPrePass(nf.run_fusion_passes).uuid()


def test_cache_key_follows_every_knob_that_changes_the_graph():
    base = uuid()
    assert uuid() == base
    for knob, value in [("soc", "Ascend950"), ("disabled_fusions", ["rope"]), ("strict", True)]:
        with nf.config.patch(**{knob: value}):
            assert uuid() != base, knob
    with nf.config.patch(max_reports=3):  # report-only
        assert uuid() == base
    with nf.config.patch(soc="generic"):  # what "auto" resolves to without an NPU
        assert uuid() == base


def test_cache_key_follows_registered_fusions_and_the_graph_pass(monkeypatch):
    base = uuid()

    class NoOpFusion(FusionPass):
        name = "no_op_test_fusion"

        def find(self, ctx):
            return []

    monkeypatch.setitem(_registry, NoOpFusion.name, NoOpFusion)
    assert uuid() != base
    monkeypatch.delitem(_registry, NoOpFusion.name)
    assert uuid() == base
    assert FusionPrePass(lambda gm, lowering: None).uuid() != base


def test_cache_key_hashes_every_source_file_of_the_package():
    sources = _package_sources()
    for name in ("npu_fuse_backend.fusion", "npu_fuse_backend.passes.rope", "npu_fuse_backend.lowering.ops.rope",
                 "npu_fuse_backend.lowering.fallback", "npu_fuse_backend.converters.rope"):
        assert name in sources and sources[name].is_file(), name


def test_report_round_trips_through_json():
    report = GraphReport(graph_id=3, kind="backward", lowering="inductor",
                         matches=[Match("rope", "rotary_mul", "add", ("add", "mul"), "mode=half")],
                         near_misses=[NearMiss("softmax_grad", "sub", "x2 is not a scalar")],
                         errors=["boom"], pass_seconds=0.5, node_count=12)
    again = GraphReport.from_json(report.to_json())
    assert again == report and isinstance(again.matches[0].nodes_replaced, tuple)


def test_a_replayed_report_is_published_once_per_replay_and_its_live_stash_is_dropped():
    live = report_module.new_report("forward", "inductor", node_count=5)
    live.matches.append(Match("rope", "rotary_mul", "add", ("add",)))
    report_module.publish(live)
    report_module.stash_for_compile_cache(live)
    (key,) = [k for k in counters["inductor"] if k.startswith(report_module.CACHED_REPORT_PREFIX)]
    counters["inductor"][key] += 1  # what a cache hit in the same process replays
    reports = nf.get_reports()
    assert [r.from_cache for r in reports] == [False, True]
    assert reports[1].matches == live.matches and reports[1].graph_id != live.graph_id
    assert counters["npu_fuse"]["rotary_mul"] == 2
    assert not any(k.startswith(report_module.CACHED_REPORT_PREFIX) for k in counters["inductor"])
    assert "from the compile cache" in reports[1].summary()
    counters["inductor"][key] += 1  # a later hit: the live stash is gone, so this one is a replay
    assert [r.from_cache for r in nf.get_reports()] == [False, True, True]


@pytest.mark.parametrize("run", ["cold", "train_cold", "train_in_process", "warm", "train_warm", "rope_disabled"])
def test_counters_and_reports_agree_after_every_step_and_no_report_stays_in_inductors_counters(runs, run):
    """Cold, replayed from the FX/AOTAutograd cache of another process, replayed in process: the
    counters are right without asking for the reports first, and nothing is left in counters["inductor"]."""
    result = runs[run]
    from_reports: dict = {}
    for report in result["reports"]:
        for op in report["fused"]:
            from_reports[op] = from_reports.get(op, 0) + 1
    assert result["counted"] == from_reports
    assert result["stash_keys_after_step"] == 0


def test_a_training_step_replayed_in_process_reports_both_graphs_from_the_cache(runs):
    assert [(r["kind"], r["from_cache"]) for r in runs["train_in_process"]["reports"]] == \
        [("forward", True), ("backward", True)]


def test_graph_logging_on_a_warm_cache_says_why_there_is_no_graph(runs):
    stderr = runs["train_warm"]["stderr"]
    assert "comes from the compile cache: npu_fuse's passes did not run on it now" in stderr
    assert "before npu_fuse's passes" in stderr  # the cache misses (config changes) log their graphs
