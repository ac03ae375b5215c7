"""MLA prologue: the fused mla_preprocess against the unfused DeepSeek MLA module.

DeepSeek-V3 sizes scaled to this machine: hidden 7168, q_lora 1536, kv_lora 512,
rope 64, nope 128 as in V3; heads 128 -> --heads (default 32); one decode step of
--tokens sequences over a paged bf16 cache. Side by side in one run: eager, plain
inductor, npu_fuse with the inductor fallback (the op's decomposition) and with the
aot_eager fallback (the op's reference kernel).
Run: python benchmarks/mla_preprocess.py [--heads 32 --tokens 16 --quant]
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

from npu_fuse_backend.timing import interleaved_ms  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--quant", action="store_true", help="the w8a8 module")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    cfg = MLAConfig(hidden=7168, heads=args.heads, block_size=128, num_blocks=args.tokens)
    torch.manual_seed(0)
    model = DeepSeekMLA(cfg, quant=args.quant).to(torch.bfloat16).eval()
    step = 8
    x, cos, sin, slots, context = mla_decode_inputs(cfg, args.tokens, step)
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576, dtype=torch.bfloat16)
    inputs = (x, cos, sin, slots, cache, context)
    fns, fused_counts = {"eager": model}, {}
    with torch.no_grad():
        torch._dynamo.reset()
        fns["inductor"] = torch.compile(copy.deepcopy(model), backend="inductor")
        fns["inductor"](*inputs)
        for fallback in ("inductor", "aot_eager"):
            nf.clear_reports()
            # its own copy of the module (and backend), so that each variant compiles its own graph
            backend = nf.config.patch(fallback=fallback)(nf.npu_fuse_backend)
            compiled = torch.compile(copy.deepcopy(model), backend=backend)
            compiled(*inputs)
            fns[f"npu_fuse[{fallback}]"] = compiled
            fused_counts[fallback] = [m.op for r in nf.get_reports() for m in r.matches]
        expected = model(*inputs)
        errors = {k: ((f(*inputs).float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                  for k, f in fns.items()}
        ms = interleaved_ms(fns, inputs, args.rounds, args.repeat)
    rows = [{"impl": k, "ms": ms[k], "vs_eager": ms[k] / ms["eager"], "rel_err_vs_eager": errors[k]} for k in fns]
    print(rows, fused_counts)
    path = write_results(
        f"mla_preprocess{'_w8a8' if args.quant else ''}", rows,
        f"DeepSeek MLA decode step, hidden 7168, heads {args.heads}, {args.tokens} tokens, bf16"
        f"{' w8a8' if args.quant else ''}, block size 128. Fused ops: {fused_counts}. On this CPU the fused op "
        "runs as its decomposition (inductor) or its reference kernel (aot_eager); the NPU kernel is the target.",
        table(rows, list(rows[0])))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
