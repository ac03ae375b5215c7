"""inplace_partial_rotary_mul reference kernel vs the unfused eager partial RoPE.

Run: python benchmarks/partial_rope.py [--shape 4 2048 32 128 --slice 0 64]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

from npu_fuse_backend.timing import interleaved_ms  # noqa: E402

from npu_fuse.ops import inplace_partial_rotary_mul  # noqa: E402


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def unfused(x, cos, sin, start, end):
    """GPT-J style: rotate the slice, cat it with the untouched parts."""
    part = x[..., start:end]
    return torch.cat([x[..., :start], part * cos + rotate_every_two(part) * sin, x[..., end:]], dim=-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[4, 2048, 32, 128])
    parser.add_argument("--slice", type=int, nargs=2, default=[0, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    b, s, n, d = args.shape
    start, end = args.slice
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(b, s, n, d, dtype=dtype)
        cos, sin = (torch.randn(b, s, 1, end - start, dtype=dtype) for _ in range(2))
        work = x.clone()

        def fused(x, cos, sin):
            inplace_partial_rotary_mul(work, cos, sin, partial_slice=[start, end])  # in place: no new tensor

        fns = {"unfused_eager": lambda x, c, s_: unfused(x, c, s_, start, end), "inplace_reference": fused}
        ms = interleaved_ms(fns, (x, cos, sin), args.rounds, args.repeat)
        check = x.clone()
        inplace_partial_rotary_mul(check, cos, sin, partial_slice=[start, end])
        exact = unfused(x.double(), cos.double(), sin.double(), start, end)
        rows.append({"dtype": str(dtype).replace("torch.", ""), "unfused_ms": ms["unfused_eager"],
                     "inplace_ms": ms["inplace_reference"], "inplace/unfused": ms["inplace_reference"] / ms["unfused_eager"],
                     "max_err_inplace": (check.double() - exact).abs().max().item(),
                     "max_err_unfused": (unfused(x, cos, sin, start, end).double() - exact).abs().max().item()})
        print(rows[-1], flush=True)
    path = write_results("partial_rope", rows,
                         f"x [{b}, {s}, {n}, {d}] BSND, slice [{start}, {end}], r1/r2 BS1D; CPU, reference kernel "
                         "(fp32 compute, one rounding, writes only the slice) vs eager slice+rotate+cat.",
                         table(rows, list(rows[0])))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
