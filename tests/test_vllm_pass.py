"""NpuFusePass (npu_fuse_backend/vllm.py) without vLLM: the pass vLLM's compile runs, as inductor runs it.

On vLLM's CPU build the pass is inductor's ``post_grad_custom_post_pass`` and nothing else of
vLLM is involved, so the pass itself is tested here with plain inductor and FX graphs; its
life inside vLLM's worker is ``tests/test_vllm.py`` (``make test-vllm``).
"""

import json
import logging
import pickle

import pytest
import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor import config as inductor_config

import npu_fuse
import npu_fuse_backend as nf
from conftest import assert_close
from npu_fuse_backend.vllm import NpuFusePass, read_reports
from test_rope_vllm import VllmAttentionPrologue, inputs


@pytest.fixture(autouse=True)
def inference():
    with torch.no_grad():
        yield


def targets(gm) -> list:
    """The ops gm calls (an auto_functionalized call as the op it wraps)."""
    return [str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
            for n in gm.graph.nodes if n.op == "call_function"]


def test_uuid_is_a_str_that_follows_the_config_it_carries():
    plain, again = NpuFusePass(), NpuFusePass()
    assert isinstance(plain.uuid(), str) and plain.uuid() == again.uuid()
    assert NpuFusePass(soc="Ascend910B").uuid() != plain.uuid()
    assert NpuFusePass(disabled_fusions=["rope_vllm"]).uuid() != plain.uuid()
    with nf.config.patch(soc="Ascend950"):  # the live config does not change a pass made before
        assert plain.uuid() == again.uuid()
        assert NpuFusePass().uuid() != plain.uuid()  # one made now carries it
    assert NpuFusePass(report_file="x.jsonl").uuid() == plain.uuid()  # the report does not change the graph


def test_the_config_travels_with_the_pass():
    """vLLM's worker is another process: npu_fuse.config.patch in the parent never reaches it,
    the pass's own copy does (it is pickled with the pass)."""
    module, args = VllmAttentionPrologue(), inputs()
    shipped = pickle.loads(pickle.dumps(NpuFusePass(disabled_fusions=["rope_vllm"])))
    assert shipped.uuid() == NpuFusePass(disabled_fusions=["rope_vllm"]).uuid()
    _, gm = compile_with(shipped, module, args)
    assert any("rotary_embedding" in t for t in targets(gm))
    with nf.config.patch(disabled_fusions=["rope_vllm"]):
        shipped = pickle.loads(pickle.dumps(NpuFusePass(disabled_fusions=[])))
    _, gm = compile_with(shipped, module, args)
    assert not any("rotary_embedding" in t for t in targets(gm))


def test_a_bad_knob_fails_where_the_pass_is_made():
    with pytest.raises(ValueError, match="config.soc='Ascend999'"):
        NpuFusePass(soc="Ascend999")
    with pytest.raises(ValueError, match="unknown fusion name"):
        NpuFusePass(disabled_fusions=["no_such_fusion"])


def compile_with(fusion_pass, module, args, as_module=False):
    """module compiled with fusion_pass run on its aten graph (as a Graph, or as a GraphModule as
    vllm-ascend hands it); returns (output, graph)."""
    graphs = []

    def fw(gm, _):
        fusion_pass(gm if as_module else gm.graph)
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        out = torch.compile(module, backend=aot_autograd(fw_compiler=fw), dynamic=True)(*args)
    return out, graphs[0]


@pytest.mark.parametrize("as_module", [False, True], ids=["fx.Graph (inductor, vLLM)", "GraphModule (vllm-ascend)"])
def test_fuses_and_decomposes_off_the_npu(as_module):
    module, args = VllmAttentionPrologue(rotary_dim=16), inputs()
    expected = module(*args)
    out, gm = compile_with(NpuFusePass(), module, args, as_module)
    assert not any("rotary_embedding" in t for t in targets(gm))
    assert not any(t.startswith("npu_fuse.") for t in targets(gm))  # lowered for inductor, as backend="npu_fuse" does
    for got, want in zip(out, expected):
        assert_close(got, want)
    report = nf.get_reports()[-1]
    assert report.lowering == "vllm (inductor)" and report.fused_counts() == {"rotary_mul": 1}


def test_reports_go_to_the_file_and_to_vllms_log(tmp_path, caplog):
    path = tmp_path / "fusions.jsonl"
    fusion_pass = NpuFusePass(report_file=str(path))
    with caplog.at_level(logging.INFO, logger="vllm.npu_fuse"):
        for rotary_dim in (32, 16):  # two graphs, one report each, appended
            compile_with(fusion_pass, VllmAttentionPrologue(rotary_dim=rotary_dim), inputs())
    reports = read_reports(str(path))
    assert [r.fused_counts() for r in reports] == [{"rotary_mul": 1}] * 2
    assert "vLLM _C.rotary_embedding" in reports[0].matches[0].detail
    assert all(json.loads(line)["lowering"] == "vllm (inductor)" for line in path.read_text().splitlines())
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.npu_fuse"]
    assert len(lines) == 2 and all("fused rotary_mul x1; 0 near-misses" in line for line in lines), lines


def test_the_report_file_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_FUSE_REPORT_FILE", str(tmp_path / "env.jsonl"))
    assert NpuFusePass().report_file == str(tmp_path / "env.jsonl")
    assert NpuFusePass(report_file="mine.jsonl").report_file == "mine.jsonl"


def test_near_misses_and_errors_are_in_the_one_line_report():
    from npu_fuse_backend.report import GraphReport, Match, NearMiss
    from npu_fuse_backend.vllm import one_line

    miss = NearMiss("rope", "auto_functionalized_1", "query has shape [s0, 4, 32], not [tokens, heads * head_size]")
    report = GraphReport(graph_id=3, kind="inference", lowering="vllm (inductor)", node_count=120,
                         matches=[Match("rope", "rotary_mul", "a", ("a",))] * 2, near_misses=[miss, miss],
                         errors=["fusion pass 'x' failed"], pass_seconds=0.0123)
    line = one_line(report)
    assert line.startswith("npu_fuse: graph 3 (inference, 120 nodes, pid ")
    assert ("fused rotary_mul x2; 2 near-misses: rope: query has shape [s0, 4, 32], not [tokens, heads * head_size] "
            "(x2); pass errors: fusion pass 'x' failed; passes 12.3 ms") in line, line


def test_as_inductors_post_grad_custom_post_pass():
    """What vLLM's CPU build does with it: torch.compile(backend="inductor", options=inductor_compile_config)."""
    module, args = VllmAttentionPrologue(is_neox=False), inputs()
    expected = module(*args)
    torch._dynamo.reset()
    options = {"post_grad_custom_post_pass": NpuFusePass(), "enable_auto_functionalized_v2": False,
               "fx_graph_cache": False}
    out = torch.compile(module, backend="inductor", dynamic=True, options=options)(*args)
    for got, want in zip(out, expected):
        assert_close(got, want)
    assert nf.get_reports()[-1].fused_counts() == {"rotary_mul": 1}


def test_npu_fuse_exports_it_lazily():
    import sys

    assert npu_fuse.vllm.NpuFusePass is NpuFusePass
    assert npu_fuse.vllm.read_reports is read_reports
    assert "npu_fuse.vllm" in sys.modules
