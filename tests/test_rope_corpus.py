"""A corpus of RoPE as other code bases write it, none of it a spelling the other RoPE tests use:
each form fuses forward and backward (training through aot_eager) with eager's numerics, and each
look-alike (code that looks like RoPE but is not a rotation any fused op computes) stays unfused
with a near-miss that says why. The recognizer (npu_fuse_backend/rotation.py) works from what the
code computes, so none of these needed a matcher of its own."""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fuse_backend as nf
from conftest import assert_close, assert_no_worse_than_eager, compile_fused, fused_ops, near_miss_reasons

aten = torch.ops.aten


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inv_freq(dim, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


# -- the forms -----------------------------------------------------------------------------------------
def sign_on_the_other_half(q, k, cos, sin):
    """rotate_half with the minus on the first half: cat((x2, -x1)) is -R(x), i.e. sin negated."""
    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x2, -x1), dim=-1)
    return q * cos + rot(q) * (-sin), k * cos + rot(k) * (-sin)


def sign_moved_to_the_add(q, k, cos, sin):
    """``q * cos - cat((b, -a)) * sin``: the sign on the other half and the add a sub."""
    def rot(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((b, -a), dim=-1)
    return q * cos - rot(q) * sin, k * cos - rot(k) * sin


def half_width_tables(q, k, cos, sin):
    """Contiguous halves with half-width tables: cat((x1*c - x2*s, x2*c + x1*s))."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return rot(q), rot(k)


def vllm_forward_native(positions, query, key, cos_sin_cache, head_size=16, rotary_dim=16, neox=True):
    """vLLM's RotaryEmbedding.forward_native: cos|sin rows of a cache indexed by position, x viewed
    [T, -1, head_size], its rotary part split (neox) or strided (GPT-J), sub/add, cat or stack."""
    cos_sin = cos_sin_cache[positions]
    cos, sin = cos_sin.chunk(2, dim=-1)
    tokens = positions.shape[0]

    def apply(x):
        shape = x.shape
        x = x.view(tokens, -1, head_size)
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        if neox:
            x1, x2 = torch.chunk(x_rot, 2, dim=-1)
        else:
            x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        x_rot = torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((x_rot, x_pass), dim=-1).reshape(shape)
    return apply(query), apply(key)


def pairs_by_reshape_recombined_by_stack(q, k, cos, sin):
    """Pairs by reshape(..., D/2, 2), lanes by select, recombined by stack (as JAX/Flax code writes it)."""
    def rot(x):
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).reshape(x.shape)
    return rot(q), rot(k)


def megatron_apply_rotary_pos_emb(t, freqs):
    """Megatron-LM's apply_rotary_pos_emb_bshd on [S, B, H, D]: rotary on the first rot_dim lanes, cos
    and sin of the freqs computed in the graph, the rest concatenated back."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    t = (t * cos_) + (rotate_half(t) * sin_)
    return torch.cat((t, t_pass), dim=-1)


def flash_attn_rotary_interleaved(x, cos, sin):
    """flash-attn's apply_rotary_emb_torch(interleaved=True): tables [S, ro_dim / 2] repeated per pair
    ("... d -> ... 1 (d 2)"), pairs rotated by stack((-x2, x1)), the lanes past ro_dim kept."""
    ro_dim = cos.shape[-1] * 2
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)

    def rot(y):
        y1, y2 = y[..., ::2], y[..., 1::2]
        return torch.stack((-y2, y1), dim=-1).flatten(-2)
    return torch.cat([x[..., :ro_dim] * cos + rot(x[..., :ro_dim]) * sin, x[..., ro_dim:]], dim=-1)


def qwen2_vl_mrope(q, k, cos, sin, section=(2, 3, 3)):
    """Qwen2-VL's multimodal RoPE: the tables' sections taken from the temporal, height and width
    position streams (cos/sin [3, B, S, D])."""
    sections = list(section) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def phi3_longrope(q, k, position_ids, ext_factors):
    """Phi-3's LongRoPE ("su"): inverse frequencies divided by per-lane factors, tables scaled."""
    inv = inv_freq(q.shape[-1]).to(ext_factors.dtype) / ext_factors
    freqs = (inv[None, :, None] @ position_ids[:, None, :].to(inv.dtype)).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = math.sqrt(1 + math.log(4.0) / math.log(64))
    cos, sin = (emb.cos() * scale).unsqueeze(1), (emb.sin() * scale).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def einsum_outer_product_tables(q, k, positions):
    """Tables as an outer product by einsum (GPT-NeoX, lucidrains), broadcast [S, D] against [B, N, S, D]."""
    freqs = torch.einsum("i,j->ij", positions.float(), inv_freq(q.shape[-1]))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def polar_complex_token_major(xq, xk, positions):
    """Llama-4 / DeepSeek-V2 complex form on token-major [T, N, D] bf16 activations, freqs_cis by
    torch.polar in the graph."""
    freqs = positions[:, None].float() * inv_freq(xq.shape[-1])[None, :]
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
    out = []
    for x in (xq, xk):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out.append(torch.view_as_real(pairs * freqs_cis).flatten(-2).type_as(x))
    return tuple(out)


def halves_by_unflatten_unbind(q, k, cos, sin):
    """The halves by unflatten(-1, (2, -1)).unbind(-2)."""
    def rot(x):
        x1, x2 = x.unflatten(-1, (2, -1)).unbind(-2)
        return torch.cat((-x2, x1), dim=-1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def glm_repeat_interleave_tables(q, k, cos, sin):
    """GLM/Cohere: full tables halved and repeated per pair, pairs rotated by stack((-x2, x1))."""
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)

    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def mlx_rope(q, k, positions):
    """MLX's rope (traditional=False): theta from positions in the graph, rx2 = x1 * sin + x2 * cos."""
    half = q.shape[-1] // 2
    theta = positions[:, None].float() * inv_freq(q.shape[-1])[None, :]
    cos, sin = theta.cos(), theta.sin()

    def rot(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rot(q), rot(k)


def vmapped_rope(q, k, cos, sin):
    """torch.vmap of a per-sequence RoPE ([N, S, D] each) over the batch."""
    def one(x, c, s):
        x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s
    batched = torch.vmap(one, in_dims=(0, None, None))
    return batched(q, cos, sin), batched(k, cos, sin)


def vmapped_over_heads_interleaved(q, cos, sin):
    """torch.vmap over the heads of [S, N, D] (in_dims=1, out_dims=1) of a GPT-J rotation: vmap
    permutes x to put the heads first, and its backward permutes each term of the gradient's sum."""
    def one(x, c, s):
        return x * c + torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * s
    return torch.vmap(one, in_dims=(1, None, None), out_dims=1)(q, cos, sin)


def deepseek_v2_split_complex(q, k_pe, freqs_cis, nope=8):
    """DeepSeek-V2's q_pe is a split of q (not contiguous): .float().reshape(..., -1, 2) copies it
    before view_as_complex; the result is concatenated back with q_nope."""
    q_nope, q_pe = torch.split(q, [nope, q.shape[-1] - nope], dim=-1)
    out = []
    for x in (q_pe, k_pe):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out.append(torch.view_as_real(pairs * freqs_cis.unsqueeze(1)).flatten(3).type_as(x))
    return torch.cat((q_nope, out[0]), dim=-1), out[1]


def lmdeploy_rotate_half_written_in_place(q, k, cos, sin):
    """LMDeploy's default rotate_half writes the halves into an empty tensor (functionalized: an
    empty_like and two slice_scatters; its backward, zeros copied into a gradient's half)."""
    def rotate(x):
        half = x.shape[-1] // 2
        out = torch.empty_like(x)
        out[..., :half] = -x[..., half:]
        out[..., half:] = x[..., :half]
        return out
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def _qk(b=2, n=4, s=6, d=16, dtype=torch.float32):
    return torch.randn(b, n, s, d, dtype=dtype), torch.randn(b, 2, s, d, dtype=dtype)


def _tables(shape, d=16):
    freqs = torch.rand(*shape, d // 2) * 3
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def _half_tables(shape, d=16):
    freqs = torch.rand(*shape, d // 2) * 3
    return freqs.cos(), freqs.sin()


def chatglm_rope_cache_pairs(q, k, rope_cache):
    """ChatGLM2/3 (THUDM's modeling_chatglm.py), sq-major [sq, b, np, hn]: a cache of (cos, sin) pairs per
    frequency, the first half of each head rotated pair by pair, the rest passed through. Its training
    forward saves the cos (and the sin) twice, once per term; the backward reads the two copies."""
    def apply(x, cache):
        sq, np = x.size(0), x.size(2)
        rot_dim = cache.shape[-2] * 2
        x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        xshaped = x.reshape(sq, -1, np, rot_dim // 2, 2)
        cache = cache[:sq].view(sq, -1, 1, xshaped.size(3), 2)
        x_out2 = torch.stack([xshaped[..., 0] * cache[..., 0] - xshaped[..., 1] * cache[..., 1],
                              xshaped[..., 1] * cache[..., 0] + xshaped[..., 0] * cache[..., 1]], -1)
        return torch.cat((x_out2.flatten(3), x_pass), dim=-1)
    return apply(q, rope_cache), apply(k, rope_cache)


def _chatglm_cache(seq=8, rot_dim=16):
    theta = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))
    t = torch.outer(torch.arange(seq, dtype=torch.float), theta)
    return torch.stack([t.cos(), t.sin()], dim=-1)


def _cos_sin_cache(positions=32, rotary_dim=16):
    freqs = torch.outer(torch.arange(positions).float(), inv_freq(rotary_dim))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


ROPE2 = {"rotary_mul": 2}, {"rotary_mul_backward": 2}
FORMS = {  # name: (fn, make args, indices of the inputs that get gradients, forward ops, backward ops)
    "sign on the other half": (sign_on_the_other_half, lambda: (*_qk(), *_tables((1, 1, 6))), (0, 1), *ROPE2),
    "sign moved to the add": (sign_moved_to_the_add, lambda: (*_qk(), *_tables((1, 1, 6))), (0, 1), *ROPE2),
    "contiguous halves, half-width tables": (half_width_tables, lambda: (*_qk(), *_half_tables((2, 6))), (0, 1),
                                             *ROPE2),
    "vLLM forward_native (neox)": (vllm_forward_native, lambda: (torch.randint(0, 32, (5,)), torch.randn(5, 64),
                                                                 torch.randn(5, 32), _cos_sin_cache()), (1, 2), *ROPE2),
    "vLLM forward_native (GPT-J style, partial)": (
        lambda p, q, k, c: vllm_forward_native(p, q, k, c, head_size=32, rotary_dim=16, neox=False),
        lambda: (torch.randint(0, 32, (5,)), torch.randn(5, 64), torch.randn(5, 32), _cos_sin_cache()), (1, 2),
        {"inplace_partial_rotary_mul": 2}, {"rotary_mul_backward": 2}),
    "pairs by reshape, recombined by stack": (pairs_by_reshape_recombined_by_stack,
                                              lambda: (*_qk(), *_half_tables((6,))), (0, 1), *ROPE2),
    "Megatron-LM bshd partial": (megatron_apply_rotary_pos_emb,
                                 lambda: (torch.randn(6, 2, 4, 32), torch.rand(6, 1, 1, 16) * 3), (0,),
                                 {"rotary_mul": 1}, {"rotary_mul_backward": 1}),
    "flash-attn rotary, interleaved, partial": (
        flash_attn_rotary_interleaved, lambda: (torch.randn(2, 6, 4, 32), *_half_tables((6,))), (0,),
        {"inplace_partial_rotary_mul": 1}, {"rotary_mul_backward": 1}),
    "Qwen2-VL M-RoPE sections": (qwen2_vl_mrope, lambda: (*_qk(), *_tables((3, 2, 6))), (0, 1), *ROPE2),
    "Phi-3 LongRoPE scaled tables": (phi3_longrope, lambda: (*_qk(), torch.arange(6).expand(2, 6),
                                                            1.0 + torch.rand(8)), (0, 1), *ROPE2),
    "einsum outer-product tables": (einsum_outer_product_tables, lambda: (*_qk(), torch.arange(6)), (0, 1), *ROPE2),
    "torch.polar complex, token-major bf16": (  # backward: conj(freqs_cis), whose tables rotary_mul reads
        polar_complex_token_major,
        lambda: (torch.randn(6, 4, 16, dtype=torch.bfloat16), torch.randn(6, 2, 16, dtype=torch.bfloat16),
                 torch.arange(6)), (0, 1), {"rotary_mul": 2}, {"rotary_mul": 2}),
    "halves by unflatten/unbind": (halves_by_unflatten_unbind, lambda: (*_qk(), *_tables((1, 1, 6))), (0, 1),
                                   *ROPE2),
    "GLM repeat_interleave tables": (glm_repeat_interleave_tables, lambda: (*_qk(), *_tables((2, 6))), (0, 1),
                                     *ROPE2),
    "MLX rope (traditional=False)": (mlx_rope, lambda: (*_qk(), torch.arange(6)), (0, 1), *ROPE2),
    "torch.vmap over the batch": (vmapped_rope, lambda: (*_qk(), *_tables((6,))), (0, 1), *ROPE2),
    "torch.vmap over the heads, interleaved": (
        vmapped_over_heads_interleaved, lambda: (torch.randn(6, 4, 16), *_tables((6,))), (0,),
        {"rotary_mul": 1}, {"rotary_mul_backward": 1}),
    "LMDeploy rotate_half written in place": (lmdeploy_rotate_half_written_in_place,
                                              lambda: (*_qk(), *_tables((1, 1, 6))), (0, 1), *ROPE2),
    "ChatGLM2/3 cache of (cos, sin) pairs, partial": (
        chatglm_rope_cache_pairs, lambda: (torch.randn(6, 2, 4, 32), torch.randn(6, 2, 2, 32), _chatglm_cache()),
        (0, 1), {"inplace_partial_rotary_mul": 2}, {"rotary_mul_backward": 2}),
    "DeepSeek-V2 split q_pe, complex": (
        deepseek_v2_split_complex,
        lambda: (torch.randn(2, 4, 6, 24, dtype=torch.bfloat16), torch.randn(2, 1, 6, 16, dtype=torch.bfloat16),
                 torch.polar(torch.ones(2, 6, 8), torch.rand(2, 6, 8) * 3)), (0, 1),
        {"inplace_partial_rotary_mul": 1, "rotary_mul": 1}, {"inplace_partial_rotary_mul": 1, "rotary_mul": 1}),
}


def _run(fn, args, grad_args, compiled=False):
    args = [a.detach().clone().requires_grad_() if i in grad_args else a for i, a in enumerate(args)]
    out = (torch.compile(fn, backend="npu_fuse", fullgraph=True) if compiled else fn)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    weights = [torch.linspace(-1, 1, o.numel()).view(o.shape) for o in outs]
    sum((o.float() * w).sum() for o, w in zip(outs, weights)).backward()
    return [o.detach() for o in outs] + [args[i].grad for i in grad_args]


def _float64(args):
    return [a.double() if a.is_floating_point() else a.to(torch.complex128) if a.is_complex() else a for a in args]


@pytest.mark.parametrize("form", FORMS)
def test_form_fuses_forward_and_backward_with_eager_numerics(form):
    fn, make, grad_args, forward_ops, backward_ops = FORMS[form]
    args = make()
    with nf.config.patch(fallback="aot_eager"):
        got = _run(fn, args, grad_args, compiled=True)
    reports = nf.get_reports()
    fused = {kind: {op: [m.op for r in reports if r.kind == kind for m in r.matches].count(op)
                    for op in {m.op for r in reports if r.kind == kind for m in r.matches}}
             for kind in ("forward", "backward")}
    assert fused == {"forward": forward_ops, "backward": backward_ops}, [r.summary() for r in reports]
    assert not near_miss_reasons(reports), near_miss_reasons(reports)
    eager = _run(fn, args, grad_args)
    exact = _run(fn, _float64(args), grad_args)
    for g, e, x in zip(got, eager, exact):
        assert_no_worse_than_eager(g, e, x.to(e.dtype) if e.dtype == torch.float32 else x)


def test_vllm_forward_native_graph_fuses_as_vllm_traces_it():
    """The aten graph vLLM's CPU build gives (shared/reference/vllm-cpu.md, "RoPE in that graph"):
    index.Tensor of the cache, split.Tensor into cos | sin, reshape to [T, -1, 32], split, sub/add, cat."""
    def graph(positions, q_part, cos_sin_cache):
        index = aten.index.Tensor(cos_sin_cache, [positions])
        cos, sin = aten.split.Tensor(index, 16, -1)
        x1, x2 = aten.split.Tensor(aten.reshape(q_part, [5, -1, 32]), 16, -1)
        c, s = aten.unsqueeze(cos, -2), aten.unsqueeze(sin, -2)
        o1 = aten.sub.Tensor(aten.mul.Tensor(x1, c), aten.mul.Tensor(x2, s))
        o2 = aten.add.Tensor(aten.mul.Tensor(x2, c), aten.mul.Tensor(x1, s))
        return aten.reshape(aten.cat.default([o1, o2], -1), [5, -1])

    args = torch.randint(0, 32, (5,)), torch.randn(5, 128), _cos_sin_cache(32, 32)
    gm = make_fx(graph, tracing_mode="fake")(*args)
    report = nf.run_fusion_passes(gm)
    assert [(m.op, m.detail) for m in report.matches] == [("rotary_mul", "mode=half")], report.summary()
    assert not report.near_misses
    assert not any(n.target in (aten.sub.Tensor, aten.mul.Tensor) for n in gm.graph.nodes)
    assert_close(gm(*args), graph(*args))


# -- look-alikes: they stay unfused, each with a near-miss saying why -------------------------------------
def _halves(x):
    return x.chunk(2, dim=-1)


def _sign_vector(d=16):
    return torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])


def _written_in_place(x, first, second):
    """LMDeploy's rotate_half with the halves it writes given."""
    out = torch.empty_like(x)
    out[..., :x.shape[-1] // 2] = first
    out[..., x.shape[-1] // 2:] = second
    return out


LOOK_ALIKES = {  # name: (fn(q, cos, sin), a phrase of the reason)
    "halves swapped without a sign": (
        lambda q, c, s: q * c + torch.cat(_halves(q)[::-1], -1) * s, "a reflection, not a rotation"),
    "both halves negated": (
        lambda q, c, s: q * c + torch.cat((-_halves(q)[1], -_halves(q)[0]), -1) * s, "a reflection, not a rotation"),
    "a cyclic shift by one lane": (
        lambda q, c, s: q * c + torch.cat((-q[..., 1:], q[..., :1]), -1) * s, "not an involution"),
    "halves split off the middle": (
        lambda q, c, s: q * c + torch.cat((-q[..., 6:], q[..., :6]), -1) * s, "not an involution"),
    "quarters rotated in place": (
        lambda q, c, s: q * c + torch.cat([torch.cat((-b, a), -1) for a, b in
                                           zip(q.chunk(4, -1)[0::2], q.chunk(4, -1)[1::2])], -1) * s,
        "no GE RoPE mode pairs lanes so"),
    "sin depends on x": (
        lambda q, c, s: q * c + rotate_half(q) * q.sigmoid(), "depends on"),
    "cos computed from x": (
        lambda q, c, s: q * (q.mean(-1, keepdim=True) * c) + rotate_half(q) * s, "depends on"),
    "another tensor rotated": (
        lambda q, c, s: q * c + rotate_half(q.flip(-2)) * s, "is not the rotated tensor"),
    "a slice rotated into another slice's place": (
        lambda q, c, s: torch.cat((q[..., 8:], q[..., :4] * c[..., :4] - q[..., 4:8] * s[..., :4],
                                   q[..., 4:8] * c[..., :4] + q[..., :4] * s[..., :4]), -1),
        "the lanes around the rotation are moved"),
    "the cos term reads x through a permutation": (
        lambda q, c, s: q.flip(-1) * c + rotate_half(q) * s, "neither its own"),
    "half-width form, sign error": (
        lambda q, c, s: torch.cat((_halves(q)[0] * c[..., :8] + _halves(q)[1] * s[..., :8],
                                   _halves(q)[1] * c[..., :8] + _halves(q)[0] * s[..., :8]), -1),
        "a reflection, not a rotation"),
    "half-width form, cos negated on one half": (
        lambda q, c, s: torch.cat((_halves(q)[0] * c[..., :8] - _halves(q)[1] * s[..., :8],
                                   -_halves(q)[1] * c[..., :8] + _halves(q)[0] * s[..., :8]), -1),
        "take their own lanes with opposite signs"),
    "pairs stacked with both odd lanes negated": (
        lambda q, c, s: (lambda p: torch.stack((p[..., 0] * c[..., :8] - p[..., 1] * s[..., :8],
                                                p[..., 1] * c[..., :8] - p[..., 0] * s[..., :8]), -1).flatten(-2))(
            q.unflatten(-1, (-1, 2))), "a reflection, not a rotation"),
    "pairs swapped inside the stack": (
        lambda q, c, s: (lambda p: torch.stack((p[..., 1] * c[..., :8] + p[..., 0] * s[..., :8],
                                                p[..., 0] * c[..., :8] - p[..., 1] * s[..., :8]), -1).flatten(-2))(
            q.unflatten(-1, (-1, 2))), "a reflection, not a rotation"),
    "even lanes negated in place (no swap)": (
        lambda q, c, s: q * c + torch.stack((-q[..., ::2], q[..., 1::2]), -1).flatten(-2) * s, "twice"),
    "conj of x times freqs (a reflection)": (
        lambda q, c, s: torch.view_as_real(torch.view_as_complex(q.unflatten(-1, (-1, 2))).conj() *
                                           torch.polar(torch.ones_like(c[..., :8]), c[..., :8])).flatten(-2),
        "a reflection, not a rotation"),
    "a product rounded to bf16 in an fp32 RoPE": (
        lambda q, c, s: (q * c).bfloat16().float() + rotate_half(q) * s, "rounds to bfloat16 in the middle"),
    "x rounded for one term only": (
        lambda q, c, s: q * c + rotate_half(q.half().float()) * s, "rounded differently for the two terms"),
    "written in place, both halves negated": (
        lambda q, c, s: q * c + _written_in_place(q, -_halves(q)[1], -_halves(q)[0]) * s,
        "a reflection, not a rotation"),
    "written in place, halves swapped without a sign": (
        lambda q, c, s: q * c + _written_in_place(q, _halves(q)[1], _halves(q)[0]) * s,
        "a reflection, not a rotation"),
    "roll without a sign": (lambda q, c, s: q * c + torch.roll(q, 8, -1) * (s * torch.ones(16)),
                            "a reflection, not a rotation"),
    "roll, every sign negative": (lambda q, c, s: q * c + torch.roll(q, 8, -1) * (s * -torch.ones(16)),
                                  "a reflection, not a rotation"),
    "roll by one lane": (lambda q, c, s: q * c + torch.roll(q, 1, -1) * (s * _sign_vector()), "not an involution"),
    "a constant that is not a sign vector": (
        lambda q, c, s: q * c + torch.roll(q, 8, -1) * (s * (2 * _sign_vector())), "a reflection, not a rotation"),
    "index_select by a cyclic shift of one lane": (
        lambda q, c, s: q * c + torch.index_select(q, -1, (torch.arange(16) + 1) % 16) * (s * _sign_vector()),
        "not an involution"),
    "the whole head flipped": (lambda q, c, s: q * c + q.flip(-1) * (s * _sign_vector()), "no GE RoPE mode pairs"),
    "a lane left zero": (
        lambda q, c, s: q * c + torch.cat((-_halves(q)[1], torch.zeros_like(_halves(q)[0])), -1) * s,
        "the result"),
}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alike_stays_unfused_with_a_near_miss(name):
    fn, phrase = LOOK_ALIKES[name]
    q, c, s = torch.randn(2, 4, 6, 16), *_tables((1, 1, 6))
    out, reports = compile_fused(fn, q, c, s)
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    reasons = near_miss_reasons(reports)
    assert len(reasons) == 1 and phrase in reasons[0], reasons
    assert_close(out, fn(q, c, s))


def test_there_are_at_least_as_many_look_alikes_as_forms():
    assert len(FORMS) >= 10 and len(LOOK_ALIKES) >= len(FORMS)


# -- signs in a constant, lanes moved by roll, flip or a constant index (inference graphs) ----------------
def _scattered(q):
    """rotate_half(q) written by a scatter: each lane of q, signed, to its partner's place."""
    z = torch.zeros_like(q)
    z[..., torch.cat([torch.arange(8, 16), torch.arange(8)])] = q * -_sign_vector()
    return z


SIGN_FORMS = {  # name: (fn(q, cos, sin) with half-layout tables, its op and mode)
    "roll, the sign in the sin table": (
        lambda q, c, s: q * c + torch.roll(q, 8, -1) * (s * _sign_vector()), "mode=half"),
    "a constant index, the sign a factor": (
        lambda q, c, s: q * c + q[..., torch.cat([torch.arange(8, 16), torch.arange(8)])] * _sign_vector() * s,
        "mode=half"),
    "pairs flipped, the sign a literal tensor": (
        lambda q, c, s: q * c + (q.unflatten(-1, (-1, 2)).flip(-1) * torch.tensor([-1.0, 1.0])).flatten(-2) * s,
        "mode=interleave"),
    "scattered into zeros by a constant index": (lambda q, c, s: q * c + _scattered(q) * s, "mode=half"),
    "pairs reversed by prims.rev (inductor's flip)": (
        lambda q, c, s: q * c + (torch.ops.prims.rev(q.unflatten(-1, (-1, 2)), [4]) *
                                 torch.tensor([-1.0, 1.0])).flatten(-2) * s, "mode=interleave"),
    "halves swapped by a flip of the (2, D/2) view": (
        lambda q, c, s: q * c + q.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * _sign_vector() * s, "mode=half"),
    "index_select by a constant index": (
        lambda q, c, s: q * c + torch.index_select(q, -1, torch.cat([torch.arange(8, 16), torch.arange(8)])) *
        _sign_vector() * s, "mode=half"),
}
@pytest.mark.parametrize("name", SIGN_FORMS)
def test_signs_in_constants_and_constant_lane_moves_fuse(name):
    fn, mode = SIGN_FORMS[name]
    q, (c, s) = torch.randn(2, 4, 6, 16), _tables((1, 1, 6))
    with torch.no_grad():
        out, reports = compile_fused(fn, q, c, s)
    assert [(m.op, m.detail) for r in reports for m in r.matches] == [("rotary_mul", mode)], \
        [r.summary() for r in reports]
    assert not near_miss_reasons(reports)
    assert_close(out, fn(q, c, s))


def test_an_index_read_at_run_time_is_not_a_constant_lane_move():
    def fn(q, c, s, idx):
        return q * c + q[..., idx] * _sign_vector() * s
    q, (c, s) = torch.randn(2, 4, 6, 16), _tables((1, 1, 6))
    idx = torch.cat([torch.arange(8, 16), torch.arange(8)])
    with torch.no_grad():
        out, reports = compile_fused(fn, q, c, s, idx)
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    assert_close(out, fn(q, c, s, idx))


@pytest.mark.parametrize("name, phrase", [
    ("a constant index, the sign a factor", "an index that is not a constant"),
    ("index_select by a constant index", "an index that is not a constant"),  # (index_add in the backward)
    ("roll, the sign in the sin table", "its values are not known in the backward graph")])
def test_aot_eager_training_fuses_the_forward_and_its_backward_says_why_not(name, phrase):
    """aot_eager's partitioner saves the constant (the index, the signed sin) for the backward, where it
    is a graph input: the forward fuses, the backward is a near-miss saying so, the gradients are eager's."""
    fn = SIGN_FORMS[name][0]
    q, (c, s) = torch.randn(2, 4, 6, 16, requires_grad=True), _tables((1, 1, 6))
    out, _ = compile_fused(fn, q, c, s)
    out.backward(torch.ones_like(out))
    reports = nf.get_reports()  # (the backward compiles at .backward())
    fused = {r.kind: [m.op for m in r.matches] for r in reports}
    assert fused == {"forward": ["rotary_mul"], "backward": []}, [r.summary() for r in reports]
    reasons = [n.reason for r in reports if r.kind == "backward" for n in r.near_misses]
    assert len(reasons) == 1 and phrase in reasons[0], reasons
    grad, q.grad = q.grad, None
    fn(q, c, s).backward(torch.ones_like(out))
    assert_close(grad, q.grad)


def test_a_lane_times_a_sign_vector_rounds_as_the_lane_alone():
    """bf16 x, fp32 tables: ``x[..., idx] * signs`` in bf16 is exact (a sign), so it is no rounding in
    the middle of the computation; the fused op's result is eager's within bf16's tolerance."""
    def fn(q, c, s):  # (a tensor built outside would be a graph input, of values unknown when it compiles)
        return q * c + q[..., torch.cat([torch.arange(8, 16), torch.arange(8)])] * _sign_vector().bfloat16() * s
    q, (c, s) = torch.randn(2, 4, 6, 16).bfloat16(), _tables((1, 1, 6))
    with torch.no_grad():
        out, reports = compile_fused(fn, q, c, s)
    assert fused_ops(reports) == ["rotary_mul"], [r.summary() for r in reports]
    assert out.dtype == torch.float32
    assert_close(out, fn(q, c, s))


def test_a_half_left_unwritten_is_a_near_miss_naming_the_uninitialized_lanes():
    """LMDeploy's form with its second write missing: those lanes read whatever memory held."""
    def fn(q, c, s):
        out = torch.empty_like(q)
        out[..., :8] = -q[..., 8:]
        return q * c + out * s
    q, (c, s) = torch.randn(2, 4, 6, 16), _tables((1, 1, 6))
    _, reports = compile_fused(fn, q, c, s)
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    reasons = near_miss_reasons(reports)
    assert len(reasons) == 1 and "lanes [8:16] of the result read empty_like" in reasons[0], reasons


@pytest.mark.parametrize("dtype, table_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.float32)])
def test_written_in_place_trains_fused_in_low_precision(dtype, table_dtype):
    """The lanes of the empty tensor not yet written hold nothing of x: no rounding in the middle (bf16 x
    with fp32 tables included); forward and backward fuse within the dtype's tolerance of eager."""
    fn = FORMS["LMDeploy rotate_half written in place"][0]
    q, k = (t.to(dtype) for t in _qk())
    c, s = (t.to(table_dtype) for t in _tables((1, 1, 6)))
    with nf.config.patch(fallback="aot_eager"):
        got = _run(fn, (q, k, c, s), (0, 1), compiled=True)
    reports = nf.get_reports()
    assert {r.kind: [m.op for m in r.matches] for r in reports} == \
        {"forward": ["rotary_mul"] * 2, "backward": ["rotary_mul_backward"] * 2}, [r.summary() for r in reports]
    for g, e in zip(got, _run(fn, (q, k, c, s), (0, 1))):
        assert_close(g, e, dtype)


def test_pairs_of_a_symbolic_head_dim_are_a_near_miss_not_a_silent_site():
    """dynamic=True with the head dim taken from the input: ``view(..., -1, 2)`` splits a symbolic width
    into pairs; the rotation is seen, and refused for its symbolic head dim."""
    def fn(q, c, s):
        p = q.view(*q.shape[:-1], -1, 2)
        return q * c + torch.stack((-p[..., 1], p[..., 0]), -1).flatten(-2) * s
    q, (c, s) = torch.randn(2, 4, 6, 16), _tables((1, 1, 6))
    with torch.no_grad():
        out, reports = compile_fused(fn, q, c, s, dynamic=True)
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    reasons = near_miss_reasons(reports)
    assert len(reasons) == 1 and "is symbolic" in reasons[0], reasons
    assert_close(out, fn(q, c, s))


def test_unflattened_pairs_of_a_symbolic_head_dim_are_near_misses_in_training():
    """``unflatten(-1, (-1, 2))`` of a symbolic head dim: the traced view's shape spells the pair as
    ``s // (s // 2)``, and the two halves' refusals each hold the other's anchor; the forward and the
    backward each report one near-miss naming the symbolic head dim (both were silent)."""
    def fn(q, c, s):
        p = q.unflatten(-1, (-1, 2))
        a, b = p[..., 0], p[..., 1]
        c, s = c[..., ::2], s[..., ::2]
        return torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)

    nf.clear_reports()
    torch._dynamo.reset()
    with nf.config.patch(fallback="aot_eager"):
        compiled = torch.compile(fn, backend="npu_fuse", dynamic=True)
        for seq in (6, 10):
            q, (c, s) = torch.randn(2, 4, seq, 16, requires_grad=True), _tables((1, 1, seq))
            out = compiled(q, c, s)
            out.pow(2).sum().backward()
            assert_close(out, fn(q, c, s))
    reports = nf.get_reports()
    assert fused_ops(reports) == [], [r.summary() for r in reports]
    for kind in ("forward", "backward"):
        reasons = [n.reason for r in reports if r.kind == kind for n in r.near_misses]
        assert len(reasons) == 1 and "is symbolic" in reasons[0], (kind, reasons)
