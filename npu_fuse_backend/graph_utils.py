"""Small helpers for reading aten FX graphs (the matchers and passes build on them).

All reads go through the ``meta["val"]`` fake tensors AOTAutograd leaves on each
node, and shape comparisons never add guards (symbolic sizes compare only when
they are known equal).
"""

import functools
import sys
from typing import Any, Iterable, Optional

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
INT_MAX = sys.maxsize
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else node


def call_arg(node: Node, position: int, name: str, default: Any = None) -> Any:
    """A call's argument, given by position or by keyword."""
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for torch.bfloat16, as messages name dtypes."""
    return str(dtype).removeprefix("torch.")


def calls_of(graph: Any, targets: Iterable) -> list:
    """The calls of ``targets`` in graph order, from FX's table of nodes by target (no scan of the graph)."""
    found: list = []
    for target in targets:
        found += graph.find_nodes(op="call_function", target=target, sort=False)
    return sorted(found)


# ops whose result is whatever memory held (``torch.empty``): no value to compute or compare
UNINITIALIZED = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted")


def uninitialized(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._opname in UNINITIALIZED


def draws_random(target: Any) -> bool:
    """A call target that draws random numbers (running it advances the user's generator)."""
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    return target is torch.ops.higher_order.run_and_save_rng_state


def mutates(target: Any) -> bool:
    """A call target that writes one of its arguments."""
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.is_mutable


@functools.lru_cache(maxsize=4096)
def pure_aten_op(target: Any) -> bool:
    """An aten/prims op whose result is a function of its arguments alone: no random draw, no
    mutation, no uninitialized memory. Once per op: reading its tags is slow."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims") and \
        not draws_random(target) and not mutates(target) and target._opname not in UNINITIALIZED


def attribute(node: Node) -> Any:
    """What a ``get_attr`` node reads of its graph's module (None where the module has no such attribute)."""
    value = node.graph.owning_module
    for name in str(node.target).split("."):
        value = getattr(value, name, None)
    return value


def is_call(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def rank(node: Node) -> Optional[int]:
    v = val(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def size_eq(a, b) -> bool:
    """True when two sizes (ints or SymInts) are known equal, without guarding."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def shape_eq(a, b) -> bool:
    return len(a) == len(b) and all(size_eq(x, y) for x, y in zip(a, b))


def static_int(x: Any) -> Optional[int]:
    """A Python int for an int argument or a node holding a non-symbolic int."""
    if isinstance(x, Node):
        x = val(x)
    if isinstance(x, torch.SymInt):
        x = x.node.maybe_as_int()
    return x if isinstance(x, int) else None


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def slice_args(node: Node):
    """(dim, start, end, step) of an ``aten.slice.Tensor`` node, defaults filled in."""
    args = list(node.args) + [None] * (5 - len(node.args))
    dim = node.kwargs.get("dim", args[1] if args[1] is not None else 0)
    start = node.kwargs.get("start", args[2] if args[2] is not None else 0)
    end = node.kwargs.get("end", args[3] if args[3] is not None else INT_MAX)
    step = node.kwargs.get("step", args[4] if args[4] is not None else 1)
    return dim, start, end, step


def slice_scatter_args(node: Node):
    """(dim, start, end, step) of ``aten.slice_scatter(base, src, dim, start, end, step)``."""
    args = list(node.args[2:]) + [None] * (6 - len(node.args))
    defaults = (0, 0, INT_MAX, 1)
    return tuple(node.kwargs.get(name, arg if arg is not None else default)
                 for name, arg, default in zip(("dim", "start", "end", "step"), args, defaults))


def users_outside(nodes: Iterable[Node], outputs: Iterable[Node]) -> Optional[Node]:
    """An intermediate of a subgraph that has a user outside it, else None.

    ``nodes`` are the subgraph's intermediates; ``outputs`` are the nodes whose
    uses are redirected to the replacement (they may have any users). A view of the
    subgraph's inputs (a half of the gradient two RoPE sites share) may be shared: it
    costs nothing, and it simply stays for its other users.
    """
    inside = set(nodes) | set(outputs)
    for node in nodes:
        if node in outputs or is_input_view(node, inside):
            continue
        for user in node.users:
            if user not in inside:
                return node
    return None


SHAREABLE_VIEWS = (aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.expand.default,
                   aten.permute.default, aten.transpose.int, aten.t.default, *VIEWS)


def is_input_view(node: Node, inside: set) -> bool:
    """node is a view of a value computed outside the subgraph ``inside``."""
    return is_call(node, *SHAREABLE_VIEWS) and isinstance(node.args[0], Node) and node.args[0] not in inside


def describe(node: Node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({target})"
