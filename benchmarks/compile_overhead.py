"""Compile-time cost of the fusion passes against the whole compile, and against inductor's pattern
matcher doing one RoPE pattern's work on the same graph.

Goals: passes <= 2% of compile time, growing linearly with node count; and the passes (all of them,
the RoPE recognizer and translation validation included) at most 0.1x the time inductor's
``PatternMatcherPass`` takes to apply one registered RoPE replacement (``register_replacement`` of
Llama's ``q * cos + rotate_half(q) * sin`` by ``rotary_mul``) to the same aten graph.

Run: python benchmarks/compile_overhead.py [--layers 2 8 32] [--fallback inductor] [--train]
     python benchmarks/compile_overhead.py --versus-pattern-matcher [--layers 2 8 32] [--repeat 5] [--disable rms_norm]
"""

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.demo_models import DecoderConfig, LlamaModel, rotate_half  # noqa: E402
from npu_fuse_backend.fusion import PassManager  # noqa: E402
from npu_fuse_backend.validate import forget_shown_equal  # noqa: E402


def _model(layers: int):
    torch.manual_seed(0)
    return LlamaModel(DecoderConfig(layers=layers)), torch.randn(2, 64, 256), torch.arange(64).expand(2, 64)


def compile_rows(args) -> list:
    rows = []
    for layers in args.layers:
        model, x, pos = _model(layers)
        x.requires_grad_(args.train)
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
    return rows


def aten_graph(layers: int):
    """The inference aten graph the passes see (AOTAutograd's, before any pass)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(copy.deepcopy(gm))
        return gm

    model, x, pos = _model(layers)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=keep))(x, pos)
    return graphs[0]


def rope_pattern_pass():
    """Inductor's pattern matcher with one RoPE replacement registered (the tracing of the pattern at
    registration is not counted: inductor does it once per process)."""
    from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

    def search(q, cos, sin):
        return q * cos + rotate_half(q) * sin

    def replace(q, cos, sin):
        return torch.ops.npu_fuse.rotary_mul(q, cos, sin, "half")

    patterns = PatternMatcherPass()
    example = [torch.empty(2, 4, 64, 64), torch.empty(2, 1, 64, 64), torch.empty(2, 1, 64, 64)]
    register_replacement(search, replace, example, fwd_only, patterns)
    return patterns


def versus_rows(args) -> list:
    patterns = rope_pattern_pass()
    rows = []
    for layers in args.layers:
        gm = aten_graph(layers)
        ours, theirs, fused, replaced = [], [], 0, 0
        for _ in range(args.repeat):  # interleaved, so that load on the machine hits both alike
            mine = copy.deepcopy(gm)
            forget_shown_equal()  # every rewrite validated again, as in a fresh process
            gc.collect()  # (each side from a collected heap: neither collects the garbage the other left)
            with nf.config.patch(translation_validation=True, disabled_fusions=args.disable):
                start = time.process_time()
                report = PassManager()(mine)
                ours.append(time.process_time() - start)
            fused = len(report.matches)
            other = copy.deepcopy(gm)
            gc.collect()
            start = time.process_time()
            replaced = patterns.apply(other.graph)
            theirs.append(time.process_time() - start)
        nodes = len(gm.graph.nodes)
        ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
        rows.append({"layers": layers, "aten_nodes": nodes, "npu_fuse_fused": fused, "pattern_matcher_replaced":
                     replaced, "npu_fuse_ms": ours_s * 1e3, "pattern_matcher_ms": theirs_s * 1e3,
                     "ratio": ours_s / theirs_s, "npu_fuse_us_per_node": 1e6 * ours_s / nodes,
                     "pattern_matcher_us_per_node": 1e6 * theirs_s / nodes})
        print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--fallback", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--train", action="store_true", help="compile forward + backward")
    parser.add_argument("--versus-pattern-matcher", action="store_true",
                        help="time the passes and inductor's pattern matcher (one RoPE pattern) on the same graph")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each side (the median is kept)")
    parser.add_argument("--disable", nargs="+", default=[], metavar="FUSION",
                        help="with --versus-pattern-matcher: passes left out (e.g. rms_norm: only the RoPE work "
                             "the pattern matcher does too)")
    args = parser.parse_args()
    if args.versus_pattern_matcher:
        rows = versus_rows(args)
        without = f" except {', '.join(args.disable)}" if args.disable else ""
        path = write_results(
            "compile_overhead_versus_pattern_matcher" + "".join(f"_without_{name}" for name in args.disable), rows,
            "Llama-style decoder stacks (hidden 256, 4 heads, GQA 2 kv heads), the inference aten graph "
            f"AOTAutograd gives. npu_fuse_ms: all the fusion passes{without} (canonicalization, the RoPE "
            "recognizer, softmax/MLA/RMSNorm passes) with translation validation on, every rewrite validated afresh; "
            "pattern_matcher_ms: inductor's PatternMatcherPass applying one registered RoPE replacement "
            "(Llama's rotate_half form -> rotary_mul) to a copy of the same graph. CPU time of this process "
            f"(steadier than wall time on a shared machine), medians of {args.repeat} interleaved runs each. "
            "Goal: ratio <= 0.1, us_per_node flat.",
            table(rows, list(rows[0])))
    else:
        rows = compile_rows(args)
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
