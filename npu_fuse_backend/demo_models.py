"""Small built-in models written the way real model code is, for the demo, tests
and benchmarks. Nothing here knows about npu_fuse: they are plain PyTorch.
"""

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class DecoderConfig:
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2  # GQA: k/v with fewer heads than q
    head_dim: int = 64
    intermediate: int = 512
    layers: int = 1
    rope_theta: float = 10000.0
    max_positions: int = 512
    rotary_dim: int = 0  # GPT-J / GPT-NeoX: rotate only the first rotary_dim of each head (0: all)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# -- Hugging Face Llama style: rotate_half, cos/sin from position_ids -----------------
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, s, c.heads, c.head_dim).transpose(1, 2)  # BNSD
        k = self.k_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = c.heads // c.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
        mask = torch.full((s, s), float("-inf"), device=x.device, dtype=scores.dtype).triu(1)
        probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """A Llama-style decoder stack: embeddings in, hidden states out."""

    def __init__(self, cfg: DecoderConfig = DecoderConfig()):
        super().__init__()
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)

    def forward(self, x, position_ids):
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


# -- GPT-J style: interleaved pairs, rotate_every_two, BSND ---------------------------
def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


class GPTJAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.heads * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        rot = cfg.rotary_dim or cfg.head_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        sinusoid = torch.einsum("i,j->ij", torch.arange(cfg.max_positions).float(), inv_freq)
        self.register_buffer("embed_positions", torch.cat((sinusoid.sin(), sinusoid.cos()), dim=1),
                             persistent=False)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        c = self.cfg
        rot = c.rotary_dim or c.head_dim
        q, k, v = self.qkv(x).view(b, s, 3, c.heads, c.head_dim).unbind(2)  # BSND
        sincos = self.embed_positions[position_ids]
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3).to(x.dtype)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3).to(x.dtype)
        q_rot, q_pass = q[:, :, :, :rot], q[:, :, :, rot:]
        k_rot, k_pass = k[:, :, :, :rot], k[:, :, :, rot:]
        q = torch.cat([(q_rot * cos) + (rotate_every_two(q_rot) * sin), q_pass], dim=-1)
        k = torch.cat([(k_rot * cos) + (rotate_every_two(k_rot) * sin), k_pass], dim=-1)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True)
        return self.out(attn.transpose(1, 2).reshape(b, s, -1))


class GPTJModel(nn.Module):
    """GPT-J layers: interleaved RoPE on the first rotary_dim of each head (all when 0)."""

    def __init__(self, cfg: DecoderConfig = DecoderConfig(kv_heads=4, rotary_dim=32)):
        super().__init__()
        self.layers = nn.ModuleList(GPTJAttention(cfg) for _ in range(cfg.layers))
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.hidden) for _ in range(cfg.layers))

    def forward(self, x, position_ids):
        for norm, attn in zip(self.norms, self.layers):
            x = x + attn(norm(x), position_ids)
        return x


# -- GPT-NeoX style: rotate_half on the first rotary_pct of each head, BNSD -----------
class NeoXAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.heads * cfg.head_dim)
        self.dense = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden)
        rot = cfg.rotary_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        freqs = torch.outer(torch.arange(cfg.max_positions).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        c = self.cfg
        qkv = self.qkv(x).view(b, s, c.heads, 3 * c.head_dim)
        q = qkv[..., : c.head_dim].permute(0, 2, 1, 3)
        k = qkv[..., c.head_dim: 2 * c.head_dim].permute(0, 2, 1, 3)
        v = qkv[..., 2 * c.head_dim:].permute(0, 2, 1, 3)
        rot = c.rotary_dim
        cos = self.cos_cached[position_ids].unsqueeze(1).to(x.dtype)
        sin = self.sin_cached[position_ids].unsqueeze(1).to(x.dtype)
        q_rot, q_pass = q[..., :rot], q[..., rot:]
        k_rot, k_pass = k[..., :rot], k[..., rot:]
        q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(attn.permute(0, 2, 1, 3).reshape(b, s, -1))


class NeoXModel(nn.Module):
    """GPT-NeoX layers (parallel attention + MLP), rotary_pct = 0.25."""

    def __init__(self, cfg: DecoderConfig = DecoderConfig(kv_heads=4, rotary_dim=16)):
        super().__init__()
        self.attn = nn.ModuleList(NeoXAttention(cfg) for _ in range(cfg.layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(cfg.hidden, cfg.intermediate), nn.GELU(),
                                               nn.Linear(cfg.intermediate, cfg.hidden))
                                 for _ in range(cfg.layers))
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.hidden) for _ in range(2 * cfg.layers))

    def forward(self, x, position_ids):
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.norms[2 * i](x), position_ids) + mlp(self.norms[2 * i + 1](x))
        return x


# -- a soft mixture of experts: a softmax router outside attention -----------------------
class SoftMoE(nn.Module):
    """Every token mixes the outputs of all experts, weighted by a softmax over the router's
    logits scaled by 1/temperature (a softmax backward outside attention, which inductor's
    attention patterns leave to us)."""

    def __init__(self, hidden: int = 256, experts: int = 4, layers: int = 1, temperature: float = 0.5):
        super().__init__()
        self.routers = nn.ModuleList(nn.Linear(hidden, experts, bias=False) for _ in range(layers))
        self.experts = nn.ParameterList(nn.Parameter(torch.randn(experts, hidden, hidden) * hidden ** -0.5)
                                        for _ in range(layers))
        self.scale = 1.0 / temperature

    def forward(self, x, position_ids=None):
        for router, experts in zip(self.routers, self.experts):
            weights = torch.softmax(router(x) * self.scale, dim=-1)  # [B, S, E]
            x = x + torch.einsum("bse,bsek->bsk", weights, torch.einsum("bsh,ehk->bsek", x, experts))
        return x


# -- DeepSeek MLA as serving engines write it: absorbed W_UK, paged KV cache ------------
@dataclasses.dataclass
class MLAConfig:
    hidden: int = 2048
    heads: int = 16  # the smallest head count MlaPreprocess takes on Atlas A2/A3
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128
    block_size: int = 16
    num_blocks: int = 16
    rope_style: str = "half"  # "interleave": DeepSeek's original pairwise layout
    eps: float = 1e-6
    cache_write: str = "index_put"  # "scatter": cache.scatter_(0, slots[:, None].expand(-1, D), rows)


def rope_tokens(x, cos, sin, style: str):
    """RoPE on [T, ..., 64] with cos/sin [T, 64] broadcast over the middle dims.
    "interleave" is DeepSeek's reference form: de-interleave the pairs, then rotate halves."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if style == "interleave":
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).reshape(x.shape)
    return x * cos + rotate_half(x) * sin


class RMSNormWithBias(nn.Module):
    """ATB's RmsNorm with a beta: weight * x / rms(x) + bias, in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.bias = nn.Parameter(0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float() + self.bias.float()).to(x.dtype)


class W8A8Linear(nn.Module):
    """Static per-tensor asymmetric activation quant, per-channel int8 weights (vLLM-Ascend's
    w8a8 layout: the input scale in the model's dtype, an int8 offset)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8))
        self.register_buffer("input_scale", torch.tensor([0.05]))
        self.register_buffer("input_offset", torch.tensor([1], dtype=torch.int8))
        self.register_buffer("deq_scale", torch.rand(out_features) * 2e-4 + 1e-4)
        self.register_buffer("quant_bias", torch.randint(-10, 10, (out_features,), dtype=torch.int32))

    def forward(self, x):
        dtype = x.dtype
        q = torch.clamp(torch.round(x.float() / self.input_scale.float() + self.input_offset.float()), -128, 127)
        acc = torch._int_mm(q.to(torch.int8), self.weight.t())
        return ((acc + self.quant_bias).float() * self.deq_scale).to(dtype)


class DeepSeekMLA(nn.Module):
    """One MLA attention step over a paged cache. ``quant=True``: the w8a8 variant, whose
    input RMSNorm (with beta) and quantize/dequantize sit inside the prologue."""

    def __init__(self, cfg: MLAConfig = MLAConfig(), quant: bool = False):
        super().__init__()
        self.cfg, self.quant = cfg, quant
        qkv_out = cfg.q_lora + cfg.kv_lora + cfg.rope
        if quant:
            self.input_layernorm = RMSNormWithBias(cfg.hidden, cfg.eps)
            self.fused_qkv_a_proj = W8A8Linear(cfg.hidden, qkv_out)
            self.q_a_layernorm = RMSNormWithBias(cfg.q_lora, cfg.eps)
            self.q_b_proj = W8A8Linear(cfg.q_lora, cfg.heads * (cfg.nope + cfg.rope))
        else:
            self.fused_qkv_a_proj = nn.Linear(cfg.hidden, qkv_out, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora, cfg.eps)
            self.q_b_proj = nn.Linear(cfg.q_lora, cfg.heads * (cfg.nope + cfg.rope), bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora, cfg.eps)
        self.w_uk = nn.Parameter(torch.randn(cfg.heads, cfg.nope, cfg.kv_lora) * 0.05)
        self.w_uv = nn.Parameter(torch.randn(cfg.heads, cfg.kv_lora, cfg.v_head) * 0.05)
        self.o_proj = nn.Linear(cfg.heads * cfg.v_head, cfg.hidden, bias=False)

    def projections(self, x):
        """The prologue up to its norms and RoPE: q_nope, q_pe [T, N, *], and kv_c (before its
        RMSNorm), k_pe [T, *] (variants of the module reuse it)."""
        c = self.cfg
        if self.quant:
            x = self.input_layernorm(x)
        q_c, kv = self.fused_qkv_a_proj(x).split([c.q_lora, c.kv_lora + c.rope], dim=-1)
        q = self.q_b_proj(self.q_a_layernorm(q_c)).view(-1, c.heads, c.nope + c.rope)
        q_nope, q_pe = q.split([c.nope, c.rope], dim=-1)
        kv_c, k_pe = kv.split([c.kv_lora, c.rope], dim=-1)
        return q_nope, q_pe, kv_c, k_pe

    def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
        """x [T, hidden] (one token per sequence), cos/sin [T, rope], slot_mapping [T],
        kv_cache [blocks, block_size, 1, kv_lora + rope], context_slots [T, L]: the cache
        slots each token attends to (its sequence so far, itself included)."""
        c = self.cfg
        q_nope, q_pe, kv_c, k_pe = self.projections(x)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = rope_tokens(q_pe, cos, sin, c.rope_style)
        k_pe = rope_tokens(k_pe, cos, sin, c.rope_style)
        q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # absorbed W_UK
        rows, flat = torch.cat([kv_c, k_pe], dim=-1), kv_cache.view(-1, c.kv_lora + c.rope)
        if c.cache_write == "scatter":
            flat.scatter_(0, slot_mapping.unsqueeze(-1).expand(-1, rows.shape[-1]), rows)
        else:
            flat[slot_mapping] = rows
        q_full = torch.cat([q_nope, q_pe], dim=-1)  # [T, N, 576]
        keys = kv_cache.view(-1, c.kv_lora + c.rope)[context_slots]  # [T, L, 576]
        scores = torch.einsum("tnd,tld->tnl", q_full.float(), keys.float()) / math.sqrt(c.nope + c.rope)
        latent = torch.einsum("tnl,tlc->tnc", scores.softmax(-1), keys[..., : c.kv_lora].float())
        out = torch.einsum("tnc,ncv->tnv", latent, self.w_uv.float())
        return self.o_proj(out.reshape(out.shape[0], -1).to(x.dtype))


def mla_decode_inputs(cfg: MLAConfig, tokens: int, step: int, dtype=torch.bfloat16, seed: int = 0):
    """Inputs of decode step ``step`` for ``tokens`` sequences: sequence t owns block t."""
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randn(tokens, cfg.hidden, generator=g).to(dtype)
    positions = torch.full((tokens,), step)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, cfg.rope, 2).float() / cfg.rope))
    freqs = positions[:, None].float() * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    slot_mapping = torch.arange(tokens) * cfg.block_size + step
    context = torch.arange(tokens)[:, None] * cfg.block_size + torch.arange(step + 1)[None]
    return x, emb.cos().to(dtype), emb.sin().to(dtype), slot_mapping, context


@dataclasses.dataclass
class DemoCase:
    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.dtype], list]  # argument tuples of the calls to make, in order
    dtype: Optional[torch.dtype] = None  # the dtype this model runs in, whatever the demo's
    training: bool = False  # a training step (forward and backward) instead of inference


def clone_calls(calls: list) -> list:
    """A copy of every tensor of a case's calls, keeping shared tensors (a cache) shared."""
    memo = {}
    return [tuple(memo.setdefault(id(a), a.clone()) if isinstance(a, torch.Tensor) else a for a in args)
            for args in calls]


def _hidden_and_positions(batch=2, seq=64, hidden=256):
    def make(dtype):
        x = torch.randn(batch, seq, hidden, dtype=dtype)
        return [(x, torch.arange(seq).expand(batch, seq))]

    return make


def _mla_decode_steps(cfg: MLAConfig, tokens: int = 4, steps: int = 3):
    def make(dtype):
        cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, cfg.kv_lora + cfg.rope, dtype=dtype)
        calls = []
        for step in range(steps):
            x, cos, sin, slots, context = mla_decode_inputs(cfg, tokens, step, dtype)
            calls.append((x, cos, sin, slots, cache, context))
        return calls

    return make


def demo_cases(layers: int = 1, seq: int = 64, training: bool = False) -> list:
    """The models the demo compiles (later fusions add theirs here); ``training`` adds the
    training-step cases (forward and backward)."""
    cases = [
        DemoCase("llama-decoder", lambda: LlamaModel(DecoderConfig(layers=layers)),
                 _hidden_and_positions(seq=seq)),
        DemoCase("gptj-partial", lambda: GPTJModel(DecoderConfig(kv_heads=4, layers=layers, rotary_dim=32)),
                 _hidden_and_positions(seq=seq)),
        DemoCase("neox-partial", lambda: NeoXModel(DecoderConfig(kv_heads=4, layers=layers, rotary_dim=16)),
                 _hidden_and_positions(seq=seq)),
        DemoCase("deepseek-mla-decode", lambda: DeepSeekMLA(MLAConfig()), _mla_decode_steps(MLAConfig()),
                 dtype=torch.bfloat16),
    ]
    if training:  # RoPE backward and softmax backward
        cases.insert(1, DemoCase("llama-train", lambda: LlamaModel(DecoderConfig(layers=layers)),
                                 _hidden_and_positions(seq=seq), training=True))
        cases.insert(2, DemoCase("softmoe-train", lambda: SoftMoE(layers=layers), _hidden_and_positions(seq=seq),
                                 training=True))
    return cases
