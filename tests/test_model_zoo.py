"""The model zoo (transformers' own model classes, tiny configs): one training step of each
family through npu_fuse fuses every expected RoPE site (forward and backward), softmax
backward and RMSNorm (forward), with outputs and gradients equal to eager's. benchmarks/coverage.py runs the same
zoo at two layers, for inference too."""

import collections

import pytest
import torch

import npu_fuse_backend as nf
from conftest import assert_close
from npu_fuse_backend import model_zoo

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", model_zoo.FAMILIES, ids=lambda f: f.name.split(" ")[0])
def test_training_step_fuses_every_site_with_eager_numerics(family):
    model = family.build(layers=1).train()
    inputs = model_zoo.example_inputs(batch=1, seq=6)
    logits = model(**inputs).logits
    logits.sum().backward()
    trained = [p for p in model.parameters() if p.grad is not None]  # (a VLM's vision tower gets none)
    expected = [logits.detach(), *(p.grad.clone() for p in trained)]
    model.zero_grad(set_to_none=True)
    with nf.config.patch(fallback="aot_eager"):
        logits = torch.compile(model, backend="npu_fuse")(**inputs).logits
        logits.sum().backward()
    got = [logits.detach(), *(p.grad for p in trained)]
    reports = nf.get_reports()
    fused = {r.kind: dict(collections.Counter(m.op for m in r.matches)) for r in reports}
    assert fused == {"forward": family.expected("forward", 1), "backward": family.expected("backward", 1)}, \
        [r.summary() for r in reports]
    # (the MLA prologue pass may say why a training-style DeepSeek attention is not the serving prologue,
    # and a MoE router's softmax backward, which no scale multiplies, is reported as such)
    routers = [n for r in reports for n in r.near_misses if n.family == "softmax_grad" and
               "is not multiplied by a scale" in n.reason and n.module.endswith(".gate")]
    assert len(routers) == family.routers, routers
    assert not [n for r in reports for n in r.near_misses if n.family != "mla_preprocess" and n not in routers]
    for g, e in zip(got, expected):
        assert_close(g, e)
    attention = [m.module for r in reports for m in r.matches if m.family != "rms_norm"]
    assert all(module.endswith(("self_attn", "attention", "attn")) for module in attention), attention
    norms = [(m.op, m.module) for r in reports for m in r.matches if m.family == "rms_norm"]
    # a norm in its own module; an add_rms_norm where its residual add is: the decoder layer
    assert all(module.endswith("norm") if op == "rms_norm" else ".layers." in module + "." for op, module in norms), \
        norms


def test_factories_follow_the_explain_contract():
    model, inputs = model_zoo.deepseek_v3()
    assert isinstance(model, torch.nn.Module) and set(inputs) == {"input_ids"}
