"""Python floats that ``dynamic=True`` passes as graph inputs, specialized again.

With ``dynamic=True`` Dynamo does not specialize a Python float: a module's ``self.eps`` (an
RMSNorm's epsilon) or a float argument reaches the graph as a 0-d float64 input. A fused op's
attributes (an epsilon, a scale) are compile-time constants, so such a graph could not fuse.
:func:`specialize_floats` specializes each such float as Dynamo does one it cannot keep symbolic:
a guard on its source (``guard_scalar``), its value a constant of the graph (the input stays, unused:
the call's signature is Dynamo's), and the symbol marked specialized in Dynamo's ``TensorifyState``,
so that AOTAutograd's tensorify pass does not restart the trace. A call with another value
recompiles. The mark is withdrawn when the frame's compile ends, so a float whose value changes
between two compiles of one frame stays an input from then on: at most one extra compile for a
float that varies, as ``dynamic=None``'s automatic dynamic does.
"""

import logging
import math
import warnings

import torch
from torch.fx import GraphModule

from . import config
from .fusion import FusionError

log = logging.getLogger("npu_fuse")

# why a float is still a runtime value where a fusion needs a constant (its near-miss says it)
RUNTIME_FLOAT = ("a tensor, or a Python float that dynamic=True passes as a graph input and that stayed one: "
                 "npu_fuse config.specialize_floats is off, the float changed between compiles of the frame, "
                 "or it is 0, NaN or infinite")
VARIES = object()  # a float seen at two values in one frame's compiles: never specialized again
_seen: dict = {}  # (Dynamo frame id, the float's source) -> the value it was specialized at, or VARIES
_requested: set = set()  # the symbols (``zf0``...) we specialized in the frame compiling now


def reset() -> None:
    """Forget the values seen (``torch.compiler.reset()``: Dynamo's frame ids start again)."""
    _seen.clear()
    _withdraw()


def specialize_floats(gm: GraphModule) -> None:
    """Called with each Dynamo graph before it is compiled: its floats made guarded constants, in
    place. Any internal error leaves them inputs, with a warning (``config.strict``: raised)."""
    if not config.specialize_floats:
        return
    try:
        _specialize(gm)
    except Exception as exc:
        message = f"npu_fuse: specializing the graph's float inputs failed and left them inputs: {exc!r}"
        if config.strict:
            raise FusionError(message) from exc
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _specialize(gm: GraphModule) -> None:
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    frame = getattr(torch._guards.CompileContext.current_compile_id(), "frame_id", None)
    if frame is None:
        return
    chosen = []
    for node in gm.graph.nodes:
        found = _python_float(node) if node.op == "placeholder" else None
        if found is None:
            continue
        memo, value, source = found
        key = (frame, source)
        seen = _seen.get(key, value)
        if seen is VARIES or seen != value:
            if seen is not VARIES:
                log.info("npu_fuse: float %s changed (%s, then %s): it stays a graph input", source, seen, value)
            _seen[key] = VARIES
            continue
        chosen.append((node, memo, source))
    if not chosen:
        return
    _withdraw_when_compiled()
    for node, memo, source in chosen:
        value = guard_scalar(memo)  # (Dynamo's guard on the float's source, as its own specialization adds)
        _seen[(frame, source)] = value
        name = memo.node._expr.name
        TensorifyState.specialize(name)  # (so that AOTAutograd's tensorify pass does not restart the trace)
        _requested.add(name)
        for item in list(node.users):
            item.replace_all_uses_with(value)
            gm.graph.erase_node(item)
        log.info("npu_fuse: float %s = %r made a constant of the graph (guarded)", source, value)
    gm.recompile()


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
    """(its SymFloat, value, source name) of a placeholder that is a Python float Dynamo passes as a
    tensor and reads with ``.item()`` only (what Dynamo itself can specialize), else None. Zero (whose
    sign a guard does not see), NaN and infinities stay inputs."""
    arg = node.meta.get("grapharg")
    example = node.meta.get("example_value")
    memo = getattr(example, "item_memo", None)
    if arg is None or arg.source is None or memo is None or not getattr(arg, "pass_arg_as_tensor", False):
        return None
    if not node.users or any(u.op != "call_method" or u.target != "item" for u in node.users):
        return None
    if not hasattr(memo.node._expr, "name") or memo.node.hint is None:
        return None
    value = float(memo.node.hint)
    if not math.isfinite(value) or value == 0.0:  # (a guard on 0.0 passes -0.0)
        return None
    return memo, value, arg.source.name
