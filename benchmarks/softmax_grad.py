"""softmax_grad_ext reference kernel vs the unfused eager chain, side by side.

Run: python benchmarks/softmax_grad.py [--shape 8 32 1024 1024 --dtype bfloat16]
(the default shape is the largest of that family that fits this 24 GiB machine
comfortably with the chain's intermediates: [4, 32, 1024, 1024] bf16).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

from npu_fuse_backend.timing import interleaved_ms  # noqa: E402

import npu_fuse  # noqa: E402,F401  (defines the npu_fuse:: ops)


def unfused(g, p, s):
    return (p * (g - (g * p).sum(-1, keepdim=True))) * s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[4, 32, 1024, 1024])
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.randn(args.shape, dtype=dtype)
    p = torch.randn(args.shape).softmax(-1).to(dtype)
    s = torch.tensor(0.125, dtype=dtype)
    fns = {"unfused_eager": unfused, "softmax_grad_ext_reference": torch.ops.npu_fuse.softmax_grad_ext}
    with torch.no_grad():
        exact = unfused(g.double(), p.double(), s.double())
        err = {k: (f(g, p, s).double() - exact).abs().max().item() for k, f in fns.items()}
        ms = interleaved_ms(fns, (g, p, s), args.rounds, args.repeat)
    rows = [{"impl": k, "ms": ms[k], "max_err_vs_fp64": err[k]} for k in fns]
    rows.append({"impl": "ratio fused/unfused", "ms": ms["softmax_grad_ext_reference"] / ms["unfused_eager"],
                 "max_err_vs_fp64": float("nan")})
    print(rows)
    path = write_results("softmax_grad", rows,
                         f"shape {args.shape} {args.dtype}, scalar x2; CPU reference kernel (fp32 compute, "
                         "one rounding) vs the eager chain in the input dtype.", table(rows, list(rows[0])))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
