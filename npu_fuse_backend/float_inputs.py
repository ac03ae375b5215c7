"""Python floats that ``dynamic=True`` passes as graph inputs, specialized again.

With ``dynamic=True`` Dynamo does not specialize a Python float: a module's ``self.eps`` (an
RMSNorm's epsilon) or a float argument reaches the graph as a 0-d float64 input. A fused op's
attributes (an epsilon, a scale) are compile-time constants, so such a graph could not fuse.
:func:`specialize_floats` asks Dynamo to specialize each such float the way it does a float it
cannot keep symbolic (``TensorifyState``, then a restart of the frame's analysis): the restarted
trace has the value as a constant, guarded, so a call with another value recompiles. The request
is withdrawn when the frame's compile ends, so a float whose value changes between two compiles
of one frame stays an input from then on: at most one extra compile for a float that varies, as
``dynamic=None``'s automatic dynamic does. The cost: Dynamo traces such a frame twice (AOTAutograd
and the lowering run once).
"""

import logging
import math
import warnings

import torch
from torch.fx import GraphModule

from . import config

log = logging.getLogger("npu_fuse")

# why a float is still a runtime value where a fusion needs a constant (its near-miss says it)
RUNTIME_FLOAT = ("a tensor, or a Python float that dynamic=True passes as a graph input and that stayed one: "
                 "npu_fuse config.specialize_floats is off, the float changed between compiles of the frame, "
                 "or it is 0, NaN or infinite")
VARIES = object()  # a float seen at two values in one frame's compiles: never specialized again
_seen: dict = {}  # (Dynamo frame id, the float's source) -> the value it was specialized at, or VARIES
_requested: set = set()  # the symbols (``zf0``...) we asked Dynamo to specialize in the frame compiling now


class SpecializationError(RuntimeError):
    """An internal failure while specializing floats (raised only under ``config.strict``)."""


def reset() -> None:
    """Forget the values seen (``torch.compiler.reset()``: Dynamo's frame ids start again)."""
    _seen.clear()
    _withdraw()


def specialize_floats(gm: GraphModule) -> None:
    """Called with each Dynamo graph before it is compiled: raises Dynamo's restart when a float of
    ``gm`` should be specialized. Any internal error leaves the floats inputs, with a warning
    (``config.strict``: raised)."""
    try:
        restart = _request(gm) if config.specialize_floats else None
    except Exception as exc:
        message = f"npu_fuse: specializing the graph's float inputs failed and left them inputs: {exc!r}"
        if config.strict:
            raise SpecializationError(message) from exc
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    if restart is not None:
        raise restart


def _request(gm: GraphModule):
    """The restart to raise (the floats to specialize requested), or None."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    frame = getattr(torch._guards.CompileContext.current_compile_id(), "frame_id", None)
    if frame is None:
        return None
    wanted = []
    for node in gm.graph.nodes:
        found = _python_float(node) if node.op == "placeholder" else None
        if found is None or found[0] in _requested:  # (requested and still an input: left one, never a loop)
            continue
        symbol, value, source = found
        key = (frame, source)
        seen = _seen.get(key, value)
        if seen is VARIES or seen != value:
            if seen is not VARIES:
                log.info("npu_fuse: float %s changed (%s, then %s): it stays a graph input", source, seen, value)
            _seen[key] = VARIES
            continue
        _seen[key] = value
        wanted.append(symbol)
        log.info("npu_fuse: float %s = %r specialized (guarded): Dynamo traces the frame again", source, value)
    if not wanted:
        return None
    _withdraw_when_compiled()
    for symbol in wanted:
        TensorifyState.specialize(symbol)
        _requested.add(symbol)
    return TensorifyScalarRestartAnalysis()


def _withdraw(_args=None) -> None:
    """At the end of a frame's compile: our requests leave Dynamo's list (it keeps the symbols it
    specializes for its own reasons), so the frame's next compile sees its floats as inputs again."""
    from torch._dynamo.symbolic_convert import TensorifyState

    TensorifyState.force_specializations.difference_update(_requested)
    _requested.clear()


def _withdraw_when_compiled() -> None:
    """(registered again after ``torch._dynamo.reset()``, which clears Dynamo's callbacks)"""
    handler = torch._dynamo.callback.callback_handler
    if _withdraw not in handler.end_callbacks:
        handler.register_end_callback(_withdraw)


def _python_float(node):
    """(symbol, value, source name) of a placeholder that is a Python float Dynamo passes as a tensor
    and reads with ``.item()`` only (what Dynamo itself can specialize on a restart), else None. Zero
    (whose sign a guard does not see), NaN and infinities stay inputs."""
    arg = node.meta.get("grapharg")
    example = node.meta.get("example_value")
    memo = getattr(example, "item_memo", None)
    if arg is None or arg.source is None or memo is None or not getattr(arg, "pass_arg_as_tensor", False):
        return None
    if not node.users or any(u.target != "item" for u in node.users):
        return None
    expr = memo.node._expr
    if not hasattr(expr, "name"):
        return None
    value = float(memo.node.hint) if memo.node.hint is not None else None
    if value is None or not math.isfinite(value) or value == 0.0:  # (a guard on 0.0 passes -0.0)
        return None
    return expr.name, value, arg.source.name
