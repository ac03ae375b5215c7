"""Coverage: how much of each model family's RoPE, attention and RMSNorm npu_fuse fuses.

The zoo is ``npu_fuse_backend.model_zoo``: transformers' own model classes (tiny configs,
random weights, eager attention). Each family is compiled for inference and for a training
step; per fused op the table gives fused / expected sites (expected: the family's RoPE
sites, q and k per layer, one softmax backward per layer, and its RMSNorms in the forward),
the near-misses, and whether the outputs (and gradients) match eager within the dtype's tolerance.

Training is also run the ways models are trained, for the Llama-, DeepSeek-V3- and GPT-NeoX-style
families: bf16 weights, autocast bf16, fp16 weights, and dynamic=True (two sequence lengths, one
graph). Their numerics are judged against an fp32 run of the same step: the compiled step may not be
farther from it than eager's own step in that precision (1.5x, plus the dtype's tolerance).

Run: python benchmarks/coverage.py [--layers 2] [--fallback aot_eager] [--dtype float32]
     python benchmarks/coverage.py --families deepseek-v2 llama4 --fallback inductor --no-precision
     python benchmarks/coverage.py --families llama deepseek-v3 gpt-neox --tag torch2.10  (in that venv)
"""

import argparse
import collections
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.cli import DTYPES, TOLERANCE, _within  # noqa: E402
from npu_fuse_backend.model_zoo import BY_NAME, FAMILIES, Family, example_inputs  # noqa: E402

PRECISION_FAMILIES = ("llama", "deepseek-v3", "gpt-neox")
NORM_OPS = ("rms_norm", "add_rms_norm")
PRECISIONS = {  # name: (weights dtype, autocast dtype, dynamic)
    "bf16 weights": (torch.bfloat16, None, False),
    "autocast bf16": (torch.float32, torch.bfloat16, False),
    "fp16 weights": (torch.float16, None, False),
    "dynamic=True": (torch.float32, None, True),
}


def _step(model, inputs: dict, mode: str, autocast=None) -> list:
    model.zero_grad(set_to_none=True)
    amp = torch.autocast("cpu", autocast) if autocast else contextlib.nullcontext()
    with torch.set_grad_enabled(mode == "training"), amp:
        logits = model(**inputs).logits
    if mode == "inference":
        return [logits]
    logits.float().sum().backward()
    return [logits, *(p.grad for p in model.parameters() if p.grad is not None)]


def _counts(reports, kinds) -> tuple:
    fused = collections.Counter(m.op for r in reports if r.kind in kinds for m in r.matches)
    return dict(fused), [f"{n.family}: {n.reason}" for r in reports for n in r.near_misses]


def run(family: Family, mode: str, layers: int, dtype: torch.dtype) -> dict:
    model = family.build(layers).to(dtype)
    model.train(mode == "training")
    inputs = example_inputs()
    expected_values = _step(model, inputs, mode)
    torch._dynamo.reset()
    nf.clear_reports()
    got = _step(torch.compile(model, backend="npu_fuse"), inputs, mode)
    worst, ok = _within(got, expected_values, dtype)
    reports = nf.get_reports()
    kinds = ("inference",) if mode == "inference" else ("forward", "backward")
    expected = collections.Counter()
    for kind in kinds:
        expected.update(family.expected(kind, layers))
    fused, misses = _counts(reports, kinds)
    return {"family": family.name, "model": family.model_class, "mode": mode, "graphs": len(reports),
            "expected": dict(expected), "fused": fused, "near_misses": misses,
            "max_diff_vs_eager": worst, "verdict": "ok" if ok else "MISMATCH"}


def run_precision(family: Family, precision: str, layers: int) -> dict:
    """A training step in a precision, against eager in that precision and an fp32 reference."""
    weights, autocast, dynamic = PRECISIONS[precision]
    lengths = (8, 12) if dynamic else (8,)
    reference = family.build(layers).train()
    model = family.build(layers).to(weights).train()
    calls = [example_inputs(seq=s) for s in lengths]
    exact = [t for inputs in calls for t in _step(reference, inputs, "training")]
    eager = [t for inputs in calls for t in _step(model, inputs, "training", autocast)]
    torch._dynamo.reset()
    nf.clear_reports()
    compiled = torch.compile(model, backend="npu_fuse", dynamic=dynamic)
    got = [t for inputs in calls for t in _step(compiled, inputs, "training", autocast)]
    low = autocast or weights
    atol = TOLERANCE.get(low, TOLERANCE[torch.float32])[0]
    ok, worst = True, 0.0
    for g, e, x in zip(got, eager, exact):
        err_g, err_e = (g.float() - x.float()).abs().max().item(), (e.float() - x.float()).abs().max().item()
        ok &= err_g <= 1.5 * err_e + atol
        worst = max(worst, (g.float() - e.float()).abs().max().item())
    reports = nf.get_reports()
    expected = collections.Counter()
    for report in reports:  # each graph is a whole step's forward or backward (a recompile: one more)
        per_graph = dict(family.expected(report.kind, layers))
        if dynamic:  # near-misses: SoftmaxGradExt needs static shapes (the RMSNorms' epsilon, a graph
            # input under dynamic=True, is specialized: float_inputs.py)
            per_graph = {op: n for op, n in per_graph.items() if op != "softmax_grad_ext"}
        if weights in (torch.bfloat16, torch.float16) and "add_rms_norm" in per_graph:
            # half-precision training: the residual add stays and the norm of its rounded sum fuses
            # (add_rms_norm's float32 rstd, which the backward reads, is that of the unrounded sum)
            per_graph["rms_norm"] = per_graph.get("rms_norm", 0) + per_graph.pop("add_rms_norm")
        expected.update(per_graph)
    fused, misses = _counts(reports, ("forward", "backward"))
    return {"family": family.name, "model": family.model_class, "mode": f"training, {precision}",
            "graphs": len(reports), "expected": dict(expected), "fused": fused, "near_misses": misses,
            "max_diff_vs_eager": worst, "verdict": "ok" if ok else "MISMATCH"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--fallback", choices=("inductor", "aot_eager"), default="aot_eager")
    parser.add_argument("--families", nargs="+", default=None, help=f"a subset of {sorted(BY_NAME)}")
    parser.add_argument("--no-precision", action="store_true", help="skip the training rows in other precisions")
    parser.add_argument("--tag", default="", help="appended to the results' name (a run on another torch)")
    args = parser.parse_args()
    families = [BY_NAME[name] for name in args.families] if args.families else FAMILIES
    rows = []
    with nf.config.patch(fallback=args.fallback):
        for family in families:
            for mode in ("inference", "training"):
                rows.append(run(family, mode, args.layers, DTYPES[args.dtype]))
                print(rows[-1], flush=True)
        if not args.no_precision:
            for name in PRECISION_FAMILIES:
                if BY_NAME[name] in families:
                    for precision in PRECISIONS:
                        rows.append(run_precision(BY_NAME[name], precision, args.layers))
                        print(rows[-1], flush=True)
    ops = sorted({op for row in rows for op in (*row["expected"], *row["fused"])})
    cells = []
    for row in rows:
        cell = {"family": row["family"], "mode": row["mode"]}
        for op in ops:
            want, have = row["expected"].get(op, 0), row["fused"].get(op, 0)
            cell[op] = f"{have}/{want}" if want or have else ""
        cell["near-misses"] = len(row["near_misses"])
        cell["numerics"] = f"{row['verdict']} ({row['max_diff_vs_eager']:.2g})"
        cells.append(cell)
    complete = sum(row["fused"] == row["expected"] for row in rows)
    misses = sorted({m for row in rows for m in row["near_misses"]})
    name = "coverage" if args.fallback == "aot_eager" and not args.families else \
        f"coverage_{args.fallback}{'_' + '_'.join(args.families) if args.families else ''}"
    name += f"_{args.tag}" if args.tag else ""
    path = write_results(
        name, rows,
        f"transformers model classes, {args.layers} layers, {args.dtype}, fallback {args.fallback}, eager "
        "attention; each cell is fused / expected sites of that op (expected: q and k RoPE per layer, forward "
        "and backward, one softmax backward per layer in training, and the RMSNorms of the forward: the "
        "residual add and norm twice per layer, the first norm alone, q/k and MLA latent norms; with "
        "dynamic=True no softmax backward, SoftmaxGradExt needs static shapes (the RMSNorms fuse: their epsilon "
        "is specialized); in bf16/fp16-weight training the residual add stays and its norm fuses as "
        "rms_norm, add_rms_norm's float32 rstd being of the unrounded sum). The precision rows' numerics: the "
        "compiled step no farther "
        "from an fp32 run than eager's step in that precision; the number is max |compiled - eager|. "
        f"{complete} of {len(rows)} rows fully fused." +
        ("\n\nNear-misses reported:\n\n" + "\n".join(f"- {m}" for m in misses) if misses else
         "\n\nNo near-miss reported."),
        table(cells, ["family", "mode", *ops, "near-misses", "numerics"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
