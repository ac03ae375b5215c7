"""Model code the tests share, written the way models write it: each builder once, here.

A test that studies one spelling (``test_rope.py``'s corpus of rotations, a look-alike)
keeps that spelling beside it; what several test files use is here.
"""

import torch

from npu_fuse_backend.demo_models import DecoderConfig, GPTJModel, LlamaModel


# -- RoPE ----------------------------------------------------------------------------------------
def rotate_half(x):
    """transformers' Llama / Qwen / Mistral rotate_half."""
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rotate_every_two(x):
    """GPT-J's rotate_every_two (interleaved pairs)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rope(q, cos, sin):
    """Full-width half-mode RoPE on one tensor."""
    return q * cos + rotate_half(q) * sin


def rope_args(seq=3, heads=4, head_dim=16, batch=2):
    """BSND q and its [1, S, 1, D] cos/sin tables."""
    return (torch.randn(batch, seq, heads, head_dim), torch.randn(1, seq, 1, head_dim),
            torch.randn(1, seq, 1, head_dim))


def gptj(q, cos, sin):
    """GPT-J's partial interleave RoPE on the first 64 lanes of q, the rest passed through."""
    q_rot, q_pass = q[..., :64], q[..., 64:]
    return torch.cat([q_rot * cos + rotate_every_two(q_rot) * sin, q_pass], -1) * 2


# -- attention / softmax backward --------------------------------------------------------------
def attention(q, k, v):
    """Explicit-softmax attention with a 1/8 scale: its backward is a scaled softmax backward."""
    return torch.softmax((q @ k.transpose(-1, -2)) * 0.125, dim=-1) @ v


def probs(*shape, dtype=torch.float32):
    """A softmax output (the x1 of softmax_grad_ext)."""
    return torch.randn(*shape).softmax(-1).to(dtype)


# -- whole models ------------------------------------------------------------------------------
def tiny_llama(**config):
    """The demo Llama (npu_fuse_backend.demo_models) at test size; ``config`` overrides DecoderConfig."""
    return LlamaModel(DecoderConfig(**{**dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64),
                                       **config}))


def tiny_gptj(**config):
    """The demo GPT-J (partial interleave RoPE) at test size."""
    return GPTJModel(DecoderConfig(**{**dict(hidden=64, heads=2, kv_heads=2, head_dim=32, intermediate=64,
                                             rotary_dim=16), **config}))


# -- RMSNorm -----------------------------------------------------------------------------------
class LlamaRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm (Qwen2, Mistral, Phi3, DeepSeek alike): float32 statistics, the
    normalized value cast back to the input's dtype, then the weight."""

    def __init__(self, hidden: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
