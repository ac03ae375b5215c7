"""The backend changes nothing in the user's program but what it fuses, and every bad input is a
clear error (issue 16): config captured at compile time, user ops never run by the validator,
eager's output strides on aot_eager, the TORCH_LOGS spelling, fusions registered without a source
file, config values, aliasing caches, device checks."""

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import npu_fuse
import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops
from npu_fuse_backend.backend import run_fusion_passes, under_config
from npu_fuse_backend.lowering.fallback import FusionPrePass


def rope(q, cos, sin):
    return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin


def rope_args(seq=3):
    return torch.randn(2, seq, 4, 16), torch.randn(1, seq, 1, 16), torch.randn(1, seq, 1, 16)


@pytest.fixture(autouse=True)
def fresh_validation_counters():
    counters["npu_fuse_validation"].clear()


def ops_by_kind(reports) -> dict:
    return {r.kind: [m.op for m in r.matches] for r in reports}


# -- config captured at compile time ---------------------------------------------------------------
def train_step(compiled, args):
    q = args[0].clone().requires_grad_()
    out = compiled(q, *args[1:])
    return q, out


def test_the_lazily_compiled_backward_runs_with_the_config_of_its_forward():
    args = rope_args()
    compiled = torch.compile(rope, backend="npu_fuse")
    with nf.config.patch(fallback="aot_eager", disabled_fusions=["rope"], translation_validation=False):
        q, out = train_step(compiled, args)
    out.sum().backward()  # AOTAutograd compiles the backward now, outside the block
    assert ops_by_kind(nf.get_reports()) == {"forward": [], "backward": []}
    assert not counters["npu_fuse_validation"]
    expected = args[0].clone().requires_grad_()
    rope(expected, *args[1:]).sum().backward()
    assert_close(q.grad, expected.grad)


def test_the_backward_of_a_default_compile_fuses_inside_a_block_that_disables_rope():
    args = rope_args()
    compiled = torch.compile(rope, backend="npu_fuse")
    with nf.config.patch(fallback="aot_eager"):
        q, out = train_step(compiled, args)
    with nf.config.patch(disabled_fusions=["rope"]):
        out.sum().backward()
    assert ops_by_kind(nf.get_reports()) == {"forward": ["rotary_mul"], "backward": ["rotary_mul_backward"]}


def test_a_recompile_of_the_frame_keeps_its_first_compiles_config_until_reset():
    compiled = torch.compile(rope, backend="npu_fuse", dynamic=False)
    with nf.config.patch(fallback="aot_eager", disabled_fusions=["rope"]):
        compiled(*rope_args(seq=3))
    compiled(*rope_args(seq=5))  # a new static shape: Dynamo recompiles the frame, outside the block
    assert [fused_ops([r]) for r in nf.get_reports()] == [[], []]
    assert len(nf.get_reports()) == 2
    torch.compiler.reset()  # forgets the frame: the next compile takes the config in force
    with nf.config.patch(fallback="aot_eager"):
        torch.compile(rope, backend="npu_fuse")(*rope_args(seq=5))
    assert fused_ops(nf.get_reports()) == ["rotary_mul"]


def test_a_bad_config_is_an_error_and_never_captured():
    compiled = torch.compile(rope, backend="npu_fuse")
    with nf.config.patch(fallback="aot_eager", translation_validation="off"), \
            pytest.raises(Exception, match="must be True or False"):
        compiled(*rope_args())
    with nf.config.patch(fallback="aot_eager"):  # the same frame compiles again, with this config
        compiled(*rope_args())
    assert fused_ops(nf.get_reports()) == ["rotary_mul"]


def test_the_compile_cache_key_is_the_one_of_the_captured_config():
    with nf.config.patch(disabled_fusions=["rope"], soc="Ascend950"):
        snapshot = nf.config.get_config_copy()
        inside = FusionPrePass(run_fusion_passes).uuid()
    captured = FusionPrePass(under_config(snapshot, run_fusion_passes)).uuid()
    assert captured == inside != FusionPrePass(run_fusion_passes).uuid()


# -- the validator runs no user op -----------------------------------------------------------------
CALLS = []


@torch.library.custom_op("npu_fuse_test::tables", mutates_args=())
def tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS.append(positions.shape)
    angles = positions[:, None].float() * torch.arange(1, 17)[None] / 16
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


@tables.register_fake
def _(positions):
    shape = (1, positions.shape[0], 1, 16)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def test_a_user_op_feeding_a_rewrite_runs_once_per_call_never_at_compile_time():
    def model(q, positions):
        cos, sin = tables(positions)
        return rope(q, cos, sin)

    q, positions = torch.randn(2, 3, 4, 16), torch.arange(3)
    CALLS.clear()
    out, reports = compile_fused(model, q, positions)
    assert fused_ops(reports) == ["rotary_mul"] and counters["npu_fuse_validation"]["equal"] == 1
    assert len(CALLS) == 1  # the compiled call's own; the validator drew the op's outputs instead
    assert_close(out, model(q, positions))


def test_a_rewrite_whose_subgraph_calls_a_user_op_is_refused_as_unvalidated():
    from npu_fuse_backend import validate

    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda p: tables(p)[0] * 2, tracing_mode="fake")(torch.arange(3))
    (mul,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    (call,) = [n for n in gm.graph.nodes if n.target == torch.ops.npu_fuse_test.tables.default]
    with gm.graph.inserting_before(mul):
        new = gm.graph.call_function(torch.ops.aten.add.Tensor, (mul.args[0], mul.args[0]))
    new.meta["val"] = mul.meta["val"]
    reason = validate.check_rewrite([mul, call, *call.users], {mul: new}, [new])
    assert reason.startswith("replacement could not be validated: ") and "is opaque" in reason


# -- aot_eager keeps eager's output strides ----------------------------------------------------------
def test_a_fused_output_keeps_eagers_strides_so_a_view_of_it_works():
    def softmax_backward(g, p):
        return (p * (g - (g * p).sum(-1, keepdim=True))) * 0.5

    g, p = torch.randn(4, 8, 6).transpose(1, 2), torch.randn(4, 6, 8).softmax(-1)  # grad: a transposed view
    out, reports = compile_fused(softmax_backward, g, p)
    assert fused_ops(reports) == ["softmax_grad_ext"]
    expected = softmax_backward(g, p)
    assert out.stride() == expected.stride()
    assert_close(out.view(4, -1), expected.view(4, -1))


def test_rope_outputs_keep_eagers_strides_in_training_too():
    def bnsd(q, cos, sin):  # q: a BSND tensor rotated as BNSD
        q = q.transpose(1, 2)
        return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

    q, cos, sin = torch.randn(2, 5, 3, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    leaf = q.clone().requires_grad_()
    with nf.config.patch(fallback="aot_eager"):
        out = torch.compile(bnsd, backend="npu_fuse")(leaf, cos, sin)
    assert out.stride() == bnsd(q, cos, sin).stride()
    out.sum().backward()
    assert "rotary_mul_backward" in fused_ops(nf.get_reports()) and leaf.grad.stride() == q.stride()


# -- TORCH_LOGS -----------------------------------------------------------------------------------
LOGGED = ("import torch\n"
          "def f(q, c, s):\n"
          "    return q * c + torch.cat((-q[..., 8:], q[..., :8]), -1) * s\n"
          "torch.compile(f, backend='npu_fuse')(torch.randn(1, 2, 3, 16), torch.randn(16), torch.randn(16))\n")


@pytest.mark.parametrize("setting, graphs, reports", [("npu_fuse_backend.graphs", True, False), ("npu_fuse", False, True)])
def test_torch_logs_spellings_of_the_readme_work_at_import_torch(setting, graphs, reports):
    env = dict(os.environ, TORCH_LOGS=setting, NPU_FUSE_FALLBACK="aot_eager")
    done = subprocess.run([sys.executable, "-c", LOGGED], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("before npu_fuse's passes" in done.stderr) == graphs
    assert ("after npu_fuse's passes" in done.stderr) == graphs
    assert ("1 fused, 0 near-misses" in done.stderr) == reports


# -- fusions registered without a source file --------------------------------------------------------
REPL_FUSION = ("import torch, npu_fuse\n"
               "from npu_fuse_backend.lowering.fallback import FusionPrePass\n"
               "@npu_fuse.register_fusion\n"
               "class Mine(npu_fuse.FusionPass):\n"
               "    name = family = 'mine'\n"
               "    def match(self, ctx, anchor):\n"
               "        return None  # VARIANT\n"
               "print(FusionPrePass(npu_fuse.run_fusion_passes).uuid())\n")


def repl(code: str, how: str, env=None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-c", code] if how == "-c" else [sys.executable, "-"]
    return subprocess.run(args, input=code if how == "stdin" else None, capture_output=True, text=True,
                          env=env or os.environ.copy())


def test_a_fusion_registered_in_main_without_a_source_file_keys_the_cache():
    first, again = repl(REPL_FUSION, "-c"), repl(REPL_FUSION, "-c")
    other = repl(REPL_FUSION.replace("None  # VARIANT", "NotImplemented"), "-c")
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout == again.stdout != other.stdout  # its code is in the key, stable across processes


def test_a_fusion_registered_from_stdin_never_breaks_an_inductor_compile():
    code = REPL_FUSION + ("f = torch.compile(lambda x: x.sin() + 1, backend='npu_fuse')\n"
                          "x = torch.randn(8)\n"
                          "assert torch.allclose(f(x), x.sin() + 1, atol=1e-6)\n"  # (inductor's sin: within an ulp)
                          "print('compiled')\n")
    env = dict(os.environ, NPU_FUSE_FALLBACK="inductor", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    done = repl(code, "stdin", env)
    assert done.returncode == 0 and done.stdout.strip().endswith("compiled"), done.stderr[-2000:]


# -- config values -----------------------------------------------------------------------------------
@pytest.mark.parametrize("knob, value", [("translation_validation", "off"), ("translation_validation", 0),
                                         ("keep_unvalidated_rewrites", "yes"), ("strict", None)])
def test_a_boolean_knob_takes_only_true_or_false(knob, value):
    with pytest.raises(Exception, match=rf"config\.{knob}={value!r}( \(env \w+\))?: must be True or False"):
        compile_fused(rope, *rope_args(), **{knob: value})


def test_an_empty_environment_variable_means_the_default():
    code = ("import torch, npu_fuse\n"
            "from npu_fuse_backend import config\n"
            "config.validate()\n"
            "print(config.soc, config.fallback, config.lowering, config.disabled_fusions, config.strict)\n")
    names = ["NPU_FUSE_SOC", "NPU_FUSE_FALLBACK", "NPU_FUSE_LOWERING", "NPU_FUSE_DISABLE", "NPU_FUSE_STRICT"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NPU_FUSE")}, **{name: "" for name in names}}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["auto", "inductor", "auto", "[]", "False"]


# -- fused ops' arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["interleave_rope", "interleave_rope_backward"])
def test_interleave_rope_refuses_cos_or_sin_on_another_device(op):
    x, table = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    call = getattr(npu_fuse.ops, op)
    for cos, sin, name in ((table.to("meta"), table, "cos"), (table, table.to("meta"), "sin")):
        with pytest.raises(ValueError, match=rf"npu_fuse\.{op}: {name} is on meta but x is on cpu"):
            call(x, cos, sin)


def mla_with_one_cache_twice():
    sys.path.insert(0, os.path.dirname(__file__))
    from mla_inputs import make_inputs

    a, modes = make_inputs(tokens=2, heads=2, quantized=False)
    cache = a.pop("kv_cache")
    a.pop("kv_cache_rope")

    def step(cache, a):
        q0, _, q1, _ = npu_fuse.ops.mla_preprocess(**a, kv_cache=cache, kv_cache_rope=cache, **modes)
        return q0, q1

    return step, cache, a


RULE = "kv_cache and kv_cache_rope must not share memory"


def test_mla_preprocess_refuses_one_cache_as_both_caches():
    step, cache, a = mla_with_one_cache_twice()
    before = cache.clone()
    with pytest.raises(ValueError, match=RULE):
        step(cache, a)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("fallback", ["aot_eager", "inductor"])
def test_mla_preprocess_with_one_cache_as_both_is_the_same_error_when_compiled(fallback):
    step, cache, a = mla_with_one_cache_twice()
    with nf.config.patch(fallback=fallback), torch.no_grad(), pytest.raises(Exception, match=RULE):
        torch.compile(step, backend="npu_fuse")(cache, a)
