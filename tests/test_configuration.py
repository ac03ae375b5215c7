"""npu_fuse's own knobs: every value that cannot work is an error naming the knob, its
environment variable, the value and what is allowed."""

import os
import subprocess
import sys

import pytest
import torch

import npu_fuse
from conftest import fused_ops
from npu_fuse_backend import config


def rope(q, cos, sin):
    return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin


def rope_args():
    return torch.randn(2, 3, 4, 16), torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16)


@pytest.mark.parametrize("knob, value, message", [
    ("max_reports", -1, r"config.max_reports=-1: must be an int >= 0"),
    ("disabled_fusions", "partial_rope",
     r"config.disabled_fusions='partial_rope' \(env NPU_FUSE_DISABLE\): must be a list of fusion names"),
    ("disabled_fusions", ["rope", "ropee"],
     r"config.disabled_fusions=\['rope', 'ropee'\] \(env NPU_FUSE_DISABLE\): unknown fusion name\(s\) \['ropee'\]; "
     r"registered fusions: \[.*'partial_rope', 'rope'"),
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
