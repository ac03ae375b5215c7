"""Fallback runtime: npu_fuse (inductor lowering) vs plain inductor vs eager.

Goal: npu_fuse / inductor <= 1.0 on the demo models: being a drop-in costs nothing.
Run: python benchmarks/fallback_runtime.py [--rounds 5 --repeat 20]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

from npu_fuse_backend.timing import interleaved_ms  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.demo_models import clone_calls, demo_cases  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    rows = []
    for case in demo_cases(layers=args.layers, seq=args.seq):
        for dtype in [case.dtype] if case.dtype else [torch.float32, torch.bfloat16]:
            torch.manual_seed(0)
            model = case.make().to(dtype).eval()
            inputs = case.inputs(dtype)[-1]  # the last call of the case (a decode step for MLA)
            torch._dynamo.reset()
            nf.clear_reports()
            with torch.no_grad():
                fns = {"eager": model,
                       "inductor": torch.compile(model, backend="inductor"),
                       "npu_fuse": torch.compile(model, backend="npu_fuse")}
                expected = model(*clone_calls([inputs])[0])
                diffs = {k: (f(*clone_calls([inputs])[0]).float() - expected.float()).abs().max().item()
                         for k, f in fns.items()}
                ms = interleaved_ms(fns, inputs, args.rounds, args.repeat)
            fused = sum(len(r.matches) for r in nf.get_reports())
            rows.append({"model": case.name, "dtype": str(dtype).replace("torch.", ""), "fused": fused,
                         "eager_ms": ms["eager"], "inductor_ms": ms["inductor"], "npu_fuse_ms": ms["npu_fuse"],
                         "npu_fuse/inductor": ms["npu_fuse"] / ms["inductor"],
                         "max_diff_vs_eager": diffs["npu_fuse"]})
            print(rows[-1], flush=True)
    path = write_results(
        "fallback_runtime", rows,
        f"Inference, {args.layers} layers, batch 2, seq {args.seq}; medians of {args.rounds} interleaved "
        f"rounds x {args.repeat} runs. Goal: npu_fuse/inductor <= 1.0 (fused ops are lowered through "
        "their decompositions, so inductor sees the same math).",
        table(rows, list(rows[0])))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
