"""The npu-fuse command line: --version, the demo's rows, verdicts and argument checks, and
``explain`` on a user's script (outside the repository) and on a model factory."""

import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import npu_fuse_backend as nf
from npu_fuse_backend import cli
from npu_fuse_backend.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"npu-fuse {nf.__version__}"


@pytest.mark.parametrize("argv", [["demo", "--repeat", "0"], ["demo", "--layers", "0"], ["demo", "--seq", "-1"],
                                  ["demo", "--rounds", "0"], ["demo", "--repeat", "x"]])
def test_demo_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "must be >= 1" in err or "invalid integer >= 1 value" in err


class Timeline(io.StringIO):
    """Records, for each line written, how many models had been built before it."""

    def __init__(self, built: list):
        super().__init__()
        self.built, self.lines = built, []

    def write(self, text):
        self.lines += [(len(self.built), line) for line in text.splitlines() if line.strip()]
        return super().write(text)


def test_demo_prints_each_row_when_measured_with_a_verdict_and_a_training_row(monkeypatch):
    from npu_fuse_backend import demo_models

    built = []
    cases = [c for c in demo_models.demo_cases(layers=1, seq=8, training=True) if c.name.startswith("llama")]
    for case in cases:
        monkeypatch.setattr(case, "make", lambda make=case.make: built.append(1) or make())
    monkeypatch.setattr(demo_models, "demo_cases", lambda **kw: cases)
    out = Timeline(built)
    with nf.config.patch(fallback="aot_eager"):
        rows = cli.run_demo(torch.float32, repeat=1, layers=1, seq=8, rounds=2, out=out)
    header = out.lines[1][1].split()
    assert header[:3] == ["model", "fused", "ops"] and "aot_eager" in header
    printed = out.lines[3:]
    assert [line.split()[0] for _, line in printed] == [c.name for c in cases]
    assert [models_built for models_built, _ in printed] == list(range(1, len(cases) + 1))  # one row per model, in time
    assert all(row["verdict"] == "ok" for row in rows) and all(" ok " in line for _, line in printed)
    train = rows[[c.name for c in cases].index("llama-train")]
    assert "rotary_mul_backward x2" in train["fused"] and "softmax_grad_ext x1" in train["fused"]
    assert all(row["npu_fuse_spread_ms"] >= 0 and row["npu_fuse_ms"] > 0 for row in rows)


def test_verdict_uses_the_dtype_tolerance():
    expected = [torch.ones(4)]
    assert cli._within([torch.ones(4) + 5e-5], expected, torch.float32) == pytest.approx((5e-5, True), rel=1e-2)
    assert cli._within([torch.ones(4) + 1e-2], expected, torch.float32)[1] is False
    assert cli._within([torch.ones(4, dtype=torch.bfloat16) * 1.0078125], expected, torch.bfloat16)[1] is True


USER_SCRIPT = textwrap.dedent("""\
    import sys
    import torch

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    class Attention(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            q = q * cos + rotate_half(q) * sin
            k = k * cos[..., :15] + rotate_half(k) * sin[..., :15]  # odd head dim: no RoPE kernel takes it
            return q, k

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention()

        def forward(self, q, k, cos, sin):
            return self.attn(q, k, cos, sin)

    model = torch.compile(Net(), backend="inductor")  # explain routes every torch.compile to npu_fuse
    model(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 15), torch.randn(16), torch.randn(16))
    torch.compiler.reset()  # explain keeps what was reported before
    print("script ran with", sys.argv[1:])
""")


def test_explain_a_user_script_outside_the_repo(tmp_path, monkeypatch):
    script = tmp_path / "my_model.py"
    script.write_text(USER_SCRIPT)
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "npu_fuse_backend.cli", "explain", "--fallback", "aot_eager",
                           str(script), "--flag"], capture_output=True, text=True, check=True)
    out = proc.stdout
    assert "script ran with ['--flag']" in out
    assert "1 fused" in out and "[0/0] forward" in out and "  attn\n" in out
    fused = out[out.index("fused     rotary_mul"):]
    assert "at my_model.py:9  q = q * cos + rotate_half(q) * sin" in fused.splitlines()[1]
    missed = out[out.index("not fused (rope)"):].splitlines()
    assert "unequal" in missed[0] and "at my_model.py:10  k = k * cos[..., :15]" in missed[1]


def test_explain_a_model_factory_as_json(tmp_path, monkeypatch):
    (tmp_path / "factory_mod.py").write_text(textwrap.dedent("""\
        import torch
        from npu_fuse_backend.demo_models import DecoderConfig, LlamaModel

        def make():
            model = LlamaModel(DecoderConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64))
            return model, (torch.randn(2, 8, 64), torch.arange(8).expand(2, 8))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with nf.config.patch(fallback="aot_eager"):
        assert cli.explain("factory_mod:make", [], training=True, as_json=True, out=out) == 0
    graphs = json.loads(out.getvalue())["graphs"]
    assert [g["kind"] for g in graphs] == ["forward", "backward"]
    ops = sorted(m["op"] for g in graphs for m in g["matches"])
    assert ops == ["add_rms_norm"] * 2 + ["rms_norm"] + ["rotary_mul"] * 2 + ["rotary_mul_backward"] * 2 + \
        ["softmax_grad_ext"]
    rope = graphs[0]["matches"][0]
    assert rope["module"] == "layers.0.self_attn" and rope["frame"] == "[0/0] forward"
    assert rope["code"].startswith("return (q * cos) + (rotate_half(q) * sin)")


def test_explain_rejects_a_target_it_cannot_run(capsys):
    with pytest.raises(SystemExit, match="TARGET must be a script"):
        main(["explain", "not_a_target"])
    with pytest.raises(SystemExit, match="no such script"):
        main(["explain", "missing.py"])
