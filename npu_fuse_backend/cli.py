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


def _max_diff(got: list, expected: list) -> float:
    pairs = [(g, e) for g_args, e_args in zip(got, expected) for g, e in zip(g_args, e_args)
             if isinstance(g, torch.Tensor) and g.is_floating_point()]
    return max((g.float() - e.float()).abs().max().item() for g, e in pairs)


def run_demo(dtype: torch.dtype, repeat: int, layers: int, seq: int, out=sys.stdout) -> list:
    import npu_fuse_backend as nf
    from npu_fuse_backend.demo_models import clone_calls, demo_cases

    rows = []
    for case in demo_cases(layers=layers, seq=seq):
        torch.manual_seed(0)
        case_dtype = case.dtype or dtype
        model = case.make().to(case_dtype).eval()
        steps = case.inputs(case_dtype)  # one call, or a few decode steps sharing a cache
        eager_steps, fused_steps = clone_calls(steps), clone_calls(steps)
        torch._dynamo.reset()
        nf.clear_reports()
        fused = torch.compile(model, backend="npu_fuse")
        with torch.no_grad():
            expected = [(model(*args),) for args in eager_steps]
            got = [(fused(*args),) for args in fused_steps]
        counts = collections.Counter()
        near_misses = []
        for report in nf.get_reports():
            counts.update(report.fused_counts())
            near_misses += report.near_misses
        torch._dynamo.reset()
        inductor = torch.compile(model, backend="inductor")
        last = clone_calls(steps[-1:])[0]
        rows.append({
            "model": case.name + ("" if case_dtype == dtype else f" ({str(case_dtype).replace('torch.', '')})"),
            "fused": ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "-",
            "near_misses": len(near_misses),
            # outputs of every step, and every input the model mutates (the KV cache)
            "max_abs_diff": _max_diff(got + fused_steps, expected + eager_steps),
            "eager_ms": _time_ms(model, last, repeat),
            "inductor_ms": _time_ms(inductor, last, repeat),
            "npu_fuse_ms": _time_ms(fused, last, repeat),
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
