"""Latency measurement shared by the demo and the benchmarks."""

import statistics
import time
from typing import Callable, NamedTuple


def median_ms(fn, args, repeat: int) -> float:
    """Median wall time of ``fn(*args)`` over ``repeat`` calls, in milliseconds."""
    return statistics.median(samples_ms(fn, args, repeat))


def samples_ms(fn, args, repeat: int) -> list:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def interleaved_ms(fns: dict, args, rounds: int, repeat: int) -> dict:
    """Median latency of each fn, measured in alternating rounds so that machine noise
    hits all of them alike."""
    per_fn = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per_fn[name].append(median_ms(fn, args, repeat))
    return {name: statistics.median(v) for name, v in per_fn.items()}


class Latency(NamedTuple):
    """Median and spread (half the interquartile range) of a latency, in milliseconds."""

    median: float
    spread: float

    def __str__(self) -> str:
        return f"{self.median:.2f} ±{self.spread:.2f}"


def latency(samples: list) -> Latency:
    if len(samples) < 2:
        return Latency(samples[0], 0.0)
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return Latency(statistics.median(samples), (q3 - q1) / 2)


def interleaved_latency(fns: dict[str, Callable[[], object]], rounds: int, repeat: int) -> dict:
    """Each argument-less fn timed ``repeat`` times per round, the fns taking turns round after
    round (so a busy machine slows them alike); {name: Latency} over all of its calls."""
    per_fn = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per_fn[name] += samples_ms(fn, (), repeat)
    return {name: latency(samples) for name, samples in per_fn.items()}
