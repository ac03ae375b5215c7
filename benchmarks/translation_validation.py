"""Compile-time cost of translation validation: the fusion passes' time with and without it.

Each aten graph the backend gets (32-layer Llama, inference and training; an MLA decode
step) is copied and passed through the fusion passes with ``translation_validation`` off
and on, in alternating order, ``--repeat`` times after one warm-up pair (the median of each
is kept, garbage collection paused inside a run), so both sides see the same graphs in the
same process; the time inside the validator is measured too. The first call's whole
compile time is given for scale.
Run: python benchmarks/translation_validation.py [--layers 32] [--repeat 7] [--fallback aot_eager]
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend import fusion  # noqa: E402
from npu_fuse_backend.validate import check_rewrite, forget_shown_equal  # noqa: E402
from npu_fuse_backend.demo_models import DecoderConfig, DeepSeekMLA, LlamaModel, MLAConfig, \
    mla_decode_inputs  # noqa: E402


def copy_of(gm: GraphModule) -> GraphModule:
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


class Timed:
    """Wraps the pass manager: every graph it gets is first timed on copies, validation off and on."""

    def __init__(self, repeat: int):
        self.repeat = repeat
        self.graphs = []
        self.original = fusion.PassManager.__call__
        self.in_validation = 0.0

    def check_rewrite(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return check_rewrite(*args, **kwargs)
        finally:
            self.in_validation += time.perf_counter() - start

    def __call__(self, manager, gm, *args, **kwargs):
        times, inside = {False: [], True: []}, []
        tally = counters["npu_fuse_validation"]
        for i in range(self.repeat + 1):  # the first pair warms caches (fake-tensor dispatch) and is dropped
            for validate in ((False, True) if i % 2 else (True, False)):
                forget_shown_equal()  # each run a cold compile: no rewrite known equal yet
                tally.clear()
                gc.collect()
                gc.disable()  # a collection inside one run but not the other is noise, not cost
                try:
                    with nf.config.patch(translation_validation=validate):
                        report = self.original(fusion.PassManager(), copy_of(gm), *args, **kwargs)
                finally:
                    gc.enable()
                if i:
                    times[validate].append(report.pass_seconds)
                    if validate:
                        inside.append(self.in_validation)
                self.in_validation = 0.0
        best = {validate: statistics.median(t) for validate, t in times.items()}
        evaluated = sum(tally.values()) - 2 * tally["equal_by_identical_rewrite"]
        self.graphs.append({"kind": report.kind, "nodes": report.node_count, "rewrites": len(report.matches),
                            "near_misses": len(report.near_misses), "evaluated": evaluated,
                            "off_s": best[False], "on_s": best[True], "inside_s": statistics.median(inside)})
        forget_shown_equal()
        return self.original(manager, gm, *args, **kwargs)


def measure(name: str, run, repeat: int) -> dict:
    timed = Timed(repeat)
    torch._dynamo.reset()
    nf.clear_reports()
    fusion.PassManager.__call__ = lambda manager, gm, *a, **k: timed(manager, gm, *a, **k)
    fusion.check_rewrite = timed.check_rewrite
    try:
        start = time.perf_counter()
        run()
        compile_s = time.perf_counter() - start
    finally:
        fusion.PassManager.__call__ = timed.original
        fusion.check_rewrite = check_rewrite
    graphs = timed.graphs
    off, on, inside = (sum(g[key] for g in graphs) for key in ("off_s", "on_s", "inside_s"))
    rewrites = sum(g["rewrites"] for g in graphs)
    # the first call also ran the timing copies: take them out of the compile time
    compile_s -= sum((repeat + 1) * (g["off_s"] + g["on_s"]) for g in graphs)
    row = {"case": name, "graphs": len(graphs), "aten_nodes": sum(g["nodes"] for g in graphs),
           "rewrites": rewrites, "near_misses": sum(g["near_misses"] for g in graphs),
           "evaluated": sum(g["evaluated"] for g in graphs),
           "passes_off_ms": off * 1e3, "passes_on_ms": on * 1e3, "on/off": on / off,
           "in_validation_ms": inside * 1e3, "ms_per_rewrite": inside * 1e3 / max(rewrites, 1),
           "compile_s": compile_s, "validation_%_of_compile": 100 * inside / compile_s}
    print(row, flush=True)
    return row


def llama(layers: int, train: bool, fallback: str):
    def run():
        torch.manual_seed(0)
        model = LlamaModel(DecoderConfig(layers=layers))
        x = torch.randn(2, 64, 256, requires_grad=train)
        pos = torch.arange(64).expand(2, 64)
        with nf.config.patch(fallback=fallback), torch.set_grad_enabled(train), \
                torch._inductor.config.patch(force_disable_caches=True):
            out = torch.compile(model, backend="npu_fuse")(x, pos)
            if train:
                out.sum().backward()

    return run


def mla_decode(fallback: str):
    def run():
        cfg = MLAConfig()
        torch.manual_seed(0)
        model = DeepSeekMLA(cfg).to(torch.bfloat16).eval()
        cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, cfg.kv_lora + cfg.rope, dtype=torch.bfloat16)
        x, cos, sin, slots, context = mla_decode_inputs(cfg, 4, 0)
        with nf.config.patch(fallback=fallback), torch.no_grad(), \
                torch._inductor.config.patch(force_disable_caches=True):
            torch.compile(model, backend="npu_fuse")(x, cos, sin, slots, cache, context)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--fallback", default="aot_eager", choices=("inductor", "aot_eager"))
    args = parser.parse_args()
    rows = [measure(f"llama-{args.layers} inference", llama(args.layers, False, args.fallback), args.repeat),
            measure(f"llama-{args.layers} training (fw+bw)", llama(args.layers, True, args.fallback), args.repeat),
            measure("deepseek-mla decode (hidden 2048, bf16)", mla_decode(args.fallback), args.repeat)]
    path = write_results(
        f"translation_validation_{args.fallback}", rows,
        f"Fusion-pass time per compile with translation validation off and on (median of {args.repeat}, "
        f"side by side on copies of the same graphs), Llama-style decoder (hidden 256, 4 heads, GQA 2 kv heads, "
        f"seq 64, batch 2) and one MLA decode step; fallback {args.fallback}. compile_s: the first call's "
        "wall time without the timing copies. Validation runs every rewrite's subgraph and replacement on "
        "random inputs (the MLA prologue on a valid and two out-of-range slot draws); evaluated: the rewrites "
        "actually run, the others being identical to one already shown equal; in_validation_ms: the time "
        "spent inside the validator (median), the cost itself, which the passes_on/off difference shows "
        "only through the noise of a shared 2-core CPU.",
        table(rows, list(rows[0])))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
