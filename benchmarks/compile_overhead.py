"""Compile-time cost of the fusion passes against the whole compile.

Goal: passes <= 2% of compile time, growing linearly with node count.
Run: python benchmarks/compile_overhead.py [--layers 2 8 32] [--backend inductor]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.demo_models import DecoderConfig, LlamaModel  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--fallback", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--train", action="store_true", help="compile forward + backward")
    args = parser.parse_args()
    rows = []
    for layers in args.layers:
        torch.manual_seed(0)
        model = LlamaModel(DecoderConfig(layers=layers))
        x = torch.randn(2, 64, 256, requires_grad=args.train)
        pos = torch.arange(64).expand(2, 64)
        torch._dynamo.reset()
        nf.clear_reports()
        # cold compiles: inductor's caches would otherwise shrink compile time on reruns
        with nf.config.patch(fallback=args.fallback), torch.set_grad_enabled(args.train), \
                torch._inductor.config.patch(force_disable_caches=True):
            start = time.perf_counter()
            out = torch.compile(model, backend="npu_fuse")(x, pos)
            if args.train:
                out.sum().backward()
            compile_s = time.perf_counter() - start
        reports = nf.get_reports()
        pass_s = sum(r.pass_seconds for r in reports)
        nodes = sum(r.node_count for r in reports)
        rows.append({"layers": layers, "graphs": len(reports), "aten_nodes": nodes,
                     "fused": sum(len(r.matches) for r in reports),
                     "compile_s": compile_s, "passes_ms": pass_s * 1e3,
                     "passes_%": 100 * pass_s / compile_s, "us_per_node": 1e6 * pass_s / nodes})
        print(rows[-1], flush=True)
    path = write_results(
        f"compile_overhead_{args.fallback}{'_train' if args.train else ''}", rows,
        f"Llama-style decoder stacks (hidden 256, 4 heads, GQA 2 kv heads), fallback {args.fallback}, "
        f"{'training (fw+bw)' if args.train else 'inference'}. compile_s is the first call's wall time "
        "(Dynamo + AOTAutograd + passes + lowering), inductor's caches disabled. Goal: passes_% <= 2 and "
        "us_per_node flat.",
        table(rows, list(rows[0])))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
