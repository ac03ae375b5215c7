"""npu_fuse inside vLLM's CPU build, for real: ``make test-vllm`` (marker ``vllm``, its own venv).

Each engine starts in a fresh process with a fresh ``VLLM_CACHE_ROOT`` (a cache hit would skip
the compile, and the passes with it) on a tiny random Llama written locally (no downloads).
Three engine starts: vLLM without npu_fuse (eager: the tokens to match), and with npu_fuse in
both forms vLLM's RoPE takes: its ``_C.rotary_embedding`` op (``custom_ops=["all"]``) and the
torch ops of ``forward_native`` (``custom_ops=["none"]``, the CPU default).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: make test-vllm installs it")

import torch  # noqa: E402

import npu_fuse.vllm  # noqa: E402
import vllm_engine  # noqa: E402
import vllm_ops  # noqa: E402
from npu_fuse_backend.report import GraphReport  # noqa: E402

# every test here runs vLLM's kernels, in engines or in this process (skipped one by one, so that the
# run still collects them: a module skipped whole is "no tests", pytest's exit status 5)
pytestmark = [pytestmark, pytest.mark.skipif(vllm_ops.UNUSABLE is not None, reason=str(vllm_ops.UNUSABLE))]

ENGINE = Path(__file__).with_name("vllm_engine.py")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """run(name, *flags) -> (result, reports, log) of one engine, each run once per module."""
    root = tmp_path_factory.mktemp("vllm")
    models = {}
    done = {}

    def model(arch):
        if arch not in models:
            models[arch] = str(root / arch)
            subprocess.run([sys.executable, str(ENGINE), "model", models[arch], "--arch", arch], check=True,
                           env={**os.environ, **vllm_engine.ENGINE_ENV}, capture_output=True)
        return models[arch]

    def run(name, *flags, arch="llama"):
        if name not in done:
            out, report_file = root / f"{name}.json", root / f"{name}.jsonl"
            env = {**os.environ, **vllm_engine.ENGINE_ENV, "VLLM_CACHE_ROOT": str(root / f"cache-{name}")}
            command = [sys.executable, str(ENGINE), "run", "--model", model(arch), "--out", str(out), *flags]
            if "--npu-fuse" in flags:
                command += ["--report-file", str(report_file)]
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            log = proc.stdout + proc.stderr
            assert proc.returncode == 0, log[-4000:]
            reports = npu_fuse.vllm.read_reports(str(report_file)) if report_file.exists() else []
            done[name] = (json.loads(out.read_text()), reports, log)
        return done[name]

    return run


def baseline(engines):
    return engines("baseline", "--custom-ops", "none", "--enforce-eager")


def rotary_mul_sites(reports: list) -> list:
    return [m for r in reports for m in r.matches if m.op == "rotary_mul"]


# -- vLLM's custom op: _C.rotary_embedding ------------------------------------------------------
def test_custom_op_form_fuses_inside_vllms_compile(engines):
    result, reports, log = engines("custom_op", "--custom-ops", "all", "--npu-fuse")
    assert reports and all(isinstance(r, GraphReport) and not r.errors for r in reports)
    sites = rotary_mul_sites(reports)
    assert sorted(m.module for m in sites) == ["layers.0.self_attn.rotary_emb", "layers.1.self_attn.rotary_emb"]
    assert all("vLLM _C.rotary_embedding on query and key" in m.detail and "mode=half" in m.detail for m in sites)
    assert {r.lowering for r in reports} == {"vllm (inductor)"}
    # the worker's one-line report, in vLLM's own log
    assert "npu_fuse: graph 0 (inference" in log and "rotary_mul x2;" in log, log[-3000:]


def test_custom_op_form_generates_the_tokens_of_plain_vllm(engines):
    fused, _, _ = engines("custom_op", "--custom-ops", "all", "--npu-fuse")
    plain, _, _ = baseline(engines)
    assert fused["tokens"] == plain["tokens"]
    assert len(plain["tokens"]) == len(vllm_engine.PROMPTS) and all(len(t) == vllm_engine.MAX_TOKENS
                                                                   for t in plain["tokens"])


# -- forward_native: torch ops -------------------------------------------------------------------
def test_forward_native_form_generates_the_tokens_of_plain_vllm(engines):
    fused, reports, _ = engines("forward_native", "--custom-ops", "none", "--npu-fuse")
    assert reports and not any(r.errors for r in reports)
    assert fused["tokens"] == baseline(engines)[0]["tokens"]


def test_forward_native_form_fuses(engines):
    """x1*c - x2*s, x2*c + x1*s on contiguous halves with half-width tables, then cat: per layer,
    one rotary_mul for the query and one for the key."""
    _, reports, _ = engines("forward_native", "--custom-ops", "none", "--npu-fuse")
    sites = rotary_mul_sites(reports)
    assert len(sites) == 4 and {m.module for m in sites} == {"layers.0.self_attn.rotary_emb",
                                                             "layers.1.self_attn.rotary_emb"}


# -- without an engine -------------------------------------------------------------------------
@pytest.mark.skipif(not vllm_ops.REAL, reason="needs vLLM's kernel")
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stand_in_computes_what_vllms_cpu_kernel_does(is_neox, rotary_dim, dtype):
    """tests/vllm_ops.py stands in for the kernel where vLLM is absent (the main suite)."""
    torch.manual_seed(0)
    positions, cache = torch.randint(0, 64, (9,)), torch.randn(64, rotary_dim).to(dtype)
    qkv = torch.randn(9, 256).to(dtype)
    q, k = qkv[:, :128], qkv[:, 128:192]  # views with row stride 256, as vLLM's split gives
    expected_q, expected_k = (vllm_ops.rotate_reference(positions, x, 32, cache, is_neox) for x in (q, k))
    vllm_ops.rotary_embedding(positions, q, k, 32, cache, is_neox)
    tolerance = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # its FMAs
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k, expected_k, **tolerance)


def test_compilation_config_puts_the_pass_under_the_platforms_key():
    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass
    from vllm.config import CompilationConfig
    from vllm.platforms import current_platform

    config = npu_fuse.vllm.compilation_config({"custom_ops": ["all"], "inductor_compile_config": {"dce": True}})
    inductor = config["inductor_compile_config"]
    assert config["custom_ops"] == ["all"] and inductor["dce"] is True
    fusion_pass = inductor[current_platform.pass_key]
    assert current_platform.pass_key == "post_grad_custom_post_pass"
    # what vLLM's PostGradPassManager and vllm-ascend's GraphFusionPassManager assert
    assert isinstance(fusion_pass, InductorPass) and isinstance(fusion_pass, VllmInductorPass)
    assert fusion_pass.is_applicable_for_range(None)
    with pytest.raises(ValueError, match="already set"):
        npu_fuse.vllm.compilation_config(config)
    # vLLM's own config hash takes the pass (its uuid must be a str) and follows our config
    hashes = {CompilationConfig(**npu_fuse.vllm.compilation_config(soc=soc)).compute_hash()
              for soc in ("Ascend910B", "Ascend950")}
    assert len(hashes) == 2


def test_import_npu_fuse_does_not_import_vllm():
    code = "import sys, npu_fuse; assert 'vllm' not in sys.modules, 'vllm imported'; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


# -- DeepSeek-V2 (MLA), opt in: one more engine start ----------------------------------------------
@pytest.mark.skipif(os.environ.get("NPU_FUSE_TEST_VLLM_DEEPSEEK") != "1",
                    reason="set NPU_FUSE_TEST_VLLM_DEEPSEEK=1 (two more engine starts)")
def test_deepseek_v2_mla_graph(engines):
    """vLLM's DeepSeek-V2 on CPU: the MLA prologue's KV-cache write and W_UK absorption are inside
    vLLM's opaque MLA ops, so mla_preprocess has nothing to match; its RoPE call takes 3-D q_pe /
    k_pe, which vLLM's CPU kernel reads differently from its CUDA kernel: refused, saying so."""
    plain, _, _ = engines("deepseek_plain", "--custom-ops", "all", "--dtype", "bfloat16", arch="deepseek_v2")
    fused, reports, _ = engines("deepseek_custom_op", "--custom-ops", "all", "--npu-fuse", "--dtype", "bfloat16",
                                arch="deepseek_v2")
    assert fused["tokens"] == plain["tokens"]
    assert not [m for r in reports for m in r.matches]
    reasons = [n.reason for r in reports for n in r.near_misses]
    assert len(reasons) == 2 and all("query has shape" in r and "depends on the build" in r for r in reasons)
