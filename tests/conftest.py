import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.validate import forget_shown_equal  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Every test starts clean, with every rewrite translation-validated."""
    torch._dynamo.reset()
    nf.clear_reports()
    forget_shown_equal()
    torch.manual_seed(0)
    with nf.config.patch(translation_validation=True):
        yield
    torch._dynamo.reset()


def compile_fused(fn, *args, fallback="aot_eager", dynamic=False, **patches):
    """Run fn through the npu_fuse backend; returns (output, reports)."""
    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback=fallback, **patches):
        out = torch.compile(fn, backend="npu_fuse", dynamic=dynamic, fullgraph=True)(*args)
    return out, nf.get_reports()


def fused_ops(reports) -> list:
    return [m.op for r in reports for m in r.matches]


def near_miss_reasons(reports) -> list:
    return [n.reason for r in reports for n in r.near_misses]


TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def assert_close(got, expected, dtype=torch.float32):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def assert_no_worse_than_eager(got, eager, exact):
    """Low-precision check: the fused result is at least about as close to a float64
    reference as eager's own result in the same dtype is."""
    assert got.dtype == eager.dtype
    err_got = (got.double() - exact.double()).abs().max().item()
    err_eager = (eager.double() - exact.double()).abs().max().item()
    atol = TOL[eager.dtype][0] if eager.dtype in TOL else 1e-6
    assert err_got <= 1.5 * err_eager + atol, f"fused error {err_got:.3g} vs eager error {err_eager:.3g}"


@pytest.fixture(autouse=True, scope="session")
def no_generic_top_level_imports():
    """The package's folders lowering/ and converters/ are importable only inside
    npu_fuse_backend; a test that imported them by their generic top-level names would
    load a second copy of every op (``python -m pytest`` puts the repository on sys.path)."""
    yield
    leaked = sorted(name for name in sys.modules if name.split(".")[0] in ("lowering", "converters"))
    assert not leaked, f"imported by a generic top-level name: {leaked}"


# The MLA pass turns an out-of-range slot into a write elsewhere (index_put: wrapped with
# remainder) or into no write (index_copy_/scatter_ with -1), where eager raises (issue 9,
# fixed on the MLA branch). Translation validation draws such slots and refuses the rewrite,
# so these tests cannot see the prologue fuse until that fix lands. strict: each fails
# loudly once the fusion validates again; then delete this list.
MLA_FUSIONS_REFUSED_UNTIL_THE_SLOT_FIX = {
    "tests/test_converters.py::test_mla_prologue_becomes_one_mla_preprocess",
    "tests/test_mla_fusion.py::test_prologue_fuses_with_outputs_and_cache_close_to_eager[half-bf16]",
    "tests/test_mla_fusion.py::test_prologue_fuses_with_outputs_and_cache_close_to_eager[half-w8a8]",
    "tests/test_mla_fusion.py::test_prologue_fuses_with_outputs_and_cache_close_to_eager[interleave-bf16]",
    "tests/test_mla_fusion.py::test_prologue_fuses_with_outputs_and_cache_close_to_eager[interleave-w8a8]",
    "tests/test_mla_fusion.py::test_dynamic_token_counts",
    "tests/test_mla_fusion.py::test_soc_gate[Ascend910B-True-None]",
    "tests/test_mla_fusion.py::test_soc_gate[Ascend910_93-True-None]",
    "tests/test_mla_fusion.py::test_other_cache_write_forms[index_copy_]",
    "tests/test_mla_fusion.py::test_other_cache_write_forms[scatter_]",
    "tests/test_mla_fusion.py::test_inductor_lowering_fuses_the_prologue[bf16-interleave]",
    "tests/test_mla_fusion.py::test_inductor_lowering_fuses_the_prologue[w8a8]",
    "tests/test_mla_fusion.py::test_w8a8_input_norm_without_beta",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid in MLA_FUSIONS_REFUSED_UNTIL_THE_SLOT_FIX:
            item.add_marker(pytest.mark.xfail(
                strict=True, reason="translation validation refuses the MLA rewrite: out-of-range slots "
                                    "do not raise as in eager (fixed on the MLA branch)"))
