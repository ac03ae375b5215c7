"""vLLM serving throughput with and without npu_fuse, side by side in one run (``make bench-vllm``).

Two engines of vLLM's CPU build on the tiny random Llama of ``tests/vllm_engine.py``, both
compiled (vLLM's inductor compile), one of them with ``npu_fuse.vllm.compilation_config``: they
live in one process and take turns, round after round, generating ``--max-tokens`` greedy
tokens for ``--batch`` prompts (``ignore_eos``). Reports tokens/s (median and IQR/2 over the
rounds), the engine start of each, what npu_fuse fused in the worker, and whether the two
generated the same tokens. Parity is the expectation on CPU: inductor compiles the fused ops'
decompositions, i.e. what it compiles without npu_fuse.

    .cache/vllm-venv/bin/python benchmarks/vllm_serving.py [--rounds 7] [--custom-ops all]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import table, write_results  # noqa: E402
import vllm_engine  # noqa: E402


def median_iqr(values: list) -> tuple:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return statistics.median(values), (q[2] - q[0]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--custom-ops", choices=["all", "none"], default="all",
                        help="all: vLLM's _C.rotary_embedding (npu_fuse fuses it); none: forward_native")
    args = parser.parse_args()
    for key, value in vllm_engine.ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    work = Path(tempfile.mkdtemp(prefix="vllm_serving_"))
    os.environ["VLLM_CACHE_ROOT"] = str(work / "cache")  # fresh: both engines compile
    model = vllm_engine.write_tiny_llama(str(work / "tiny_llama"))
    report_file = str(work / "fusions.jsonl")
    prompts = [vllm_engine.PROMPTS[i % len(vllm_engine.PROMPTS)] for i in range(args.batch)]

    engines, starts = {}, {}
    for name, fused in (("vllm", False), ("vllm + npu_fuse", True)):
        start = time.perf_counter()
        engines[name] = vllm_engine.make_engine(model, args.custom_ops, fused, report_file=report_file)
        starts[name] = time.perf_counter() - start
        print(f"{name}: engine started in {starts[name]:.1f} s", flush=True)

    tokens = {name: vllm_engine.generate(llm, prompts, args.max_tokens) for name, llm in engines.items()}  # warm-up
    rates = {name: [] for name in engines}
    load_before = os.getloadavg()[0]
    for round_ in range(args.rounds):
        for name, llm in (engines.items() if round_ % 2 == 0 else reversed(engines.items())):
            start = time.perf_counter()
            out = vllm_engine.generate(llm, prompts, args.max_tokens)
            rates[name].append(sum(map(len, out)) / (time.perf_counter() - start))
            assert out == tokens[name], f"{name}: greedy tokens changed between rounds"
    same_tokens = tokens["vllm"] == tokens["vllm + npu_fuse"]
    load = max(load_before, os.getloadavg()[0])
    # each round's pair ran back to back: their ratio cancels the machine's drift
    paired = median_iqr([f / p for p, f in zip(rates["vllm"], rates["vllm + npu_fuse"])])

    import npu_fuse.vllm

    reports = npu_fuse.vllm.read_reports(report_file)
    fused = ", ".join(f"{op} x{n}" for r in reports for op, n in sorted(r.fused_counts().items())) or "nothing"
    pass_seconds = sum(r.pass_seconds for r in reports)
    rows = []
    for name in engines:
        median, half_iqr = median_iqr(rates[name])
        fused_engine = name != "vllm"
        rows.append({"engine": name, "custom_ops": args.custom_ops, "engine_start_s": starts[name],
                     "npu_fuse_pass_s": pass_seconds if fused_engine else 0.0, "tokens_per_s": median,
                     "iqr_half": half_iqr, "paired_ratio": paired[0] if fused_engine else 1.0,
                     "fused": fused if fused_engine else "", "same_tokens": same_tokens})
    notes = (f"Tiny random Llama (2 layers, hidden 128, fp32), vLLM's CPU build 0.32.0, both engines compiled in "
             f"one process, {args.rounds} interleaved rounds of {args.batch} prompts x {args.max_tokens} greedy "
             f"tokens (tokens/s: medians, ±IQR/2; paired_ratio: median of each round's npu_fuse/plain, "
             f"±{paired[1]:.3f}). npu_fuse fused in the worker: {fused}, its passes took {pass_seconds:.2f} s of "
             f"the engine start. Same tokens: {same_tokens}. Parity is expected on CPU (inductor compiles the "
             f"fused ops' decompositions). The first engine start also pays vLLM's first start in the process. "
             f"Load average during the rounds: {load:.1f} on {os.cpu_count()} cores.")
    columns = ["engine", "custom_ops", "engine_start_s", "npu_fuse_pass_s", "tokens_per_s", "iqr_half",
               "paired_ratio", "fused", "same_tokens"]
    path = write_results("vllm_serving", rows, notes, table(rows, columns))
    print(path.read_text())


if __name__ == "__main__":  # vLLM spawns its engine processes: nothing may run on import
    main()
