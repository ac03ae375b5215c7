"""A differential fuzzer for the fusion passes: generated programs, compiled with npu_fuse and
compared with eager (forward, backward, the caches they write, and whether they raise).

Each program is drawn from one seed: a RoPE program (every rotation style the rope and
partial_rope passes know, operand orders, layouts BSND/BNSD/[T,N,D]/[T,D], GQA, fp32/fp16/bf16,
table shapes and in-graph tables from positions with an offset, partial slices kept by
``cat`` or written back), a softmax-backward program (v1/v2 orders, the decomposed and fma
forms, every kind of scale, training attention) or an MLA-prologue program (variants of
``DeepSeekMLA``); a share of them are look-alikes: a mutation that changes the math (swapped
or missing signs, wrong dims, wrong slice bounds, another tensor, extra users of an
intermediate, an accumulating cache write, RMSNorm over the wrong dim). An MLA program may
also write at an out-of-range slot: it fuses, and raises where eager does.

Each program also draws a value class for its inputs (``VALUE_CLASSES``): ordinary normal values,
magnitudes far outside [-1, 1] (inputs scaled up, tables and scales above 1, as YaRN/NTK tables and
temperatures are), NaN planted in the activations (eager's NaN pattern must come back exactly), or,
for an MLA program writing with ``index_put_``, repeated slots (the last write of a slot wins).

A result is a *mismatch* when the compiled program differs from eager beyond what eager's own
rounding explains (measured against a float64 run of the same program where it has one), or
raises where eager does not (or the reverse); *unexpected* when a form that must fuse did not,
or a look-alike fused. ``tests/test_fuzz.py`` runs a fixed seed in CI; ``scripts/fuzz.py``
runs any seed and count.
"""

import dataclasses
import random
from typing import Callable, Optional

import torch

import npu_fuse_backend as nf
from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs, rope_tokens

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


VALUE_CLASSES = ("normal", "normal", "magnitudes", "NaN")
# how far "magnitudes" scales activations / tables and scales, per dtype (float16: within its range)
MAGNITUDE = {torch.float16: (16.0, 4.0), torch.bfloat16: (1e3, 4.0), torch.float32: (1e3, 4.0)}


def with_values(kind: str, g: torch.Generator, activations: list, tables: list = ()) -> None:
    """Apply a value class to freshly drawn inputs, in place."""
    if kind == "magnitudes":
        for t in activations:
            t.mul_(MAGNITUDE[t.dtype][0])
        for t in tables:
            t.mul_(MAGNITUDE[t.dtype][1])
    elif kind == "NaN":
        for t in activations:
            flat = t.view(-1)
            flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)] = float("nan")


@dataclasses.dataclass
class Program:
    name: str
    family: str
    fn: Callable
    make_inputs: Callable[[], list]
    must_fuse: Optional[str] = None  # an op the compiled program must contain
    must_not_fuse: Optional[str] = None  # an op it must not contain (a look-alike)
    grad_args: tuple = ()  # inputs whose gradients are compared too
    exact: bool = True  # the program runs in float64 as well (the reference for rounding)
    rtol: float = 0.0  # without a float64 run: max |compiled - eager| / max |eager| allowed


@dataclasses.dataclass
class Outcome:
    program: Program
    fused: list
    near_misses: list
    mismatch: Optional[str] = None
    unexpected: Optional[str] = None
    inductors_own: Optional[str] = None  # a difference from eager that plain inductor shows too (not ours)


# -- RoPE --------------------------------------------------------------------------------------
def _rot_half_slice(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def _rot_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rot_half_split_mul(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=x.dim() - 1)
    return torch.cat([x2 * -1, x1], dim=x.dim() - 1)


def _rot_half_negative_indices(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., -h:], x[..., :-h]), -1)


def _rot_pairs_stack(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rot_pairs_unbind(x):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rot_pairs_cat(x):
    return torch.cat(((-x[..., 1::2]).unsqueeze(-1), x[..., ::2].unsqueeze(-1)), -1).flatten(-2)


def _rot_half_other_sign(x):  # -R(x): the rotation by -sin
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def _rot_pairs_odd_negated(x):  # -R(x), pairs
    return torch.stack((x[..., 1::2], -x[..., ::2]), dim=-1).flatten(-2)


def _signs(x):  # rotate_half's signs as a constant table
    h = x.shape[-1] // 2
    return torch.cat([-torch.ones(h, dtype=x.dtype), torch.ones(h, dtype=x.dtype)])


def _rot_half_roll(x):
    return torch.roll(x, x.shape[-1] // 2, -1) * _signs(x)


def _rot_half_constant_index(x):
    h = x.shape[-1] // 2
    return x[..., torch.cat([torch.arange(h, 2 * h), torch.arange(h)])] * _signs(x)


def _rot_half_in_place(x):  # LMDeploy's
    h = x.shape[-1] // 2
    out = torch.empty_like(x)
    out[..., :h] = -x[..., h:]
    out[..., h:] = x[..., :h]
    return out


def _rot_pairs_flip_literal(x):
    return (x.unflatten(-1, (-1, 2)).flip(-1) * torch.tensor([-1.0, 1.0], dtype=x.dtype)).flatten(-2)


ROTATIONS = {"half/slice": _rot_half_slice, "half/chunk": _rot_half_chunk, "half/split*-1": _rot_half_split_mul,
             "half/negative-indices": _rot_half_negative_indices, "interleave/stack": _rot_pairs_stack,
             "interleave/unbind": _rot_pairs_unbind, "interleave/cat-unsqueeze": _rot_pairs_cat,
             "half/sign on the other half": _rot_half_other_sign, "interleave/odd lane negated": _rot_pairs_odd_negated,
             "half/roll*signs": _rot_half_roll, "half/constant index*signs": _rot_half_constant_index,
             "half/written in place": _rot_half_in_place, "interleave/flip*literal signs": _rot_pairs_flip_literal}

# mutations of R that change the math: none of them is a rotation a fused op computes
LOOKALIKE_ROTATIONS = {
    "no negation": lambda x: torch.cat((x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), -1),
    "both halves negated": lambda x: torch.cat((-x[..., x.shape[-1] // 2:], -x[..., : x.shape[-1] // 2]), -1),
    "unequal halves": lambda x: torch.cat((-x[..., x.shape[-1] // 2 + 2:], x[..., : x.shape[-1] // 2 + 2]), -1),
    "rotation along dim -2": lambda x: torch.cat((-x.chunk(2, -2)[1], x.chunk(2, -2)[0]), -2),
    "pair lanes swapped": lambda x: torch.stack((-x[..., ::2], x[..., 1::2]), dim=-1).flatten(-2),
    "pairs not negated": lambda x: torch.stack((x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2),
}

ORDERS = {
    "x*c+r*s": lambda x, r, c, s: x * c + r * s,
    "c*x+r*s": lambda x, r, c, s: c * x + r * s,
    "s*r+x*c": lambda x, r, c, s: s * r + x * c,
    "r*s+c*x": lambda x, r, c, s: r * s + c * x,
}


def _randn(g, shape, dtype):
    return torch.randn(shape, generator=g).to(dtype)


def rope_program(rng: random.Random, g: torch.Generator, lookalike: bool) -> Program:
    layout = rng.choice(["BSND", "BNSD", "BNSD-view", "TND", "TD"])
    dtype = rng.choice(DTYPES)
    b, s, n, d = rng.choice([1, 2]), rng.choice([3, 5, 8]), rng.choice([2, 4]), rng.choice([8, 16, 32])
    style, order_name = rng.choice(list(ROTATIONS)), rng.choice(list(ORDERS))
    rotate, order, mutation = ROTATIONS[style], ORDERS[order_name], None
    values = rng.choice(VALUE_CLASSES)
    if lookalike:
        mutation = rng.choice([*LOOKALIKE_ROTATIONS, "another tensor rotated", "extra user of the rotation"])
        rotate = LOOKALIKE_ROTATIONS.get(mutation, rotate)
    gqa = not lookalike and layout in ("BSND", "BNSD", "BNSD-view") and rng.random() < 0.3
    from_positions = rng.random() < 0.3
    offset = rng.choice([0, 3]) if from_positions else 0
    positions = b * s if layout in ("TND", "TD") else s
    x_shape, tables = {
        "BSND": ([b, s, n, d], [[1, s, 1, d], [b, s, 1, d], [s, 1, d]]),
        "BNSD": ([b, n, s, d], [[1, 1, s, d], [b, 1, s, d], [s, d]]),
        "BNSD-view": ([b, s, n, d], [[1, 1, s, d], [s, d]]),  # x is a transposed view of BSND memory
        "TND": ([b * s, n, d], [[b * s, 1, d]]), "TD": ([b * s, d], [[b * s, d]])}[layout]
    if from_positions:  # one table row per position: the tables hold no batch dim
        tables = [t for t in tables if t[0] != b or b == 1 or layout in ("TND", "TD")]
    table_shape = rng.choice(tables)
    table_dtype = torch.float32 if dtype != torch.float32 and rng.random() < 0.2 else dtype
    heads_dim = 2 if layout in ("BSND", "BNSD-view") else 1

    def rope_of(x, cos, sin, other):
        if layout == "BNSD-view":
            x, other = x.transpose(1, 2), other.transpose(1, 2)
        rotated = rotate(other if mutation == "another tensor rotated" else x)
        out = order(x, rotated, cos, sin)
        return (out, rotated) if mutation == "extra user of the rotation" else out

    def fn(x, k, a, b_, other):
        if from_positions:  # a: [P, 2, D] cos/sin rows, b_: the positions
            rows = a[b_ + offset]
            a, b_ = rows[:, 0].reshape(table_shape), rows[:, 1].reshape(table_shape)
        out = rope_of(x, a, b_, other)
        return (out, rope_of(k, a, b_, k)) if gqa else out

    def make_inputs():
        k_shape = list(x_shape)
        if gqa:
            k_shape[heads_dim] = 1
        x, k, other = _randn(g, x_shape, dtype), _randn(g, k_shape, dtype), _randn(g, x_shape, dtype)
        if from_positions:
            rows = _randn(g, [positions + offset + 4, 2, d], table_dtype)
            with_values(values, g, [x, k, other], [rows])
            return [x, k, rows, torch.randperm(positions, generator=g), other]
        cos, sin = _randn(g, table_shape, table_dtype), _randn(g, table_shape, table_dtype)
        with_values(values, g, [x, k, other], [cos, sin])
        return [x, k, cos, sin, other]

    name = (f"rope {style} {order_name} {layout}{' GQA' if gqa else ''} {str(dtype)[6:]} tables {table_shape}"
            f"{' fp32' if table_dtype != dtype else ''}{f' from positions+{offset}' if from_positions else ''}"
            f"{'' if values == 'normal' else ', ' + values + ' values'}{f' LOOK-ALIKE: {mutation}' if mutation else ''}")
    return Program(name, "rope", fn, make_inputs, must_fuse=None if lookalike else "rotary_mul",
                   must_not_fuse="rotary_mul" if lookalike else None, grad_args=(0,) if rng.random() < 0.5 else ())


def complex_rope_program(rng: random.Random, g: torch.Generator, lookalike: bool) -> Program:
    b, s, n, d = rng.choice([1, 2]), rng.choice([3, 6]), rng.choice([2, 4]), rng.choice([8, 16])
    conj = lookalike  # the inverse rotation (as the backward computes it): fuses too, with -sin
    values = rng.choice(VALUE_CLASSES)

    def fn(x, freqs):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        f = freqs.view(1, s, 1, d // 2)
        return torch.view_as_real(pairs * (f.conj() if conj else f)).flatten(3)

    def make_inputs():
        angles = torch.rand(s, d // 2, generator=g) * 6
        x = _randn(g, [b, s, n, d], torch.float32)
        with_values(values, g, [x])
        return [x, torch.polar(torch.ones_like(angles), angles)]

    return Program(f"rope Meta complex form [{b},{s},{n},{d}]{' by conj(freqs_cis)' if conj else ''}"
                   f"{'' if values == 'normal' else ', ' + values + ' values'}", "rope",
                   fn, make_inputs, must_fuse="rotary_mul", grad_args=(0,))


def partial_rope_program(rng: random.Random, g: torch.Generator, lookalike: bool) -> Program:
    dtype = rng.choice(DTYPES)
    b, s, n, d = rng.choice([1, 2]), rng.choice([3, 5]), rng.choice([2, 3]), rng.choice([16, 32])
    r = rng.choice([4, 8, d // 2])
    start = rng.choice([0, 0, 2])
    end = start + r
    kept = rng.choice(["cat", "written back"])
    mode = rng.choice(["interleave", "interleave", "half"])
    rotate = _rot_pairs_stack if mode == "interleave" else _rot_half_slice
    mutation = None
    if lookalike:
        mutation = rng.choice(["cat order" if kept == "cat" else "written at another slice", "another slice rotated"])
    bnsd = rng.random() < 0.25  # x a BNSD view of BSND memory (not contiguous)
    values = rng.choice(VALUE_CLASSES)

    def fn(x, cos, sin):
        if bnsd:
            x = x.transpose(1, 2)
        src = x[..., start + 2:end + 2] if mutation == "another slice rotated" else x[..., start:end]
        rope = src * cos + rotate(src) * sin
        if kept == "cat":
            if mutation == "cat order":
                return torch.cat([x[..., end:], rope, x[..., :start]], -1)
            return torch.cat([x[..., :start], rope, x[..., end:]], -1)
        y = x.clone()
        if mutation == "written at another slice":
            y[..., start + 2:end + 2] = rope
        else:
            y[..., start:end] = rope
        return y

    table = [rng.choice([1, b]), 1, s, r] if bnsd else [rng.choice([1, b]), s, 1, r]

    def make_inputs():
        x, cos, sin = _randn(g, [b, s, n, d], dtype), _randn(g, table, dtype), _randn(g, table, dtype)
        with_values(values, g, [x], [cos, sin])
        return [x, cos, sin]

    name = (f"partial rope {mode} [{start}:{end}] of D={d} {kept}{' BNSD' if bnsd else ''} {str(dtype)[6:]}"
            f"{'' if values == 'normal' else ', ' + values + ' values'}{f' LOOK-ALIKE: {mutation}' if mutation else ''}")
    must = "inplace_partial_rotary_mul" if mode == "interleave" else "rotary_mul"
    return Program(name, "partial_rope", fn, make_inputs, must_fuse=None if lookalike else must,
                   must_not_fuse="inplace_partial_rotary_mul" if lookalike else None,
                   grad_args=(0,) if rng.random() < 0.5 else ())


# -- softmax backward ----------------------------------------------------------------------------
CHAINS = {
    "v1 (x2*x1)*sub": lambda g, p, s: (s * p) * (g - (g * p).sum(-1, keepdim=True)),
    "v1 sub*(x1*x2)": lambda g, p, s: (g - (p * g).sum(-1, keepdim=True)) * (p * s),
    "v2 (x1*sub)*x2": lambda g, p, s: (p * (g - (g * p).sum(-1, keepdim=True))) * s,
    "v2 (sub*x1)*x2": lambda g, p, s: ((g - (g * p).sum(dim=-1, keepdim=True)) * p) * s,
    "v2 x2*(x1*sub)": lambda g, p, s: s * (p * (g - (p * g).sum(-1, keepdim=True))),
    "decomposed": lambda g, p, s: (lambda m0: (m0 - p * m0.sum(-1, keepdim=True)) * s)(g * p),
    "fma": lambda g, p, s: (lambda m0: torch.ops.prims.fma(-p, m0.sum(-1, keepdim=True), m0) * s)(g * p),
}
LOOKALIKE_CHAINS = {
    "sum - grad": lambda g, p, s: (p * ((g * p).sum(-1, keepdim=True) - g)) * s,
    "sum over dim 0": lambda g, p, s: (p * (g - (g * p).sum(0, keepdim=True))) * s,
    "sum over every dim": lambda g, p, s: (p * (g - (g * p).sum())) * s,
    "another x1 in the second mul": lambda g, p, s: (g * (g - (g * p).sum(-1, keepdim=True))) * s,
    "extra user of the sum": lambda g, p, s: ((p * (g - (t := (g * p).sum(-1, keepdim=True)))) * s, t),
}


def softmax_program(rng: random.Random, g: torch.Generator, lookalike: bool) -> Program:
    dtype = rng.choice(DTYPES)
    rank = rng.choice([1, 2, 3, 4])
    shape = [rng.choice([2, 3]) for _ in range(rank - 1)] + [rng.choice([8, 16, 64])]
    scale_kind = rng.choice(["python", "0-d", "(1,)", "full", "higher-rank one-element"])
    form = rng.choice(list(CHAINS))
    chain = CHAINS[form]
    mutation = None
    if lookalike:
        mutation = rng.choice([*LOOKALIKE_CHAINS, "fp16 scale 1e6", "scale over the last dim only"])
        chain = LOOKALIKE_CHAINS.get(mutation, chain)
        if mutation == "fp16 scale 1e6":
            dtype, scale_kind = torch.float16, "python"
        if mutation == "scale over the last dim only":
            scale_kind = "last dim"
        if mutation in ("sum over dim 0", "scale over the last dim only") and rank == 1:
            shape = [2, *shape]  # of a 1-D grad, dim 0 is its last dim and a last-dim scale is its shape
    value = 1e6 if mutation == "fp16 scale 1e6" else rng.choice([0.125, 0.5, 3.0])
    values = "normal" if mutation == "fp16 scale 1e6" else rng.choice(VALUE_CLASSES)

    def make_inputs():
        grad = _randn(g, shape, dtype) * (1e-3 if mutation == "fp16 scale 1e6" else 1)
        probs = torch.randn(shape, generator=g).softmax(-1).to(dtype)
        scales = {"0-d": lambda: torch.tensor(value, dtype=dtype), "(1,)": lambda: torch.tensor([value], dtype=dtype),
                  "full": lambda: torch.rand(shape, generator=g).to(dtype),
                  "higher-rank one-element": lambda: torch.full([1] * (rank + 1), value, dtype=dtype),
                  "last dim": lambda: torch.rand(shape[-1:], generator=g).to(dtype)}
        scale = [scales[scale_kind]()] if scale_kind != "python" else []
        with_values(values, g, [grad], scale)
        return [grad, probs] + scale

    def fn(grad, probs, *scale):
        return chain(grad, probs, scale[0] if scale else value)

    name = (f"softmax backward {form} scale {scale_kind} {shape} {str(dtype)[6:]}"
            f"{'' if values == 'normal' else ', ' + values + ' values'}{f' LOOK-ALIKE: {mutation}' if mutation else ''}")
    grad_args = (0,) if form != "fma" and rng.random() < 0.3 else ()  # prims.fma has no autograd
    # in training the forward keeps the chain's intermediates for the backward: a near-miss there
    return Program(name, "softmax_grad", fn, make_inputs,
                   must_fuse=None if lookalike or grad_args else "softmax_grad_ext",
                   must_not_fuse="softmax_grad_ext" if lookalike else None, grad_args=grad_args)


def attention_program(rng: random.Random, g: torch.Generator, lookalike: bool) -> Program:
    """Training attention: AOTAutograd writes softmax backward as ``_softmax_backward_data * scale``, or,
    with the scale inside the matmul (``baddbmm``'s alpha, q and k each scaled by its square root as
    SDPA's math decomposition does), both matmuls of the softmax backward times one scale. The
    look-alike scales q only (Whisper, BART): the key's gradient reads the softmax backward unscaled.
    A causal mask may be filled into the scores (nanoGPT): its backward zeros the softmax backward's
    masked places before the scale."""
    dtype = rng.choice([torch.float32, torch.bfloat16])
    scaling = "q only" if lookalike else rng.choice(["mul", "div", "baddbmm alpha", "q and k by its root"])
    d = rng.choice([8, 16])
    values = rng.choice(VALUE_CLASSES)
    masked = rng.random() < 0.5

    def fn(q, k, v):
        if scaling == "baddbmm alpha":
            q3, k3 = q.flatten(0, 1), k.flatten(0, 1)
            zeros = torch.zeros(q3.shape[0], q3.shape[1], k3.shape[1], dtype=q.dtype)
            scores = torch.baddbmm(zeros, q3, k3.transpose(1, 2), beta=0.0, alpha=d ** -0.5).view(
                *q.shape[:2], q.shape[2], k.shape[2])
        elif scaling == "q and k by its root":
            scores = (q * d ** -0.25) @ (k * d ** -0.25).transpose(-1, -2)
        elif scaling == "q only":
            scores = (q * d ** -0.5) @ k.transpose(-1, -2)
        else:
            scores = q @ k.transpose(-1, -2)
            scores = scores * (d ** -0.5) if scaling == "mul" else scores / d ** 0.5
        if masked:
            scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    def make_inputs():
        q, k, v = (_randn(g, [2, 2, 8, d], dtype) for _ in range(3))
        if values == "magnitudes":
            q.mul_(4), k.mul_(4), v.mul_(MAGNITUDE[dtype][0])  # scores up to 16x: softmax near saturation
        else:
            with_values(values, g, [v])
        return [q, k, v]

    mask = ", causal mask filled in" if masked else ""
    return Program(f"training attention ({scaling} by scale{mask}) {str(dtype)[6:]}"
                   f"{'' if values == 'normal' else ', ' + values + ' values'}", "softmax_grad", fn, make_inputs,
                   must_fuse=None if lookalike else "softmax_grad_ext",
                   must_not_fuse="softmax_grad_ext" if lookalike else None, grad_args=(0, 1, 2))


# -- MLA prologue ------------------------------------------------------------------------------------
MLA = MLAConfig(heads=2)


def mla_program(rng: random.Random, g: torch.Generator, lookalike: bool) -> Program:
    quant = rng.random() < 0.3
    style = rng.choice(["half", "interleave"])
    write = rng.choice(["index_put_", "index_copy_", "scatter_"])
    tokens = rng.choice([2, 3, 4])
    mutation = rng.choice(["accumulate=True", "RMSNorm over dim 0"]) if lookalike else None
    out_of_range = not lookalike and rng.random() < 0.25
    if mutation == "accumulate=True":
        write = "index_put_"
    # repeated slots only where eager defines the result (index_put_: the last write wins); NaN not
    # into w8a8 programs, whose quantization turns NaN into an unspecified int8
    classes = [*VALUE_CLASSES, *(["repeated slots"] * 4 if write == "index_put_" and not out_of_range else [])]
    values = rng.choice([c for c in classes if not (quant and c == "NaN")])
    cfg = dataclasses.replace(MLA, rope_style=style)

    class Variant(DeepSeekMLA):
        def forward(self, x, cos, sin, slot_mapping, kv_cache, context_slots):
            c = self.cfg
            q_nope, q_pe, kv_c, k_pe = self.projections(x)
            if mutation == "RMSNorm over dim 0":
                xf = kv_c.float()
                kv_c = self.kv_a_layernorm.weight * (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + c.eps)
                                                     ).to(kv_c.dtype)
            else:
                kv_c = self.kv_a_layernorm(kv_c)
            q_pe, k_pe = rope_tokens(q_pe, cos, sin, c.rope_style), rope_tokens(k_pe, cos, sin, c.rope_style)
            q_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            flat, rows = kv_cache.view(-1, c.kv_lora + c.rope), torch.cat([kv_c, k_pe], dim=-1)
            if write == "index_copy_":
                flat.index_copy_(0, slot_mapping, rows)
            elif write == "scatter_":
                flat.scatter_(0, slot_mapping.unsqueeze(-1).expand(-1, rows.shape[-1]), rows)
            else:
                flat.index_put_((slot_mapping,), rows, accumulate=mutation == "accumulate=True")
            return torch.cat([q_nope, q_pe], dim=-1)

    seed = rng.randrange(1 << 30)
    torch.manual_seed(seed)
    model = Variant(cfg, quant=quant).to(torch.bfloat16).eval()

    def make_inputs():
        x, cos, sin, slots, context = mla_decode_inputs(cfg, tokens, step=1, seed=seed)
        if out_of_range:
            slots = slots.clone()
            slots[-1] = cfg.num_blocks * cfg.block_size
        if values == "repeated slots":
            slots = slots.clone()
            slots[-1] = slots[0]  # two tokens write one slot: the later one's row stays
        elif values in ("magnitudes", "NaN"):
            with_values(values, g, [x])
        cache = torch.randn(cfg.num_blocks, cfg.block_size, 1, cfg.kv_lora + cfg.rope, generator=g).to(torch.bfloat16)
        return [x, cos, sin, slots, cache, context]

    name = (f"MLA prologue {'w8a8' if quant else 'bf16'} {style} rope, {write} cache write, T={tokens}"
            f"{', a slot out of range' if out_of_range else ''}{'' if values == 'normal' else ', ' + values}"
            f"{f' LOOK-ALIKE: {mutation}' if mutation else ''}")
    return Program(name, "mla_preprocess", lambda *a: model(*a), make_inputs,
                   must_fuse=None if lookalike else "mla_preprocess",
                   must_not_fuse="mla_preprocess" if lookalike else None, exact=False, rtol=0.05 if quant else 0.02)


GENERATORS = {"rope": (rope_program, 6), "complex": (complex_rope_program, 1), "partial": (partial_rope_program, 3),
              "softmax": (softmax_program, 4), "attention": (attention_program, 1), "mla": (mla_program, 1)}


def generate(seed: int, index: int, families: Optional[list] = None, lookalike_share: float = 0.35) -> Program:
    """Program ``index`` of ``seed``: the same pair always gives the same program and inputs."""
    rng = random.Random(f"{seed}/{index}")
    names = [n for n in GENERATORS if families is None or n in families]
    make, _ = GENERATORS[rng.choices(names, weights=[GENERATORS[n][1] for n in names])[0]]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return make(rng, g, lookalike=rng.random() < lookalike_share)


# -- running and comparing ------------------------------------------------------------------------------
def _tensors(tree) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _run(fn, inputs: list, grad_args: tuple, dtype=None):
    """(outputs, the inputs after the call, grads), or the exception it raised."""
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    if dtype is not None:
        inputs = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else
                  t.to(torch.complex128) if isinstance(t, torch.Tensor) and t.is_complex() else t for t in inputs]
    for i in grad_args:
        inputs[i] = inputs[i].detach().requires_grad_()
    try:
        with torch.set_grad_enabled(bool(grad_args)):
            out = fn(*inputs)
            grads = []
            if grad_args:
                outs = [o for o in _tensors(out) if o.requires_grad]
                weights = [torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape) for o in outs]
                grads = list(torch.autograd.grad(outs, [inputs[i] for i in grad_args], weights))
    except Exception as exc:  # an outcome to compare
        return exc
    return [t.detach() for t in _tensors(out)], [t.detach() for t in _tensors(inputs)], [t.detach() for t in grads]


def _compare(program: Program, eager, compiled, exact) -> Optional[str]:
    if isinstance(eager, Exception) or isinstance(compiled, Exception):
        if isinstance(eager, Exception) and isinstance(compiled, Exception):
            return None
        if isinstance(eager, Exception):
            return f"eager raises ({type(eager).__name__}: {eager}) and the compiled program does not"
        return f"the compiled program raises ({type(compiled).__name__}: {compiled}) and eager does not"
    for what, e_list, c_list, x_list in zip(("output", "input after the call", "gradient"), eager, compiled,
                                           exact or (None, None, None)):
        if len(e_list) != len(c_list):
            return f"{len(c_list)} {what}s, eager gives {len(e_list)}"
        for i, (e, c) in enumerate(zip(e_list, c_list)):
            if e.shape != c.shape or e.dtype != c.dtype:
                return f"{what} {i}: {list(c.shape)} {c.dtype}, eager {list(e.shape)} {e.dtype}"
            if not e.is_floating_point() and not e.is_complex():
                if not torch.equal(e, c):
                    return f"{what} {i}: integer values differ"
                continue
            e64, c64 = e.to(torch.complex128 if e.is_complex() else torch.float64), \
                c.to(torch.complex128 if e.is_complex() else torch.float64)
            if not torch.equal(e64.isfinite(), c64.isfinite()):
                return f"{what} {i}: finite where eager is not (or the reverse)"
            finite = e64.isfinite()
            e64, c64 = e64[finite], c64[finite]
            if not e64.numel():
                continue
            scale = e64.abs().max().item()
            if x_list is not None:
                x64 = x_list[i].to(e64.dtype)[finite]
                err_c, err_e = (c64 - x64).abs().max().item(), (e64 - x64).abs().max().item()
                floor = 1e-5 if e.dtype in (torch.float32, torch.complex64) else 1e-3
                if err_c > 2 * err_e + floor * scale:
                    return (f"{what} {i}: max error {err_c:.3g} against float64, eager's own {err_e:.3g} "
                            f"(largest value {scale:.3g})")
            elif (c64 - e64).abs().max().item() > program.rtol * scale:
                return f"{what} {i}: differs from eager by {(c64 - e64).abs().max().item():.3g} (largest {scale:.3g})"
    return None


def run_program(program: Program, fallback: str = "aot_eager") -> Outcome:
    inputs = program.make_inputs()
    eager = _run(program.fn, inputs, program.grad_args)
    exact = _run(program.fn, inputs, program.grad_args, torch.float64) if program.exact else None
    if isinstance(exact, Exception):
        exact = None
    torch._dynamo.reset()
    nf.clear_reports()
    with nf.config.patch(fallback=fallback):
        compiled = _run(torch.compile(program.fn, backend="npu_fuse"), inputs, program.grad_args)
    reports = nf.get_reports()
    fused = [m.op for r in reports for m in r.matches]
    misses = [f"{n.family}: {n.reason}" for r in reports for n in r.near_misses]
    outcome = Outcome(program, fused, misses, mismatch=_compare(program, eager, compiled, exact))
    if outcome.mismatch and fallback == "inductor":  # inductor's own numerics (an fp16 overflow it avoids)?
        torch._dynamo.reset()
        plain = _run(torch.compile(program.fn, backend="inductor"), inputs, program.grad_args)
        if _compare(program, eager, plain, exact) is not None and _compare(program, plain, compiled, None) is None:
            outcome.inductors_own, outcome.mismatch = outcome.mismatch, None
    if program.must_fuse and program.must_fuse not in fused and fallback == "aot_eager":
        outcome.unexpected = f"{program.must_fuse} did not fuse: {misses or 'no near-miss'}"
    if program.must_not_fuse and program.must_not_fuse in fused:
        outcome.unexpected = f"the look-alike fused into {program.must_not_fuse}"
    return outcome


@dataclasses.dataclass
class Summary:
    outcomes: list

    @property
    def mismatches(self) -> list:
        return [o for o in self.outcomes if o.mismatch]

    @property
    def unexpected(self) -> list:
        return [o for o in self.outcomes if o.unexpected]

    def line(self) -> str:
        fused = sum(bool(o.fused) for o in self.outcomes)
        refused = sum(not o.fused and bool(o.near_misses) for o in self.outcomes)
        inductors = sum(bool(o.inductors_own) for o in self.outcomes)
        return (f"{len(self.outcomes)} programs: {fused} fused, {refused} refused (near-misses only), "
                f"{len(self.outcomes) - fused - refused} untouched, {len(self.mismatches)} mismatches, "
                f"{len(self.unexpected)} unexpected" +
                (f" ({inductors} differ from eager as plain inductor does)" if inductors else ""))

    def details(self) -> str:
        return "\n".join(f"  {o.program.name}: {o.mismatch or ''}{' ' if o.mismatch and o.unexpected else ''}"
                         f"{o.unexpected or ''}" for o in self.mismatches + self.unexpected)


def fuzz(seed: int, count: int, fallback: str = "aot_eager", families: Optional[list] = None,
         on_outcome: Optional[Callable] = None) -> Summary:
    outcomes = []
    for index in range(count):
        outcome = run_program(generate(seed, index, families), fallback)
        outcomes.append(outcome)
        if on_outcome:
            on_outcome(index, outcome)
    return Summary(outcomes)
