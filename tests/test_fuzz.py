"""The differential fuzzer's CI run: a fixed seed, a bounded count (tests/fuzzing.py makes the
programs; scripts/fuzz.py runs any seed for longer). Zero mismatches allowed."""

import pytest

import fuzzing

SEED = 2024
COUNT = 60  # aot_eager: RoPE, partial RoPE, softmax backward and their look-alikes
INDUCTOR = ("rope", "softmax")  # one program of each, also through the inductor fallback


def _report(capsys, label, summary):
    with capsys.disabled():
        print(f"\nfuzz {label} (seed {SEED}): {summary.line()}")
        if summary.mismatches or summary.unexpected:
            print(summary.details())


def _check(summary):
    assert not summary.mismatches, summary.details()
    assert not summary.unexpected, summary.details()


def test_generated_programs_and_look_alikes_match_eager(capsys):
    families = [name for name in fuzzing.GENERATORS if name != "mla"]
    summary = fuzzing.fuzz(SEED, COUNT, families=families)
    _report(capsys, "aot_eager", summary)
    _check(summary)
    outcomes = summary.outcomes
    assert {o.program.family for o in outcomes} == {"rope", "partial_rope", "softmax_grad"}
    assert sum(bool(o.program.must_not_fuse) for o in outcomes) >= COUNT // 5  # look-alikes are drawn
    assert sum(bool(o.fused) for o in outcomes) >= COUNT // 2
    assert any(o.program.grad_args and o.fused for o in outcomes)  # backward graphs too


def test_mla_prologue_programs_match_eager(capsys):
    """A prologue variant and a look-alike of one (accumulating write or wrong-dim norm)."""
    programs = [fuzzing.generate(SEED, i, ["mla"], lookalike_share=share) for i, share in enumerate((0, 1))]
    summary = fuzzing.Summary([fuzzing.run_program(p) for p in programs])
    _report(capsys, "MLA", summary)
    _check(summary)
    assert "mla_preprocess" not in summary.outcomes[1].fused


@pytest.mark.parametrize("family", INDUCTOR)
def test_programs_match_eager_through_inductor(capsys, family):
    program = next(p for p in (fuzzing.generate(SEED, i, [family], lookalike_share=0) for i in range(50))
                   if not p.grad_args)
    summary = fuzzing.Summary([fuzzing.run_program(program, "inductor")])
    _report(capsys, f"inductor {family}", summary)
    _check(summary)
    assert summary.outcomes[0].fused
