"""Translation validation: a rewrite stays only if its replacement computes what the
subgraph it replaces computes, checked by running both on random inputs.

The matchers check every rule they know; this is the net under them. Before the pass
manager accepts a rewrite, :func:`check_rewrite` evaluates the matched subgraph and its
replacement on the same random inputs and compares each output the replacement takes
over (shape, dtype, and values within the output dtype's tolerance). A difference is a
refusal ("replacement differs from the subgraph: ..."), and the manager undoes the
rewrite as a near-miss; a wrong match cannot ship silently.

Inputs. The values both sides read from the rest of the graph are drawn once and shared:

- a value one side reads that is computed (within a few nodes) from a value the other
  side reads, or from constants only (``full``, ``arange``, a ``get_attr``), is computed
  from it, not drawn: the two sides then see one consistent program state;
- floating tensors: uniform in [-1, 1]; integer tensors used as indices (``index``,
  ``index_put``, ``index_copy``, ``scatter``..., and the arguments another library's kernels
  index with, declared by :func:`register_opaque_indexing`): distinct valid indices of the
  indexed dim (negative ones too where Python indexing allows them); other integers: small
  values (the full range for 8-bit types); sizes: the traced hints;
- the tensors keep the stride order of the graph's values (expanded dims stay expanded);
- a small subgraph runs at its own shapes; one whose inputs exceed ``FULL_SIZE_ELEMENTS``
  runs first with its large non-last dims (never a head dim, never an indexed dim) shrunk
  to distinct small primes, in the inputs and in the size arguments of its nodes (cheap:
  RoPE on [B, N, S, D] runs at S = 5). Where the shrunk problem does not run, or differs,
  the full one decides, up to ``MAX_ELEMENTS`` input elements; beyond that the rewrite is
  refused if the shrunk run differed, else accepted unvalidated (counted in
  ``counters["npu_fuse_validation"]``, logged).

Values compare within the output dtype's tolerance (``TOLERANCE_EPS``): relative to the element,
plus a few eps of the scale of the values it is computed with (the rms of its last-dim row, or of
the whole output where larger).

Raising is an outcome like a value: for every index input a second and third draw put one
index just out of range (too large, too negative), where the subgraph raises; the
replacement must raise there too, or it would write where eager code stops the program
(not for a kernel that does not check the range: its result there is undefined, never run).
Where the subgraph raises on the valid draw, the replacement must too and the rewrite is
refused as unvalidated.

An internal failure of the validator refuses the rewrite with the reason (never the
compile): a rewrite that cannot be shown equal is not made.
"""

import dataclasses
import logging
import math
from typing import Any, Iterable, Optional

import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

log = logging.getLogger("npu_fuse")
aten = torch.ops.aten

FULL_SIZE_ELEMENTS = 1 << 13  # inputs up to this many elements run at their own shapes
MAX_ELEMENTS = 1 << 26  # never evaluate more (beyond: unvalidated)
SHRINK_FROM = 16  # only dims at least this large are shrunk
BRIDGE_HOPS = 6  # how far back a shared input is traced to the values it is computed from

# Tolerance per output element, in units of the output dtype's eps: |a - b| <= rtol*|b| + atol*scale(b),
# scale: see _value_scale. The inputs are uniform in [-1, 1], so intermediate terms stay near the
# outputs' scale and a rounding difference (eager rounds each op, a fused kernel once) stays within a
# few eps of it; a miscompile (a wrong element, sign, slice, broadcast or write) is off by the values
# themselves.
TOLERANCE_EPS = {torch.float16: (4, 8), torch.bfloat16: (4, 8), torch.float32: (16, 16), torch.float64: (16, 16)}

# ops through which an integer input keeps being "the same indices"
_INDEX_PASSTHROUGH = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                      aten.squeeze.dim, aten.squeeze.default, aten.expand.default, aten._to_copy.default,
                      aten.clone.default, aten.slice.Tensor, aten.select.int, aten.permute.default,
                      torch.ops.prims.convert_element_type.default, aten.alias.default}
_RANDOM_OPS = ("rand", "randn", "randint", "randperm", "bernoulli", "normal", "uniform", "multinomial",
               "native_dropout", "empty", "empty_strided", "empty_like", "new_empty")


class _NoSignature(Exception):
    pass


class _Ref(int):
    """A node of the rewrite, by its position, in a signature."""

    def __repr__(self) -> str:
        return f"%{int(self)}"


class Unvalidatable(Exception):
    """The rewrite cannot be evaluated (the reason says why)."""


@dataclasses.dataclass
class Raised:
    """An evaluation that raised."""

    error: BaseException

    def __str__(self) -> str:
        return f"{type(self.error).__name__}: {str(self.error).splitlines()[0] if str(self.error) else ''}"


@dataclasses.dataclass
class _IndexUse:
    bound: int  # the size of the indexed dim
    python: bool  # negative indices count from the end (index, index_put)
    indexed: tuple = ()  # the tensors indexed
    checked: bool = True  # eager raises on an index out of range (else nothing is drawn out of range)


# Opaque ops (another library's kernels) that index a table's rows with an integer argument:
# {schema name: (index argument, table argument, raises out of range)}. Their index inputs get
# valid rows; a kernel that does not check the range is never run on an index out of it.
_OPAQUE_INDEXING: dict = {}


def register_opaque_indexing(op_name: str, index: str, table: str, bounds_checked: bool) -> None:
    """Tell the validator that ``op_name`` (e.g. ``"_C::rotary_embedding"``) indexes the rows of
    its argument ``table`` with its argument ``index``."""
    _OPAQUE_INDEXING[op_name] = (index, table, bounds_checked)


def check_rewrite(subgraph: Iterable[Node], outputs: dict, inserted: list, seed: int = 0) -> Optional[str]:
    """None when the replacement computes what ``subgraph`` computes; else why not.

    ``outputs`` maps each output node of the subgraph to the node that replaced it;
    ``inserted`` are the replacement's nodes in the order they were built."""
    tally = counters["npu_fuse_validation"]
    try:
        with unset_fake_temporarily(), torch.no_grad():
            validation = _Validation(list(subgraph), outputs, inserted, seed)
            signature = validation.signature()
            if signature is not None and signature in _SHOWN_EQUAL:
                tally["equal"] += 1
                tally["equal_by_identical_rewrite"] += 1
                return None
            outcome = validation.run()
    except Unvalidatable as why:
        tally["unvalidated"] += 1
        return f"replacement could not be validated: {why}"
    except Exception as exc:  # the validator's own failure refuses the rewrite, never the compile
        log.debug("translation validation failed internally", exc_info=True)
        tally["unvalidated"] += 1
        return f"replacement could not be validated: {type(exc).__name__}: {exc}"
    if outcome is _TOO_LARGE:
        tally["skipped_too_large"] += 1
        return None
    tally["differs" if outcome else "equal"] += 1
    if outcome is None and signature is not None:
        if len(_SHOWN_EQUAL) >= _SHOWN_EQUAL_SIZE:
            _SHOWN_EQUAL.clear()
        _SHOWN_EQUAL.add(signature)
    return outcome


_TOO_LARGE = object()  # run()'s answer when the subgraph is too large to evaluate
# Signatures of rewrites shown equal. The evaluation is deterministic (fixed seed), so a rewrite
# identical to one of them op for op, on inputs of the same shapes, strides and dtypes, has the
# same outcome: the 32 layers of a model cost one validation per distinct site.
_SHOWN_EQUAL: set = set()
_SHOWN_EQUAL_SIZE = 4096


def forget_shown_equal() -> None:
    """Validate every rewrite again (tests do, so each sees its own rewrites evaluated)."""
    _SHOWN_EQUAL.clear()


class _Validation:
    def __init__(self, subgraph: list, outputs: dict, inserted: list, seed: int):
        self.original = _topological(subgraph)
        self.inserted = list(inserted)
        self.outputs = outputs
        self.seed = seed
        original, replacement = set(self.original), set(self.inserted)
        reads = [n for node in self.original for n in node.all_input_nodes if n not in original]
        reads += [n for node in self.inserted for n in node.all_input_nodes
                  if n not in replacement and n not in original]
        reads += [new for new in outputs.values() if new not in replacement]
        self.reads = list(dict.fromkeys(reads))
        self.bridge, self.leaves = _plan_inputs(self.reads, replacement)
        self.index_uses = self._index_uses()

    # -- the plan ------------------------------------------------------------------------
    def _index_uses(self) -> dict:
        """{integer leaf: _IndexUse} for the leaves the subgraph (or the bridge) indexes with."""
        scope = set(self.original) | set(self.bridge)
        uses = {}
        for leaf in self.leaves:
            value = leaf.meta.get("val")
            if not (isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()
                    and value.dtype != torch.bool):
                continue
            found = _index_use(leaf, scope)
            if found is not None:
                uses[leaf] = found
        return uses

    def _all_values(self) -> list:
        nodes = [*self.leaves, *self.bridge, *self.original, *self.inserted]
        return [n.meta.get("val") for n in nodes]

    def signature(self) -> Optional[tuple]:
        """The rewrite, input metadata and seed as a hashable value; None where that is not the
        whole story (a constant's values, a tensor constant in an argument)."""
        index = {}
        parts: list = [self.seed]
        for node in self.leaves:
            if node.op == "get_attr":
                return None
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                parts.append(("tensor", tuple(_concrete(x) for x in value.shape),
                              tuple(_concrete(x) for x in value.stride()), value.dtype, value.device))
            else:
                parts.append(("value", type(value).__name__, _concrete(value)))
            index[node] = len(index)
        def encode(x):
            if isinstance(x, Node):
                return _Ref(index[x])
            if isinstance(x, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise _NoSignature
            return x

        for node in [*self.bridge, *self.original, *self.inserted]:
            index[node] = len(index)
            try:
                encoded = torch.fx.node.map_aggregate((node.args, node.kwargs), encode)
            except (_NoSignature, KeyError):
                return None
            parts.append((str(node.target), repr(encoded)))
        parts.append(tuple((index.get(old), index.get(new)) for old, new in self.outputs.items()))
        return tuple(parts)

    # -- running ---------------------------------------------------------------------------
    def run(self) -> Optional[str]:
        full = sum(_numel(n.meta.get("val")) for n in self.leaves)
        shrunk_difference = None
        if full > FULL_SIZE_ELEMENTS:
            shrink = self._shrink_map()
            if shrink:
                try:
                    shrunk_difference = self._compare(shrink)
                    if shrunk_difference is None:
                        return None
                    # confirmed at the real shapes below: shrinking may have broken the subgraph
                except Unvalidatable as why:
                    log.debug("validation on shrunk shapes did not run (%s); trying full shapes", why)
            if full > MAX_ELEMENTS:
                if shrunk_difference:  # unconfirmed, but not shown equal either: refused
                    return shrunk_difference + " (on shrunk shapes)"
                log.info("npu_fuse: rewrite accepted unvalidated: its inputs have %d elements (> %d)",
                         full, MAX_ELEMENTS)
                return _TOO_LARGE
        return self._compare({})

    def _shrink_map(self) -> dict:
        """{size: smaller size} for the large non-last, non-indexed dims of the inputs."""
        keep = set()
        sizes = {}
        for value in self._all_values():
            if isinstance(value, torch.Tensor) and value.dim():
                keep.add(_concrete(value.shape[-1]))
        leaves = set(self.leaves)
        for use in self.index_uses.values():  # an indexed tensor keeps its rows: they bound the indices
            keep.add(use.bound)
            for node in use.indexed:
                while node not in leaves and node.target in _INDEX_PASSTHROUGH and isinstance(node.args[0], Node):
                    node = node.args[0]
                if node in leaves and isinstance(node.meta.get("val"), torch.Tensor):
                    keep.update(_concrete(size) for size in node.meta["val"].shape)
        for leaf in self.leaves:
            value = leaf.meta.get("val")
            if isinstance(value, torch.Tensor):
                for size in value.shape[:-1]:
                    size = _concrete(size)
                    if size >= SHRINK_FROM and size not in keep:
                        sizes[size] = sizes.get(size, 0) + 1
        taken = {_concrete(s) for v in self._all_values() if isinstance(v, torch.Tensor) for s in v.shape}
        small = (n for n in range(5, 10 ** 6) if n not in taken and all(n % p for p in range(2, int(n ** 0.5) + 1)))
        shrink = {}
        for size in sorted(sizes, reverse=True):
            shrink[size] = next(small)
            total = sum(_numel(n.meta.get("val"), shrink) for n in self.leaves)
            if total <= FULL_SIZE_ELEMENTS:
                break
        return shrink

    def _compare(self, shrink: dict) -> Optional[str]:
        draws = _Draws(self, shrink)
        for name, values in draws.samples():
            env = dict(values)
            base = self._evaluate(self.bridge, env, shrink)
            if isinstance(base, Raised):
                raise Unvalidatable(f"the inputs shared by both sides could not be computed ({base})")
            original = self._evaluate(self.original, dict(env), shrink, copy_inputs=True)
            replacement = self._evaluate(self.inserted, dict(env), shrink, copy_inputs=True,
                                         fallback=original if isinstance(original, dict) else None)
            reason = self._verdict(name, original, replacement, shrink)
            if reason:
                return reason
        return None

    def _verdict(self, sample: str, original, replacement, shrink: dict) -> Optional[str]:
        if isinstance(original, Raised):
            if isinstance(replacement, Raised):
                if sample == "valid":
                    if shrink:
                        raise Unvalidatable(f"the subgraph raised on shrunk shapes ({original})")
                    raise Unvalidatable(f"the subgraph raised on random inputs ({original})")
                return None  # both stop the program
            return (f"replacement differs from the subgraph: on {sample} inputs the subgraph raises "
                    f"({original}) and the replacement does not")
        if isinstance(replacement, Raised):
            if shrink:
                raise Unvalidatable(f"the replacement raised on shrunk shapes ({replacement})")
            return (f"replacement differs from the subgraph: the replacement raises ({replacement}) on "
                    f"{sample} inputs where the subgraph does not")
        for old, new in self.outputs.items():
            difference = _difference(original[old], replacement[new])
            if difference:
                return f"replacement differs from the subgraph: output {old.name} {difference} ({sample} inputs)"
        return None

    def _evaluate(self, nodes: list, env: dict, shrink: dict, copy_inputs: bool = False, fallback=None):
        """The values of nodes (in order), or Raised; env holds the values of what they read."""
        if copy_inputs and any(_mutates(n) for n in nodes):
            env = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in env.items()}
        for node in nodes:
            missing = [n for n in node.all_input_nodes if n not in env]
            for n in missing:
                if fallback is None or n not in fallback:
                    return Raised(Unvalidatable(f"{n.name} has no value"))
                env[n] = fallback[n]
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: env[n])
            if shrink:
                args, kwargs = _shrunk((args, kwargs), shrink)
            try:
                env[node] = node.target(*args, **kwargs)
            except Exception as exc:  # an outcome to compare, like a value
                return Raised(exc)
        return env


# -- inputs -------------------------------------------------------------------------------------
def _plan_inputs(reads: list, replacement: frozenset = frozenset()) -> tuple:
    """(bridge, leaves): the nodes to compute before the two sides (in order), and the values
    to draw. A read computed from another read or from constants is computed, not drawn; so is a
    node of the replacement, however far from the reads (a subgraph output that reads another one,
    ``copy(view, y)``, reads y's replacement once the rewrite is applied)."""
    reads_set = set(reads)
    kinds: dict = {}

    def kind(node: Node, depth: int) -> str:  # "const", "linked" (computed from a read) or "free"
        if node in kinds:
            return kinds[node]
        if node.op == "get_attr":
            result = "const"
        elif node.op != "call_function" or _is_random(node) or (depth > BRIDGE_HOPS and node not in replacement):
            result = "free"
        else:
            inputs = node.all_input_nodes
            sub = ["linked" if i in reads_set else kind(i, depth + 1) for i in inputs]
            result = "linked" if "linked" in sub else "const" if all(k == "const" for k in sub) else "free"
        kinds[node] = result
        return result

    needed: list = []
    leaves: list = []
    seen = set()

    def need(node: Node) -> None:
        if node in seen:
            return
        seen.add(node)
        if kind(node, 0) == "free":
            leaves.append(node)
            return
        for i in node.all_input_nodes:
            need(i)
        needed.append(node)

    for node in reads:
        kind(node, 0)
    for node in reads:
        need(node)
    return needed, leaves  # ``need`` appends a node after its inputs: a topological order


def _is_random(node: Node) -> bool:
    """A node whose value is not a function of its inputs (random, uninitialized, or mutating)."""
    name = getattr(node.target, "__name__", "")
    return name.split(".")[0] in _RANDOM_OPS or _mutates(node)


def _index_use(leaf: Node, scope: set) -> Optional[_IndexUse]:
    """How the subgraph indexes with an integer input: the tightest bound of its uses."""
    found: list = []
    frontier, seen = [leaf], set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user not in scope:
                continue
            use = _indexing(user, node)
            if use is not None:
                found.append(use)
            elif user.target in _INDEX_PASSTHROUGH and user.args and user.args[0] is node:
                frontier.append(user)
    if not found:
        return None
    return _IndexUse(min(u.bound for u in found), all(u.python for u in found), sum((u.indexed for u in found), ()),
                     all(u.checked for u in found))


def _indexing(user: Node, index: Node) -> Optional[_IndexUse]:
    def size(tensor, dim):
        value = tensor.meta["val"]
        return _concrete(value.shape[dim % value.dim()])

    target, args = user.target, user.args
    if target in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index.Tensor,
                  aten._unsafe_index_put.default):
        positions = [i for i, t in enumerate(args[1]) if t is index]
        return _IndexUse(size(args[0], positions[0]), True, (args[0],)) if positions else None
    if target in (aten.index_copy.default, aten.index_select.default, aten.index_add.default,
                  aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter_add.default,
                  aten.scatter_reduce.two, aten.gather.default, aten.index_fill.int_Scalar):
        if len(args) > 2 and args[2] is index:
            return _IndexUse(size(args[0], args[1]), False, (args[0],))
        return None
    if target == aten.embedding.default and len(args) > 1 and args[1] is index:
        return _IndexUse(size(args[0], 0), False, (args[0],))
    if target in (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2) \
            and args and getattr(args[0], "_schema", None) is not None:
        spec = _OPAQUE_INDEXING.get(args[0]._schema.name)
        if spec is not None and user.kwargs.get(spec[0]) is index and isinstance(user.kwargs.get(spec[1]), Node):
            return _IndexUse(size(user.kwargs[spec[1]], 0), False, (user.kwargs[spec[1]],), spec[2])
    return None


class _Draws:
    """The samples: one valid draw of every leaf, then per index input one draw with an index
    too large and one too negative."""

    def __init__(self, validation: _Validation, shrink: dict):
        self.v = validation
        self.shrink = shrink

    def samples(self):
        gen = {}
        values = {leaf: self._draw(leaf, gen) for leaf in self.v.leaves}
        yield "valid", values
        for leaf, use in self.v.index_uses.items():
            if not use.checked:  # eager's result out of range is undefined: nothing to compare
                continue
            bound = self.shrink.get(use.bound, use.bound)
            for label, bad in (("too large", bound), ("too negative", -bound - 1 if use.python else -1)):
                wrong = values[leaf].clone()
                if wrong.numel():
                    wrong.view(-1)[0] = bad
                    yield f"out-of-range index ({label}: {bad} into {bound} rows of {leaf.name})", \
                        {**values, leaf: wrong}

    def _generator(self, device, gen: dict) -> torch.Generator:
        if device not in gen:
            gen[device] = torch.Generator(device=device).manual_seed(self.v.seed)
        return gen[device]

    def _draw(self, leaf: Node, gen: dict) -> Any:
        value = leaf.meta.get("val")
        if leaf.op == "get_attr":
            return _attribute(leaf)
        if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)):
            concrete = _concrete(value)
            return self.shrink.get(concrete, concrete) if isinstance(concrete, int) and \
                not isinstance(concrete, bool) else concrete
        if not isinstance(value, torch.Tensor):
            raise Unvalidatable(f"input {leaf.name} has no tensor or number value ({type(value).__name__})")
        if value.device.type == "meta":
            raise Unvalidatable(f"input {leaf.name} is on the meta device")
        shape = [self.shrink.get(_concrete(s), _concrete(s)) for s in value.shape]
        strides = [_concrete(s) for s in value.stride()]
        g = self._generator(value.device, gen)
        use = self.v.index_uses.get(leaf)
        dense = [1 if st == 0 else sz for sz, st in zip(shape, strides)]  # expanded dims are drawn once
        order = sorted(range(len(shape)), key=lambda d: -strides[d])  # outermost first
        drawn = self._values([dense[d] for d in order], value.dtype, value.device, g, use)
        inverse = [order.index(d) for d in range(len(shape))]
        return drawn.permute(inverse).expand(shape) if shape else drawn

    def _values(self, shape, dtype, device, g, use: Optional[_IndexUse]) -> torch.Tensor:
        if dtype.is_floating_point or dtype.is_complex:  # uniform in [-1, 1): see TOLERANCE_EPS
            drawn = torch.empty(shape, dtype=dtype, device=device)
            (torch.view_as_real(drawn) if dtype.is_complex else drawn).uniform_(-1, 1, generator=g)
            return drawn
        if dtype == torch.bool:
            return torch.rand(shape, generator=g, device=device) < 0.5
        numel = math.prod(shape)
        if use is not None:
            bound = self.shrink.get(use.bound, use.bound)
            if numel <= bound:  # distinct rows: duplicate writes have no defined order
                rows = torch.randperm(bound, generator=g, device=device)[:numel]
            else:
                rows = torch.randint(0, max(bound, 1), (numel,), generator=g, device=device)
            if use.python and numel:  # some of them counted from the end
                flip = torch.rand(numel, generator=g, device=device) < 0.5
                flip[0] = True
                rows = torch.where(flip, rows - bound, rows)
            return rows.to(dtype).view(shape)
        info = torch.iinfo(dtype)
        low, high = (info.min, info.max + 1) if info.bits <= 8 else (max(info.min, -64), 65)
        return torch.randint(low, high, shape, generator=g, device=device, dtype=dtype)


# -- comparing ---------------------------------------------------------------------------------
def _difference(expected: Any, got: Any) -> Optional[str]:
    """How got differs from expected (None: equal within the dtype's tolerance)."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"is a sequence of {len(expected)}, the replacement gives {type(got).__name__}"
        for i, (e, g) in enumerate(zip(expected, got)):
            difference = _difference(e, g)
            if difference:
                return f"[{i}] {difference}"
        return None
    if not isinstance(expected, torch.Tensor):
        return None if expected == got else f"is {expected!r}, the replacement gives {got!r}"
    if not isinstance(got, torch.Tensor):
        return f"is a tensor, the replacement gives {type(got).__name__}"
    if got.shape != expected.shape:
        return f"has shape {list(expected.shape)}, the replacement gives {list(got.shape)}"
    if got.dtype != expected.dtype:
        return f"has dtype {expected.dtype}, the replacement gives {got.dtype}"
    if expected.device != got.device:
        return f"is on {expected.device}, the replacement gives {got.device}"
    if expected.is_complex():
        expected, got = torch.view_as_real(expected), torch.view_as_real(got)
    if not expected.is_floating_point():
        if torch.equal(expected, got):
            return None
        wrong = (expected != got).sum().item()
        return f"has {wrong} of {expected.numel()} integer values different"
    if torch.equal(expected, got):
        return None
    precise = torch.float64 if expected.dtype == torch.float64 else torch.float32
    e, g = expected.to(precise), got.to(precise)
    finite = torch.isfinite(e)
    if not (finite.all() and torch.isfinite(g).all()):
        if not torch.equal(finite, torch.isfinite(g)) or not torch.equal(e[~finite].nan_to_num(),
                                                                          g[~finite].nan_to_num()):
            count = (finite != torch.isfinite(g)).sum().item()
            return f"is finite where the replacement is not (or the reverse) at {count} of {e.numel()} elements"
        e, g = torch.where(finite, e, 0), torch.where(finite, g, 0)  # equal there: no error
    eps = torch.finfo(expected.dtype).eps
    rel, absolute = TOLERANCE_EPS.get(expected.dtype, (16, 16))
    scale = _value_scale(e)
    err = (e - g).abs_()
    slack = err - e.abs().mul_(rel * eps) - scale.mul_(absolute * eps)
    if slack.max().item() > 0:
        bad = int((slack > 0).sum())
        worst = int(slack.argmax())
        return (f"differs at {bad} of {expected.numel()} elements (by up to {err.max().item():.3g}; "
                f"e.g. {e.reshape(-1)[worst].item():.4g} vs {g.reshape(-1)[worst].item():.4g}, {expected.dtype})")
    return None


def _value_scale(e: torch.Tensor) -> torch.Tensor:
    """Per element, the scale of the values it is computed with: the rms of its last-dim row (a
    RoPE, softmax or normalized row), or of the whole output where that is larger. A row of large
    values computed by cancellation (``x1 * cos - x2 * sin``) carries its operands' rounding, which
    the rms of a mostly small output (an updated cache) would not allow."""
    whole = torch.linalg.vector_norm(e) / max(e.numel(), 1) ** 0.5
    if e.dim() == 0 or e.numel() == 0:
        return whole.expand(e.shape).clone()
    return e.pow(2).mean(-1, keepdim=True).sqrt_().clamp_(min=whole.item()).expand(e.shape).clone()


# -- helpers -----------------------------------------------------------------------------------
def _concrete(x: Any) -> Any:
    if isinstance(x, (torch.SymInt, torch.SymBool)):
        try:
            return guarding_hint_or_throw(x)
        except Exception as exc:
            raise Unvalidatable(f"symbolic size {x} has no hint") from exc
    if isinstance(x, torch.SymFloat):
        hint = x.node.hint
        if hint is None:
            raise Unvalidatable(f"symbolic float {x} has no hint")
        return hint
    return x


def _numel(value: Any, shrink: Optional[dict] = None) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    shrink = shrink or {}
    return math.prod(shrink.get(_concrete(s), _concrete(s)) for s in value.shape)


def _shrunk(tree: Any, shrink: dict) -> Any:
    """Integer arguments equal to a shrunk size, replaced by the smaller size."""
    def one(x):
        if type(x) is int and x in shrink:
            return shrink[x]
        return x

    return torch.utils._pytree.tree_map(one, tree)


def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _attribute(node: Node) -> Any:
    value = node.graph.owning_module
    for name in node.target.split("."):
        value = getattr(value, name)
    return value


def _topological(nodes: list) -> list:
    """nodes, each after the ones of them it reads."""
    inside, done, order = set(nodes), set(), []

    def visit(node):
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if current in done:
                continue
            if expanded:
                done.add(current)
                order.append(current)
                continue
            stack.append((current, True))
            stack.extend((i, False) for i in current.all_input_nodes if i in inside and i not in done)

    for node in nodes:
        visit(node)
    return order
