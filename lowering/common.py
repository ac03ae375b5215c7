"""What the fused ops share: the RoPE rotation (vectorised), the compute dtype, device and layout rules."""

import torch

ROTARY_MODES = ("half", "interleave")


def rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    """R(x): half: cat(-x2, x1) of the two halves; interleave: (x0, x1) -> (-x1, x0) per pair."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 compute in fp32 and round once, as the NPU kernels do."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_one_device(op: str, tensors: dict) -> None:
    """Raise ValueError unless every tensor is on the first one's device, as eager ops require
    (a CPU 0-d tensor goes with any device, as in eager arithmetic). A direct call with one
    argument on ``meta`` would otherwise run the fake kernel and return garbage."""
    (first, anchor), *rest = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in rest:
        if t.device != anchor.device and not (t.dim() == 0 and t.device.type == "cpu"):
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {anchor.device}; "
                             "all tensors must be on one device")


def like(result: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """result laid out as ``torch.empty_like(layout)`` (the kernels keep their input's layout)."""
    out = torch.empty_like(layout, dtype=result.dtype)
    if all(size == 1 or a == b for size, a, b in zip(out.shape, out.stride(), result.stride())):
        return result
    return out.copy_(result)
