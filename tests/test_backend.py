"""The backend as a user meets it: by name, its config, its lowerings, its CLI."""

import os
import subprocess
import sys

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops
from npu_fuse_backend.lowering.fallback import decompose_fused_ops


def test_backend_is_found_by_name_through_the_entry_point():
    code = ("import torch\n"
            "assert 'npu_fuse' in torch._dynamo.list_backends()\n"
            "f = torch.compile(lambda x: x.sin() + 1, backend='npu_fuse')\n"
            "x = torch.randn(4)\n"
            "assert torch.allclose(f(x), x.sin() + 1)\n"
            "import sys; assert 'npu_fuse_backend' in sys.modules\n")
    env = dict(os.environ, NPU_FUSE_FALLBACK="aot_eager")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_import_torch_still_works_in_a_fresh_process():
    """torch_npu is fetched for the converter tests, but never where it breaks torch."""
    subprocess.run([sys.executable, "-c", "import torch; import torch_npu"], env=os.environ.copy(),
                   capture_output=True)  # torch_npu must not even be importable here
    result = subprocess.run([sys.executable, "-c", "import torch, importlib.util as u; "
                             "print(u.find_spec('torch_npu') is None)"],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"


def test_environment_overrides_the_main_knobs():
    code = ("from npu_fuse_backend import config\n"
            "print(config.soc, config.fallback, config.strict, config.disabled_fusions)\n")
    env = dict(os.environ, NPU_FUSE_SOC="Ascend950", NPU_FUSE_FALLBACK="aot_eager", NPU_FUSE_STRICT="1",
               NPU_FUSE_DISABLE="rope,softmax_grad")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Ascend950", "aot_eager", "True", "['rope',", "'softmax_grad']"]


@pytest.mark.parametrize("knob, value, message", [
    ("fallback", "tvm", "config.fallback='tvm'"),
    ("lowering", "gpu", "config.lowering='gpu'"),
    ("soc", "Ascend310", "config.soc='Ascend310'"),
])
def test_bad_config_values_are_named(knob, value, message):
    def fn(q, cos, sin):
        return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

    with pytest.raises(Exception, match=message):
        compile_fused(fn, torch.randn(1, 2, 3, 16), torch.randn(16), torch.randn(16), **{knob: value})


def test_inductor_lowering_decomposes_fused_ops_back_to_aten():
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(q, cos, sin):
        return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

    args = torch.randn(2, 3, 4, 16), torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    nf.run_fusion_passes(gm)
    assert any(n.target == torch.ops.npu_fuse.rotary_mul.default for n in gm.graph.nodes)
    assert decompose_fused_ops(gm) == 1
    assert not any("npu_fuse" in str(n.target) for n in gm.graph.nodes)
    assert_close(gm(*args), fn(*args))


def test_soc_auto_is_generic_without_an_npu():
    from npu_fuse_backend.soc import resolve_soc
    assert resolve_soc() == "generic"
    with nf.config.patch(soc="Ascend910B"):
        assert resolve_soc() == "Ascend910B"


def test_npu_lowering_hands_the_fused_graph_to_torchair():
    """With lowering forced to "npu", torchair's real backend runs our passes as its
    post_grad_custom_pre_pass (here with run_eagerly: no GE on this machine)."""
    from torchair_offline import load_torchair_offline, torchair_dir
    if not (torchair_dir() / "torchair").is_dir():
        pytest.skip("torchair not fetched: run `make test`")
    load_torchair_offline()
    from torchair.configs.compiler_config import CompilerConfig

    from npu_fuse_backend.lowering.npu import compile_with_torchair

    cfg = CompilerConfig()
    cfg.debug.run_eagerly = True

    def backend(gm, inputs):
        return compile_with_torchair(gm, inputs, nf.run_fusion_passes, compiler_config=cfg)

    def fn(q, cos, sin):
        return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

    args = torch.randn(2, 3, 4, 16), torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16)
    out = torch.compile(fn, backend=backend)(*args)
    assert_close(out, fn(*args))
    assert fused_ops(nf.get_reports()) == ["rotary_mul"]
    assert nf.get_reports()[0].lowering == "torchair"


def test_cli_demo_prints_the_table(capsys):
    from npu_fuse_backend.cli import main

    assert main(["demo", "--repeat", "1", "--layers", "1", "--seq", "16", "--fallback", "aot_eager"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert "rotary_mul x2" in rows["llama-decoder"]  # q and k of one layer
    assert "inplace_partial_rotary_mul x2" in rows["gptj-partial"]
    assert "rotary_mul x2" in rows["neox-partial"]


def test_torch_logs_shows_the_report():
    code = ("import torch\n"
            "f = torch.compile(lambda q, c, s: q * c + torch.cat((-q[..., 8:], q[..., :8]), -1) * s,"
            " backend='npu_fuse')\n"
            "f(torch.randn(1, 2, 3, 16), torch.randn(16), torch.randn(16))\n")
    env = dict(os.environ, TORCH_LOGS="+npu_fuse", NPU_FUSE_FALLBACK="aot_eager")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "fused rotary_mul at add" in out.stderr


def test_inductor_lowering_accepts_every_fusion_glue():
    """The nodes a fusion inserts around its op (stack, arange, casts...) must be ones
    inductor lowers after its decompositions: compile each family's smallest case."""
    def meta_complex(xq, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        return torch.view_as_real(xq_ * freqs_cis.view(1, xq_.shape[1], 1, -1)).flatten(3).type_as(xq)

    def token_rope(q, cos, sin):  # 2-D [T, D] x, lifted to 4-D
        return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

    def softmax_backward(g, p):
        return (p * (g - (g * p).sum(-1, keepdim=True))) * 0.125

    freqs = torch.polar(torch.ones(8, 8), torch.randn(8, 8))
    cases = [(meta_complex, (torch.randn(2, 8, 4, 16, dtype=torch.bfloat16), freqs), "rotary_mul"),
             (token_rope, (torch.randn(5, 16), torch.randn(5, 16), torch.randn(5, 16)), "rotary_mul"),
             (softmax_backward, (torch.randn(2, 8, 8), torch.randn(2, 8, 8).softmax(-1)), "softmax_grad_ext")]
    for fn, args, op in cases:
        out, reports = compile_fused(fn, *args, fallback="inductor")
        assert fused_ops(reports) == [op]
        torch.testing.assert_close(out.float(), fn(*args).float(), atol=2e-2, rtol=2e-2)
