"""What the fused ops share: their dtypes, the RoPE rotation (vectorised), the compute dtype, device
and layout rules."""

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the float dtypes the fused ops take
HALF_DTYPES = (torch.float16, torch.bfloat16)  # computed in float32 and rounded once
ROTARY_MODES = ("half", "interleave")


def rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    """R(x): half: cat(-x2, x1) of the two halves; interleave: (x0, x1) -> (-x1, x0) per pair."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


SMALL_MATMUL_ELEMENTS = 1 << 16  # a 16-bit matmul whose operands hold at most this many runs in float32


def half_matmul(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``op(a, b)`` (``torch.mm`` or ``torch.bmm``) of 16-bit tensors: products accumulated in float32
    and rounded once, as oneDNN's 16-bit kernels and the NPU's cube unit compute them. Small CPU
    operands (both of one 16-bit dtype, at most ``SMALL_MATMUL_ELEMENTS`` together) are multiplied in
    float32: oneDNN builds a kernel for each new shape (~0.7 ms), more than such a product costs.
    Anything else (other dtypes, a mismatch eager refuses) is ``op(a, b)`` itself."""
    if a.dtype in HALF_DTYPES and b.dtype == a.dtype and a.device.type == b.device.type == "cpu" \
            and a.numel() + b.numel() <= SMALL_MATMUL_ELEMENTS:
        return op(a.float(), b.float()).to(a.dtype)
    return op(a, b)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 compute in fp32 and round once, as the NPU kernels do."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def check_one_device(op: str, tensors: dict) -> None:
    """Raise ValueError unless every tensor is on the first one's device, as eager ops require
    (a CPU 0-d tensor goes with any device, as in eager arithmetic). A direct call with one
    argument on ``meta`` would otherwise run the fake kernel and return garbage."""
    (first, anchor), *rest = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in rest:
        if t.device != anchor.device and not (t.dim() == 0 and t.device.type == "cpu"):
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {anchor.device}; "
                             "all tensors must be on one device")


def check_rotation_args(op: str, x: torch.Tensor, tables: dict, x_name: str = "x",
                        layout: str = "BSND or BNSD") -> None:
    """The contract of the full-width RoPE ops (rotary_mul, interleave_rope and their backwards):
    raise ValueError naming the op, the argument and the first rule the arguments break. ``tables``
    are cos and sin by the op's names for them; ``x_name`` is what the op calls the rotated tensor."""
    check_one_device(op, {x_name: x, **tables})
    if x.dim() != 4:
        raise ValueError(f"{op}: {x_name} must be 4-D ({layout}), got {x.dim()}-D shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {x_name} dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if any(t.dtype != x.dtype for t in tables.values()):
        raise ValueError(f"{op}: {', '.join(tables)} and {x_name} must share one dtype, got {x_name} {x.dtype}, "
                         + ", ".join(f"{name} {t.dtype}" for name, t in tables.items()))
    head_dim = x.shape[-1]
    if head_dim % 2 != 0:
        raise ValueError(f"{op}: head dim (last dim of {x_name}) must be even, got {head_dim}")
    for arg, table in tables.items():
        if table.dim() != 4:
            raise ValueError(f"{op}: {arg} must be 4-D, got {table.dim()}-D shape {tuple(table.shape)}")
        if table.shape[-1] != head_dim:
            raise ValueError(f"{op}: last dim of {arg} must equal head dim {head_dim} (full width), "
                             f"got {table.shape[-1]}")
        for i in range(3):
            if table.shape[i] != 1 and table.shape[i] != x.shape[i]:
                raise ValueError(f"{op}: {arg} shape {tuple(table.shape)} does not broadcast to "
                                 f"{x_name} shape {tuple(x.shape)} (dim {i})")


def like(result: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """result laid out as ``torch.empty_like(layout)`` (the kernels keep their input's layout)."""
    out = torch.empty_like(layout, dtype=result.dtype)
    if all(size == 1 or a == b for size, a, b in zip(out.shape, out.stride(), result.stride())):
        return result
    return out.copy_(result)
