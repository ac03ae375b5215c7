"""What a user of ``npu_fuse`` sees: the fused ops' entry points carry their real signatures and
docstrings (``help()``, ``inspect.signature``), and call the ops; the model zoo says how to get
transformers when it is missing."""

import inspect
import pydoc
import sys

import pytest
import torch

import npu_fuse


@pytest.mark.parametrize("name", npu_fuse.ops.__all__)
def test_every_entry_point_has_its_signature_and_a_docstring(name):
    fn = getattr(npu_fuse.ops, name)
    parameters = inspect.signature(fn).parameters.values()
    assert parameters and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)
    assert inspect.isfunction(fn) and len(inspect.getdoc(fn)) > 80
    page = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    assert f"{name}({next(iter(parameters)).name}" in page and "custom_op" not in page.lower()


def test_entry_points_call_the_ops():
    x, r1, r2 = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    torch.testing.assert_close(npu_fuse.ops.rotary_mul(x, r1, r2, rotary_mode="interleave"),
                               torch.ops.npu_fuse.rotary_mul(x, r1, r2, "interleave"))
    assert "torch.ops.npu_fuse.rotary_mul" in npu_fuse.ops.rotary_mul.__doc__
    compiled = torch.compile(lambda x: npu_fuse.ops.rotary_mul(x, r1, r2) + 1, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.ops.npu_fuse.rotary_mul(x, r1, r2) + 1)


def test_mla_preprocess_names_its_keywords():
    keywords = [p.name for p in inspect.signature(npu_fuse.ops.mla_preprocess).parameters.values()
                if p.kind is p.KEYWORD_ONLY]
    assert keywords == ["quant_scale0", "quant_offset0", "bias0", "quant_scale1", "quant_offset1", "bias1",
                        "ctkv_scale", "q_nope_scale", "cache_mode", "quant_mode", "epsilon"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_mod'"):
        npu_fuse.ops.mla_preprocess(*[torch.empty(0)] * 16, cache_mod=1)


def test_the_model_zoo_says_how_to_get_transformers(monkeypatch):
    from npu_fuse_backend import model_zoo

    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    with pytest.raises(ModuleNotFoundError, match=r"model zoo builds transformers' own model classes, and "
                                                  r"transformers is not installed: pip install -e '\.\[zoo\]'"):
        model_zoo.llama()
