"""The rotation both RoPE ops share, written once in vectorised torch ops."""

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
