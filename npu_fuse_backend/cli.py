"""``npu-fuse``: the command line.

``npu-fuse demo`` compiles the built-in small models with npu_fuse and prints what
fused, the numerics against eager, and eager / inductor / npu_fuse latency.
"""

import argparse
import collections
import sys

import torch

from .timing import median_ms


def _time_ms(fn, args, repeat: int) -> float:
    with torch.no_grad():
        fn(*args)  # warm-up (and compile)
        return median_ms(fn, args, repeat)


def run_demo(dtype: torch.dtype, repeat: int, layers: int, seq: int, out=sys.stdout) -> list:
    import npu_fuse_backend as nf
    from npu_fuse_backend.demo_models import demo_cases

    rows = []
    for case in demo_cases(layers=layers, seq=seq):
        torch.manual_seed(0)
        model = case.make().to(dtype).eval()
        args = case.inputs(dtype)
        with torch.no_grad():
            expected = model(*args)
        torch._dynamo.reset()
        nf.clear_reports()
        fused = torch.compile(model, backend="npu_fuse")
        with torch.no_grad():
            got = fused(*args)
        counts = collections.Counter()
        near_misses = []
        for report in nf.get_reports():
            counts.update(report.fused_counts())
            near_misses += report.near_misses
        torch._dynamo.reset()
        inductor = torch.compile(model, backend="inductor")
        rows.append({
            "model": case.name,
            "fused": ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "-",
            "near_misses": len(near_misses),
            "max_abs_diff": (got.float() - expected.float()).abs().max().item(),
            "eager_ms": _time_ms(model, args, repeat),
            "inductor_ms": _time_ms(inductor, args, repeat),
            "npu_fuse_ms": _time_ms(fused, args, repeat),
        })
    _print_table(rows, dtype, out)
    return rows


def _print_table(rows: list, dtype: torch.dtype, out) -> None:
    from npu_fuse_backend import config

    print(f"npu_fuse demo ({dtype}, CPU tensors: lowering = fallback {config.fallback}, "
          f"torch {torch.__version__})", file=out)
    header = ("model", "fused ops", "near-misses", "max |diff| vs eager", "eager ms", "inductor ms",
              "npu_fuse ms")
    lines = [header] + [(r["model"], r["fused"], str(r["near_misses"]), f"{r['max_abs_diff']:.3g}",
                         f"{r['eager_ms']:.2f}", f"{r['inductor_ms']:.2f}", f"{r['npu_fuse_ms']:.2f}")
                        for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for i, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="npu-fuse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile the built-in models and print what fused")
    demo.add_argument("--dtype", choices=DTYPES, default="float32")
    demo.add_argument("--repeat", type=int, default=20, help="timed runs per model (median shown)")
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--seq", type=int, default=128)
    demo.add_argument("--fallback", choices=("inductor", "aot_eager"), default=None,
                      help="lowering without an NPU (default: config.fallback)")
    args = parser.parse_args(argv)
    from npu_fuse_backend import config

    patches = {"fallback": args.fallback} if args.fallback else {}
    with config.patch(**patches):
        run_demo(DTYPES[args.dtype], args.repeat, args.layers, args.seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
