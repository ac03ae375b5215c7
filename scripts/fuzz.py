"""Differential fuzzing of the fusion passes: generated RoPE, softmax-backward and MLA-prologue
programs and their look-alikes, compiled with npu_fuse and compared with eager.

    python scripts/fuzz.py --seed 7 --count 500                # aot_eager, every family
    python scripts/fuzz.py --seed 7 --count 100 --inductor-every 10
    python scripts/fuzz.py --seed 7 --families rope,partial --no-validation   # the passes alone

Program i of a seed is always the same program with the same inputs: rerun one with
``--seed S --first i --count 1 --verbose``. Exits 1 on any mismatch (or, with --strict, on any
form that should have fused and did not, or look-alike that fused). The generators live in
tests/fuzzing.py; tests/test_fuzz.py runs a fixed seed in CI.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fuzzing  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--first", type=int, default=0, help="index of the first program")
    parser.add_argument("--families", default=None, help=f"comma-separated subset of {','.join(fuzzing.GENERATORS)}")
    parser.add_argument("--inductor-every", type=int, default=0,
                        help="also compile every N-th program with the inductor fallback (slow)")
    parser.add_argument("--no-validation", action="store_true", help="translation validation off")
    parser.add_argument("--strict", action="store_true", help="unexpected fusions/refusals fail the run too")
    parser.add_argument("--verbose", action="store_true", help="one line per program")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else None
    outcomes, start = [], time.perf_counter()
    with nf.config.patch(translation_validation=not args.no_validation):
        for index in range(args.first, args.first + args.count):
            program = fuzzing.generate(args.seed, index, families)
            fallbacks = ["aot_eager"] + (["inductor"] if args.inductor_every and index % args.inductor_every == 0
                                         else [])
            for fallback in fallbacks:
                outcome = fuzzing.run_program(program, fallback)
                outcomes.append(outcome)
                if args.verbose or outcome.mismatch or outcome.unexpected or outcome.inductors_own:
                    flag = "MISMATCH " if outcome.mismatch else "unexpected " if outcome.unexpected else \
                        "inductor's own " if outcome.inductors_own else ""
                    why = outcome.mismatch or outcome.unexpected or outcome.inductors_own
                    print(f"[{index} {fallback}] {flag}{program.name}: fused {outcome.fused}"
                          f"{' - ' + why if flag else ''}", flush=True)
    summary = fuzzing.Summary(outcomes)
    print(f"seed {args.seed}: {summary.line()} in {time.perf_counter() - start:.0f} s")
    return 1 if summary.mismatches or (args.strict and summary.unexpected) else 0


if __name__ == "__main__":
    sys.exit(main())
