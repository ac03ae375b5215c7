import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The compile caches of this run only: a report replayed from a cache another checkout filled would
# quote that checkout's source paths, and a test's outcome must not depend on what ran before it.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="npu_fuse_tests_inductor_")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

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
