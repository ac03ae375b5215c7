"""Coverage: how much of each model family's RoPE, attention and RMSNorm npu_fuse fuses.

The zoo is ``npu_fuse_backend.model_zoo``: transformers' own model classes (tiny configs,
random weights, eager attention). Each family is compiled for inference and for a training
step; per fused op the table gives fused / expected sites (expected: the family's RoPE
sites, q and k per layer, one softmax backward per layer, and its RMSNorms in the forward),
the near-misses, and whether the outputs (and gradients) match eager within the dtype's tolerance.

Run: python benchmarks/coverage.py [--layers 2] [--fallback aot_eager] [--dtype float32]
"""

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_results  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.cli import DTYPES, _within  # noqa: E402
from npu_fuse_backend.model_zoo import FAMILIES, Family, example_inputs  # noqa: E402


def run(family: Family, mode: str, layers: int, dtype: torch.dtype) -> dict:
    model = family.build(layers).to(dtype)
    model.train(mode == "training")
    inputs = example_inputs()

    def step(m):
        m.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(mode == "training"):
            logits = m(**inputs).logits
        if mode == "inference":
            return [logits]
        logits.float().sum().backward()
        return [logits, *(p.grad for p in model.parameters() if p.grad is not None)]

    expected_values = step(model)
    torch._dynamo.reset()
    nf.clear_reports()
    got = step(torch.compile(model, backend="npu_fuse"))
    worst, ok = _within(got, expected_values, dtype)
    reports = nf.get_reports()
    kinds = ("inference",) if mode == "inference" else ("forward", "backward")
    expected = collections.Counter()
    for kind in kinds:
        expected.update(family.expected(kind, layers))
    fused = collections.Counter(m.op for r in reports for m in r.matches)
    return {"family": family.name, "model": family.model_class, "mode": mode, "graphs": len(reports),
            "expected": dict(expected), "fused": dict(fused),
            "near_misses": [f"{n.family}: {n.reason}" for r in reports for n in r.near_misses],
            "max_diff_vs_eager": worst, "verdict": "ok" if ok else "MISMATCH"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--fallback", choices=("inductor", "aot_eager"), default="aot_eager")
    args = parser.parse_args()
    rows = []
    with nf.config.patch(fallback=args.fallback):
        for family in FAMILIES:
            for mode in ("inference", "training"):
                rows.append(run(family, mode, args.layers, DTYPES[args.dtype]))
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
    path = write_results(
        "coverage", rows,
        f"transformers model classes, {args.layers} layers, {args.dtype}, fallback {args.fallback}, eager "
        "attention; each cell is fused / expected sites of that op (expected: q and k RoPE per layer, forward "
        "and backward, one softmax backward per layer in training, and the RMSNorms of the forward: "
        "the residual add and norm twice per layer, the first norm alone, q/k and MLA latent norms). "
        f"{complete} of {len(rows)} rows fully fused.",
        table(cells, ["family", "mode", *ops, "near-misses", "numerics"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
