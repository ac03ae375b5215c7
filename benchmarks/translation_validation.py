"""Cost of translation validation on large models: time and peak extra memory, validation off and on.

Each case runs in fresh processes, one with translation validation off and one with it on (in
alternating order, ``--repeat`` pairs), so that both see a cold compile in a process of their own:

- ``compile_s``: the first call's wall time: Dynamo, AOTAutograd, the passes and the lowering of
  the forward, and for a training step the backward its ``.backward()`` compiles;
- ``validation_s``: the time spent inside the validator (``check_rewrite``), and its share of the
  compile with validation on (the budget: at most 2 %), the median of each process's own share;
- ``validation_peak_extra_mb``: the most resident memory the validator added over what the process
  held when it started, sampled every 0.5 ms from ``/proc/self/statm`` while it runs (budget: 64 MB),
  in a third process: the sampling thread takes the interpreter's lock, which slows what it watches,
  so the times come from processes that do not sample;
- ``process_peak_mb``: the process's peak resident memory (``ru_maxrss``), side by side.

Cases: a 2048-token softmax training step (softmax backward on [1, 4, 2048, 2048] fp32), one
decode step of an MLA attention over a 1 GB paged KV cache (bf16, 7282 blocks of 128 slots, hidden
2048, 16 heads, 4 tokens), and a 32-layer Llama-style training step (hidden 256, seq 64, batch 2).

Run (heavy; prefix ``nice``): python benchmarks/translation_validation.py [--fallback inductor]
[--repeat 1] [--cases softmax,mla,llama]
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = {
    "softmax": "softmax training step, 2048 tokens (softmax backward over [1, 4, 2048, 2048] fp32 scores)",
    "mla": "MLA decode step, 1 GB paged KV cache (bf16, 7282 x 128 slots, hidden 2048, 16 heads, 4 tokens)",
    "llama": "Llama-style training step, 32 layers (hidden 256, seq 64, batch 2)",
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The highest resident memory above a baseline while ``running`` (a background thread)."""

    def __init__(self):
        self.peak_extra = 0
        self._running = threading.Event()
        self._stop = False
        self._baseline = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop:
            if self._running.wait(0.1):
                self.peak_extra = max(self.peak_extra, _rss_bytes() - self._baseline)
                time.sleep(0.0005)

    def __enter__(self):
        self._baseline = _rss_bytes()
        self._running.set()
        return self

    def __exit__(self, *exc):
        self.peak_extra = max(self.peak_extra, _rss_bytes() - self._baseline)
        self._running.clear()


def child(case: str, validation: bool, fallback: str, sample_memory: bool) -> dict:
    """One cold compile (and run) of ``case`` in this process (``sample_memory``: the validator's
    peak extra memory sampled, which slows it)."""
    import torch
    from torch._dynamo.utils import counters

    import npu_fuse_backend as nf
    from npu_fuse_backend import fusion
    from npu_fuse_backend.demo_models import DecoderConfig, DeepSeekMLA, LlamaModel, MLAConfig, mla_decode_inputs

    inside = {"s": 0.0, "calls": 0}
    sampler = PeakSampler() if sample_memory else None
    check = fusion.check_rewrite

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            with sampler if sample_memory else contextlib.nullcontext():
                return check(*args, **kwargs)
        finally:
            inside["s"] += time.perf_counter() - start
            inside["calls"] += 1

    fusion.check_rewrite = timed
    torch.manual_seed(0)
    if case == "softmax":  # (not followed by @ v: inductor would make an attention SDPA, hiding the softmax)
        def softmax(scores, weights):
            return torch.softmax(scores * 0.125, dim=-1) * weights

        model, train = softmax, True
        args = [torch.randn(1, 4, 2048, 2048, requires_grad=True), torch.randn(1, 4, 2048, 2048)]
    elif case == "mla":
        cfg = MLAConfig(block_size=128, num_blocks=7282)
        model = DeepSeekMLA(cfg).to(torch.bfloat16).eval()
        cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, cfg.kv_lora + cfg.rope, dtype=torch.bfloat16)
        x, cos, sin, slots, context = mla_decode_inputs(cfg, 4, 1)
        args, train = [x, cos, sin, slots, cache, context], False
    else:
        model = LlamaModel(DecoderConfig(layers=32))
        args, train = [torch.randn(2, 64, 256, requires_grad=True), torch.arange(64).expand(2, 64)], True
    with nf.config.patch(fallback=fallback, translation_validation=validation), torch.set_grad_enabled(train), \
            torch._inductor.config.patch(force_disable_caches=True):
        start = time.perf_counter()
        out = torch.compile(model, backend="npu_fuse")(*args)
        if train:
            out.sum().backward()
        compile_s = time.perf_counter() - start
    reports = nf.get_reports()
    return {"compile_s": compile_s, "validation_s": inside["s"], "validations": inside["calls"],
            "validation_peak_extra_mb": sampler.peak_extra / 2 ** 20 if sampler else None,
            "process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "fused": sorted({m.op for r in reports for m in r.matches}),
            "rewrites": sum(len(r.matches) for r in reports),
            "refused": [n.reason for r in reports for n in r.near_misses if "validated" in n.reason
                        or "differs" in n.reason],
            "tally": dict(counters["npu_fuse_validation"])}


def run_child(case: str, validation: bool, fallback: str, sample_memory: bool = False) -> dict:
    # the memory process fixes glibc's mmap threshold: it returns every large block on free, so resident
    # memory follows what is allocated (its dynamic threshold would keep freed blocks and charge them to
    # whoever comes next). The timed processes keep glibc's defaults, as a user's process does: with the
    # fixed threshold every block of 64 KB or more is mapped and its pages faulted in afresh, which makes
    # the validator (many short-lived MB-sized values) ~1.2x slower and the compile not measurably (an MLA
    # step: 35 ms of validation instead of 29, in a 2.1 s compile either way)
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if sample_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps([case, validation, fallback, sample_memory])],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{case} (validation {validation}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(case: str, fallback: str, repeat: int) -> dict:
    runs = {False: [], True: []}
    for i in range(repeat):
        for validation in ((False, True) if i % 2 == 0 else (True, False)):
            runs[validation].append(run_child(case, validation, fallback))
    memory = run_child(case, True, fallback, sample_memory=True)
    med = lambda side, key: statistics.median(r[key] for r in runs[side])  # noqa: E731
    on = runs[True][-1]
    shares = [100 * r["validation_s"] / r["compile_s"] for r in runs[True]]
    row = {"case": CASES[case], "fused": ", ".join(on["fused"]), "rewrites": on["rewrites"],
           "validated": on["tally"].get("equal", 0), "refused_by_validation": len(on["refused"]),
           "compile_s_off": med(False, "compile_s"), "compile_s_on": med(True, "compile_s"),
           "validation_s": med(True, "validation_s"),
           # (each process's own share, then their median: the shared CPU's speed drifts from one process
           # to the next by up to ~1.5x, the validation and the compile of one process see the same)
           "validation_%_of_compile": statistics.median(shares),
           "validation_%_range": f"{min(shares):.2f}-{max(shares):.2f}",
           "validation_peak_extra_mb": memory["validation_peak_extra_mb"],
           "process_peak_mb_off": med(False, "process_peak_mb"), "process_peak_mb_on": med(True, "process_peak_mb"),
           "evaluations": on["tally"].get("evaluations", 0)}
    if on["refused"]:
        row["refusals"] = on["refused"]
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fallback", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--repeat", type=int, default=1, help="pairs of processes per case (medians)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    from common import table, write_results

    rows = [measure(case, args.fallback, args.repeat) for case in args.cases.split(",")]
    columns = ["case", "fused", "rewrites", "validated", "refused_by_validation", "compile_s_off", "compile_s_on",
               "validation_s", "validation_%_of_compile", "validation_%_range", "validation_peak_extra_mb",
               "process_peak_mb_off", "process_peak_mb_on", "evaluations"]
    path = write_results(
        f"translation_validation_{args.fallback}", rows,
        f"Translation validation off and on, each case in fresh processes (cold compile, inductor's caches off; "
        f"median of {args.repeat} pair(s)), fallback {args.fallback}. compile_s: the first call's wall time "
        "(forward, and the backward a training step's .backward() compiles). validation_s: time inside the "
        "validator; validation_%_of_compile: its share of the compile in each process with validation on, "
        "median (budget: 2 %), and the lowest and highest of them. validation_peak_extra_mb: "
        "the most resident memory the validator added over the process's memory when it started (sampled "
        "every 0.5 ms, glibc's mmap threshold fixed at 64 KB so that freed blocks leave; budget: 64 MB), in a "
        "third process with validation on (the sampling slows what it watches, and the fixed threshold makes "
        "every large block a fresh mapping: the times come from processes that do neither, with glibc's "
        "default allocator settings). "
        "process_peak_mb: the process's peak resident memory, off and on. "
        "validated: rewrites shown equal by an evaluation (the others identical to one of them); "
        "evaluations: probe evaluations of both sides.",
        table(rows, columns))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
