"""``npu-fuse``: the command line.

``npu-fuse demo`` compiles the built-in small models with npu_fuse and prints, row by row,
what fused, whether the numerics match eager, and the latency of eager, of the fallback
lowering alone (inductor by default) and of npu_fuse on it.
``npu-fuse explain TARGET`` runs a user's script or model factory under the backend and
prints, per site, what fused or why not, with the source line.
"""

import argparse
import collections
import dataclasses
import importlib
import json
import linecache
import os
import runpy
import sys
import traceback
from typing import Callable, Optional

import torch

from . import __version__
from .graph_utils import dtype_name
from .timing import interleaved_latency

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# |fused - eager| <= atol + rtol * |eager|: the fused ops compute fp16/bf16 in fp32 and round once
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}


# -- demo ----------------------------------------------------------------------------------------
def _float_tensors(values) -> list:
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _within(got: list, expected: list, dtype: torch.dtype) -> tuple[float, bool]:
    """(max |diff|, every pair within the dtype's tolerance)."""
    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    worst, ok = 0.0, True
    for g, e in zip(got, expected):
        diff = (g.float() - e.float()).abs()
        worst = max(worst, diff.max().item())
        ok &= bool((diff <= atol + rtol * e.float().abs()).all())
    return worst, ok


def _training_step(model) -> Callable:
    """One training step's results: the output and every parameter's gradient."""
    def step(*args):
        model.zero_grad(set_to_none=True)
        out = model(*args)
        out.float().sum().backward()
        return [out, *(p.grad for p in model.parameters() if p.grad is not None)]

    return step


def _results(fn, calls: list, training: bool) -> list:
    if training:
        return [t for args in calls for t in fn(*args)]
    with torch.no_grad():
        return [fn(*args) for args in calls]


WIDTHS = (26, 90, 11, 10, 8, 14, 14, 14)  # the model column grows to the longest name


def _row(cells, widths, out) -> None:
    print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip(), file=out, flush=True)


def _case_name(case, dtype: torch.dtype) -> str:
    return case.name + ("" if (case.dtype or dtype) == dtype else f" ({dtype_name(case.dtype)})")


def progress(message: str, err=None) -> None:
    """A progress line on stderr: long compiles say what they are doing, stdout stays the result."""
    print(message, file=err or sys.stderr, flush=True)


def run_demo(dtype: torch.dtype, repeat: int, layers: int, seq: int, rounds: int = 5, out=None, err=None) -> list:
    """Compile every demo case, print its row as soon as it is measured; returns the rows."""
    out = out or sys.stdout
    import npu_fuse_backend as nf
    from npu_fuse_backend import config
    from npu_fuse_backend.demo_models import clone_calls, demo_cases

    baseline = config.fallback  # the same lowering without our passes
    cases = demo_cases(layers=layers, seq=seq, training=True)
    widths = (max(WIDTHS[0], *(len(_case_name(c, dtype)) for c in cases)), *WIDTHS[1:])
    print(f"npu_fuse demo ({dtype_name(dtype)}, CPU tensors: lowering = fallback {baseline}, "
          f"torch {torch.__version__}; latency: median ±IQR/2 over {rounds} interleaved rounds of {repeat})",
          file=out, flush=True)
    _row(["model", "fused ops", "near-misses", "max |diff|", "verdict", "eager ms", f"{baseline} ms", "npu_fuse ms"],
         widths, out)
    _row(["-" * w for w in widths], widths, out)
    rows = []
    for case in cases:
        torch.manual_seed(0)
        case_dtype = case.dtype or dtype
        progress(f"compiling {case.name} (npu_fuse on {baseline})...", err)
        model = case.make().to(case_dtype)
        model.train(case.training)
        steps = case.inputs(case_dtype)  # one call, or a few decode steps sharing a cache
        eager_steps, fused_steps = clone_calls(steps), clone_calls(steps)
        torch._dynamo.reset()
        nf.clear_reports()
        fused = torch.compile(model, backend="npu_fuse")
        run = _training_step if case.training else (lambda m: m)
        expected = _results(run(model), eager_steps, case.training) + _float_tensors(eager_steps[-1])
        got = _results(run(fused), fused_steps, case.training) + _float_tensors(fused_steps[-1])
        counts = collections.Counter()
        near_misses = 0
        for report in nf.get_reports():
            counts.update(report.fused_counts())
            near_misses += len(report.near_misses)
        worst, ok = _within(got, expected, case_dtype)
        torch._dynamo.reset()
        progress(f"compiling {case.name} ({baseline} alone) and timing it...", err)
        plain = torch.compile(model, backend=baseline)
        last = clone_calls(steps[-1:])[0]
        fns = {"eager": run(model), baseline: run(plain), "npu_fuse": run(fused)}
        with torch.set_grad_enabled(case.training):
            for fn in fns.values():
                fn(*last)  # warm-up (and compile)
            latency = interleaved_latency({k: (lambda f=f: f(*last)) for k, f in fns.items()}, rounds, repeat)
        row = {
            "model": _case_name(case, dtype),
            "fused": ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "-",
            "near_misses": near_misses,
            "max_abs_diff": worst,
            "verdict": "ok" if ok else "MISMATCH",
            **{f"{k}_ms": v.median for k, v in latency.items()},
            **{f"{k}_spread_ms": v.spread for k, v in latency.items()},
        }
        rows.append(row)
        _row([row["model"], row["fused"], row["near_misses"], f"{worst:.3g}", row["verdict"],
              latency["eager"], latency[baseline], latency["npu_fuse"]], widths, out)
    return rows


# -- explain ---------------------------------------------------------------------------------------
class TargetError(Exception):
    """A target explain cannot run, in one line; ``status`` is the exit status (2: a usage error)."""

    def __init__(self, message: str, status: int = 2, raised: Optional[BaseException] = None):
        super().__init__(message)
        self.status, self.raised = status, raised  # raised: the target's own exception, if it raised


def _outside_our_code(frame) -> bool:
    import npu_fuse_backend

    ours = [os.path.dirname(torch.__file__), os.path.dirname(npu_fuse_backend.__file__),
            os.path.dirname(os.__file__)]  # torch, npu_fuse, the standard library
    return not any(os.path.abspath(frame.filename).startswith(d + os.sep) for d in ours)


def _raised(what: str, exc: BaseException) -> TargetError:
    """The target's own exception in one line: type, first line of its message, and the last frame of
    the user's code it passed through."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _outside_our_code(f)]
    where = f" at {_short(f'{frames[-1].filename}:{frames[-1].lineno}')}" if frames else ""
    message = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return TargetError(f"{what} raised {type(exc).__name__}{': ' + message if message else ''}{where} "
                       "(--traceback shows all of it)", status=1, raised=exc)


def _load_factory(target: str) -> Callable:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise TargetError(f"TARGET must be a script (path/to/script.py) or module:callable, got {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise TargetError(f"no module named {exc.name!r} (from TARGET {target!r}; the module must be importable "
                              "from the current directory or sys.path)") from None
        raise _raised(f"importing {module_name}", exc) from None
    except Exception as exc:
        raise _raised(f"importing {module_name}", exc) from None
    factory = module
    for name in attr.split("."):
        if not hasattr(factory, name):
            raise TargetError(f"{module_name} has no attribute {attr!r} (TARGET {target!r})")
        factory = getattr(factory, name)
    if not callable(factory):
        raise TargetError(f"{target} is not callable ({type(factory).__name__}); it must be a callable returning "
                          "(model, inputs)")
    return factory


def _run_factory(target: str, factory: Callable, training: bool) -> None:
    """``module:callable``: callable() returns (model, inputs), inputs a tuple of positional
    arguments, a dict of keyword arguments or one tensor; the model is compiled with npu_fuse and run once
    (with ``training``: train mode, and a backward of the sum of its floating outputs)."""
    try:
        made = factory()
    except Exception as exc:
        raise _raised(f"{target}()", exc) from None
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and callable(made[0])
            and isinstance(made[1], (tuple, list, dict, torch.Tensor))):
        got = type(made).__name__ if not isinstance(made, (tuple, list)) else \
            f"({', '.join(type(m).__name__ for m in made)})"
        raise TargetError(f"{target} must return (model, inputs) with inputs a tuple of arguments, a dict of "
                          f"keyword arguments or one tensor, got {got}")
    model, inputs = made
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
    if isinstance(model, torch.nn.Module):
        model.train(training)
    compiled = torch.compile(model, backend="npu_fuse")
    try:
        with torch.set_grad_enabled(training):
            out = compiled(*args, **kwargs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            if training and not leaves:
                raise TargetError("--training: the model's outputs do not require grad")
            if training:
                sum(t.float().sum() for t in leaves).backward()
    except TargetError:
        raise
    except Exception as exc:
        raise _raised(f"running {target}'s model under npu_fuse", exc) from None


def _run_script(path: str, argv: list) -> int:
    """Run a script as ``__main__`` with every ``torch.compile`` call using the npu_fuse backend;
    returns its exit status."""
    original = torch.compile

    def compile_with_npu_fuse(model=None, *args, backend=None, **kwargs):
        return original(model, *args, backend="npu_fuse", **kwargs)

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    torch.compile = compile_with_npu_fuse
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        raise _raised(path, exc) from None
    finally:
        torch.compile, sys.argv, sys.path[:] = original, saved_argv, saved_path
    return 0


def _code_at(source: str) -> str:
    file, _, line = source.rpartition(":")
    return linecache.getline(file, int(line)).strip() if line.isdigit() else ""


def _short(source: str) -> str:
    file, _, line = source.rpartition(":")
    try:
        rel = os.path.relpath(file)
    except ValueError:
        rel = file
    return f"{rel if not rel.startswith('..') else file}:{line}" if source else "?"


def explain_records(reports: list) -> list:
    """The reports as JSON-ready dicts, each match and near-miss with its source line."""
    graphs = []
    for report in reports:
        graph = dataclasses.asdict(report)
        for key in ("matches", "near_misses"):
            for record in graph[key]:
                record["code"] = _code_at(record["source"])
        graphs.append(graph)
    return graphs


def print_explanation(reports: list, out=None) -> None:
    out = out or sys.stdout
    from .report import by_module

    fused = sum(len(r.matches) for r in reports)
    missed = sum(len(r.near_misses) for r in reports)
    print(f"npu_fuse explain: {len(reports)} graph(s), {fused} fused, {missed} not fused", file=out)
    for report in reports:
        print(f"\ngraph {report.graph_id}: {report.frame or '?'} ({report.kind}, lowering {report.lowering})", file=out)
        records = [*report.matches, *report.near_misses]
        if not records and not report.errors:
            print("  nothing that looks like a fused op's pattern", file=out)
        for module, group in by_module(records).items():
            print(f"  {module or '(top level)'}", file=out)
            for r in group:
                if hasattr(r, "op"):
                    head = f"fused     {r.op} ({r.family}{', ' + r.detail if r.detail else ''})"
                else:
                    head = f"not fused ({r.family}): {r.reason}"
                print(f"    {head}\n      at {_short(r.source)}  {_code_at(r.source)}", file=out)
        for error in report.errors:
            print(f"  pass error: {error}", file=out)


def _lowering_in_words() -> str:
    from npu_fuse_backend import config

    if config.lowering == "npu":
        return "lowering torchair"
    if config.lowering == "fallback" or "torch_npu" not in sys.modules:
        return f"lowering {config.fallback}: no NPU" if config.lowering == "auto" else f"lowering {config.fallback}"
    return f"lowering torchair for NPU tensors, else {config.fallback}"


def explain(target: str, argv: list, training: bool, as_json: bool, out=None, err=None) -> int:
    """Run the target under npu_fuse and print what fused where; returns the exit status (the
    script's own, if it exits with one). A target that cannot run raises :class:`TargetError`."""
    import time

    out = out or sys.stdout
    from .report import collect

    is_script = target.endswith(".py") or os.path.isfile(target)
    if is_script and not os.path.isfile(target):
        raise TargetError(f"no such script: {target}")
    if not is_script and ":" not in target:
        raise TargetError(f"TARGET must be a script (path/to/script.py) or module:callable, got {target!r}")
    if not is_script and argv:
        raise TargetError(f"a module:callable target takes no arguments, got {' '.join(argv)}")
    if is_script and training:
        raise TargetError("--training is for a module:callable target; a script trains as it is written")
    factory = None if is_script else _load_factory(target)
    progress(f"npu-fuse explain: running {target} under npu_fuse ({_lowering_in_words()}); "
             "compiles can take minutes on a CPU...", err)
    start = time.perf_counter()
    status = 0
    with collect() as reports:  # kept even if the script resets Dynamo between compiles
        if is_script:
            status = _run_script(target, argv)
        else:
            _run_factory(target, factory, training)
    progress(f"npu-fuse explain: {len(reports)} graph(s) compiled in {time.perf_counter() - start:.1f} s", err)
    if as_json:
        json.dump({"target": target, "graphs": explain_records(reports)}, out, indent=2)
        print(file=out)
    else:
        print_explanation(reports, out)
    return status


# -- arguments ----------------------------------------------------------------------------------------
def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def main(argv=None) -> int:
    from npu_fuse_backend.soc import KNOWN_SOCS

    parser = argparse.ArgumentParser(prog="npu-fuse", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"npu-fuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile the built-in models and print what fused")
    demo.add_argument("--dtype", choices=DTYPES, default="float32")
    demo.add_argument("--repeat", type=_at_least(1), default=10, help="timed calls per round")
    demo.add_argument("--rounds", type=_at_least(1), default=5, help="interleaved rounds (eager, inductor, npu_fuse)")
    demo.add_argument("--layers", type=_at_least(1), default=2)
    demo.add_argument("--seq", type=_at_least(1), default=128)
    demo.add_argument("--fallback", choices=("inductor", "aot_eager"), default=None,
                      help="lowering without an NPU (default: config.fallback)")
    exp = sub.add_parser(
        "explain", help="run a script or model factory under npu_fuse and say, per site, what fused or why not",
        usage="npu-fuse explain [options] TARGET [options] [-- TARGET_ARGS...]",
        description="TARGET is a script (path/to/script.py, run as __main__ with every torch.compile using "
                    "the npu_fuse backend) or module:callable, a factory returning (model, inputs) with inputs a "
                    "tuple of positional arguments or a dict of keyword arguments, compiled with npu_fuse and "
                    "called once. explain's options go before or after TARGET; a script's own arguments go "
                    "after --.")
    exp.add_argument("target", metavar="TARGET")
    exp.add_argument("--json", action="store_true", help="machine-readable output (progress lines go to stderr)")
    exp.add_argument("--training", action="store_true", help="module:callable only: a forward and backward step")
    exp.add_argument("--fallback", choices=("inductor", "aot_eager"), default=None,
                     help="lowering without an NPU (default: config.fallback)")
    exp.add_argument("--soc", choices=("auto", *KNOWN_SOCS), default=None,
                     help="target SoC whose limits apply (default: config.soc)")
    exp.add_argument("--traceback", action="store_true", help="on an error in the target, its whole traceback")
    argv = list(sys.argv[1:] if argv is None else argv)
    target_args = []
    if "--" in argv:  # the target's own arguments, passed on untouched
        split = argv.index("--")
        argv, target_args = argv[:split], argv[split + 1:]
    args, unknown = parser.parse_known_args(argv)
    if args.command == "demo" and (unknown or target_args):
        demo.error(f"unrecognized arguments: {' '.join([*unknown, *target_args])}")
    if args.command == "explain" and unknown:
        hint = f" (a script's own arguments go after --: npu-fuse explain {args.target} -- {' '.join(unknown)})" \
            if args.target.endswith(".py") else ""
        exp.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    from npu_fuse_backend import config

    patches = {"fallback": args.fallback} if args.fallback else {}
    if args.command == "explain" and args.soc:
        patches["soc"] = args.soc
    with config.patch(**patches):
        if args.command == "demo":
            run_demo(DTYPES[args.dtype], args.repeat, args.layers, args.seq, args.rounds)
            return 0
        try:
            return explain(args.target, target_args, args.training, args.json)
        except TargetError as error:
            if args.traceback and error.raised is not None:
                traceback.print_exception(error.raised)
            print(f"npu-fuse explain: {error}", file=sys.stderr)
            return error.status


if __name__ == "__main__":
    sys.exit(main())
