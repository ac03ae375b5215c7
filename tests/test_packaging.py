"""What ``pip install`` puts on a user's machine: one namespace, nothing generic.

The repository keeps the design's top-level folders ``lowering/`` and ``converters/``;
setup.cfg maps them into ``npu_fuse_backend``. These tests build the real wheel,
install it (non-editable) into a fresh directory and use it from a user's folder that
has its own ``lowering.py`` and ``converters/``.
"""

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", "results")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project's wheel, built from a clean copy of the sources and installed with --target."""
    tmp = tmp_path_factory.mktemp("install")
    sources, wheels, target = tmp / "src", tmp / "wheels", tmp / "site"
    shutil.copytree(REPO, sources, ignore=NOT_SOURCES)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(sources)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("npu_fuse-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True)
    return target


def top_level_names(names) -> set:
    return {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}


def test_wheel_has_only_the_projects_own_top_level_names(installed):
    (wheel,) = (installed.parent / "wheels").glob("npu_fuse-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert top_level_names(names) == {"npu_fuse", "npu_fuse_backend"}
    assert "npu_fuse_backend/lowering/ops/rope.py" in names
    assert "npu_fuse_backend/converters/rope.py" in names
    importable = {p.name for p in installed.iterdir() if p.suffix != ".dist-info" and p.name != "bin"}
    assert importable == {"npu_fuse", "npu_fuse_backend"}


def test_a_users_lowering_and_converters_cannot_shadow_ours(installed, tmp_path):
    user = tmp_path / "user_project"
    (user / "converters").mkdir(parents=True)
    (user / "lowering.py").write_text("WHO = 'user'\n")
    (user / "converters" / "__init__.py").write_text("raise ImportError('the user converters were imported')\n")
    (user / "train.py").write_text(textwrap.dedent(f"""
        import sys
        import lowering                      # the user's own module, imported first
        import torch

        def rope(q, cos, sin):
            return q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin

        args = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
        out = torch.compile(rope, backend="npu_fuse")(*args)   # found by its entry point
        torch.testing.assert_close(out, rope(*args))

        import npu_fuse, npu_fuse_backend.converters
        site = {str(installed)!r}
        assert npu_fuse_backend.converters.__file__.startswith(site), npu_fuse_backend.converters.__file__
        assert npu_fuse.__file__.startswith(site), npu_fuse.__file__
        assert [m.op for r in npu_fuse.get_reports() for m in r.matches] == ["rotary_mul"]
        assert lowering.WHO == "user" and sys.modules["lowering"] is lowering
        assert "converters" not in sys.modules
        assert callable(npu_fuse.ops.inplace_partial_rotary_mul)
        print("ok")
    """))
    env = dict(os.environ, PYTHONPATH=str(installed), NPU_FUSE_FALLBACK="aot_eager")
    result = subprocess.run([sys.executable, "train.py"], cwd=user, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_wheel_ships_type_information_and_the_zoo_extra(installed):
    (wheel,) = (installed.parent / "wheels").glob("npu_fuse-*.whl")
    archive = zipfile.ZipFile(wheel)
    assert {"npu_fuse/py.typed", "npu_fuse_backend/py.typed"} <= set(archive.namelist())  # PEP 561
    (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    requires = [line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert "Requires-Dist: transformers==5.23.0; extra == \"zoo\"" in requires
    assert "Requires-Dist: transformers==5.23.0; extra == \"test\"" in requires
    assert not any(line.startswith("Requires-Dist: transformers") and "extra" not in line for line in requires)


def test_an_uninstalled_checkout_says_to_install_it(tmp_path):
    """lowering/ and converters/ join the package only when installed: importing the package from a
    checkout's folder says so (not Python's "most likely due to a circular import")."""
    shutil.copytree(REPO / "npu_fuse_backend", tmp_path / "npu_fuse_backend", ignore=NOT_SOURCES)
    not_installed = "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]"
    result = subprocess.run([sys.executable, "-c", f"{not_installed}; import npu_fuse_backend"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "npu_fuse_backend.lowering is not installed" in result.stderr and "pip install -e ." in result.stderr
    assert "circular import" not in result.stderr


def test_wheel_metadata_declares_the_supported_torch_range_and_a_release(installed):
    """torch 2.10 to 2.14 (docs/torch-versions.md), no torch_npu pin in the npu extra (each torch_npu
    pins its own torch minor), and the fields an index shows."""
    (wheel,) = (installed.parent / "wheels").glob("npu_fuse-*.whl")
    archive = zipfile.ZipFile(wheel)
    (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    lines = archive.read(metadata).decode().splitlines()
    requires = [line for line in lines if line.startswith("Requires-Dist:")]
    (torch_pin,) = [line for line in requires if line.startswith("Requires-Dist: torch") and "extra" not in line]
    assert torch_pin.replace(" ", "") in ("Requires-Dist:torch<2.15,>=2.10", "Requires-Dist:torch>=2.10,<2.15")
    assert not any("torch_npu" in line or "torch-npu" in line for line in requires)
    assert {'Requires-Dist: protobuf>=3.13; extra == "npu"', 'Requires-Dist: packaging; extra == "npu"'} <= set(requires)
    assert "Requires-Python: >=3.10" in lines and "License-File: LICENSE" in lines
    classifiers = {line.split(": ", 1)[1] for line in lines if line.startswith("Classifier:")}
    assert {"License :: OSI Approved :: BSD License", "Typing :: Typed", "Programming Language :: Python :: 3.11"} \
        <= classifiers
    assert any(line.startswith("Description-Content-Type: text/markdown") for line in lines)
    assert "# npu_fuse" in archive.read(metadata).decode()  # the README as the long description
