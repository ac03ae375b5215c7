"""The GE graphs of the demo models (tiny configs), fused for each SoC and converted by torchair's real
FX->GE conversion: every node conforms to the CANN op definitions, no mutated graph input is copied,
and what fuses is what the SoC's ops allow."""

import pytest
import torch

import npu_fuse_backend as nf
from ge_conformance import check_graph, input_copies
from models import attention, tiny_gptj as gptj, tiny_llama
from torchair_offline import ge_graphs_of, torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")


def llama():
    return tiny_llama(heads=2, kv_heads=1, head_dim=64)


def hidden():
    return torch.randn(1, 8, 64), torch.arange(8)[None]


def attention_inputs():
    return [torch.randn(2, 2, 8, 8, requires_grad=True) for _ in range(3)]


def nanogpt_attention(q, k, v):
    """nanoGPT's attention: the causal mask filled into the scaled scores; its backward zeros the mask's
    places of the softmax backward before the scale (the mask stays a MaskedFill after SoftmaxGradExt)."""
    att = (q @ k.transpose(-1, -2)) * 0.125
    att = att.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(att, dim=-1) @ v


def deepseek_v3_rope():
    """transformers 5.x DeepSeek-V3's interleaved RoPE (pairs in, halves out) on q and k."""
    def rope(q, k, cos, sin):
        cos, sin = cos[..., :32].unsqueeze(1), sin[..., :32].unsqueeze(1)
        q1, q2, k1, k2 = q[..., 0::2], q[..., 1::2], k[..., 0::2], k[..., 1::2]
        return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1)
                + torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1))
    return rope


def deepseek_v3_inputs(dtype=torch.bfloat16, grad=False):
    def make():
        emb = torch.randn(1, 8, 32).repeat(1, 1, 2)
        return (torch.randn(1, 2, 8, 64, dtype=dtype, requires_grad=grad),
                torch.randn(1, 2, 8, 64, dtype=dtype, requires_grad=grad), emb.cos().to(dtype), emb.sin().to(dtype))
    return make


def lmdeploy_rope():
    """LMDeploy's rotate_half, written into an empty tensor half by half, on q and k."""
    def rotate(x):
        out = torch.empty_like(x)
        out[..., :32] = -x[..., 32:]
        out[..., 32:] = x[..., :32]
        return out

    return lambda q, k, cos, sin: (q * cos + rotate(q) * sin) + (k * cos + rotate(k) * sin)


def roll_signs_rope():
    """rotate_half as a roll, its signs a constant table times sin, on q and k."""
    def rope(x, cos, sin):
        return x * cos + torch.roll(x, 32, -1) * (sin * torch.cat([-torch.ones(32), torch.ones(32)]))

    return lambda q, k, cos, sin: rope(q, cos, sin) + rope(k, cos, sin)


def rope_inputs(grad=False):
    def make():
        emb = torch.randn(1, 1, 8, 32).repeat(1, 1, 1, 2)
        return (torch.randn(1, 2, 8, 64, requires_grad=grad), torch.randn(1, 1, 8, 64, requires_grad=grad),
                emb.cos(), emb.sin())
    return make


NORMS = ["rms_norm", "add_rms_norm", "add_rms_norm"]  # a Llama layer's: the embeddings', the residuals'
ROPE_TRAIN = {"forward": ["rotary_mul"] * 2, "backward": ["rotary_mul_backward"] * 2}
LLAMA_TRAIN = {**ROPE_TRAIN, "forward": ["rotary_mul"] * 2 + NORMS}
PARTIAL = ["inplace_partial_rotary_mul"] * 2
CASES = {  # name: (function maker, inputs, training, {soc: {graph kind: fused ops}})
    "llama-inference": (llama, hidden, False, {soc: {"inference": ["rotary_mul"] * 2 + NORMS} for soc in
                                               ("generic", "Ascend910B", "Ascend950")}),
    "llama-training": (llama, hidden, True, {
        "generic": LLAMA_TRAIN, "Ascend910B": LLAMA_TRAIN,
        "Ascend950": {**LLAMA_TRAIN, "backward": ["rotary_mul_backward"] * 2 + ["softmax_grad_ext"]}}),
    # GPT-J's [B, S, 1, rot] tables with B = 1 are no Ascend950 layout of InplacePartialRotaryMul (BSND,
    # B1ND, B11D, 111D): there the rotation of the slice fuses alone
    "gptj-inference": (gptj, hidden, False, {"generic": {"inference": PARTIAL}, "Ascend910B": {"inference": PARTIAL},
                                             "Ascend950": {"inference": ["rotary_mul"] * 2}}),
    # (its scaled_dot_product_attention decomposes to q and k each scaled by sqrt(scale): both matmuls of
    # the softmax backward carry that scale, which moves in front of them into SoftmaxGradExt, Ascend950's)
    "gptj-training": (gptj, hidden, True, {
        **{soc: {"forward": PARTIAL, "backward": ["rotary_mul_backward"] * 2} for soc in ("generic", "Ascend910B")},
        "Ascend950": {**ROPE_TRAIN, "backward": ["rotary_mul_backward"] * 2 + ["softmax_grad_ext"]}}),
    # InterleaveRope is A2/A3's, mode 3 Ascend950's (no op on every SoC: generic does not fuse it);
    # A2/A3 have no gradient op: training fuses on Ascend950 only
    "deepseek-v3-inference": (deepseek_v3_rope, deepseek_v3_inputs(), False, {
        "generic": {"inference": []},
        **{soc: {"inference": ["interleave_rope"] * 2} for soc in ("Ascend910B", "Ascend950")}}),
    "deepseek-v3-training": (deepseek_v3_rope, deepseek_v3_inputs(torch.float32, grad=True), True, {
        "generic": {"forward": [], "backward": []}, "Ascend910B": {"forward": [], "backward": []},
        "Ascend950": {"forward": ["interleave_rope"] * 2, "backward": ["interleave_rope_backward"] * 2}}),
    "lmdeploy-rope-training": (lmdeploy_rope, rope_inputs(grad=True), True, {
        soc: ROPE_TRAIN for soc in ("generic", "Ascend910B", "Ascend950")}),
    "roll-signs-rope-inference": (roll_signs_rope, rope_inputs(), False, {
        soc: {"inference": ["rotary_mul"] * 2} for soc in ("generic", "Ascend910B", "Ascend950")}),
    "attention-training": (lambda: attention, attention_inputs, True, {
        "generic": {"forward": [], "backward": []}, "Ascend910B": {"forward": [], "backward": []},
        "Ascend950": {"forward": [], "backward": ["softmax_grad_ext"]}}),
    "nanogpt-attention-training": (lambda: nanogpt_attention, attention_inputs, True, {
        "generic": {"forward": [], "backward": []}, "Ascend910B": {"forward": [], "backward": []},
        "Ascend950": {"forward": [], "backward": ["softmax_grad_ext"]}}),
}


@pytest.mark.parametrize("soc", ["generic", "Ascend910B", "Ascend950"])
@pytest.mark.parametrize("case", list(CASES))
def test_model_graphs_conform_on_every_soc(case, soc):
    make, inputs, training, expected = CASES[case]
    torch.manual_seed(0)
    fn = make()
    nf.clear_reports()
    with nf.config.patch(soc=soc), torch.set_grad_enabled(training):
        graphs = ge_graphs_of(fn, *inputs())
    assert len(graphs) == (2 if training else 1)
    for graph in graphs:
        assert [str(v) for v in check_graph(graph, soc)] == []
        assert input_copies(graph) == []
    assert {r.kind: [m.op for m in r.matches] for r in nf.get_reports()} == expected[soc]
