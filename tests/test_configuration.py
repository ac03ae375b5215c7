"""Configuring the compilers behind npu_fuse: torch.compile's ``mode=``/``options=`` on
torchair and on inductor, a full torchair CompilerConfig through ``get_npu_backend``, and
the errors for every value that cannot work."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import npu_fuse
from conftest import assert_close, fused_ops
from models import rope, rope_args
from npu_fuse_backend import config


@pytest.fixture
def torchair(monkeypatch):
    """Offline torchair, with a spy on the CompilerConfig each compile hands to it."""
    from torchair_offline import load_torchair_offline, torchair_dir

    if not (torchair_dir() / "torchair").is_dir():
        pytest.skip("torchair not fetched: run `make test`")
    module = load_torchair_offline()
    real = module.get_npu_backend
    monkeypatch.setattr(module, "received", [], raising=False)

    def spy(*, compiler_config=None, custom_decompositions={}):
        module.received.append(compiler_config)
        return real(compiler_config=compiler_config, custom_decompositions=custom_decompositions)

    monkeypatch.setattr(module, "get_npu_backend", spy)
    return module


# -- torchair -------------------------------------------------------------------------

def test_options_reach_torchairs_compiler_config(torchair):
    # (GE's session-wide options, e.g. ge_config.enable_single_stream, cannot change once GE is up)
    options = {"debug.run_eagerly": True, "experimental_config.frozen_parameter": True,
               "experimental_config.topology_sorting_strategy": "BFS"}
    args = rope_args()
    with config.patch(lowering="npu"):
        out = torch.compile(rope, backend="npu_fuse", options=options)(*args)
    assert_close(out, rope(*args))
    assert fused_ops(npu_fuse.get_reports()) == ["rotary_mul"]
    (received,) = torchair.received
    assert received.debug.run_eagerly.value == "1"
    assert received.experimental_config.frozen_parameter.value == "1"
    assert received.experimental_config.topology_sorting_strategy.value == "BFS"
    assert received.as_dict()[0]["ge.topoSortingMode"] == "0"  # what GE is given: BFS
    assert received.mode.value == "max-autotune"  # torch.compile's default mode: GE graph mode


def test_reduce_overhead_selects_torchairs_aclgraph_mode(torchair):
    cfg = torchair.CompilerConfig()
    cfg.debug.run_eagerly = True
    backend = npu_fuse.get_npu_backend(compiler_config=cfg)
    # aclgraph capture needs torch_npu's NPUGraph: torchair itself says so, here without an NPU
    with pytest.raises(Exception, match="CompilerConfig.mode is reduce-overhead"):
        torch.compile(rope, backend=backend, mode="reduce-overhead")(*rope_args())
    assert [c.mode.value for c in torchair.received] == ["reduce-overhead"]
    assert cfg.mode.value == "max-autotune"  # the caller's config is untouched


@pytest.mark.parametrize("mode, torchair_mode", [("max-autotune", "max-autotune"),
                                                 ("max-autotune-no-cudagraphs", "max-autotune")])
def test_torch_compile_modes_map_to_ge_graph_mode(torchair, mode, torchair_mode):
    cfg = torchair.CompilerConfig()
    cfg.debug.run_eagerly = True
    cfg.mode = "reduce-overhead"  # the mode argument wins over the config's own
    args = rope_args()
    out = torch.compile(rope, backend=npu_fuse.get_npu_backend(compiler_config=cfg), mode=mode)(*args)
    assert_close(out, rope(*args))
    assert [c.mode.value for c in torchair.received] == [torchair_mode]


def test_get_npu_backend_runs_the_users_pre_pass_after_ours_on_a_copy(torchair):
    seen = []

    def user_pre_pass(gm, inputs, compiler_config):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])

    cfg = torchair.CompilerConfig()
    cfg.debug.run_eagerly = True
    cfg.post_grad_custom_pre_pass = user_pre_pass
    backend = npu_fuse.get_npu_backend(compiler_config=cfg)
    args = rope_args()
    for _ in range(2):  # reusing the config must not stack our pass up
        torch._dynamo.reset()
        npu_fuse.clear_reports()
        out = torch.compile(rope, backend=backend)(*args)
        assert_close(out, rope(*args))
        assert fused_ops(npu_fuse.get_reports()) == ["rotary_mul"]
    assert seen == [["npu_fuse.rotary_mul.default"]] * 2  # it saw our fused graph
    assert cfg.post_grad_custom_pre_pass.value is user_pre_pass
    assert all(c.post_grad_custom_pre_pass.value is not user_pre_pass for c in torchair.received)


@pytest.mark.parametrize("kwargs, message", [
    ({"options": {"debug.run_eagrly": True}},
     r"options\['debug.run_eagrly'\] is not a torchair CompilerConfig field \(did you mean \['debug.run_eagerly'\]"),
    ({"options": {"debug.run_eagerly": 5}}, r"torchair rejects options\['debug.run_eagerly'\]=5: .*not in optional"),
    ({"options": {"mode": "reduce-overhead"}}, r"options\['mode'\] is not a torchair CompilerConfig field"),
    ({"mode": "fastest"}, r"mode='fastest' has no torchair equivalent; expected .*'reduce-overhead'"),
])
def test_bad_torchair_mode_or_options_are_named(torchair, kwargs, message):
    with config.patch(lowering="npu"), pytest.raises(Exception, match=message):
        torch.compile(rope, backend="npu_fuse", **kwargs)(*rope_args())
    assert torchair.received == []


def test_get_npu_backend_wants_a_compiler_config(torchair):
    with pytest.raises(TypeError, match="compiler_config must be a torchair CompilerConfig, got dict"):
        npu_fuse.get_npu_backend(compiler_config={"mode": "reduce-overhead"})


def test_npu_lowering_without_torch_npu_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchair", None)  # as on a machine without torch_npu
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    minor = re.escape(".".join(torch.__version__.split(".")[:2]))
    message = (r"needs torchair, which ships inside torch_npu, but importing it failed: .*install the torch_npu "
               rf"built for your torch .* \(torch_npu {minor}\.\*.*`pip install protobuf packaging`.*"
               r"config.lowering='auto'")
    with config.patch(lowering="npu"), pytest.raises(Exception, match=message):
        torch.compile(rope, backend="npu_fuse")(*rope_args())
    with pytest.raises(ImportError, match=message):
        npu_fuse.get_npu_backend()


# -- inductor -------------------------------------------------------------------------

class RecordInductorConfig:
    """A user's own post-grad pre pass: what inductor's config says while it runs, and
    whether ours ran before it."""

    def __init__(self):
        self.seen = []

    def __call__(self, graph):
        from torch._inductor import config as inductor_config

        self.seen.append({"cudagraphs": inductor_config.triton.cudagraphs,
                          "epilogue_fusion": inductor_config.epilogue_fusion,
                          "fused_before": counters["npu_fuse"]["rotary_mul"],
                          "fused_ops_left": any("npu_fuse" in str(n.target) for n in graph.nodes)})


def test_options_reach_inductors_config_and_chain_the_users_pre_pass():
    user_pass = RecordInductorConfig()
    options = {"epilogue_fusion": False, "fx_graph_cache": False, "post_grad_custom_pre_pass": user_pass}
    args = rope_args()
    with config.patch(fallback="inductor"):
        out = torch.compile(rope, backend="npu_fuse", options=options)(*args)
    assert_close(out, rope(*args))
    assert fused_ops(npu_fuse.get_reports()) == ["rotary_mul"]
    assert user_pass.seen == [{"cudagraphs": False, "epilogue_fusion": False, "fused_before": 1,
                               "fused_ops_left": False}]


def test_mode_reaches_inductor_with_a_pre_pass_from_inductors_config():
    user_pass = RecordInductorConfig()
    args = rope_args()
    with config.patch(fallback="inductor"), torch._inductor.config.patch(
            post_grad_custom_pre_pass=user_pass, fx_graph_cache=False):
        out = torch.compile(rope, backend="npu_fuse", mode="reduce-overhead")(*args)
    assert_close(out, rope(*args))
    assert fused_ops(npu_fuse.get_reports()) == ["rotary_mul"]
    assert [(s["cudagraphs"], s["fused_before"]) for s in user_pass.seen] == [(True, 1)]


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fastest"}, r"mode='fastest' is not an inductor mode; expected one of \[.*'max-autotune'"),
    ({"options": {"max_autotun": True}},
     r"options\['max_autotun'\] is not an inductor option \(did you mean \['max_autotune'.*; the options are "
     r"torch._inductor.list_options\(\)"),
    ({"options": {"max_autotune": "yes"}}, r"options\['max_autotune'\]='yes' must be a bool"),
    ({"options": {"translation_validation": False}},
     r"options\['translation_validation'\] is a setting of npu_fuse, not an inductor option: set it with "
     r"npu_fuse.config.patch\(translation_validation=...\)"),
])
def test_bad_inductor_mode_or_options_are_named(kwargs, message):
    with config.patch(fallback="inductor"), pytest.raises(Exception, match=message):
        torch.compile(rope, backend="npu_fuse", **kwargs)(*rope_args())


@pytest.mark.parametrize("kwargs", [{"mode": "fastest"}, {"options": {"max_autotune": True}}])
def test_aot_eager_takes_no_mode_or_options(kwargs):
    with config.patch(fallback="aot_eager"), pytest.raises(Exception, match="aot_eager fallback .* takes only"):
        torch.compile(rope, backend="npu_fuse", **kwargs)(*rope_args())


# -- NPU code, unchanged, off the NPU --------------------------------------------------------------
NPU_ONLY = [  # torch.compile settings only an NPU lowering takes, and how the warning names them
    ({"mode": "npugraph_ex"}, ["mode='npugraph_ex' (npugraph_ex's aclgraph capture)"]),
    ({"options": {"experimental_config.frozen_parameter": True, "debug.graph_dump.type": "pbtxt",
                  "frozen_parameter": True}},
     ["options['experimental_config.frozen_parameter'] (a field of torchair's CompilerConfig)",
      "options['debug.graph_dump.type'] (a field of torchair's CompilerConfig)",
      "options['frozen_parameter'] (a field of npugraph_ex's CompilerConfig)"]),
]


def npu_setting_warnings(record) -> list:
    from npu_fuse_backend.lowering.fallback import NpuSettingIgnored

    return [str(w.message) for w in record if issubclass(w.category, NpuSettingIgnored)]


@pytest.mark.parametrize("fallback", ["inductor", "aot_eager"])
@pytest.mark.parametrize("kwargs, named", NPU_ONLY)
def test_npu_only_settings_are_ignored_off_the_npu_with_one_warning(fallback, kwargs, named, recwarn):
    if fallback == "inductor" and "options" in kwargs:
        kwargs = {"options": {**kwargs["options"], "fx_graph_cache": False}}  # an inductor option beside them
    args = rope_args()
    with config.patch(fallback=fallback):
        out = torch.compile(rope, backend="npu_fuse", **kwargs)(*args)
    assert_close(out, rope(*args))
    assert fused_ops(npu_fuse.get_reports()) == ["rotary_mul"]
    (message,) = npu_setting_warnings(recwarn)
    assert message.startswith(f"npu_fuse: no NPU found (torch_npu is not loaded), so the fallback {fallback} "
                              "compiles this graph and ignores what only an NPU lowering takes: ")
    assert message.endswith(", ".join(named))


def test_the_warning_says_when_the_fallback_was_asked_for(recwarn):
    with config.patch(fallback="aot_eager", lowering="fallback"):
        torch.compile(rope, backend="npu_fuse", mode="npugraph_ex")(*rope_args())
    (message,) = npu_setting_warnings(recwarn)
    assert message.startswith("npu_fuse: config.lowering='fallback', so the fallback aot_eager compiles")


def test_modes_inductor_has_keep_inductors_meaning(recwarn):
    with config.patch(fallback="inductor"):
        torch.compile(rope, backend="npu_fuse", mode="max-autotune-no-cudagraphs")(*rope_args())
    assert npu_setting_warnings(recwarn) == []


@pytest.mark.parametrize("fallback", ["inductor", "aot_eager"])
def test_strict_makes_an_ignored_npu_setting_an_error(fallback):
    with config.patch(fallback=fallback, strict=True), pytest.raises(
            Exception, match=r"ignores what only an NPU lowering takes: mode='npugraph_ex' .*\(an error under "
                             r"config.strict\)"):
        torch.compile(rope, backend="npu_fuse", mode="npugraph_ex")(*rope_args())


@pytest.mark.parametrize("kwargs, message", [
    ({"options": {"frozen_paramter": True}},
     r"options\['frozen_paramter'\] is not an inductor option \(did you mean \[.*'frozen_parameter'.*\]\?\); the "
     r"options are torch._inductor.list_options\(\), .* and the fields of torchair's and npugraph_ex's CompilerConfig"),
    ({"mode": "npugraph"}, r"mode='npugraph' is not an inductor mode; expected one of \[.*\] \(or an NPU lowering's, "
                           r"ignored here: \['npugraph_ex'\]\)"),
])
def test_names_no_lowering_takes_stay_errors(kwargs, message):
    with config.patch(fallback="inductor"), pytest.raises(Exception, match=message):
        torch.compile(rope, backend="npu_fuse", **kwargs)(*rope_args())


# options the supported torch_npu releases after 2.10.0.post4 added (the tables are the union)
ADDED_AFTER_TORCH_NPU_2_10 = {"ge_config.multistream_parallel_mode", "unsafe_skip_npugraph_capture_validation"}


def test_the_npu_option_names_are_the_wheels(torchair):
    """The fallback knows the NPU lowerings' option names without torch_npu: every name of the installed
    wheel's configs, and only names some supported wheel has."""
    from npugraph_ex_offline import load_npugraph_ex_offline

    from npu_fuse_backend.lowering import npu, npugraph_ex

    wheels = set(npu.compiler_config_fields(torchair.CompilerConfig())) - {"mode"}
    assert wheels <= npu.TORCHAIR_OPTIONS and npu.TORCHAIR_OPTIONS - wheels <= ADDED_AFTER_TORCH_NPU_2_10
    assert tuple(torchair.CompilerConfig().mode.optional) == npu.TORCHAIR_MODES
    ng = load_npugraph_ex_offline()
    wheels = set(npugraph_ex.compiler_config_fields(ng.CompilerConfig()))
    assert wheels <= npugraph_ex.NPUGRAPH_EX_OPTIONS
    assert npugraph_ex.NPUGRAPH_EX_OPTIONS - wheels <= ADDED_AFTER_TORCH_NPU_2_10


# -- npu_fuse's own knobs ---------------------------------------------------------------

@pytest.mark.parametrize("knob, value, message", [
    ("max_reports", -1, r"config.max_reports=-1: must be an int >= 0"),
    ("disabled_fusions", "partial_rope",
     r"config.disabled_fusions='partial_rope' \(env NPU_FUSE_DISABLE\): must be a list of fusion names "
     r"\(e.g. \['partial_rope'\]\), not a str"),
    ("disabled_fusions", ["rope", "ropee"],
     r"config.disabled_fusions=\['rope', 'ropee'\] \(env NPU_FUSE_DISABLE\): unknown fusion name\(s\) \['ropee'\]; "
     r"registered fusions: \[.*'partial_rope', 'rms_norm', 'rope'"),
    ("strict", "yes", r"config.strict='yes' \(env NPU_FUSE_STRICT\): must be True or False"),
])
def test_bad_knob_values_are_named(knob, value, message):
    with config.patch(**{knob: value}), pytest.raises(Exception, match=message):
        torch.compile(rope, backend="npu_fuse")(*rope_args())
    with config.patch(**{knob: value}), pytest.raises(ValueError, match=message):
        npu_fuse.run_fusion_passes(torch.fx.symbolic_trace(rope))


def test_disabling_partial_rope_leaves_rope_on():
    args = rope_args()
    with config.patch(fallback="aot_eager", disabled_fusions=["partial_rope"]):
        torch.compile(rope, backend="npu_fuse")(*args)
    assert fused_ops(npu_fuse.get_reports()) == ["rotary_mul"]


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("True", True), ("yes", True), ("on", True),
                                        ("0", False), ("false", False), ("no", False), ("off", False), ("", False)])
def test_npu_fuse_strict_accepts_the_usual_spellings(monkeypatch, raw, value):
    monkeypatch.setenv("NPU_FUSE_STRICT", raw)
    assert config._env_flag("NPU_FUSE_STRICT") is value


def test_an_unknown_npu_fuse_strict_spelling_fails_the_import():
    env = dict(os.environ, NPU_FUSE_STRICT="maybe")
    done = subprocess.run([sys.executable, "-c", "import npu_fuse"], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "environment variable NPU_FUSE_STRICT='maybe' is not a boolean; use one of" in done.stderr
