"""SoC limits of the fused ops' GE kernels (``@soc_limits`` beside each op), and what "generic" and an
unrecognised NPU mean."""

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close, compile_fused, fused_ops, near_miss_reasons
from models import rotate_every_two, rotate_half
from npu_fuse_backend import soc as soc_module
from npu_fuse_backend.lowering.registry import SOC_LIMITS, soc_refusal

rotary_mul = torch.ops.npu_fuse.rotary_mul.default


def rope(rotate):
    def fn(x, cos, sin):
        return x * cos + rotate(x) * sin
    return fn


def limit(soc, x_shape, table_shape, mode="half"):
    x, table = torch.empty(x_shape, device="meta"), torch.empty(table_shape, device="meta")
    return SOC_LIMITS[rotary_mul](soc, x, table, table, mode)


@pytest.mark.parametrize("soc, x, table, mode, ok", [
    ("Ascend910B", (2, 4, 16, 64), (1, 1, 16, 64), "half", True),        # BNSD, 11SD
    ("Ascend910B", (2, 4, 16, 64), (2, 1, 16, 64), "half", True),        # BNSD, B1SD
    ("Ascend910_93", (2, 16, 4, 64), (2, 16, 1, 64), "half", True),      # BSND, BS1D
    ("Ascend910B", (2, 16, 4, 64), (2, 16, 1, 64), "interleave", False),  # interleave: 11SD/1S1D/S11D only
    ("Ascend910B", (2, 16, 4, 64), (1, 16, 1, 64), "interleave", True),   # BSND, 1S1D
    ("Ascend910B", (2, 16, 4, 64), (1, 16, 4, 64), "half", False),       # 1SND: no A2/A3 layout
    ("Ascend910B", (2, 4, 16, 896), (1, 1, 16, 896), "half", False),     # D < 896
    ("Ascend910B", (1000, 1, 2, 64), (1, 1, 2, 64), "half", False),      # B < 1000 (BNSD: B=1000)
    ("Ascend910B", (40, 30, 30, 64), (1, 30, 1, 64), "interleave", False),  # BSND 1S1D, B * N = 1200
    ("Ascend910B", (40, 30, 20, 64), (1, 30, 1, 64), "interleave", True),  # BSND 1S1D, B * N = 800
    ("Ascend950", (2, 16, 4, 896), (1, 16, 1, 896), "half", True),       # 1S1D, D <= 1024
    ("Ascend950", (2, 16, 4, 1026), (1, 16, 1, 1026), "half", False),    # D > 1024
    ("Ascend950", (2, 16, 4, 64), (1, 16, 4, 64), "half", False),        # 1SND is not an Ascend950 layout
    ("Ascend950", (2, 16, 4, 64), (2, 16, 1, 64), "interleave", True),   # BS1D, every mode
    ("generic", (2, 16, 4, 2048), (1, 16, 4, 2048), "half", True),       # no NPU: the contract only
])
def test_rope_limits_per_soc(soc, x, table, mode, ok):
    reason = limit(soc, x, table, mode)
    assert (reason is None) == ok, reason


def test_a_rope_the_soc_cannot_run_is_a_near_miss_naming_the_limit():
    x, cos, sin = torch.randn(2, 16, 4, 64), torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    out, reports = compile_fused(rope(rotate_every_two), x, cos, sin, soc="Ascend910B")
    assert fused_ops(reports) == []
    (reason,) = near_miss_reasons(reports)
    assert reason.startswith("rotary_mul on Ascend910B: cos/sin [2, 16, 1, 64] / [2, 16, 1, 64]")
    assert "interleave mode takes" in reason
    assert_close(out, rope(rotate_every_two)(x, cos, sin))
    _, reports = compile_fused(rope(rotate_every_two), x, cos, sin, soc="Ascend950")
    assert fused_ops(reports) == ["rotary_mul"]


def test_the_backward_has_the_forward_limits():
    grad_limit = SOC_LIMITS[torch.ops.npu_fuse.rotary_mul_backward.default]
    g, table = torch.empty(2, 4, 16, 896, device="meta"), torch.empty(1, 1, 16, 896, device="meta")
    assert "< 896" in grad_limit("Ascend910B", g, None, table, table, "half", False)
    assert grad_limit("Ascend950", g, None, table, table, "half", False) is None


def test_softmax_grad_ext_runs_on_ascend950_only():
    op, g = torch.ops.npu_fuse.softmax_grad_ext.default, torch.empty(2, 8, device="meta")
    assert "Ascend950 only" in soc_refusal(op, "Ascend910_93", g, g, g)
    assert soc_refusal(op, "Ascend950", g, g, g) is None and soc_refusal(op, "generic", g, g, g) is None
    assert "unrecognised NPU" in soc_refusal(op, "Ascend310P3", g, g, g)  # an op without limits is asked too


def test_partial_rope_layouts_are_the_ops_limits():
    limits = SOC_LIMITS[torch.ops.npu_fuse.inplace_partial_rotary_mul.default]
    x = torch.empty(2, 5, 3, 16, device="meta")
    bs1d, bsnd = torch.empty(2, 5, 1, 8, device="meta"), torch.empty(2, 5, 3, 8, device="meta")
    assert limits("Ascend910B", x, bs1d, bs1d, partial_slice=[0, 8]) is None
    assert "BS1D, B11D that Ascend910B accepts" in limits("Ascend910B", x, bsnd, bsnd, partial_slice=[0, 8])
    assert limits("Ascend950", x, bsnd, bsnd, partial_slice=[0, 8]) is None
    backward = SOC_LIMITS[torch.ops.npu_fuse.inplace_partial_rotary_mul_backward.default]
    assert "that Ascend950 accepts" in backward("Ascend950", x, bs1d, bs1d, partial_slice=[4, 12])


@pytest.mark.parametrize("name, soc", [
    ("", "generic"), ("Ascend910B1", "Ascend910B"), ("Ascend910B4-1", "Ascend910B"),
    ("Ascend910_9391", "Ascend910_93"), ("Ascend910_9362", "Ascend910_93"), ("Ascend950PR_9579", "Ascend950"),
    ("Ascend910_9589", "Ascend950"),
    ("Ascend310P3", "Ascend310P3"), ("Ascend910A", "Ascend910A"), ("Ascend910ProB", "Ascend910ProB"),
])
def test_device_names_map_to_socs_and_an_unrecognised_npu_is_never_generic(name, soc):
    assert soc_module.soc_from_device_name(name) == soc


def test_on_an_unrecognised_npu_every_fusion_is_a_near_miss_saying_so(monkeypatch):
    monkeypatch.setattr(soc_module, "npu_device_name", lambda: "Ascend310P3")
    x, cos, sin = torch.randn(2, 16, 4, 64), torch.randn(1, 16, 1, 64), torch.randn(1, 16, 1, 64)
    out, reports = compile_fused(rope(rotate_half), x, cos, sin, soc="auto")
    assert fused_ops(reports) == []
    assert any("unrecognised NPU 'Ascend310P3'" in r and "npu_fuse.config.soc" in r for r in near_miss_reasons(reports))
    assert_close(out, rope(rotate_half)(x, cos, sin))
    with nf.config.patch(soc="Ascend910B"):  # naming the SoC explicitly targets it
        assert soc_module.resolve_soc() == "Ascend910B"
