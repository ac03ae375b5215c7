"""vLLM's own RoPE op, ``_C::rotary_embedding``, -> ``npu_fuse::rotary_mul`` (spec section 1).

vLLM models call ``RotaryEmbedding.forward_cuda``/``forward_cpu`` when their custom ops are
on (``compilation_config={"custom_ops": ["all"]}``): one in-place kernel per layer,

    _C::rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size,
                         Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False)

which reaches the aten graph functionalized, as ``auto_functionalized(_C.rotary_embedding.default,
positions=..., query=q, key=k, ...)`` whose outputs 1 and 2 are the new query and key (vLLM
compiles with auto-functionalization v1; the slice_scatters that write them back into the qkv
projection stay as they are).

Semantics (vLLM's kernels, csrc/cpu/pos_encoding.cpp and csrc/pos_encoding_kernels.cu, and
vLLM 0.32.0's CPU kernel run on random inputs): query is ``[T, N * head_size]``, key
``[T, K * head_size]``, one position per row; ``cos, sin = cos_sin_cache[positions]`` split in
halves (the table is ``[max_position, rotary_dim]``, cos then sin); in each head the first
``rotary_dim`` elements rotate, the rest stay:

* ``is_neox``: halves ``x1, x2`` -> ``(x1*cos - x2*sin, x2*cos + x1*sin)``: rotary_mul "half"
  with ``cat([cos, cos])``/``cat([sin, sin])``;
* GPT-J: pairs ``(x[2i], x[2i+1])`` rotated alike: rotary_mul "interleave" with each value of
  cos/sin repeated per pair.

Replacement: ``rotary_mul`` on ``query.view(1, T, N, head_size)[..., :rotary_dim]`` (BSND,
cos/sin BS1D) per tensor, ``cat`` with the untouched part when ``rotary_dim < head_size``,
viewed back to ``[T, N * head_size]``. The kernels need one position per query row (the CUDA
kernel checks it; the CPU kernel runs ``positions.numel()`` rows, past the query's end if there
are more); where the graph cannot prove it (vLLM passes a slice of its positions buffer, a
symbol of its own), the replacement reads the first T positions: the same wherever the kernels
are defined.

Refused, each with its reason (near-misses): a query or key that is not 2-D rows of whole
heads (vLLM's CPU kernel takes a 3-D ``[T, N, head_size]`` query's last dim for the heads and
its dim -2 stride for the token stride, so it rotates the first T one-head rows only; the CUDA
kernel rotates T tokens of N heads: the result depends on the build; vLLM's DeepSeek-V2 code
calls it so on its ``q_pe``), a last dim that is not contiguous, ``rope_dim_offset != 0`` or
``inverse=True`` (vLLM's CPU kernel raises for both, so their results cannot be checked against
it here), a table of another dtype than the query (the kernels read it as the query's type),
``rotary_dim`` odd or wider than a head, positions that are not int64, and two views of one
base not known to be disjoint (auto-functionalization v2).

Every rewrite is validated like any other (translation validation runs vLLM's real kernel on
the subgraph's side, on valid positions only: the kernel does not check their range).
"""

import operator
from typing import Optional

import torch
from torch._higher_order_ops.auto_functionalize import (
    AliasViewInfo, AsStridedViewInfo, NotView, SliceViewInfo, get_mutable_args, read_view_information_from_args,
)
from torch.fx import Node

from ..fusion import FusionPass, GraphBuilder, NotFused, PassContext, Rewrite, register_fusion
from ..graph_utils import aten, size_eq, static_int, val
from ..lowering.common import FLOAT_DTYPES
from ..validate import register_opaque_indexing

VLLM_ROTARY_EMBEDDING = "_C::rotary_embedding"
ARGUMENTS = ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox", "rope_dim_offset", "inverse")
_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized
_AUTO_FUNCTIONALIZED_V2 = torch.ops.higher_order.auto_functionalized_v2

# the kernels index the table's rows with positions and do not check their range
register_opaque_indexing(VLLM_ROTARY_EMBEDDING, index="positions", table="cos_sin_cache", bounds_checked=False)


def is_vllm_rotary_embedding(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and op._schema.name == VLLM_ROTARY_EMBEDDING


@register_fusion
class VllmRotaryEmbeddingFusion(FusionPass):
    """vLLM's in-place ``_C::rotary_embedding`` on query and key -> one rotary_mul each."""

    name = "rope_vllm"
    op = "rotary_mul"
    anchor_targets = (_AUTO_FUNCTIONALIZED, _AUTO_FUNCTIONALIZED_V2)

    def anchors(self, ctx: PassContext):
        return (n for n in super().anchors(ctx) if n.args and is_vllm_rotary_embedding(n.args[0]))

    def match(self, ctx: PassContext, anchor: Node) -> Optional[Rewrite]:
        op = anchor.args[0]
        names = tuple(a.name for a in op._schema.arguments)
        if names != ARGUMENTS:
            raise NotFused(f"{VLLM_ROTARY_EMBEDDING} has arguments {list(names)}, not vLLM's {list(ARGUMENTS)}; "
                           "its meaning is unknown")
        getitems = {}
        for user in anchor.users:
            if user.target is not operator.getitem or not isinstance(user.args[1], int) or user.args[1] < 1:
                raise NotFused(f"{user.name} reads {anchor.name} other than by a new value of a mutated input")
            getitems[user.args[1]] = user
        if anchor.target is _AUTO_FUNCTIONALIZED:
            site = _Site.of_v1(op, anchor)
        else:
            site = _Site.of_v2(op, anchor)
        site.check()
        both = "query and key" if site.tensors.get("key") is not None else "query"
        detail = f"mode={site.mode}, vLLM _C.rotary_embedding on {both}"
        if site.rotary_dim < site.head_size:
            detail += f", rotary_dim={site.rotary_dim} of head_size {site.head_size}"
        return Rewrite(anchor, list(getitems.values()), self.op, lambda b: site.build(b, getitems), detail=detail)


class _Site:
    """One call: its arguments, the fake value of each rotated tensor, and how to read and write them.

    v1 (``auto_functionalized``): query and key are arguments, outputs 1 and 2 their new values.
    v2 (``auto_functionalized_v2``): they are views of ``_all_bases`` (slice, as_strided, alias
    or the base itself), outputs 1.. the new bases."""

    def __init__(self, args: dict, tensors: dict, bases: Optional[list] = None, views: Optional[dict] = None):
        self.args = args
        self.tensors = tensors  # name -> fake value of query / key (None: no key)
        self.bases = bases
        self.views = views or {}
        self.head_size = args["head_size"]
        self.mode = "half" if args["is_neox"] else "interleave"
        self.rotary_dim = -1

    @classmethod
    def of_v1(cls, op, anchor: Node) -> "_Site":
        args = {a.name: anchor.kwargs.get(a.name, a.default_value) for a in op._schema.arguments}
        return cls(args, {name: val(args[name]) for name in ("query", "key")})

    @classmethod
    def of_v2(cls, op, anchor: Node) -> "_Site":
        kwargs = dict(anchor.kwargs)
        bases = list(kwargs.pop("_all_bases"))
        views = read_view_information_from_args(*get_mutable_args(op), kwargs, bases)
        args = {a.name: kwargs.get(a.name, a.default_value) for a in op._schema.arguments if a.name not in views}
        tensors = {}
        for name, view in views.items():
            args[name] = None
            if view is not None:
                fake_args = torch.fx.map_arg(_view_args(view), val)
                with val(bases[view.base_index]).fake_mode:
                    tensors[name] = _regenerate(view, val(bases[view.base_index]), fake_args)
            else:
                tensors[name] = None
        return cls(args, tensors, bases, views)

    def _check_disjoint(self) -> None:
        """The two views of one base must not overlap (the kernels rotate them at once)."""
        views = [v for v in self.views.values() if v is not None]
        if len(views) == 2 and views[0].base_index == views[1].base_index:
            a, b = views
            if not (isinstance(a, SliceViewInfo) and isinstance(b, SliceViewInfo) and a.dim == b.dim and
                    all(static_int(x) is not None for x in (a.start, a.end, b.start, b.end)) and
                    (static_int(a.end) <= static_int(b.start) or static_int(b.end) <= static_int(a.start))):
                raise NotFused("query and key are views of one base that are not known to be disjoint")

    def check(self) -> None:
        """Raises NotFused with the first rule the call breaks."""
        args = self.args
        positions, cache, head_size, is_neox = args["positions"], args["cos_sin_cache"], args["head_size"], \
            args["is_neox"]
        if not isinstance(positions, Node) or not isinstance(cache, Node) or self.tensors["query"] is None:
            raise NotFused("positions, query and cos_sin_cache must be tensors of the graph")
        if not isinstance(head_size, int) or head_size <= 0 or not isinstance(is_neox, bool):
            raise NotFused(f"head_size={head_size!r} and is_neox={is_neox!r} must be constants")
        if args["rope_dim_offset"] != 0:
            raise NotFused(f"rope_dim_offset={args['rope_dim_offset']!r}: only 0 is fused (vLLM's CPU kernel raises "
                           "for any other, so the result could not be checked against it)")
        if args["inverse"] is not False:
            raise NotFused(f"inverse={args['inverse']!r}: only the forward rotation is fused (vLLM's CPU kernel "
                           "raises for the inverse, so the result could not be checked against it)")
        pv, cv, qv = val(positions), val(cache), self.tensors["query"]
        if pv.dim() != 1 or pv.dtype != torch.int64:
            raise NotFused(f"positions {positions.name} is {pv.dim()}-D {pv.dtype}; the kernels take 1-D int64 "
                           "positions")
        if cv.dim() != 2:
            raise NotFused(f"cos_sin_cache {cache.name} is {cv.dim()}-D; the kernels take [max_position, rotary_dim]")
        for name, v in self.tensors.items():
            if v is None:
                continue
            if v.dim() != 2:
                raise NotFused(f"{name} has shape {list(v.shape)}, not [tokens, heads * head_size]: vLLM's CPU kernel "
                               f"takes a {v.dim()}-D {name}'s last dim for its heads (it rotates the first T "
                               "one-head rows), its CUDA kernel dim 0 for the T tokens: the result depends on the "
                               "build")
            width = static_int(v.shape[-1])
            if width is None or width % head_size:
                raise NotFused(f"{name}'s last dim {v.shape[-1]} is not a static multiple of head_size {head_size}")
            if not size_eq(v.shape[0], qv.shape[0]):
                raise NotFused(f"key has {v.shape[0]} rows and query {qv.shape[0]}: the kernels rotate both at one "
                               "token count")
            if v.dtype not in FLOAT_DTYPES or v.dtype != qv.dtype or cv.dtype != qv.dtype:
                raise NotFused(f"query {qv.dtype}, {name} {v.dtype} and cos_sin_cache {cv.dtype} must share one float "
                               "dtype (the kernels read the table as the query's type)")
            if not size_eq(v.stride(-1), 1) and not size_eq(v.shape[-1], 1):
                raise NotFused(f"{name} has last-dim stride {v.stride(-1)}; the kernels read heads as contiguous")
        self.rotary_dim = static_int(cv.shape[1])
        if self.rotary_dim is None or self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_size:
            raise NotFused(f"rotary_dim (cos_sin_cache's last dim) {cv.shape[1]} must be even, static and within "
                           f"head_size {head_size}")
        self._check_disjoint()

    # -- the replacement ------------------------------------------------------------------------
    def build(self, b: GraphBuilder, getitems: dict) -> dict:
        """{output of the call: its replacement}: the tables once, then one rotary_mul per tensor."""
        if self.bases is None:
            inputs = {name: self.args[name] for name, v in self.tensors.items() if v is not None}
        else:
            inputs = {name: _view_node(b, view, self.bases) for name, view in self.views.items() if view is not None}
        cos, sin = self._tables(b, inputs["query"])
        rotated = {name: self._rotate(b, x, cos, sin) for name, x in inputs.items()}
        if self.bases is None:
            return {out: rotated[("query", "key")[index - 1]] for index, out in getitems.items()}
        new_bases = list(self.bases)
        for name, view in self.views.items():
            if view is not None:
                new_bases[view.base_index] = _scatter(b, view, new_bases[view.base_index], rotated[name])
        return {out: new_bases[index - 1] for index, out in getitems.items()}

    def _tables(self, b: GraphBuilder, query: Node) -> tuple:
        """cos and sin as [1, T, 1, rotary_dim] (BS1D against the BSND heads)."""
        positions = self.args["positions"]
        if not size_eq(val(positions).shape[0], self.tensors["query"].shape[0]):
            # one position per query row, where the kernels are defined: read the first T (T known at run time)
            tokens = b.call(aten.sym_size.int, query, 0)
            positions = b.call(aten.as_strided.default, positions, [tokens], [val(positions).stride(0)])
        rows = b.call(aten.index.Tensor, self.args["cos_sin_cache"], [positions])  # [T, rotary_dim]: cos | sin
        half = self.rotary_dim // 2
        tables = []
        for start in (0, half):
            part = b.call(aten.slice.Tensor, rows, 1, start, start + half)
            if self.mode == "half":
                full = b.call(aten.cat.default, [part, part], -1)
            else:  # each value twice, for the pair it rotates
                full = b.call(aten.view.default, b.call(aten.stack.default, [part, part], -1), [-1, self.rotary_dim])
            tables.append(b.call(aten.view.default, full, [1, -1, 1, self.rotary_dim]))
        return tuple(tables)

    def _rotate(self, b: GraphBuilder, x: Node, cos: Node, sin: Node) -> Node:
        """x [T, H * head_size] with the first rotary_dim of each head rotated."""
        width, head_size, rotary_dim = static_int(val(x).shape[-1]), self.head_size, self.rotary_dim
        heads = b.call(aten.unsqueeze.default, b.call(aten.view.default, x, [-1, width // head_size, head_size]), 0)
        part = heads if rotary_dim == head_size else b.call(aten.slice.Tensor, heads, -1, 0, rotary_dim)
        result = b.call(torch.ops.npu_fuse.rotary_mul.default, part, cos, sin, self.mode)
        if rotary_dim < head_size:
            kept = b.call(aten.slice.Tensor, heads, -1, rotary_dim, head_size)
            result = b.call(aten.cat.default, [result, kept], -1)
        return b.call(aten.view.default, result, [-1, width])


def _view_args(view) -> tuple:
    if isinstance(view, SliceViewInfo):
        return (view.dim, view.start, view.end)
    if isinstance(view, AsStridedViewInfo):
        return (list(view.size), list(view.stride), view.storage_offset)
    return ()


def _regenerate(view, base, args: tuple):
    if isinstance(view, SliceViewInfo):
        return aten.slice.Tensor(base, *args)
    if isinstance(view, AsStridedViewInfo):
        return aten.as_strided.default(base, *args)
    if isinstance(view, (AliasViewInfo, NotView)):
        return base
    raise NotFused(f"auto_functionalized_v2 view {type(view).__name__} is not known")


def _view_node(b: GraphBuilder, view, bases: list) -> Node:
    base = bases[view.base_index]
    if isinstance(view, SliceViewInfo):
        return b.call(aten.slice.Tensor, base, *_view_args(view))
    if isinstance(view, AsStridedViewInfo):
        return b.call(aten.as_strided.default, base, *_view_args(view))
    return base


def _scatter(b: GraphBuilder, view, base: Node, value: Node) -> Node:
    """base with the region ``view`` reads replaced by value."""
    if isinstance(view, SliceViewInfo):
        return b.call(aten.slice_scatter.default, base, value, *_view_args(view))
    if isinstance(view, AsStridedViewInfo):
        return b.call(aten.as_strided_scatter.default, base, value, *_view_args(view))
    return value
