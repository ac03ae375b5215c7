"""Canonicalization before the fusion passes: one form of a value instead of several.

Model code and tracing leave nodes that change nothing, and write the same view twice;
each would otherwise be a special case in every matcher that reads through it:

- no-op slices (``x[:, :, :]``, ``x[..., 0:D]``), views/reshapes/expands to x's own
  shape, identity permutes (``torch.vmap`` leaves them), casts to x's own dtype and clones
  that keep x's strides -> x;
- identical pure views of one tensor (``x[..., :r]`` written twice, two ``split``\\ s of
  the same tensor) -> one node;
- the Scalar overloads of multiply and divide (``mul.Scalar``, which autograd's formulas write,
  e.g. ``baddbmm``'s backward of ``alpha``) -> their Tensor overloads with the same number,
  the form every matcher reads (one meaning: a wrapped number promotes as a Scalar does).

The graph is functionalized (values are never mutated in place), so these edits keep
its meaning. A node that is a graph output is never removed: AOTAutograd has already
decided which outputs alias inputs (a duplicate view that is one stays for the output alone).
"""

import operator

import torch
from torch.fx import Graph, Node

from .graph_utils import INT_MAX, aten, calls_of, norm_dim, shape_eq, size_eq, slice_args, static_int

RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
            aten.alias.default)
CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.clone.default)
# pure, cheap ops whose identical calls on one input are one value
DEDUPLICATED = (aten.slice.Tensor, aten.select.int, aten.view.default, aten._unsafe_view.default,
                aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default,
                aten.transpose.int, aten.t.default, aten.expand.default, aten.split.Tensor,
                aten.split_with_sizes.default, aten.unbind.int, operator.getitem)


PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)
_MAYBE_NOOP = {id(t) for t in (aten.slice.Tensor, *RESHAPES, *CASTS, *PERMUTES)}  # by id: OpOverloads hash slowly
_DEDUPLICATED = {id(t) for t in DEDUPLICATED}
_SLICE, _VIEW_OR_PERMUTE, _CAST = id(aten.slice.Tensor), {id(t) for t in (*RESHAPES, *PERMUTES)}, {id(t) for t in CASTS}
_SCALAR_OVERLOADS = ((aten.mul.Scalar, aten.mul.Tensor), (aten.div.Scalar, aten.div.Tensor))
_TENSOR_OVERLOAD = {id(scalar): tensor for scalar, tensor in _SCALAR_OVERLOADS}
_EDITED = tuple(dict.fromkeys((aten.slice.Tensor, *RESHAPES, *CASTS, *PERMUTES, *DEDUPLICATED,
                               *(scalar for scalar, _ in _SCALAR_OVERLOADS))))  # the ops canonicalize edits


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a._has_symbolic_sizes_strides or b._has_symbolic_sizes_strides):  # ints: compared as tuples
        same = a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and \
            a.storage_offset() == b.storage_offset()  # (most candidates: a view or slice that changes the shape)
    else:
        same = (a.dim() == b.dim() and a.dtype == b.dtype and shape_eq(a.shape, b.shape)
                and shape_eq(a.stride(), b.stride()) and size_eq(a.storage_offset(), b.storage_offset()))
    return same and a.device == b.device


def _is_noop(node: Node) -> bool:
    """node returns a value equal to, and laid out like, its first argument."""
    target = id(node.target)
    args = node.args  # (a property: read once)
    if target not in _MAYBE_NOOP or not args or not isinstance(args[0], Node):
        return False
    out, src = node.meta.get("val"), args[0].meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and _same_layout(out, src)):
        return False
    if target == _SLICE:
        dim, start, end, step = slice_args(node)
        end_i = static_int(end)
        return (static_int(start) == 0 and static_int(step) == 1
                and (end_i == INT_MAX or (end_i is not None and size_eq(src.shape[norm_dim(dim, src.dim())], end_i))))
    if target in _VIEW_OR_PERMUTE:  # (a permutation of the same layout: identity, or of size-1 dims)
        return True
    if target in _CAST:  # same dtype, device and strides: checked above; nothing else may change
        return set(node.kwargs) <= {"dtype", "layout", "device", "pin_memory", "memory_format"}
    return False


def canonicalize(graph: Graph) -> int:
    """Remove no-op nodes, merge duplicate views and retarget Scalar overloads, in place; returns how
    many nodes went or changed."""
    outputs = {n for out in graph.find_nodes(op="output") for n in out.all_input_nodes}
    seen: dict = {}
    changed = 0
    for node in calls_of(graph, _EDITED):  # (the calls of the ops this edits, in graph order: not every node)
        target = id(node.target)
        tensor_overload = _TENSOR_OVERLOAD.get(target)
        if tensor_overload is not None:
            node.target = tensor_overload
            changed += 1
            continue
        output = node in outputs
        if not output and _is_noop(node):
            node.replace_all_uses_with(node.args[0])
        elif target in _DEDUPLICATED:
            # (FX's immutable args hash; OpOverloads and an empty kwargs dict hash slowly)
            key = (target, node.args, node.kwargs or None)
            try:
                first = seen.setdefault(key, node)
            except TypeError:  # an unhashable constant argument: leave the node alone
                continue
            if first is node:
                continue
            if output:  # (saved for the backward: the graph returns it, every other user reads the first)
                if any(u.op != "output" for u in node.users):
                    node.replace_all_uses_with(first, delete_user_cb=lambda user: user.op != "output")
                    changed += 1
                continue
            node.replace_all_uses_with(first)
        else:
            continue
        graph.erase_node(node)
        changed += 1
    return changed
