"""Latency measurement shared by the demo and the benchmarks."""

import statistics
import time


def median_ms(fn, args, repeat: int) -> float:
    """Median wall time of ``fn(*args)`` over ``repeat`` calls, in milliseconds."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def interleaved_ms(fns: dict, args, rounds: int, repeat: int) -> dict:
    """Median latency of each fn, measured in alternating rounds so that machine noise
    hits all of them alike."""
    per_fn = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per_fn[name].append(median_ms(fn, args, repeat))
    return {name: statistics.median(v) for name, v in per_fn.items()}
