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
    cases = [c for c in demo_models.demo_cases(layers=1, seq=8, training=True) if c.name.startswith(("llama", "softmoe"))]
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
    assert "rotary_mul_backward x2" in train["fused"] and "softmax_grad_ext x1" in train["fused"]  # aot_eager
    assert rows[[c.name for c in cases].index("softmoe-train")]["fused"] == "softmax_grad_ext x1"
    assert all(row["npu_fuse_spread_ms"] >= 0 and row["npu_fuse_ms"] > 0 for row in rows)


def test_demo_table_fits_its_columns_and_progress_goes_to_stderr(monkeypatch):
    import dataclasses

    from npu_fuse_backend import demo_models

    (llama,) = [c for c in demo_models.demo_cases(layers=1, seq=8) if c.name == "llama-decoder"]
    cases = [llama, dataclasses.replace(llama, name="llama-decoder-with-a-long-name", dtype=torch.bfloat16)]
    monkeypatch.setattr(demo_models, "demo_cases", lambda **kw: cases)
    out, err = io.StringIO(), io.StringIO()
    with nf.config.patch(fallback="aot_eager"):
        cli.run_demo(torch.float32, repeat=1, layers=1, seq=8, rounds=1, out=out, err=err)
    header, rule, *rows = out.getvalue().splitlines()[1:]
    start = header.index("fused ops")
    assert rule.index("  -") + 2 == start  # the model column's rule ends two spaces before the next column
    for row in rows:
        assert row[start:].startswith("add_rms_norm x2, rms_norm x1, rotary_mul x2") and row[start - 2:start] == "  ", row
    assert rows[1].startswith("llama-decoder-with-a-long-name (bfloat16)")
    assert err.getvalue().splitlines() == [
        "compiling llama-decoder (npu_fuse on aot_eager)...", "compiling llama-decoder (aot_eager alone) and timing it...",
        "compiling llama-decoder-with-a-long-name (npu_fuse on aot_eager)...",
        "compiling llama-decoder-with-a-long-name (aot_eager alone) and timing it..."]


def test_the_demos_softmax_row_fuses_softmax_backward_on_inductor():
    """Inside attention, inductor's SDPA patterns take the softmax before our passes see it: the
    demo's softmax-backward row is a router softmax outside attention, fused on the default lowering."""
    from npu_fuse_backend.demo_models import demo_cases

    (case,) = [c for c in demo_cases(layers=1, seq=8, training=True) if c.name == "softmoe-train"]
    model = case.make()
    (args,) = case.inputs(torch.float32)
    with nf.config.patch(fallback="inductor"):
        torch.compile(model, backend="npu_fuse")(*args).sum().backward()
    assert {r.kind: sorted(r.fused_counts()) for r in nf.get_reports()} == {
        "forward": [], "backward": ["softmax_grad_ext"]}


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
                           str(script), "--", "--flag", "--json"], capture_output=True, text=True, check=True)
    out = proc.stdout
    assert "script ran with ['--flag', '--json']" in out  # after --: the script's, even explain's own names
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


FACTORY = textwrap.dedent("""\
    import torch
    from npu_fuse_backend.demo_models import DecoderConfig, LlamaModel

    def make():
        model = LlamaModel(DecoderConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64))
        return model, (torch.randn(2, 8, 64), torch.arange(8).expand(2, 8))

    def fails():
        raise ValueError("no weights here\\nsecond line")

    def not_a_pair():
        return torch.nn.Linear(4, 4)

    def one_tensor():
        return torch.nn.Linear(4, 4), torch.randn(2, 4)

    NOT_CALLABLE = 3
""")


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    (tmp_path / "factory_mod.py").write_text(FACTORY)
    monkeypatch.delitem(sys.modules, "factory_mod", raising=False)  # another test's factory_mod
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv", [
    ["explain", "factory_mod:make", "--training", "--json", "--fallback", "aot_eager"],  # the README's order
    ["explain", "--json", "--fallback", "aot_eager", "factory_mod:make", "--training"],
])
def test_explain_takes_its_flags_before_or_after_the_target(factory_dir, argv, capsys):
    assert main(argv) == 0
    captured = capsys.readouterr()
    graphs = json.loads(captured.out)["graphs"]  # stdout is the JSON alone
    assert [g["kind"] for g in graphs] == ["forward", "backward"]  # --training reached explain, not the target
    assert "npu-fuse explain: running factory_mod:make under npu_fuse (lowering aot_eager" in captured.err
    assert "2 graph(s) compiled in" in captured.err


BAD_TARGETS = [  # argv, exit status, the one line on stderr
    (["missing.py"], 2, "no such script: missing.py"),
    (["not_a_target"], 2, "TARGET must be a script (path/to/script.py) or module:callable, got 'not_a_target'"),
    (["no_such_module:make"], 2, "no module named 'no_such_module' (from TARGET 'no_such_module:make'"),
    (["factory_mod:nope"], 2, "factory_mod has no attribute 'nope' (TARGET 'factory_mod:nope')"),
    (["factory_mod:NOT_CALLABLE"], 2, "factory_mod:NOT_CALLABLE is not callable (int); it must be a callable"),
    (["factory_mod:not_a_pair"], 2, "factory_mod:not_a_pair must return (model, inputs) with inputs a tuple"),
    (["factory_mod:fails"], 1, "factory_mod:fails() raised ValueError: no weights here at factory_mod.py:9"),
    (["factory_mod:make", "--", "x"], 2, "a module:callable target takes no arguments, got x"),
]


def test_a_factory_may_give_one_tensor_as_the_input(factory_dir, capsys):
    assert main(["explain", "factory_mod:one_tensor", "--json", "--fallback", "aot_eager"]) == 0
    assert [g["kind"] for g in json.loads(capsys.readouterr().out)["graphs"]] == ["inference"]


@pytest.mark.parametrize("argv, status, line", BAD_TARGETS)
def test_a_bad_target_is_one_line_and_an_exit_status(factory_dir, argv, status, line, capsys):
    assert main(["explain", *argv]) == status
    err = capsys.readouterr().err
    errors = [e for e in err.splitlines() if not e.startswith("npu-fuse explain: running")]
    assert len(errors) == 1 and errors[0].startswith(f"npu-fuse explain: {line}"), err
    assert "Traceback" not in err


def test_a_raising_script_is_one_line_and_traceback_shows_it(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("import sys\nraise RuntimeError('the data is missing: ' + ' '.join(sys.argv[1:]))\n")
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "train.py", "--", "data.csv"]) == 1
    err = capsys.readouterr().err
    assert "npu-fuse explain: train.py raised RuntimeError: the data is missing: data.csv at train.py:2" in err
    assert "Traceback" not in err
    assert main(["explain", "--traceback", "train.py"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["explain", "train.py", "--epochs", "3"],
     "unrecognized arguments: --epochs 3 (a script's own arguments go after --: npu-fuse explain train.py -- "
     "--epochs 3)"),
    (["explain", "--soc", "Ascend999", "m:f"], "invalid choice: 'Ascend999'"),
    (["explain", "--json"], "the following arguments are required: TARGET"),
    (["demo", "--", "x"], "unrecognized arguments: x"),
])
def test_explain_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_explaining_the_model_zoo_without_transformers_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    assert main(["explain", "npu_fuse_backend.model_zoo:llama"]) == 1
    (line,) = [e for e in capsys.readouterr().err.splitlines() if "raised" in e]
    assert line.startswith("npu-fuse explain: npu_fuse_backend.model_zoo:llama() raised ModuleNotFoundError: "
                           "npu_fuse's model zoo builds transformers' own model classes, and transformers is not "
                           "installed: pip install -e '.[zoo]' (or transformers==5.23.0)")
