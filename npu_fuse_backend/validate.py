"""Translation validation: a rewrite stays only if its replacement computes what the subgraph
it replaces computes, checked by running both on the same inputs before the rewrite is kept.

The matchers check every rule they know; this is the net under them. :func:`check_rewrite`
evaluates the matched subgraph and its replacement on shared inputs and compares each output
the replacement takes over: shape, dtype, device, which elements are NaN or +-inf, and the
finite values within the output dtype's tolerance. Raising is an outcome too. A difference is
a refusal ("replacement differs from the subgraph: ..."), which the manager undoes as a
near-miss. The proof strategy, written down (the README repeats it for users):

**Inputs.** The values both sides read from the rest of the graph are drawn once per probe and
shared. A read computed (within ``BRIDGE_HOPS`` nodes) from another read, from constants, or
from sizes only (``full``, ``arange``, inductor's shared zeros, a ``get_attr``) is computed,
not drawn, so both sides see one consistent program state. Three kinds of node are never run:
random ops, ops that mutate their inputs, and opaque ops (a user's custom op, an unknown
higher-order op); their outputs are drawn as inputs of the check instead, so validation has
no side effect on the user's program (a subgraph or replacement containing one is refused as
unvalidated). An RNG-state input (the state ``run_with_rng_state`` replays, as inductor's
recomputation of checkpointed code does) is a recorded generator state, never random bytes.

**Probes** (every float input of each probe, tables and scales included):

- ``uniform``: uniform in [-1, 1);
- ``magnitudes``: values far outside [-1, 1], large values, tables and scales above 1: uniform
  times a power of two that changes from block to block (slices along the outermost dims, so
  the rows an op reduces or contracts over keep one magnitude), from 2^-10 up to 2^27 (float16:
  2^-6 .. 2^12); a one-element input (a scale, a temperature) is (1 + |u|) 2^7 (float16: 2^4).
  An input of more than 2^20 elements (a weight: the op fixes its sizes, so it never shrinks)
  stays uniform: scaling a weight's output features apart would make the next contraction
  ill-conditioned rather than test large values. An element eager computes finite must be finite
  and within tolerance in the replacement. Where eager overflows on this probe although it is
  finite on ``uniform`` (an fp16 MLA: three contractions of scaled inputs), the probe is at the
  dtype's edge, where a correct kernel that rounds an intermediate once overflows where eager,
  rounding twice, does not: the elements both sides compute finite are compared there (where the
  precise run below fits: near overflow eager is ill-conditioned), then the probe is drawn again
  with its levels' exponents times 3/4 (``_lowered``: 2^12, 2^9, 2^6...) until eager is finite,
  and that draw is compared by the rule above (if even 2^1 overflows, the elements eager overflows
  on are not compared). Large values still make some subgraphs ill-conditioned (``p * (g - sum(g * p))``
  with |p| > 1 loses digits to cancellation, in eager as in any kernel), so this probe also
  allows 2^-12 of the row's rms (a faulty kernel is off by far more) and four times eager's own
  error (the largest in the element's last-dim row) measured against the subgraph run in float64
  (float32 for a subgraph of 16-bit floats), where that run fits the budget (it runs only when the
  comparison without that allowance fails: it only ever allows more);
- ``NaN``: uniform with NaN and -0.0 planted in every float input: an output element is NaN in
  the replacement exactly where it is NaN in eager (the sign of a zero is not compared);
- ``infinities``: uniform with +inf and -inf planted: where eager is finite the replacement is
  finite and close, where eager is not (inf, or NaN from inf - inf) neither is the replacement
  (which infinity or NaN is not compared: ``m0 - p * sum(m0)`` and ``p * (g - sum(m0))`` are one
  function of finite inputs, ``inf - inf`` in one and ``-inf`` in the other);
- ``repeated indices`` where the subgraph allows them: reads (``index``, ``gather``,
  ``embedding``...), accumulating writes (``index_add``, ``index_put(accumulate=True)``,
  ``scatter_add``) and ``index_put``/``t[idx] = v``, whose duplicates keep the last write (eager's
  order on a serial CPU run, and what ``torch.use_deterministic_algorithms`` guarantees): the
  replacement must agree. ``index_copy`` and ``scatter`` (src) are documented as
  nondeterministic for duplicates, so their indices are drawn distinct;
- ``out-of-range index``: per index input, one index just past each end (too large, too
  negative where Python indexing allows negatives): where eager raises, the replacement must.

The two index probes run right after ``uniform`` and draw its very float values, so what the
subgraph computes from floats alone (an MLA's projections) is computed once for the three.

Integer inputs used as indices are valid (distinct where the input has at most as many
entries as rows, negative ones where Python indexing allows them); other integers small.

**Shapes.** A rewrite whose inputs hold at most ``FULL_ELEMENTS`` elements, with static
shapes, runs at its real shapes with every probe (so does one that shrinking would not make
much smaller, e.g. an MLA prologue whose weights' sizes the op fixes, if it fits the budget).
Otherwise:

1. *Shrunk run*, every probe but ``magnitudes``: each size of at least ``SHRINK_FROM`` becomes a distinct small
   prime, both in the inputs and in the integer arguments equal to it (and to its products
   with neighbouring sizes: a flattened view, ``view(q, [-1, heads, 192])``; and to its sums with
   the others of a split's sizes or a cat's inputs: a fused projection's 2112 = 1536 + 576 rows,
   whose weight would otherwise be read at its real size by every evaluation). A size is shrunk
   per dim of the inputs, so that two dims of one size shrink apart (the sequence dims of an
   ``[S, S]`` attention map; an MLA's heads and its 128-wide nope dim), each integer argument
   following the dim it names, found by trying; where that fails, per value. A shrink is used
   only if every node, run on meta tensors, gets the shape the shrink predicts, so the shrunk
   problem is the same program at other sizes; sizes that break that stay real: a shrink that breaks
   at a node is tried again without the size its shapes, integers or summed sizes point to that saves
   the least (an MLA's rope dim, whose halves a literal slices), and an integer two sizes share (an
   MLA's block size and nope dim, both 128) follows one, then the other, where that breaks. An
   integer that is also a product of sizes that stay (a slot count, 16 blocks * 16 slots, beside
   2 heads * a shrunk 128) keeps its value; no prime equals a symbol's hint. A shrunk problem on
   which the subgraph raises on ``uniform`` inputs broke a rule no meta kernel checks (an opaque
   kernel's): the rewrite is evaluated at its real shapes instead, where they fit the budget. A fused op's size
   ranges that only its NPU kernel has (an MLA's hidden size of 2048..8192) are lifted while the
   validator runs (``registry.size_limits_lifted``): its call at the real sizes was checked when the
   rewrite was built, and the confirmation below runs each size at its real length. (A pointwise op's
   shape there is its inputs' broadcast, a softmax's or a cast's its input's: their meta kernels,
   Python and slow, are not run.) Symbolic sizes
   are symbols: the shrunk run sets each one to a small value that satisfies every guard of the
   graph's shape environment.
2. *Confirmation*, of every shrunk size (or symbol) at its real length (the hint of a symbol),
   the other sizes shrunk, on the ``magnitudes`` probe (which the shrunk run leaves to it), so every
   position of every dim is evaluated once at its real place, with large values. The static sizes are
   packed into groups (first fit, largest first) whose inputs hold at most ``CONFIRM_ELEMENTS``
   elements (judged from the inputs' shapes; a complete group is then sized against the memory
   budget, and one over it confirmed size by size): an MLA's hidden size with its heads, nope dim and
   block size, its q latent with its kv latent (the parts of a sum go together where they fit: each
   row of a fused projection at its real place), never both dims of a weight at their real lengths,
   which would be the real compute the shrink spares. A size whose real length alone exceeds that
   (a long sequence, a paged cache's blocks) is confirmed on ``SAMPLE_ROWS`` (or the next free prime)
   sampled rows instead, packed likewise: the rows include the first and the last, an ``arange`` of
   that length yields the sampled rows' real positions, and a cache's slots are drawn in the smaller
   cache (a whole cache is never copied). Symbols are confirmed one at a time.
3. A symbolic graph runs once more, ``uniform``, at a second small value of every symbol.

**Budget.** Every evaluation is sized before it runs, from its nodes' shapes: those of a run on
meta tensors, or for a confirmation those of the shrunk problem with the confirmed sizes' primes at
their new lengths (each node's shape is checked as it runs, a factory's before it allocates): it may
hold at most ``MEMORY_BUDGET`` bytes at once (inputs, clones of what a side mutates, the
live intermediates of one side, a fused kernel's temporaries, the float64 reference where it
runs); outputs are compared block by block; a confirmation's inputs hold at most ``CONFIRM_ELEMENTS``
elements (its share of the time budget). An input of more than ``PERIODIC_FROM`` elements (a weight)
is a window of one repeated random block of a prime length per dtype, at a phase of its own (cheap,
and no two of its rows alike; the magnitudes probe scales a copy), and every draw is reused by the
next problem of the rewrite where its shape is the same. Evaluations dispatch as a compiled program's
run does: without the Python dispatcher a compile enables (under it every op call is ~6x slower), and
without autograd or view tracking. A rewrite that no problem of the plan fits is refused
("could not be validated within the budget: ..."), or kept with a warning and a mark in its
report under ``config.keep_unvalidated_rewrites``. Nothing ships unchecked silently.

**Tolerance** (``TOLERANCE_EPS``): per element, a few eps of the output dtype relative to the
element plus a few eps of the scale of the values it is computed with, the rms of its last-dim
row (and, outside the ``magnitudes`` probe, of the whole output where that is larger). An output
larger than ``COMPARE_ELEMENTS`` (an updated cache) is compared on its rows that are not bit for bit
eager's, with the counts and the rms of the whole.

**What is not checked.** Values, sizes and positions no probe draws (a fault that needs two
sizes past their shrunk lengths at once, rows past the sampled ones of a size confirmed by
sampling, a weight's values beyond [-1, 1]); the order of duplicate writes where eager's own
order is undefined; the sign of a zero; which infinity or NaN an ``inf - inf`` becomes; the
behaviour of the opaque and random ops themselves (their outputs are inputs here).

An internal failure of the validator refuses the rewrite with the reason (never the compile):
a rewrite that cannot be shown equal is not made.
"""

import contextlib
import dataclasses
import functools
import logging
import math
import random
import warnings
from typing import Any, Iterable, Optional

import torch
from torch._dynamo.utils import counters
from torch._dispatch.python import no_python_dispatcher
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2_dense
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node

from .graph_utils import attribute, describe, draws_random, mutates, pure_aten_op, uninitialized
from .lowering.common import half_matmul
from .lowering.registry import size_limits_lifted
from .torch_compat import concrete_hint

log = logging.getLogger("npu_fuse")
aten = torch.ops.aten

FULL_ELEMENTS = 1 << 18  # static inputs up to this many elements run at their real shapes
MEMORY_BUDGET = 64 << 20  # bytes one evaluation may hold at once
SHRINK_FROM = 16  # only sizes at least this large are shrunk
SAMPLE_ROWS = 19  # rows of a size confirmed by sampling (a prime, past the shrunk sizes)
CONFIRM_ELEMENTS = 1 << 21  # a confirmation's inputs hold at most this many elements (its share of the time
# budget): sizes are confirmed together up to it; a size past it alone is confirmed on sampled rows
BRIDGE_HOPS = 6  # how far back a shared input is traced to the values it is computed from
PERIODIC_FROM = 1 << 14  # inputs with more elements are windows of one periodic sequence (see _uniform)
SCALED_UP_TO = 1 << 20  # the magnitudes probe scales inputs of at most this many elements (a larger one is a weight)
PERIOD = 65521  # the largest prime below 2^16
PYTHON_DRAWS_UP_TO = 4096  # index inputs of at most this many entries are drawn with Python's random
PHASE = 64  # inputs drawn from one periodic sequence start position * PHASE into it (mod PERIOD, aligned:
# a matmul reads a 64-byte-aligned weight ~1.5x faster)
GREEDY_TRIES = 12  # sizes tried one at a time (the largest savings) when shrinking all of them at once fails

# Tolerance per output element, in units of the output dtype's eps: |a - b| <= rtol*|b| + atol*scale(b),
# scale: the rms of the element's last-dim row (see _beyond_tolerance). A rounding difference (eager
# rounds each op, a fused kernel once) stays within a few eps of the values an element is computed
# with; a miscompile (a wrong element, sign, slice, broadcast or write) is off by the values themselves.
TOLERANCE_EPS = {torch.float16: (4, 8), torch.bfloat16: (4, 8), torch.float32: (16, 16), torch.float64: (16, 16)}

# Powers of two by which the magnitudes probe scales blocks (exact scalings, no rounding), per dtype.
MAGNITUDES = {torch.float16: (2.0 ** -6, 1.0, 2.0 ** 4, 2.0 ** 8, 2.0 ** 12)}
MAGNITUDES_DEFAULT = (2.0 ** -10, 1.0, 2.0 ** 7, 2.0 ** 14, 2.0 ** 27)
MAGNITUDES_RTOL = 2.0 ** -12  # of the row's rms: what the magnitudes probe allows on top of rounding
PARALLEL_FROM = 1 << 21  # a problem whose inputs hold this many elements runs on the caller's threads
COMPARE_ELEMENTS = 1 << 18  # outputs are compared in blocks of rows of about this many elements
PLANTED = {"NaN": (float("nan"), -0.0), "infinities": (float("inf"), float("-inf"))}

# views through which an integer input keeps being "the same indices", or a write reaches its base
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.expand.default, aten.slice.Tensor,
          aten.select.int, aten.permute.default, aten.transpose.int, aten.t.default, aten.alias.default,
          aten.as_strided.default, aten.unflatten.int, aten.flatten.using_ints}
_INDEX_PASSTHROUGH = _VIEWS | {aten._to_copy.default, aten.clone.default, torch.ops.prims.convert_element_type.default}
_MATMULS = (aten.mm.default, aten.bmm.default)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


class Unvalidatable(Exception):
    """The rewrite cannot be evaluated (the reason says why)."""


class OverBudget(Unvalidatable):
    """No evaluation of the plan fits the budget."""


class _Unfaithful(Exception):
    """A problem at other sizes than the real ones on which the subgraph raises on uniform inputs: the
    shrink broke a rule no meta kernel checks (an opaque op's), it is not the same program."""


class _NoSignature(Exception):
    pass


class _Inconsistent(Exception):
    """A shrink under which the program is not the same program at other sizes (at ``node``)."""

    def __init__(self, message: str, node: Optional[Node] = None, blamed: frozenset = frozenset()):
        super().__init__(message)
        self.node = node
        self.blamed = blamed  # the shrunk sizes (_Size) the shapes there point to, where known


_NODE_REF = object()  # (_NODE_REF, i): the rewrite's i-th node, in a signature
_AS_IS = frozenset((int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))


def _signed(x: Any, index: dict) -> Any:
    """An argument as a hashable value for a signature: a node by its position in ``index``, a
    constant by its type and value (1, True and 1.0 apart; -0.0 and nan by their spelling)."""
    kind = type(x)
    if kind in _AS_IS:
        return x
    if kind is Node:
        return _NODE_REF, index[x]
    if kind is float:
        return float, repr(x)
    if isinstance(x, (list, tuple)):
        return list if isinstance(x, list) else tuple, tuple([_signed(a, index) for a in x])
    if isinstance(x, dict):
        return dict, tuple([(k, _signed(v, index)) for k, v in x.items()])
    if isinstance(x, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _NoSignature
    return kind, repr(x)  # (a bool, an op, a slice: by type and spelling)


@dataclasses.dataclass
class Raised:
    """An evaluation that raised."""

    error: BaseException
    node: Optional[Node] = None  # the node that raised

    def __str__(self) -> str:
        return f"{type(self.error).__name__}: {str(self.error).splitlines()[0] if str(self.error) else ''}"


def check_rewrite(subgraph: Iterable[Node], outputs: dict, inserted: list, seed: int = 0,
                  notes: Optional[list] = None, keep_unvalidated: bool = False) -> Optional[str]:
    """None when the replacement computes what ``subgraph`` computes; else why not.

    ``outputs`` maps each output node of the subgraph to the node that replaced it; ``inserted``
    are the replacement's nodes in the order they were built. A rewrite kept unvalidated (over
    the budget, ``keep_unvalidated``: ``config.keep_unvalidated_rewrites``) returns None and appends
    why to ``notes``."""
    tally = counters["npu_fuse_validation"]
    signature = None
    try:
        validation = _Validation(list(subgraph), outputs, inserted, seed)  # (reads metadata only)
        signature = validation.signature()
        if signature is not None and signature in _SHOWN_EQUAL:
            tally["equal"] += 1
            tally["equal_by_identical_rewrite"] += 1
            return None
        # (an op's NPU size ranges are lifted: the shrunk problems run it at other sizes; the real call was
        # checked when the rewrite was built)
        with unset_fake_temporarily(), _eager_dispatch(), _one_thread() as validation.threads, size_limits_lifted():
            outcome = validation.run()
            tally["evaluations"] += validation.evaluations
    except OverBudget as why:
        if keep_unvalidated:
            tally["kept_unvalidated"] += 1
            note = f"kept unvalidated (config.keep_unvalidated_rewrites): {why}"
            warnings.warn(f"npu_fuse: a rewrite is {note}", RuntimeWarning, stacklevel=2)
            if notes is not None:
                notes.append(note)
            return None
        tally["over_budget"] += 1
        return f"replacement could not be validated within the budget: {why}"
    except Unvalidatable as why:
        tally["unvalidated"] += 1
        return f"replacement could not be validated: {why}"
    except Exception as exc:  # the validator's own failure refuses the rewrite, never the compile
        log.debug("translation validation failed internally", exc_info=True)
        tally["unvalidated"] += 1
        return f"replacement could not be validated: {type(exc).__name__}: {exc}"
    tally["differs" if outcome else "equal"] += 1
    if outcome is None and signature is not None:
        if len(_SHOWN_EQUAL) >= _SHOWN_EQUAL_SIZE:
            _SHOWN_EQUAL.clear()
        _SHOWN_EQUAL.add(signature)
    return outcome


@contextlib.contextmanager
def _eager_dispatch():
    """Ops dispatched as a compiled program's run does: no Python dispatcher (a compile enables it, and
    with it every op call looks for Python kernels: ~6x slower), no autograd, and no view or version
    tracking (ADInplaceOrView: every value here is an inference temporary; an op's own kernel runs)."""
    with no_python_dispatcher(), torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        yield


@contextlib.contextmanager
def _one_thread():
    """Most evaluations are small: one thread runs them faster than a pool whose threads wait for
    cores a compile (or other work) keeps busy. Yields the caller's thread count, which a problem of
    at least ``PARALLEL_FROM`` input elements uses (see _Validation._compare)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


# Signatures of rewrites shown equal. The evaluation is deterministic (fixed seed), so a rewrite
# identical to one of them op for op, on inputs of the same shapes, strides and dtypes, has the
# same outcome: the 32 layers of a model cost one validation per distinct site.
_SHOWN_EQUAL: set = set()
_SHOWN_EQUAL_SIZE = 4096


def forget_shown_equal() -> None:
    """Validate every rewrite again (tests do, so each sees its own rewrites evaluated)."""
    _SHOWN_EQUAL.clear()


# -- what a node is --------------------------------------------------------------------------------
def _is_sym(value: Any) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _is_size(node: Node) -> bool:
    """A node holding a number (a size, a symbolic value), not tensor data."""
    value = node.meta.get("val")
    return isinstance(value, (int, float, bool)) or _is_sym(value)


def _is_float_tensor(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _runnable(node: Node) -> bool:
    """A node the bridge may run: a known op (below) that neither draws random numbers nor mutates."""
    target = node.target
    if node.op != "call_function":
        return _runnable_node(node)
    found = _RUNNABLE_TARGETS.get(id(target))  # the other calls': a property of their target alone
    if found is not None and found[0] is target:
        return found[1]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _runnable_node(node)  # (what a higher-order op runs is among its arguments)
    found = _RUNNABLE_TARGETS[id(target)] = (target, _runnable_node(node))
    return found[1]


def _runnable_node(node: Node) -> bool:
    # (an ``empty``'s value is no input to compute, though a side may run it: it writes it before reading)
    return not draws_random(node.target) and not uninitialized(node) and not mutates(node.target) and _known(node)


# id(call target) -> (the target, _runnable of its calls) (asked of every node a bridge walks past; by id:
# an OpOverload hashes slowly)
_RUNNABLE_TARGETS: dict = {}


def _known(node: Node) -> bool:
    """aten/prims ops, our own fused ops, getitem and size arithmetic, and the replay of a
    recorded RNG state; everything else (a user's custom op, another higher-order op) is opaque."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in ("aten", "prims", "npu_fuse")
    if _registered_opaque(node) is not None:
        return True
    if target is torch.ops.higher_order.auto_functionalized_v2:
        op = node.args[0]
        return isinstance(op, torch._ops.OpOverload) and op.namespace == "npu_fuse"
    if target is torch.ops.higher_order.run_with_rng_state:
        return isinstance(node.args[1], torch._ops.OpOverload) and node.args[1].namespace in ("aten", "prims")
    module = getattr(target, "__module__", None) or ""
    return module in ("_operator", "operator", "math", "builtins") or target in (
        torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sum)


_REFUSED_TARGETS: dict = {}  # id(op) -> (op, whether its calls are random or opaque) (asked of every node of every rewrite)
_TARGET_NAMES: dict = {}  # id(call target) -> (target, str(target)), in signatures (an OpOverload's str is slow)


# -- the validation --------------------------------------------------------------------------------
class _Validation:
    def __init__(self, subgraph: list, outputs: dict, inserted: list, seed: int):
        self.original = _topological(subgraph)
        self.inserted = list(inserted)
        self.outputs = outputs
        self.seed = seed
        self.evaluations = 0
        self.overflow_free = True  # eager's outputs are finite on uniform inputs: a non-finite one on the
        # magnitudes probe is an overflow (the probe's values lowered), not what the subgraph computes
        for node in [*self.original, *self.inserted]:  # (a mutating op runs on clones of what it writes)
            target = node.target
            known = _REFUSED_TARGETS.get(id(target)) if node.op == "call_function" else None
            if known is not None and known[0] is target:  # (an op call's: a property of its op)
                refused = known[1]
            else:
                refused = draws_random(node.target) or not _known(node)
                if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
                    _REFUSED_TARGETS[id(target)] = (target, refused)
            if refused:
                what = "random" if draws_random(node.target) else "opaque"
                raise Unvalidatable(f"{describe(node)} is {what}: validation never runs such an op")
        original, replacement = set(self.original), set(self.inserted)
        reads = [n for node in self.original for n in node.all_input_nodes if n not in original]
        reads += [n for node in self.inserted for n in node.all_input_nodes
                  if n not in replacement and n not in original]
        reads += [new for new in outputs.values() if new not in replacement]
        self.reads = list(dict.fromkeys(reads))
        self.bridge, self.leaves = _plan_inputs(self.reads, frozenset(replacement))
        self.nodes = [*self.leaves, *self.bridge, *self.original, *self.inserted]

    # what only an evaluation needs (most rewrites are shown equal by their signature alone)
    @functools.cached_property
    def kept(self) -> set:
        """The original values the replacement reads, and the outputs: kept for the second side and the
        verdict."""
        original = set(self.original)
        kept = {n for node in self.inserted for n in node.all_input_nodes if n in original}
        return kept | set(self.outputs) | set(self.outputs.values())

    @functools.cached_property
    def constants(self) -> tuple:
        """The nodes of either side made from their arguments alone (the replacement's ``full`` of ones for
        a scale its op needs), which no node writes: computed once per problem, shared by its probes."""
        return tuple(node for node in [*self.original, *self.inserted] if node.op == "call_function" and
                     not node.all_input_nodes and pure_aten_op(node.target) and
                     not any(mutates(user.target) for user in node.users))

    @functools.cached_property
    def mutated(self) -> dict:
        """{id of a side's node list: the leaves it writes}: cloned before that side runs."""
        leaves = set(self.leaves)
        return {id(nodes): _mutated_leaves(nodes, leaves) for nodes in (self.original, self.inserted)}

    @functools.cached_property
    def reference_dtype(self) -> torch.dtype:
        floats = [leaf.meta["val"].dtype for leaf in self.leaves if _is_float_tensor(leaf)]
        narrow = floats and all(torch.finfo(d).bits <= 16 for d in floats)
        return torch.float32 if narrow else torch.float64

    @functools.cached_property
    def rng_states(self) -> set:
        # (a generator state is an integer tensor: a float leaf, as a table every layer reads, is none)
        return {leaf for leaf in self.leaves if not _is_float_tensor(leaf) for user in leaf.users
                if user.target is torch.ops.higher_order.run_with_rng_state and user.args[0] is leaf}

    @functools.cached_property
    def index_uses(self) -> dict:
        """{integer leaf: [_IndexUse]} for the leaves the subgraph (or the bridge) indexes with."""
        scope = set(self.original) | set(self.bridge)
        uses = {}
        for leaf in self.leaves:
            value = leaf.meta.get("val")
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
                    and value.dtype != torch.bool:
                found = _index_uses_of(leaf, scope)
                if found:
                    uses[leaf] = found
        return uses

    @functools.cached_property
    def stable(self) -> frozenset:
        """The subgraph's nodes computed from float inputs (and sizes and attributes) alone. The
        probes that follow ``uniform`` in a problem and change only integers (``repeated indices``,
        ``out-of-range index``) draw every float input as the very tensor ``uniform`` drew, untouched
        since, so such a node has the value it had there: those probes reuse it (an MLA's matmuls
        are computed once, its cache write per probe). Empty where a node of either side writes in
        place (a reused value could have been written: the replacement reads the subgraph's values)."""
        if any(mutates(node.target) for node in [*self.original, *self.inserted]):
            return frozenset()
        stable = {leaf for leaf in self.leaves if not isinstance(value := leaf.meta.get("val"), torch.Tensor)
                  or value.is_floating_point() or value.is_complex()}  # (integers, RNG states: drawn afresh)
        for node in [*self.bridge, *self.original]:
            if all(n in stable for n in node.all_input_nodes):
                stable.add(node)
        return frozenset(n for n in self.original if n in stable)

    def _reused(self, problem: "_Problem") -> Optional[set]:
        """The stable nodes whose uniform values the integer-only probes of ``problem`` reuse: those an
        integer-dependent node reads, and outputs (the rest is not needed then); None where there is
        nothing to reuse, or it would hold more than an eighth of the memory budget."""
        if not self.stable or not (set(problem.probes) & {"repeated indices", "out-of-range index"}):
            return None
        kept = self.kept
        frontier = {n for n in self.stable if n in kept or any(u not in self.stable for u in n.users)}
        held = 0
        for node in frontier:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                shape = problem.shapes.get(node)
                if shape is None:
                    return None
                held += math.prod(shape) * value.dtype.itemsize
        return frontier if frontier and held <= MEMORY_BUDGET // 8 else None

    def signature(self) -> Optional[tuple]:
        """The rewrite, input metadata and seed as a hashable value; None where that is not the
        whole story (a constant's values, a tensor constant in an argument)."""
        index = {}
        parts: list = [self.seed, FULL_ELEMENTS, MEMORY_BUDGET]
        for node in self.leaves:
            if node.op == "get_attr":
                return None
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                shape, stride = tuple(value.shape), value.stride()
                if value._has_symbolic_sizes_strides:
                    shape, stride = tuple(map(_sym_repr, shape)), tuple(map(_sym_repr, stride))
                parts.append(("tensor", shape, stride, value.dtype, value.device))
            else:
                parts.append(("value", type(value).__name__, _sym_repr(value)))
            index[node] = len(index)

        for node in [*self.bridge, *self.original, *self.inserted]:
            index[node] = len(index)
            try:
                encoded = _signed(node.args, index), _signed(node.kwargs, index) if node.kwargs else ()
            except (_NoSignature, KeyError):
                return None
            named = _TARGET_NAMES.get(id(node.target))
            if named is None or named[0] is not node.target:
                named = _TARGET_NAMES[id(node.target)] = (node.target, str(node.target))
            parts.append((named[1], encoded))
        parts.append(tuple((index.get(old), index.get(new)) for old, new in self.outputs.items()))
        return tuple(parts)

    # -- the plan ------------------------------------------------------------------------------
    def run(self) -> Optional[str]:
        self.periodic: dict = {}  # (dtype, device) -> the sequence large inputs are windows of (_Draws._sequence)
        self.patterns: dict = {}  # the magnitudes probe's factors per block count (_scale_rows)
        plan = _Plan(self)
        for problem in plan.problems():
            try:
                difference = self._compare(problem)
            except _Unfaithful as why:  # (then the real shapes, if they fit the budget, prove it all)
                log.debug("validation: %s; at the real shapes instead", why)
                return self._compare(plan.real())
            if difference:
                return difference
        return None

    def _compare(self, problem: "_Problem") -> Optional[str]:
        # uniform draws of inputs whose shape the previous problem had too (weights an op fixes) are reused
        self.bases = {leaf: (shape, t) for leaf, (shape, t) in getattr(self, "bases", {}).items()
                      if tuple(problem.shapes.get(leaf, ())) == shape}
        draws = _Draws(self, problem)
        parallel = getattr(self, "threads", 1) > 1 and _elements(problem, self.leaves) >= PARALLEL_FROM
        if parallel:  # (an MLA's weights at their real sizes: the compile's Python leaves the other cores idle)
            torch.set_num_threads(self.threads)
        try:
            return self._compare_probes(problem, draws)
        finally:
            draws.restore()
            if parallel:
                torch.set_num_threads(1)

    def _compare_probes(self, problem: "_Problem", draws: "_Draws") -> Optional[str]:
        frontier = self._reused(problem)
        uniform: Optional[dict] = None  # frontier node -> its value in the uniform probe (see stable)
        for probe, values in draws.samples():
            self.evaluations += 1
            if probe == "uniform" and frontier:
                uniform = dict.fromkeys(frontier)
                original = self._side(self.original, values, problem, record=uniform)
                if not isinstance(original, dict):
                    uniform = None
            elif uniform is not None and probe.startswith(("repeated indices", "out-of-range index")):
                original = self._side(self.original, values, problem, reuse=uniform)
            else:
                uniform = None  # (the float inputs change from here on)
                original = self._side(self.original, values, problem)
            if probe == "uniform" and isinstance(original, dict):
                self.overflow_free = self.overflow_free and self._outputs_finite(original)
            if probe == "magnitudes" and self.overflow_free and isinstance(original, dict) \
                    and not self._outputs_finite(original):
                # eager overflows: the probe is at the dtype's range. Near the largest finite value a correct
                # kernel overflows where eager does not (it rounds an intermediate once where eager rounds
                # twice, to either side of it), so here only what both sides compute finite is compared, and
                # the probe is drawn again, lower, until eager does not overflow: there the rule is strict
                reason = self._judge(probe, problem, values, original, overflowed=True) if problem.precise else None
                if reason:
                    return reason
                while not self._outputs_finite(original) and draws.lower_magnitudes():
                    self.evaluations += 1
                    values = draws.redraw(probe)
                    original = self._side(self.original, values, problem)
                    if not isinstance(original, dict):
                        break
            reason = self._judge(probe, problem, values, original, lowered=draws.lowered)
            if reason:
                return reason
            values = original = None  # (freed before the next probe is drawn)
        return None

    def _judge(self, probe: str, problem: "_Problem", values: dict, original, lowered: int = 0,
               overflowed: bool = False) -> Optional[str]:
        """The replacement run on the probe's values and compared with eager's outputs: a refusal or None."""
        replacement = self._side(self.inserted, values, problem,
                                 fallback=original if isinstance(original, dict) else None)
        reason = self._verdict(probe, problem, original, replacement, lowered=lowered, overflowed=overflowed)
        if reason and probe == "magnitudes" and problem.precise and isinstance(original, dict) \
                and isinstance(replacement, dict):  # (eager's own error only ever allows more: measured
            exact = self._side(self.original, values, problem, precise=True)  # where the verdict needs it)
            reason = self._verdict(probe, problem, original, replacement, exact if isinstance(exact, dict) else None,
                                   lowered=lowered, overflowed=overflowed)
        return reason

    def _outputs_finite(self, values: dict) -> bool:
        """Every element of every output the replacement takes over is finite (in a list's tensors too)."""
        def finite(value) -> bool:
            if isinstance(value, (tuple, list)):
                return all(finite(v) for v in value)
            return not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()) \
                or _all_finite(torch.view_as_real(value) if value.is_complex() else value)
        return all(finite(values[old]) for old in self.outputs)

    def _side(self, nodes: list, values: dict, problem: "_Problem", fallback=None, precise: bool = False,
              record: Optional[dict] = None, reuse: Optional[dict] = None):
        """The values of one side (bridge, then nodes), or Raised; what a side mutates is cloned first.
        ``precise``: every float value in the reference dtype (what a rounding error is measured against:
        float64, or float32 for a subgraph of 16-bit floats only). ``record``: a dict whose nodes get
        their values here; ``reuse``: such a record, whose nodes take their recorded values and
        whose other stable nodes are not needed (see :attr:`stable`)."""
        env = dict(values)
        for leaf in self.mutated[id(nodes)]:
            env[leaf] = env[leaf].clone()
        reference = self.reference_dtype if precise else None
        if self.constants and not precise:
            if problem.constants is None:
                made = _evaluate(list(self.constants), {}, problem)
                problem.constants = made if isinstance(made, dict) else {}
            env.update(problem.constants)
            nodes = [n for n in nodes if n not in problem.constants]
        base = _evaluate(self.bridge, env, problem, precise=reference)
        if isinstance(base, Raised):
            if precise:
                return base
            raise Unvalidatable(f"the inputs shared by both sides could not be computed ({base})")
        if reuse is not None:
            env.update(reuse)
            nodes = [n for n in nodes if n not in self.stable]
        keep = self.kept | record.keys() if record is not None else self.kept
        result = _evaluate(nodes, env, problem, fallback, keep=keep, precise=reference)
        if record is not None and isinstance(result, dict):
            record.update({n: result[n] for n in record})
        return result

    def _verdict(self, probe: str, problem: "_Problem", original, replacement, exact=None, lowered: int = 0,
                 overflowed: bool = False) -> Optional[str]:
        """A refusal, or None. ``lowered``: the magnitudes probe was drawn lower that many times;
        ``overflowed``: eager overflows on these inputs, only the elements both sides compute finite count."""
        where = f"{probe} inputs{problem.where}"
        if lowered:
            where += f", its levels lowered {lowered}x (eager overflows at the full ones)"
        elif overflowed:
            where += ", where both sides are finite (eager overflows on some)"
        if isinstance(original, Raised) and probe == "uniform" and problem.lengths:
            raise _Unfaithful(f"the subgraph raises on {where} ({original})")
        if isinstance(original, Raised):
            if isinstance(replacement, Raised):
                if not probe.startswith("out-of-range"):
                    raise Unvalidatable(f"the subgraph raised on {where} ({original})")
                return None  # both stop the program
            return (f"replacement differs from the subgraph: on {where} the subgraph raises ({original}) "
                    f"and the replacement does not")
        if isinstance(replacement, Raised):
            return (f"replacement differs from the subgraph: the replacement raises ({replacement}) on {where} "
                    f"where the subgraph does not")
        for old, new in self.outputs.items():
            difference = _difference(original[old], replacement[new], probe, exact.get(old) if exact else None,
                                     overflowed)
            if difference:
                return f"replacement differs from the subgraph: output {old.name} {difference} ({where})"
        return None


# -- inputs -------------------------------------------------------------------------------------
def _plan_inputs(reads: list, replacement: frozenset = frozenset()) -> tuple:
    """(bridge, leaves): the nodes to compute before the two sides (in order), and the values to
    draw. A read computed from another read, from constants or from sizes is computed, not drawn;
    so is a node of the replacement, however far from the reads (a subgraph output that reads
    another one, ``copy(view, y)``, reads y's replacement once the rewrite is applied); random,
    mutating and opaque nodes are drawn."""
    reads_set = set(reads)
    kinds: dict = {}

    def kind(node: Node, depth: int) -> str:  # "const", "size", "linked" (computed from a read) or "free"
        found = kinds.get(node)
        if found is not None:
            return found
        op = node.op
        if op == "get_attr":
            result = "const"
        elif op == "placeholder":  # (a size, else a value no bridge computes)
            result = "size" if _is_size(node) else "free"
        elif (depth > BRIDGE_HOPS and node not in replacement) or not _runnable(node):
            result = "free"
        else:
            linked = free = False
            for i in node._input_nodes:  # (every input's kind found, in order: the memo is filled alike)
                sub = "linked" if i in reads_set else kind(i, depth + 1)
                if sub == "linked":
                    linked = True
                elif sub == "free":
                    free = True
            result = "linked" if linked else "free" if free else "size" if _is_size(node) else "const"
        kinds[node] = result
        return result

    needed: list = []
    leaves: list = []
    seen = set()

    def need(node: Node) -> None:
        if node in seen:
            return
        seen.add(node)
        if kind(node, 0) == "free" or (node.op == "placeholder" and _is_size(node)) or node.op == "get_attr":
            leaves.append(node)  # (an attribute: its own value, read as a leaf)
            return
        for i in node.all_input_nodes:
            need(i)
        needed.append(node)

    for node in reads:
        kind(node, 0)
    for node in reads:
        need(node)
    return needed, leaves  # ``need`` appends a node after its inputs: a topological order


@dataclasses.dataclass
class _IndexUse:
    indexed: Node  # the tensor indexed
    dim: int  # its indexed dim
    python: bool  # negative indices count from the end (index, index_put)
    repeats: bool  # duplicate indices have a defined result eager computes
    checked: bool = True  # eager raises on an index out of range (else nothing is drawn out of range)


# Another library's kernels whose meaning a pass knows and rewrites (vLLM's ``_C::rotary_embedding``):
# {schema name: (index argument, table argument, raises out of range)}. Validation runs them (on
# clones of what they write: they have no other effect), their index inputs get valid rows of the
# table, and a kernel that does not check the range is never run on an index out of it.
_OPAQUE_INDEXING: dict = {}


def register_opaque_indexing(op_name: str, index: str, table: str, bounds_checked: bool) -> None:
    """Tell the validator that ``op_name`` (e.g. ``"_C::rotary_embedding"``) is a kernel it may run,
    which indexes the rows of its argument ``table`` with its argument ``index``."""
    _OPAQUE_INDEXING[op_name] = (index, table, bounds_checked)


def _registered_opaque(node: Node) -> Optional[tuple]:
    """The registered spec of the kernel an ``auto_functionalized`` node runs, if any."""
    if node.target in (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2) \
            and node.args and getattr(node.args[0], "_schema", None) is not None:
        return _OPAQUE_INDEXING.get(node.args[0]._schema.name)
    return None


def _index_uses_of(leaf: Node, scope: set) -> list:
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
    return found


_READS = (aten.index.Tensor, aten._unsafe_index.Tensor)
_PUTS = (aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default)
_ACCUMULATING = (aten.index_add.default, aten.scatter_add.default, aten.scatter_reduce.two, aten.scatter.reduce,
                 aten.scatter.value, aten.index_fill.int_Scalar, aten.index_select.default, aten.gather.default)
_NO_REPEATS = (aten.index_copy.default, aten.scatter.src)  # documented nondeterministic for duplicates


def _indexing(user: Node, index: Node) -> Optional[_IndexUse]:
    target, args = user.target, user.args
    if target in _READS or target in _PUTS:
        positions = [i for i, t in enumerate(args[1]) if t is index]
        return _IndexUse(args[0], positions[0], True, True) if positions else None
    if target in _ACCUMULATING or target in _NO_REPEATS:
        if len(args) > 2 and args[2] is index:
            return _IndexUse(args[0], args[1], False, target not in _NO_REPEATS)
        return None
    if target == aten.embedding.default and len(args) > 1 and args[1] is index:
        return _IndexUse(args[0], 0, False, True)
    spec = _registered_opaque(user)
    if spec is not None and user.kwargs.get(spec[0]) is index and isinstance(user.kwargs.get(spec[1]), Node):
        return _IndexUse(user.kwargs[spec[1]], 0, False, True, checked=spec[2])
    return None


def _mutated_leaves(nodes: list, leaves: set) -> list:
    """The leaves whose memory a node of ``nodes`` (or auto_functionalized's bases) writes."""
    found = []
    for node in nodes:
        if not mutates(node.target):
            continue
        schema = node.target._schema
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, Node):
                while value not in leaves and value.target in _VIEWS and isinstance(value.args[0], Node):
                    value = value.args[0]
                if value in leaves:
                    found.append(value)
    return found


# -- problems: the shapes an evaluation runs at ----------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Size:
    """A size validation may change: a static size shared by some dims of the inputs (``by_value``:
    every integer argument equal to it follows it), or a symbol."""

    real: int
    dims: list  # [(leaf, dim)] of a static size
    by_value: bool = True
    symbol: Any = None
    named: bool = False  # (a per-dim size) integer arguments equal to it exist: those of some nodes follow it

    def __repr__(self) -> str:
        if self.symbol is not None:
            return str(self.symbol)
        if self.by_value:
            return f"{self.real}"
        leaf, dim = self.dims[0]
        return f"{self.real} (dim {dim - leaf.meta['val'].dim()})"


@dataclasses.dataclass
class _Problem:
    label: str  # "" (the real shapes), "shrunk", "confirming ..."
    lengths: dict  # _Size -> its length here
    rows: dict  # _Size -> the real positions of its rows, where they are sampled
    probes: tuple
    shapes: dict = dataclasses.field(default_factory=dict)  # node -> shape here
    values: dict = dataclasses.field(default_factory=dict)  # int argument -> its value here
    node_values: dict = dataclasses.field(default_factory=dict)  # node -> {int argument: value} for that node
    symbols: dict = dataclasses.field(default_factory=dict)  # sympy symbol -> its value here
    dims: dict = dataclasses.field(default_factory=dict)  # (leaf, dim) -> _Size
    precise_fits: Any = True  # the magnitudes probe's float64 reference fits the budget (or how to find out)
    repairs: dict = dataclasses.field(default_factory=dict)
    decoded: dict = dataclasses.field(default_factory=dict)  # a derived size's length -> its real value (a sum, a product)
    summing: set = dataclasses.field(default_factory=set)  # the repaired nodes whose own sizes make a sum
    templates: dict = dataclasses.field(default_factory=dict)  # node -> its (args, kwargs), integers remapped
    constants: Optional[dict] = None  # the values of _Validation.constants here, once computed
    derived: bool = False  # node shapes derived from the shrunk problem's, checked as the nodes run
    ints: dict = dataclasses.field(default_factory=dict)  # node -> the integers of its arguments (the plan's)

    @property
    def where(self) -> str:
        return f", {self.label}" if self.label else ""

    @property
    def precise(self) -> bool:
        """The magnitudes probe's float64 reference fits the budget (sized where a verdict first needs it)."""
        if callable(self.precise_fits):
            self.precise_fits = self.precise_fits()
        return self.precise_fits

    def leaf_shape(self, leaf: Node) -> list:
        return list(self.shapes[leaf])


class _Plan:
    """The problems a rewrite is evaluated on, each sized from its nodes' shapes (see the docstring)."""

    def __init__(self, validation: _Validation):
        self.v = validation
        self.symbols = _free_symbols(validation.leaves)
        self.shape_env = _shape_env(validation.nodes)
        self.taken = _taken_numbers(validation.nodes)
        if self.symbols:  # (a symbol left at its hint: no prime may read as it, nor it as a prime)
            hints = _hints(self.shape_env)
            self.taken["all"] |= {int(hints[s]) for s in self.symbols if s in hints}
        self.ints: dict = {}  # node -> the integers of its arguments, shared by the problems
        self.blamed: frozenset = frozenset()  # the sizes the last shrink that broke points to (_try_shrink)
        self.meta_results: dict = {}  # (node, its arguments' metadata) -> its meta value: shrinks tried one
        # after another share most of their nodes' shapes
        self.hops: dict = {}  # node -> (its distances, the one past them): see _hops_from

    @functools.cached_property
    def windows(self) -> tuple:
        return _size_windows(self.v.nodes, self.v.leaves, frozenset(self.taken["all"]))

    @functools.cached_property
    def probes(self) -> tuple:
        v = self.v
        probes = ("uniform",)  # then the probes that draw its float values again (see _Validation.stable)
        if any(use.repeats for uses in v.index_uses.values() for use in uses):
            probes += ("repeated indices",)
        probes += ("out-of-range index",) if v.index_uses else ()
        return probes + ("magnitudes", "NaN", "infinities")

    def real(self) -> _Problem:
        """The problem at the real shapes, every probe; OverBudget where it does not fit the budget."""
        real = self._problem("", {}, {}, self.probes, check=False)
        self._fits(real)
        return real

    def problems(self):
        v = self.v
        probes = self.probes
        real = self._problem("", {}, {}, probes, check=False)
        if not self.symbols and _elements(real, v.leaves) <= FULL_ELEMENTS:
            self._fits(real)
            yield real
            return
        sizes = self._candidates()
        total = _elements(real, v.leaves)
        if not self.symbols and sum(self._saving(s, real) for s in sizes) < total // 2 \
                and self._bytes(real) <= MEMORY_BUDGET:
            self._fits(real)  # shrinking saves little (weights of sizes an op fixes): the real shapes
            yield real
            return
        primes = _primes(self.taken)
        # (every probe but magnitudes: the confirmations below run it with each size at its real length)
        shrunk = self._shrink(sizes, primes, tuple(p for p in probes if p != "magnitudes"), real)
        if shrunk is None:
            self._fits(real)
            yield real
            return
        self._fits(shrunk)
        yield shrunk
        yield from self._confirmations(shrunk, primes)
        second = dict(shrunk.lengths)
        for size in shrunk.lengths:
            if size.symbol is not None:
                value = self._symbol_value(size, second, primes)
                if value is not None:
                    second[size] = value
        if second != shrunk.lengths:
            problem = self._problem("at a second value of the symbols", second, {}, ("uniform",),
                                    repairs=shrunk.repairs)
            self._fits(problem)
            yield problem

    # -- which sizes ------------------------------------------------------------------------------
    def _candidates(self) -> list:
        """The static sizes (per dim where no integer argument names them, else per value) and the
        symbols that may change, largest first."""
        named = self.taken["arguments"]
        per_value: dict = {}
        for leaf in self.v.leaves:
            value = leaf.meta.get("val")
            if leaf.op == "get_attr" or not isinstance(value, torch.Tensor):
                continue
            for dim, size in enumerate(value.shape):
                if isinstance(size, int) and size >= SHRINK_FROM:
                    per_value.setdefault(size, []).append((leaf, dim))
        sizes = []
        for real, dims in per_value.items():
            by_position: dict = {}
            for leaf, dim in dims:
                by_position.setdefault(dim - leaf.meta["val"].dim(), []).append((leaf, dim))
            if real in named and len(by_position) == 1:
                sizes.append(_Size(real, dims, by_value=True))
            else:  # per dim; a named one takes the integer arguments of the nodes that stay consistent
                sizes += [_Size(real, group, by_value=False, named=real in named) for group in by_position.values()]
        sizes += [_Size(self._hint(s), [], symbol=s) for s in sorted(self.symbols, key=str)]
        return sorted(sizes, key=lambda s: -s.real)

    def _shrink(self, sizes: list, primes: list, probes: tuple, real: _Problem) -> Optional[_Problem]:
        """The shrunk problem: every size that can shrink consistently shrunk, else None."""
        # first without the sizes that are sums or named products of others (a fused projection's 2112 rows,
        # 1536 + 576): they follow their parts (see _value_map)
        reals = {s.real for s in sizes if s.symbol is None}
        _, products_of, sums_of, _ = self.windows
        dependent = {real for parts, real, _ in sums_of if reals.intersection(parts)} | \
            {real for window, real, node in products_of if node is not None and reals.intersection(window)}
        independent = [s for s in sizes if s.symbol is not None or s.real not in dependent]
        attempt = independent  # each failure drops the size it points to that saves the least, while one does
        for _ in range(len(independent)):
            problem = self._try_shrink(attempt, primes, probes)
            if problem is not None:
                return problem
            if not self.blamed:
                break
            dropped = min(self.blamed, key=lambda size: self._saving(size, real))
            attempt = [size for size in attempt if size is not dropped]
        attempts = [sizes] if len(independent) != len(sizes) else []
        merged = _merged_by_value(sizes)
        if len(merged) != len(sizes):
            attempts.append(merged)
        for attempt in attempts:
            problem = self._try_shrink(attempt, primes, probes)
            if problem is not None:
                return problem
        # one size at a time, the largest saving first, keeping those that shrink consistently, until the
        # inputs are small (a size saving less than 1 % of what is left of them is not tried: once an MLA's
        # 1 GB cache is shrunk, its heads are worth shrinking, whose weights every evaluation reads)
        left = _elements(real, self.v.leaves)
        chosen: list = []
        problem = None
        failed = set()  # values a per-dim size of which did not shrink: tried per value afterwards
        fine = sorted(((s, self._saving(s, real)) for s in sizes), key=lambda item: -item[1])
        coarse = [(s, self._saving(s, real)) for s in merged if len(s.dims) > 1 and s not in sizes]
        tries = 0
        for size, saving in fine + coarse:
            if saving < left // 100 or (size in merged and size not in sizes and size.real not in failed):
                continue
            tries += 1
            if tries > GREEDY_TRIES:
                break
            if problem is not None and _elements(problem, self.v.leaves) <= FULL_ELEMENTS:
                break
            trial = self._try_shrink(chosen + [size], primes, probes)
            if trial is not None:
                chosen.append(size)
                problem = trial
                left = _elements(problem, self.v.leaves)
            elif size.symbol is None:
                failed.add(size.real)
        return problem

    def _saving(self, size: _Size, real: _Problem) -> int:
        """How many input elements shrinking ``size`` (to about 5) saves."""
        saving = 0
        for leaf in self.v.leaves:
            value = leaf.meta.get("val")
            if not isinstance(value, torch.Tensor) or leaf not in real.shapes:
                continue
            dims = [d for d, s in enumerate(value.shape)
                    if (leaf, d) in size.dims or (size.symbol is not None and _is_sym(s)
                                                  and size.symbol in s.node.expr.free_symbols)]
            if dims:
                numel = math.prod(real.shapes[leaf])
                saving += numel - numel // math.prod(real.shapes[leaf][d] for d in dims) * 5 ** len(dims)
        return saving

    def _try_shrink(self, sizes: list, primes: list, probes: tuple) -> Optional[_Problem]:
        """Static sizes take the first primes, symbols small values made of the others."""
        # the smallest primes first to the sizes beside which an input holds more than FULL_ELEMENTS elements
        # per position (a confirmation runs one size at its real length, the others at their primes: an MLA's
        # block size, beside a 7282-block cache, gets 5), then to the smallest sizes, which they shrink the
        # most relative to their length (its 16 heads, in the weights every evaluation reads; a contraction
        # stays long enough that one int8 rounding step of a w8a8 kernel is small beside its sum); a prime is
        # smaller than the size it codes, or the size stays
        static = sorted((s for s in sizes if s.symbol is None),
                        key=lambda s: (self._beside(s) <= FULL_ELEMENTS, s.real))
        lengths, rest = {}, list(primes)
        for size in static:
            if rest and rest[0] < size.real:
                lengths[size] = rest.pop(0)
        for size in sizes:
            if size.symbol is not None:
                value = self._symbol_value(size, lengths, rest)
                if value is not None:
                    lengths[size] = value
        if not lengths:
            return None
        # a per-dim size that integer arguments name: first every node naming it follows it (the first of the
        # sizes of that value: an MLA's block size and nope dim are both 128), then each node at which the
        # program stops being consistent, or the nearest one above it that follows a size the shapes there
        # point to, follows the next such size, and then keeps its real value
        options: dict = {}
        for size in lengths:
            if size.named:
                for node in self.v.nodes:
                    if size.real in _ints_of(node, self.ints):
                        options.setdefault(node, {}).setdefault(size.real, []).append(size)
        for node, reals in options.items():  # the size whose inputs are nearest the node first
            for queue in reals.values():
                if len(queue) > 1:
                    queue.sort(key=lambda size: self._distance(node, size))
        repairs = {node: {real: queue[0] for real, queue in reals.items()} for node, reals in options.items()}
        self.blamed = frozenset()
        for _ in range(sum(len(q) for reals in options.values() for q in reals.values()) + 1):
            try:
                return self._problem("shrunk", lengths, {}, probes, repairs=repairs)
            except _Inconsistent as why:
                log.debug("validation: shrink %s not used: %s", lengths, why)
                node = why.node if why.node in repairs else self._repaired_above(why, repairs)
                if node is None:
                    self.blamed = why.blamed & set(sizes)
                    return None
                reals = options[node]
                real = next((r for r, queue in reals.items() if len(queue) > 1), None)
                if real is None:
                    del repairs[node], options[node]
                else:
                    reals[real].pop(0)
                    repairs[node] = {r: queue[0] for r, queue in reals.items()}
        return None

    def _distance(self, node: Node, size: _Size) -> int:
        """How many edges of the rewrite (either way) lie between node and an input with a dim of ``size``."""
        hops, unreachable = self._hops_from(node)
        return min((hops[leaf] for leaf, _ in size.dims if leaf in hops), default=unreachable)

    def _hops_from(self, node: Node) -> tuple:
        """({node of the rewrite: how many edges, either way, from ``node``}, a distance past every one),
        found once per node."""
        found = self.hops.get(node)
        if found is not None:
            return found
        inside = set(self.v.nodes)
        hops, frontier, depth = {node: 0}, [node], 0
        while frontier:
            depth += 1
            frontier = [n for f in frontier for n in (*f.all_input_nodes, *f.users) if n in inside and n not in hops]
            hops.update(dict.fromkeys(frontier, depth))
        found = self.hops[node] = (hops, depth + len(inside))
        return found

    def _parts_of(self, node: Node) -> set:
        """The sizes a node's split sizes or cat inputs sum, and theirs in turn (576 = 512 + 64)."""
        parts, _ = _summed_parts(node)
        found, todo = set(), [p for p in parts or () if type(p) is int]
        sums = {real: relation for relation, real, _ in self.windows[2]}
        while todo:
            part = todo.pop()
            if part not in found:
                found.add(part)
                todo += list(sums.get(part, ()))
        return found

    def _beside(self, size: _Size) -> int:
        """The most elements an input with a dim of ``size`` has per position of that dim."""
        shapes = [leaf.meta["val"].shape for leaf, _ in size.dims]
        return max((math.prod(s) // size.real for s in shapes if all(type(d) is int for d in s)), default=0)

    def _repaired_above(self, why: _Inconsistent, repairs: dict) -> Optional[Node]:
        """The repaired node nearest above the node of an inconsistency that follows a size it blames."""
        if why.node is None:
            return None
        seen, frontier, inside = set(), [why.node], set(self.v.nodes)
        while frontier:
            frontier = [n for node in frontier for n in node.all_input_nodes if n in inside and n not in seen]
            seen.update(frontier)
        suspects = [n for n in seen if n in repairs and why.blamed.intersection(repairs[n].values())]
        return max(suspects, key=self.v.nodes.index) if suspects else None

    def _confirmations(self, shrunk: _Problem, primes: list):
        """Every shrunk size at its real length, in few small evaluations. The static sizes are packed
        into groups (first fit, largest first) whose inputs stay within ``CONFIRM_ELEMENTS`` and the
        memory budget: an MLA's hidden size goes with its heads, not with its q latent, for together
        they are its weight at the real shape, the real compute a shrunk size spares. The parts of a
        sum go together where they fit (a fused projection's 1536 + 512 + 64 rows: each row at its real
        place). A size whose real length alone exceeds ``CONFIRM_ELEMENTS`` is confirmed on
        ``SAMPLE_ROWS`` sampled rows (a paged cache's blocks), packed likewise; a group over the memory
        budget, size by size (sampled where the real length alone is over it). Symbols are confirmed one
        at a time."""
        groups: list = []  # {size: (length, sampled rows or None)} per group
        for unit in self._units([size for size in shrunk.lengths if size.symbol is None]):
            if len(unit) > 1 and self._placed(shrunk, groups, {size: (size.real, None) for size in unit}):
                continue
            for size in unit:  # (the parts of a sum one at a time, where together they are too large)
                if not self._placed(shrunk, groups, {size: (size.real, None)}):
                    self._placed(shrunk, groups, {size: self._sampled(shrunk, size, primes)}, alone=True)
        for group in groups:
            problem = self._group(shrunk, group)
            held = self._bytes(problem)
            if held <= MEMORY_BUDGET:
                self._fits(problem, held)
                yield problem
            else:  # (its intermediates too large together: one size at a time)
                for size in group:
                    yield self._alone(shrunk, size, group[size], primes)
        for size in shrunk.lengths:
            if size.symbol is not None:
                yield self._alone(shrunk, size, (size.real, None), primes)

    def _placed(self, shrunk: _Problem, groups: list, settings: dict, alone: bool = False) -> bool:
        """Settings added to the first group that stays small with them, else as a new group where they
        are small alone (``alone``: in any case); False where they are not."""
        for group in groups:
            if self._small(shrunk, {**group, **settings}):
                group.update(settings)
                return True
        if not alone and not self._small(shrunk, settings):
            return False
        groups.append(dict(settings))
        return True

    def _small(self, shrunk: _Problem, settings: dict) -> bool:
        """The confirmation's inputs hold at most ``CONFIRM_ELEMENTS`` elements (judged from its inputs'
        shapes alone; its memory is sized once its group is complete)."""
        return _elements(self._group(shrunk, settings, leaves_only=True), self.v.leaves) <= CONFIRM_ELEMENTS

    def _alone(self, shrunk: _Problem, size: _Size, setting: tuple, primes: list) -> _Problem:
        """A size's confirmation by itself: at its length (``setting``) where that fits the memory budget,
        else on sampled rows (OverBudget where even that does not fit; a symbol is never sampled)."""
        if setting[1] is None:
            problem = self._group(shrunk, {size: setting})
            held = self._bytes(problem)
            if held <= MEMORY_BUDGET:
                self._fits(problem, held)
                return problem
            if size.symbol is not None:
                raise OverBudget(f"symbol {size} at its hint {size.real} needs {held >> 20} MB "
                                 f"(> {MEMORY_BUDGET >> 20} MB)")
            setting = self._sampled(shrunk, size, primes)
        problem = self._group(shrunk, {size: setting})
        self._fits(problem)
        return problem

    def _units(self, sizes: list) -> list:
        """The sizes, those that are parts of one sum (a split's sizes, a cat's inputs) in one list,
        largest first."""
        sums = self.windows[2]
        totals: dict = {}
        for parts, total, _ in sums:
            totals.setdefault(total, set()).update(parts)

        def expanded(parts, depth=0) -> set:  # (a part that is a sum itself: 2112 = 1536 + 576, 576 = 512 + 64)
            return set().union(*(expanded(totals[p], depth + 1) | {p} if p in totals and depth < 4 else {p}
                                 for p in parts))

        unit_of = {size: [size] for size in sizes}
        for parts, _, _ in sums:
            parts = expanded(parts)
            members = [size for size in sizes if size.real in parts]
            for size in members[1:]:
                first, other = unit_of[members[0]], unit_of[size]
                if other is not first:
                    first += other
                    for moved in other:
                        unit_of[moved] = first
        units = list({id(unit): unit for unit in unit_of.values()}.values())
        return sorted(units, key=lambda unit: -max(size.real for size in unit))

    def _sampled(self, shrunk: _Problem, size: _Size, primes: list) -> tuple:
        """(a prime count of rows, the rows: the first and the last among them, the others at random), or
        (its real length, None) where there are not more rows than that."""
        count = next(p for p in primes if p >= SAMPLE_ROWS and p not in shrunk.lengths.values())
        if count >= size.real:
            return size.real, None
        g = torch.Generator().manual_seed(self.v.seed)
        middle = torch.randperm(size.real - 2, generator=g)[:count - 2] + 1
        return count, torch.cat([torch.tensor([0, size.real - 1]), middle]).sort().values

    def _group(self, shrunk: _Problem, settings: dict, leaves_only: bool = False) -> _Problem:
        """The confirmation of the sizes of ``settings`` ({size: (length, sampled rows or None)})."""
        real = [size for size, (_, rows) in settings.items() if rows is None]
        parts = [f"size {size} on {length} sampled rows" for size, (length, rows) in settings.items()
                 if rows is not None]
        if real:
            parts.append(f"size {real[0]} at its real length" if len(real) == 1 else
                         f"sizes {', '.join(map(repr, real))} at their real lengths")
        lengths = {**shrunk.lengths, **{size: length for size, (length, _) in settings.items()}}
        rows = {size: rows for size, (_, rows) in settings.items() if rows is not None}
        return self._problem("confirming " + " and ".join(parts), lengths, rows, ("magnitudes",),
                             repairs=shrunk.repairs, base=shrunk, leaves_only=leaves_only)

    # -- symbols --------------------------------------------------------------------------------
    def _hint(self, symbol) -> int:
        hints = _hints(self.shape_env)
        if symbol not in hints:
            raise Unvalidatable(f"symbol {symbol} has no hint")
        return int(hints[symbol])

    def _symbol_value(self, size: _Size, chosen: dict, primes: list) -> Optional[int]:
        """A small value of the symbol that keeps every guard of the shape environment true (the
        symbols chosen so far at theirs, the others at their hints); None if there is none."""
        env = self.shape_env
        others = {s.symbol: length for s, length in chosen.items() if s.symbol is not None and s is not size}
        taken = set(chosen.values())
        candidates = [p for p in primes if p not in taken][:8]  # (primes: none of them codes a static size)
        candidates += [k * p for k in (2, 4, 8, 16) for p in candidates[:3]]
        for value in sorted(c for c in candidates if 2 <= c < size.real):
            if _guards_hold(env, {**others, size.symbol: value}):
                return value
        return None

    # -- sizing a problem -------------------------------------------------------------------------
    def _problem(self, label: str, lengths: dict, rows: dict, probes: tuple, check: bool = True,
                 repairs: Optional[dict] = None, base: Optional[_Problem] = None,
                 leaves_only: bool = False) -> _Problem:
        """The problem at ``lengths``: every node's shape, from a run on meta tensors, or (``base``: the
        shrunk problem, of which one static size changes) derived from base's shapes; ``leaves_only``:
        the inputs' shapes only (what its size is judged by first)."""
        problem = _Problem(label, lengths, rows, probes, ints=self.ints)
        problem.repairs = dict(repairs or {})  # node -> {real value: the per-dim size its arguments follow}
        problem.node_values = {node: {real: lengths[size] for real, size in named.items() if size in lengths}
                               for node, named in problem.repairs.items()}
        problem.symbols = {s: self._hint(s) for s in self.symbols}
        problem.symbols.update({size.symbol: n for size, n in lengths.items() if size.symbol is not None})
        for size, n in lengths.items():
            for leaf_dim in size.dims:
                problem.dims[leaf_dim] = size
        problem.values, products, problem.decoded, problem.summing = _value_map(self.windows, lengths,
                                                                                 problem.node_values)
        for leaf in self.v.leaves:
            value = leaf.meta.get("val")
            if isinstance(value, torch.Tensor):  # a dim that a size list names as a product follows it too
                problem.shapes[leaf] = tuple(
                    lengths[problem.dims[(leaf, d)]] if (leaf, d) in problem.dims else
                    products.get(s, s) if isinstance(s, int) else _at(s, problem.symbols)
                    for d, s in enumerate(value.shape))
        if leaves_only:
            return problem
        if not lengths and not check:  # the real shapes: the traced ones
            for node in self.v.nodes:
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    problem.shapes[node] = tuple(_at(s, problem.symbols) for s in value.shape)
            return problem
        if base is None or not _derive_shapes(problem, base, self.v.leaves):
            self._meta_run(problem)
        return problem

    def _meta_run(self, problem: _Problem) -> None:
        """Every node's shape in ``problem``, run on meta tensors; _Inconsistent (at the first such
        node) when a node raises or its shape is not the one the problem predicts (the shrink
        changed what the program computes)."""
        v = self.v
        env = {leaf: _meta_leaf(leaf, problem) for leaf in v.leaves}
        coded = {n: size for size, n in problem.lengths.items() if size.symbol is None and n != size.real}
        for leaf in v.leaves:
            try:
                self._check_shape(leaf, env[leaf], coded, problem)
            except _Inconsistent as why:  # an input's size followed a sum that a node's own sizes made
                if problem.summing:
                    raise _Inconsistent(str(why), next(iter(problem.summing))) from None
                raise
        for node in [*v.bridge, *v.original, *v.inserted]:
            result = _evaluate([node], env, problem, meta=True, memo=self.meta_results)
            try:
                if isinstance(result, Raised):
                    raise _Inconsistent(f"{result}", node)
                self._check_shape(node, env[node], coded, problem)
            except _Inconsistent as why:  # blamed: the shrunk sizes of the shapes it read, and of its integers
                ints = _ints_of(node, self.ints)
                dims = [d for n in node.all_input_nodes if isinstance(env.get(n), torch.Tensor) for d in env[n].shape]
                named = frozenset(size for size in coded.values() if size.real in ints | self._parts_of(node))
                raise _Inconsistent(str(why), node, why.blamed | _blamed(dims, coded) | named) from None

    @staticmethod
    def _check_shape(node: Node, got: Any, coded: dict, problem: _Problem) -> None:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and isinstance(got, torch.Tensor):
            if got.dim() != value.dim():
                raise _Inconsistent(f"{node.name} has {got.dim()} dims", node)
            for want, have in zip(value.shape, got.shape):
                if problem.decoded.get(have, _predicted(have, coded)) != _at(want, problem.symbols):
                    raise _Inconsistent(f"{node.name} is {list(got.shape)}, not {list(value.shape)} shrunk", node,
                                        _blamed([have], coded))
            problem.shapes[node] = tuple(got.shape)

    def _at_most(self, problem: _Problem) -> int:
        """A bound on both of :meth:`_bytes` at the real shapes: each of their at most seven terms holds
        no more than every value of the rewrite at 16 bytes an element."""
        elements = 0
        for node in self.v.nodes:
            value = node.meta.get("val")
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(t, torch.Tensor):
                    shape = problem.shapes.get(node, t.shape)
                    if not all(type(d) is int for d in shape):
                        return MEMORY_BUDGET + 1  # (a symbolic size: the exact count decides)
                    elements += math.prod(shape)
        return 7 * 16 * elements

    @functools.cached_property
    def _sides(self) -> tuple:
        """Per side (the subgraph, the replacement): the leaves it mutates (cloned first), its nodes each
        with the values freed after it (their last use; the outputs are kept), and its fused nodes."""
        v = self.v
        sides = []
        for nodes in (v.original, v.inserted):
            schedule = list(zip(nodes, _freed_after(nodes, [node.all_input_nodes for node in nodes], v.kept)))
            fused = [node for node in nodes if isinstance(node.target, torch._ops.OpOverload) and
                     node.target.namespace == "npu_fuse" or node.target is torch.ops.higher_order.auto_functionalized_v2]
            sides.append((v.mutated[id(nodes)], schedule, fused))
        return tuple(sides)

    def _bytes(self, problem: _Problem, precise: bool = False) -> int:
        """What an evaluation of ``problem`` holds at most: its inputs (a probe derives its values
        from the problem's uniform draw in place), then per side the clones of what it mutates, the
        bridge, the side's values (each freed after its last use; a view holds nothing) and the
        temporaries of its largest op (a fused op's kernel upcasts: four float32 copies of its
        output). ``precise``: what the float64 run of the subgraph adds (the magnitudes probe's
        reference), with both sides' outputs still held."""
        v = self.v
        shapes = problem.shapes
        sizes: dict = {}

        def size(node) -> int:
            held = sizes.get(node)
            if held is None:
                value = node.meta.get("val")
                shape = shapes.get(node)
                held = 0 if not isinstance(value, torch.Tensor) or shape is None or node.target in _VIEWS else \
                    math.prod(shape) * value.dtype.itemsize  # (a fake tensor's element_size() dispatches: ~10x slower)
                sizes[node] = held
            return held

        def peak(schedule, size) -> int:
            live = most = 0
            for node, freed in schedule:
                live += size(node)
                most = max(most, live)
                for n in freed:
                    live -= size(n)
            return most

        def temporaries(node) -> int:
            if not problem.lengths:
                value = node.meta.get("val")
                outputs = value if isinstance(value, (tuple, list)) else [value]
                return 4 * 4 * sum(t.numel() for t in outputs if isinstance(t, torch.Tensor))
            return 4 * 4 * math.prod(shapes.get(node, (0,)))

        inputs = sum(size(n) for n in v.leaves)
        outputs = sum(size(n) for n in v.outputs)  # the subgraph's outputs, kept for the comparison
        bridge = sum(size(n) for n in v.bridge)
        if precise:  # the values in the reference dtype, each input converted where a node reads it
            widened: dict = {}
            scale = self.v.reference_dtype.itemsize

            def wide(node) -> int:  # (a view holds nothing, but in the reference dtype it reads a converted copy)
                held = widened.get(node)
                if held is None:
                    value = node.meta.get("val")
                    shape = shapes.get(node)
                    if not isinstance(value, torch.Tensor) or shape is None:
                        held = 0
                    else:
                        itemsize = (16 if value.is_complex() else 8) if value.is_floating_point() or \
                            value.is_complex() else value.dtype.itemsize
                        held = math.prod(shape) * itemsize * scale // 8
                    widened[node] = held
                return held

            leaves = set(v.leaves)
            converted = max((sum(wide(i) for i in n.all_input_nodes if i in leaves) for n in v.original), default=0)
            return inputs + outputs + sum(size(n) for n in v.outputs.values()) + converted + \
                sum(wide(n) for n in v.bridge) + peak(self._sides[0][1], wide) + \
                max((wide(n) for n in v.original), default=0)
        largest = 0
        for nodes, (mutated, schedule, fused) in zip((v.original, v.inserted), self._sides):
            held = sum(size(n) for n in mutated) + bridge + peak(schedule, size) + \
                max([size(n) for n in nodes if n not in fused] + [temporaries(n) for n in fused], default=0)
            largest = max(largest, held)
        return inputs + outputs + largest

    def _fits(self, problem: _Problem, held: Optional[int] = None) -> None:
        if held is None and not problem.lengths and self._at_most(problem) <= MEMORY_BUDGET:
            problem.precise_fits = True  # (a small rewrite at its real shapes: fits either way)
            return
        held = self._bytes(problem) if held is None else held
        if held > MEMORY_BUDGET:
            what = f"the {problem.label} problem" if problem.label else "the rewrite at its real shapes"
            raise OverBudget(f"{what} needs {held / 2 ** 20:.0f} MB (> {MEMORY_BUDGET >> 20} MB): no size "
                             f"can shrink consistently far enough")
        # the magnitudes probe's float64 reference, where it fits (else that probe uses the plain tolerance)
        problem.precise_fits = lambda: self._bytes(problem, precise=True) <= MEMORY_BUDGET


def _derive_shapes(problem: _Problem, base: _Problem, leaves: list) -> bool:
    """Every node's shape in ``problem`` from its shape in ``base`` when they differ in static sizes
    only: base's length of each is a prime that divides no other integer of the rewrite, so each dim
    holds that prime once per time the size enters it, and the dim at the new lengths follows.
    The evaluation checks each node's shape as it runs (``_shape_checked``); False when the shapes
    cannot be derived (a symbol changed, a leaf that disagrees)."""
    changed = [size for size, n in problem.lengths.items() if base.lengths.get(size) != n]
    if not changed or any(size.symbol is not None for size in changed) or set(problem.lengths) != set(base.lengths):
        return False
    swaps = [(base.lengths[size], problem.lengths[size]) for size in changed]
    lengths_of = {real: new for new, real in problem.decoded.items()}

    def follow(dim: int) -> int:
        if dim in base.decoded:  # (base's meta run found each dim a derived size, or a product of its primes)
            return lengths_of.get(base.decoded[dim], base.decoded[dim])
        rest, factor = dim, 1
        for prime, new in swaps:
            while rest and rest % prime == 0:
                rest //= prime
                factor *= new
        return rest * factor

    shapes = {node: tuple(follow(d) for d in shape) for node, shape in base.shapes.items()}
    if any(shapes.get(leaf) != problem.shapes[leaf] for leaf in leaves if leaf in problem.shapes):
        return False
    problem.shapes = shapes
    problem.derived = True
    return True


def _shape_checked(node: Node, value: Any, problem: _Problem) -> None:
    """A derived problem's promise, kept: the node got the shape derived for it."""
    want = problem.shapes.get(node)
    if want is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != want:
        raise Unvalidatable(f"{node.name} is {list(value.shape)} on the {problem.label} problem, not the "
                            f"{list(want)} the shrunk problem predicts")


def _merged_by_value(sizes: list) -> list:
    """The per-dim sizes of one value merged into one per-value size."""
    merged, by_value = [], {}
    for size in sizes:
        if size.symbol is not None:
            merged.append(size)
        elif size.real in by_value:
            by_value[size.real].dims += size.dims
        else:
            by_value[size.real] = _Size(size.real, list(size.dims), by_value=True)
            merged.append(by_value[size.real])
    return merged


def _blamed(dims: list, coded: dict) -> frozenset:
    """The shrunk sizes whose primes (``coded``: {prime: _Size}) divide one of ``dims``."""
    return frozenset(size for prime, size in coded.items() for d in dims if isinstance(d, int) and d and d % prime == 0)


def _predicted(have: int, coded: dict) -> int:
    """The real size of a dim of length ``have`` in a problem whose shrunk sizes are the primes
    ``coded`` ({prime: _Size}): each prime factor back to the size it stands for."""
    real = have
    for prime, size in coded.items():
        while have and have % prime == 0:
            have //= prime
            real = real // prime * size.real
    return real


def _elements(problem: _Problem, leaves: list) -> int:
    return sum(math.prod(problem.shapes[leaf]) for leaf in leaves if leaf in problem.shapes)


def _value_map(windows: tuple, lengths: dict, node_values: dict) -> tuple:
    """({integer argument: its value in the problem}, {input size: its length}, {a derived size's length:
    its real value, where unambiguous}, the nodes whose own values make a sum): each changed per-value
    size; the sums of sizes it is a part of (a fused projection's ``split(qkv, [1536, 576])``,
    ``cat([kv, k_pe])``: the 2112 rows of its weight follow the 1536 that shrinks); and its products
    with neighbouring sizes: of the dims of an input (what a flattening view names), and of the entries
    of a size list (``view(q, [-1, 32, 192])`` names the 6144 = 32 * 192 columns of q and of the weight
    that makes q, which then follow too). Each only where unambiguous: a value that is also a product of
    sizes that do not change (an MLA's slot count, 16 blocks * 16 slots, where 2 heads * a 128-wide dim
    shrink) stays. ``windows``: the rewrite's :func:`_size_windows`."""
    values = {size.real: n for size, n in lengths.items()
              if size.by_value and size.symbol is None and n != size.real}
    sizes, products_of, sums_of, taken = windows
    changed = {size.real for size in lengths}
    summed, owned = _sums(sums_of, values, node_values, changed, taken)
    for _ in range(2):  # (again without the sums a product makes ambiguous)
        mapped = {**values, **summed}
        products: dict = {}
        for window, real, node in products_of:
            own = node_values.get(node) if node is not None else None
            mapping = {**mapped, **own} if own else mapped
            new = math.prod(mapping.get(s, s) for s in window)
            products.setdefault(real, {}).setdefault(new, set()).add(node is not None)
        ambiguous = {real for real, new in summed.items() if set(products.get(real, {new: None})) != {new}}
        if not ambiguous:
            break
        summed = {real: new for real, new in summed.items() if real not in ambiguous}
    values.update(summed)
    derived = dict(summed)
    for real, news in products.items():
        if len(news) == 1 and real not in values and real not in changed:
            (new, named), = news.items()
            if new == real:
                continue
            if real not in sizes:
                values[real] = new
            elif True in named:  # an input size a size list names as a product
                derived[real] = new
                values[real] = new
    lengths_of: dict = {}  # (a length two derived sizes share, or a shrunk size's, decodes to neither)
    for real, new in derived.items():
        lengths_of.setdefault(new, set()).add(real)
    coded = set(lengths.values())
    decoded = {new: reals.pop() for new, reals in lengths_of.items() if len(reals) == 1 and new not in coded}
    return values, derived, decoded, owned


def _sums(relations: list, values: dict, node_values: dict, changed: set, taken: frozenset) -> tuple:
    """{real sum: its length} for the sums of sizes (``relations``: [(parts, their real sum, the node whose
    size list they are, or None)]) a part of which changes (``values``, and a node's own ``node_values``),
    to a fixed point (a sum that is a part of another: 576 = 512 + 64 in
    2112 = 1536 + 576). A sum stays where its relations disagree, where it is a size of its own
    (``changed``), or where its length would be an integer the rewrite has already or another size's."""
    derived: dict = {}
    for _ in range(len(relations) + 1):
        mapping = {**values, **derived}
        proposed: dict = {}
        owned = set()
        for parts, real, node in relations:
            if real not in changed and real not in values:
                own = node_values.get(node) or {}
                if own.keys() & set(parts):
                    owned.add(node)
                proposed.setdefault(real, set()).add(sum(own.get(p, mapping.get(p, p)) for p in parts))
        found = {real: next(iter(news)) for real, news in proposed.items() if len(news) == 1 and real not in news}
        if found == derived:
            break
        derived = found
    used = set(values.values())
    lengths = list(derived.values())
    return {real: new for real, new in derived.items()
            if new not in taken and new not in used and lengths.count(new) == 1}, owned


def _size_windows(nodes: list, leaves: list, taken: frozenset) -> tuple:
    """(the inputs' static sizes, [(a run of sizes, their product, the node whose size list it is in, or None
    for an input's dims)], [(sizes, their sum)] of a split's size list or a cat's inputs, the rewrite's
    integers): the products and sums :func:`_value_map` may remap, found once per plan (each problem of
    it asks)."""
    sizes = {s for leaf in leaves if isinstance(leaf.meta.get("val"), torch.Tensor)
             for s in leaf.meta["val"].shape if isinstance(s, int)}
    lists = []
    for leaf in leaves:
        value = leaf.meta.get("val")
        if isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape):
            lists.append((list(value.shape), None))
    sums = set()
    for node in nodes:
        for arg in node.args:
            if isinstance(arg, (list, tuple)) and len(arg) > 1 and all(type(x) is int for x in arg):
                lists.append(([x for x in arg if x > 0], node))
        parts, named = _summed_parts(node)
        if parts is not None and len(parts) > 1 and all(type(x) is int and x > 0 for x in parts):
            sums.add((tuple(parts), sum(parts), node if named else None))
    runs = []
    for shape, node in lists:
        for start in range(len(shape)):
            for end in range(start + 2, len(shape) + 1):
                window = tuple(shape[start:end])
                if sum(s > 1 for s in window) > 1:
                    runs.append((window, math.prod(window), node))
    return sizes, runs, list(sums), taken


def _summed_parts(node: Node) -> tuple:
    """(the sizes whose sum is a dim of a node's input (a split's size list: True) or of its value (a cat's
    inputs along its dim: False), or None)."""
    if node.target in (aten.split_with_sizes.default, aten.split_with_sizes_copy.default) and \
            isinstance(node.args[1], (list, tuple)):
        return list(node.args[1]), True
    if node.target is aten.cat.default:
        tensors = [n.meta.get("val") for n in node.args[0] if isinstance(n, Node)]
        value = node.meta.get("val")
        if len(tensors) == len(node.args[0]) and isinstance(value, torch.Tensor) and \
                all(isinstance(t, torch.Tensor) and t.dim() == value.dim() for t in tensors):
            dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % value.dim()
            return [t.shape[dim] for t in tensors], False
    return None, False


def _ints_of(node: Node, cache: dict) -> frozenset:
    """The integers in a node's arguments (kept in ``cache``: a plan asks of each node many times)."""
    found = cache.get(node)
    if found is None:
        found = cache[node] = frozenset(_argument_ints(node))
    return found


def _taken_numbers(nodes: list) -> dict:
    """The integers of the rewrite: every static size of a value ("sizes") and every integer in
    the nodes' arguments ("arguments")."""
    sizes, arguments = set(), set()
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            sizes.update(s for s in value.shape if isinstance(s, int))
        arguments.update(abs(x) for x in _argument_ints(node))
    return {"sizes": sizes, "arguments": arguments, "all": sizes | arguments}


def _argument_ints(node: Node) -> list:
    """The integers in a node's arguments (its lists, tuples and dicts walked)."""
    found: list = []
    _mapped((node.args, node.kwargs), lambda x: found.append(x) if type(x) is int else None)
    return found


def _primes(taken: dict) -> list:
    """Primes from 5 up that neither equal nor divide any integer of the rewrite."""
    numbers = [n for n in taken["all"] if 1 < n < 1 << 40]
    found = []
    n = 5
    while len(found) < 24:
        if all(n % p for p in range(2, int(n ** 0.5) + 1)) and not any(m % n == 0 for m in numbers):
            found.append(n)
        n += 2
    return found


def _free_symbols(leaves: list) -> set:
    found = set()
    for leaf in leaves:
        value = leaf.meta.get("val")
        items = list(value.shape) + list(value.stride()) if isinstance(value, torch.Tensor) else [value]
        for x in items:
            if _is_sym(x):
                found |= x.node.expr.free_symbols
    return found


def _shape_env(nodes: list):
    for node in nodes:
        value = node.meta.get("val")
        for x in ([value] if not isinstance(value, torch.Tensor) else list(value.shape)):
            if _is_sym(x):
                return x.node.shape_env
        fake_mode = getattr(value, "fake_mode", None)
        if fake_mode is not None and fake_mode.shape_env is not None:
            return fake_mode.shape_env
    return None


def _guards_hold(env, values: dict) -> bool:
    """Every guard, deferred runtime assert and value range of the shape environment holds with the
    symbols at ``values`` (the others at their hints)."""
    import sympy

    if env is None:
        return False
    point = {s: sympy.Integer(v) for s, v in _hints(env).items()}
    point.update({s: sympy.Integer(v) for s, v in values.items()})
    for symbol, expr in env.replacements.items():  # symbols unified with (or defined by) others follow them
        if symbol not in values:
            value = expr.xreplace(point)
            if getattr(value, "is_number", False):
                point[symbol] = value
    for symbol, value in values.items():
        bounds = env.var_to_range.get(symbol)
        if bounds is not None and not (bounds.lower <= value <= bounds.upper):
            return False
    exprs = [g.expr for g in env.guards]
    exprs += [a.expr for asserts in env.deferred_runtime_asserts.values() for a in asserts]
    for expr in exprs:
        try:
            if not bool(expr.xreplace(point)):
                return False
        except TypeError:  # a symbol without a value: the guard does not decide
            return False
    return True


def _hints(env) -> dict:
    """{symbol: hint} of a shape environment."""
    if env is None:
        return {}
    return getattr(env, "backed_var_to_val", None) or env.var_to_val


def _at(x: Any, symbols: dict) -> Any:
    """A size (or number) with its symbols at the problem's values."""
    if isinstance(x, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        import sympy

        expr = x.node.expr.xreplace({s: sympy.Integer(symbols[s]) for s in x.node.expr.free_symbols if s in symbols})
        if getattr(expr, "free_symbols", None):
            raise Unvalidatable(f"symbolic value {x} has no value")
        return bool(expr) if isinstance(x, torch.SymBool) else float(expr) if isinstance(x, torch.SymFloat) \
            else int(expr)
    return x


def _sym_repr(x: Any) -> Any:
    return str(x) if _is_sym(x) else x


def _stride_order(value: torch.Tensor, strides: Optional[list] = None) -> list:
    """The input's dims, outermost first (by the traced strides at their hints)."""
    strides = [_hint(s) for s in value.stride()] if strides is None else strides
    return sorted(range(value.dim()), key=lambda d: -strides[d])


def _hint(x: Any) -> Any:
    if _is_sym(x):
        try:
            return concrete_hint(x)
        except Exception as exc:
            raise Unvalidatable(f"symbolic size {x} has no hint") from exc
    return x


def _meta_leaf(leaf: Node, problem: _Problem) -> Any:
    value = leaf.meta.get("val")
    if leaf.op == "get_attr":
        return attribute(leaf).to("meta")
    if not isinstance(value, torch.Tensor):
        return _at(value, problem.symbols) if _is_sym(value) else value
    shape = problem.leaf_shape(leaf)
    stored, inverse = _layout(value, shape)
    return _arranged(torch.empty(stored, dtype=value.dtype, device="meta"), inverse, shape)


def _arranged(stored: torch.Tensor, inverse: list, shape: list) -> torch.Tensor:
    """A leaf drawn in its memory order (``_layout``) as the leaf: permuted to its dim order and expanded
    where it is broadcast (each view only where it changes something: on meta tensors they are slow)."""
    if inverse != list(range(len(inverse))):
        stored = stored.permute(inverse)
    return stored.expand(shape) if list(stored.shape) != list(shape) else stored


def _layout(value: torch.Tensor, shape: list) -> tuple:
    """How a leaf of ``shape`` with the traced value's layout is made: (the shape to allocate, its
    dims outermost first and an expanded dim once, the permutation that gives the leaf's dim order)."""
    strides = [_hint(s) for s in value.stride()]
    dense = [1 if st == 0 else sz for sz, st in zip(shape, strides)]  # expanded dims are drawn once
    order = _stride_order(value, strides)
    return [dense[d] for d in order], [order.index(d) for d in range(len(shape))]


# -- drawing ----------------------------------------------------------------------------------------
class _Draws:
    """The probes of one problem, each a value for every leaf."""

    def __init__(self, validation: _Validation, problem: _Problem):
        self.v = validation
        self.problem = problem
        self._undo: list = []  # how to turn the inputs back into the uniform draw after a probe
        self._layouts: dict = {}  # leaf -> (its shape, how it is allocated: _layout)
        self.lowered = 0  # how often the magnitudes probe was drawn lower (see lower_magnitudes)

    def bound(self, use: _IndexUse) -> int:
        return self.problem.shapes[use.indexed][use.dim]

    def samples(self):
        self._base: dict = self.v.bases  # the problem's uniform float values, which the other probes derive from
        for probe in self.problem.probes:
            self.restore()
            if probe == "out-of-range index":
                values = self._draw_all("uniform")
                for leaf, uses in self.v.index_uses.items():
                    if not all(u.checked for u in uses):  # eager's result is undefined there: never run
                        continue
                    bound = min(self.bound(u) for u in uses)
                    python = all(u.python for u in uses)
                    for label, bad in (("too large", bound), ("too negative", -bound - 1 if python else -1)):
                        wrong = values[leaf].clone()
                        if wrong.numel():
                            wrong.view(-1)[0] = bad
                            yield f"out-of-range index ({label}: {bad} into {bound} rows of {leaf.name})", \
                                {**values, leaf: wrong}
            else:
                yield probe, self._draw_all(probe)

    def lower_magnitudes(self) -> bool:
        """Lower the magnitudes probe's levels (see :func:`_lowered`), for a problem where eager overflows
        at the dtype's range; False once the largest is 2^1."""
        dtypes = {value.dtype.to_real() for value in (leaf.meta.get("val") for leaf in self.v.leaves)
                  if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())}
        if all(_lowered(MAGNITUDES.get(d, MAGNITUDES_DEFAULT), self.lowered)[-1] <= 2 for d in dtypes):
            return False
        self.lowered += 1
        return True

    def redraw(self, probe: str) -> dict:
        self.restore()
        return self._draw_all(probe)

    def restore(self) -> None:
        """The uniform values back in the inputs a probe changed in place (the next probe, and the next
        problem, which reuses them, start from the uniform draw)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _draw_all(self, probe: str) -> dict:
        gen: dict = {}
        return {leaf: self._draw(leaf, position, probe, gen) for position, leaf in enumerate(self.v.leaves)}

    def _generator(self, device, gen: dict) -> torch.Generator:
        if device not in gen:
            gen[device] = torch.Generator(device=device).manual_seed(self.v.seed)
        return gen[device]

    def _draw(self, leaf: Node, position: int, probe: str, gen: dict) -> Any:
        value = leaf.meta.get("val")
        if leaf.op == "get_attr":
            return attribute(leaf)
        if not isinstance(value, torch.Tensor):
            if isinstance(value, (int, float, bool)) or _is_sym(value):
                return _at(value, self.problem.symbols)
            raise Unvalidatable(f"input {leaf.name} has no tensor or number value ({type(value).__name__})")
        if value.device.type == "meta":
            raise Unvalidatable(f"input {leaf.name} is on the meta device")
        g = self._generator(value.device, gen)
        if leaf in self.v.rng_states:  # a recorded generator state, the same on both sides
            return torch.Generator(device=value.device).manual_seed(self.v.seed).get_state().to(value.device)
        layout = self._layouts.get(leaf)  # (the same for every probe of the problem)
        if layout is None:
            shape = self.problem.leaf_shape(leaf)
            layout = self._layouts[leaf] = (shape, *_layout(value, shape))
        shape, stored, inverse = layout
        drawn = self._values(stored, value.dtype, value.device, g, leaf, position, probe, tuple(shape))
        return _arranged(drawn, inverse, shape)

    def _sequence(self, dtype: torch.dtype, device, g: torch.Generator, numel: int) -> torch.Tensor:
        """The rewrite's periodic sequence of dtype's values that large inputs (``numel`` real values
        here) are windows of (see :func:`_uniform`), long enough for the largest of the problem's."""
        real = dtype.to_real()
        sequence = self.v.periodic.get((real, device))
        if sequence is None or sequence.numel() < numel + PERIOD:
            longest = numel
            for leaf in self.v.leaves:
                value = leaf.meta.get("val")
                if isinstance(value, torch.Tensor) and value.dtype.to_real() == real and value.device == device:
                    values = math.prod(self.problem.leaf_shape(leaf)) * (2 if value.dtype.is_complex else 1)
                    longest = max(longest, values if values > PERIODIC_FROM else 0)
            block = sequence[:PERIOD] if sequence is not None else None  # (a longer one repeats the same block)
            sequence = self.v.periodic[(real, device)] = _periodic(longest + PERIOD, real, device, g, block)
        return sequence

    def _values(self, shape, dtype, device, g, leaf: Node, position: int, probe: str, logical=()) -> torch.Tensor:
        if dtype.is_floating_point or dtype.is_complex:
            if leaf not in self._base:
                numel = math.prod(shape) * (2 if dtype.is_complex else 1)
                shared = self._sequence(dtype, device, g, numel) if numel > PERIODIC_FROM else None
                self._base[leaf] = (logical, _uniform(shape, dtype, device, g, shared, position))
            drawn = self._base[leaf][1]
            real = torch.view_as_real(drawn) if dtype.is_complex else drawn
            if probe == "magnitudes" and real.numel() <= SCALED_UP_TO:
                if real.numel() > PERIODIC_FROM:  # (a window of the shared sequence: scaled into a copy)
                    scaled = _scale_rows(real, dtype, position, self.lowered, self.v.patterns, copy=True)
                    return torch.view_as_complex(scaled) if dtype.is_complex else scaled
                # in place, by powers of two: undone exactly
                self._undo.append(_scale_rows(real, dtype, position, self.lowered, self.v.patterns))
            elif probe in PLANTED:
                self._undo.append(_plant(real, PLANTED[probe], g))
            return drawn
        if dtype == torch.bool:
            return torch.rand(shape, generator=g, device=device) < 0.5
        numel = math.prod(shape)
        uses = self.v.index_uses.get(leaf)
        if uses:
            bound = min(self.bound(u) for u in uses)
            repeats = probe == "repeated indices" and all(u.repeats for u in uses) and numel > 1
            python = all(u.python for u in uses)  # (then some are counted from the end)
            if numel <= PYTHON_DRAWS_UP_TO:  # (a tensor op per step costs more than drawing them one by one)
                rows = _index_rows(random.Random(self.v.seed * PERIOD + position), bound, numel, repeats, python)
                return torch.tensor(rows, dtype=dtype, device=device).view(shape)
            if repeats:  # the second half repeats the first: each duplicate writes another value
                half = (numel + 1) // 2
                rows = torch.randperm(bound, generator=g, device=device)[:half] if half <= bound else \
                    torch.randint(0, max(bound, 1), (half,), generator=g, device=device)
                rows = torch.cat([rows, rows[:numel - half]])
            elif numel <= bound:  # distinct rows
                rows = torch.randperm(bound, generator=g, device=device)[:numel]
            else:
                rows = torch.randint(0, max(bound, 1), (numel,), generator=g, device=device)
            if python and numel:
                flip = torch.rand(numel, generator=g, device=device) < 0.5
                flip[0] = True
                rows = torch.where(flip, rows - bound, rows)
            return rows.to(dtype).view(shape)
        info = torch.iinfo(dtype)
        low, high = (info.min, info.max + 1) if info.bits <= 8 else (max(info.min, -64), 65)
        return torch.randint(low, high, shape, generator=g, device=device, dtype=dtype)


def _index_rows(rng: random.Random, bound: int, numel: int, repeats: bool, python: bool) -> list:
    """numel valid indices into ``bound`` rows, as _Draws._values draws them: distinct where there are at
    most as many as rows, the second half repeating the first for ``repeats``, and (``python``) about
    half of them, the first always, counted from the end."""
    def some(k: int) -> list:
        return rng.sample(range(bound), k) if k <= bound else [rng.randrange(max(bound, 1)) for _ in range(k)]

    if repeats:
        half = (numel + 1) // 2
        rows = some(half)
        rows += rows[:numel - half]
    else:
        rows = some(numel)
    if python:
        rows = [r - bound if i == 0 or rng.random() < 0.5 else r for i, r in enumerate(rows)]
    return rows


def _uniform(shape: list, dtype: torch.dtype, device, g: torch.Generator, shared: Optional[torch.Tensor] = None,
             position: int = 0) -> torch.Tensor:
    """Uniform in [-1, 1). An input of more than ``PERIODIC_FROM`` elements repeats a random block of a
    prime length along its memory: no two of its rows, nor two elements of a row, coincide for rows
    shorter than the period, and drawing it costs a copy rather than a random number per element.
    With ``shared`` (such a sequence, at least PERIOD longer than the input: :meth:`_Draws._sequence`)
    the input is a window of it starting at a phase of its own (``position``: no two inputs alike), so
    one block is drawn per rewrite and dtype, and the memory touched is the largest input's, not the
    sum of all (an MLA's weights). Windows overlap: no probe scales one in place (the magnitudes probe
    scales a copy), and a planted value is restored before the next probe."""
    numel = math.prod(shape)
    width = 2 if dtype.is_complex else 1
    if numel * width <= PERIODIC_FROM:
        drawn = torch.empty(shape, dtype=dtype, device=device)
        (torch.view_as_real(drawn) if dtype.is_complex else drawn).uniform_(-1, 1, generator=g)
        return drawn
    if shared is None:
        flat = _periodic(numel * width, dtype.to_real(), device, g)
    else:
        start = position * PHASE % (PERIOD - PERIOD % PHASE)
        flat = shared[start:start + numel * width]
    drawn = flat.view(*shape, 2) if dtype.is_complex else flat.view(shape)
    return torch.view_as_complex(drawn) if dtype.is_complex else drawn


def _periodic(numel: int, dtype: torch.dtype, device, g: torch.Generator,
              block: Optional[torch.Tensor] = None) -> torch.Tensor:
    """numel values repeating a uniform block of PERIOD values (a copy, not a draw per element): the
    given one, else a new one."""
    if block is None:
        block = torch.empty(PERIOD, dtype=dtype, device=device).uniform_(-1, 1, generator=g)
    return block.repeat(-(-numel // PERIOD))[:numel]


def _lowered(levels: tuple, times: int) -> tuple:
    """The levels above 2 with their exponents times 3/4, ``times`` times (float16's 2^12: 2^9, 2^6, 2^4...)."""
    for _ in range(times):
        levels = tuple(2.0 ** max(1, int(math.log2(level) * 3 / 4)) if level > 2 else level for level in levels)
    return levels


def _scale_rows(values: torch.Tensor, dtype: torch.dtype, position: int, lowered: int = 0,
                patterns: Optional[dict] = None, copy: bool = False):
    """Blocks of the input times powers of two that change from block to block (in place); returns
    how to undo it (``copy``: the scaled copy, the input untouched). A block is a slice along the outermost dims (enough of them for every level to
    appear), so the rows an op reduces or contracts over (a last-dim row, a weight's rows for one
    output feature or one head) keep one magnitude: mixing magnitudes inside a reduction would make
    the problem ill-conditioned rather than test large values. A 1-D input scales element by element."""
    levels = _lowered(MAGNITUDES.get(dtype, MAGNITUDES_DEFAULT), lowered)
    if values.numel() <= 1:  # a scale, a temperature: positive and well above 1
        saved = values.clone()
        values.abs_().add_(1).mul_(levels[2])
        return lambda: values.copy_(saved)
    lead = 1
    while lead < values.dim() - 1 and math.prod(values.shape[:lead]) < len(levels):
        lead += 1
    blocks = values.view(-1, 1) if values.dim() == 1 else values.view(math.prod(values.shape[:lead]), -1)
    # block i gets levels[(i + position) % len(levels)]: the levels turned by position, repeated
    turned = levels[position % len(levels):] + levels[:position % len(levels)]
    key = (turned, blocks.shape[0], values.dtype, values.device)  # (``patterns``: those made so far)
    pattern = patterns.get(key) if patterns is not None else None
    if pattern is None:
        pattern = torch.tensor(turned, dtype=values.dtype, device=values.device)
        pattern = pattern.repeat(-(-blocks.shape[0] // len(levels)))[:blocks.shape[0], None]
        if patterns is not None:
            patterns[key] = pattern
    if copy:
        return (blocks * pattern).view(values.shape)
    blocks.mul_(pattern)
    return lambda: blocks.div_(pattern)


def _plant(values: torch.Tensor, specials: tuple, g: torch.Generator):
    """The special values at a few distinct places (in place), spread over the input and over the lanes
    of its rows (a stride coprime with the size from a random start); returns how to undo it."""
    flat = values.view(-1)
    numel = flat.numel()
    count = min(max(len(specials), numel // 97), 64, numel)
    if not count:
        return lambda: None
    stride = max(1, int(numel * 0.6180339887)) | 1
    while math.gcd(stride, numel) != 1:
        stride += 2
    start = int(torch.randint(0, numel, (1,), generator=g, device=flat.device))
    places = torch.tensor([(start + i * stride) % numel for i in range(count)], device=flat.device)
    saved = flat[places]  # (an index copies)
    flat[places] = torch.tensor([specials[i % len(specials)] for i in range(count)], dtype=flat.dtype,
                                device=flat.device)
    return lambda: flat.index_put_((places,), saved)


# -- running ----------------------------------------------------------------------------------------
def _evaluate(nodes: list, env: dict, problem: _Problem, fallback=None, keep: Optional[set] = None,
              meta: bool = False, precise: Optional[torch.dtype] = None, memo: Optional[dict] = None):
    """The values of nodes (in order) added to env, or Raised; env holds the values they read.
    Integer arguments follow the problem's sizes; an ``arange`` of a sampled size gives its rows'
    real positions; values no later node reads are dropped unless in ``keep``."""
    inputs = [node.all_input_nodes for node in nodes]  # (a property that builds its list per call)
    freed = _freed_after(nodes, inputs, keep) if keep is not None else [()] * len(nodes)
    checked = problem.derived and not meta
    templates = problem.templates
    for i, node in enumerate(nodes):
        reads = inputs[i]
        for n in reads:
            if n not in env:
                if fallback is None or n not in fallback:
                    return Raised(Unvalidatable(f"{n.name} has no value"))
                env[n] = fallback[n]
        template = templates.get(node)
        if template is None:  # (the node's arguments with its integers remapped: once per problem)
            template = node.args, node.kwargs
            values = {**problem.values, **problem.node_values[node]} if node in problem.node_values else problem.values
            if values and not values.keys().isdisjoint(_ints_of(node, problem.ints)):
                template = _remapped(template, values)
            templates[node] = template
        args, kwargs = torch.fx.map_arg(template, env.__getitem__)
        if precise:
            args, kwargs = _widened((args, kwargs), precise)
        if checked and not any(isinstance(env[n], torch.Tensor) for n in reads):
            _shape_checked(node, _call(node, args, kwargs, problem, meta=True), problem)  # (a factory: before it allocates)
        key = _meta_key(node, args, kwargs, problem) if memo is not None else None
        if key is not None and key in memo:
            env[node] = memo[key]
            continue
        try:
            env[node] = _call(node, args, kwargs, problem, meta)
            if key is not None:
                memo[key] = env[node]
        except Exception as exc:  # an outcome to compare, like a value (its traceback, which holds the
            return Raised(exc.with_traceback(None), node)  # evaluation's frames and their tensors, dropped)
        if checked:
            _shape_checked(node, env[node], problem)
        for n in freed[i]:
            env.pop(n, None)
    return env


def _freed_after(nodes: list, inputs: list, keep: set) -> list:
    """Per node (``inputs``: the nodes each reads), the values of ``nodes`` whose last use it is, but
    those in ``keep``: what an evaluation frees after running it."""
    last = {}
    for i, reads in enumerate(inputs):
        for n in reads:
            last[n] = i
    freed: list = [()] * len(nodes)
    inside = set(nodes)
    for n, i in last.items():
        if n in inside and n not in keep:
            freed[i] = (*freed[i], n)
    return freed


def _meta_key(node: Node, args, kwargs, problem: _Problem) -> Optional[tuple]:
    """What a node's meta value depends on: its arguments' metadata (None: not to be reused, e.g.
    an ``arange`` whose rows a problem samples)."""
    if problem.rows and node.target in _ARANGES:
        return None
    parts = [node]
    _key_parts(args, parts)
    if kwargs:
        _key_parts(kwargs, parts)
    return tuple(parts)


_PLAIN = (int, float, bool, str, torch.dtype, torch.device, torch.memory_format, torch.layout, type(None))


def _key_parts(x: Any, parts: list) -> None:
    """x's metadata appended to parts (a walk of its lists, tuples and dicts: pytree's costs ~4x)."""
    if isinstance(x, torch.Tensor):
        parts.append((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype))
    elif isinstance(x, (tuple, list)):
        parts.append((type(x), len(x)))
        for y in x:
            _key_parts(y, parts)
    elif isinstance(x, dict):
        parts.append((dict, tuple(x)))
        for y in x.values():
            _key_parts(y, parts)
    elif isinstance(x, _PLAIN):
        parts.append((type(x), x))
    else:  # (an op overload, a generator...: keyed by what it is)
        parts.append(id(x))


def _call(node: Node, args, kwargs, problem: _Problem, meta: bool):
    target = node.target
    if meta:
        kwargs = {k: ("meta" if k == "device" else v) for k, v in kwargs.items()}
        if target is torch.ops.higher_order.run_with_rng_state:
            return args[1](*args[2:], **kwargs)
        shaped = _meta_by_rule(node, args, kwargs)
        if shaped is not None:
            return shaped
    if target is torch.ops.higher_order.auto_functionalized_v2:
        # the kernel the higher-order op dispatches to on dense tensors (its assertion that the op can be
        # functionalized held when the graph was traced; ~0.15 ms a call)
        return auto_functionalized_v2_dense(*args, **kwargs)
    if target in _ARANGES and problem.rows:
        sampled = _sampled_positions(node, problem)
        if sampled is not None:
            dtype = kwargs.get("dtype") or node.meta["val"].dtype
            return sampled.to(dtype=dtype, device="meta" if meta else kwargs.get("device", "cpu"))
    if target in _MATMULS and len(args) == 2 and not kwargs:  # (see half_matmul: each problem has new shapes)
        return half_matmul(target, *args)
    return target(*args, **kwargs)


# ops whose result has the broadcast shape of their tensor arguments (pointwise ops), or the shape of the
# first one (these), or that concatenate or reduce: their meta kernels are Python, and slow (a softmax
# backward's takes ~0.4 ms, a cat's ~0.3 ms)
_SHAPE_OF_FIRST = (aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
                   aten._log_softmax_backward_data.default, aten._to_copy.default, aten.clone.default,
                   torch.ops.prims.convert_element_type.default)
_SAME_SHAPES = (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)  # (grad, output)
_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default)  # (input, dim, keepdim)
_SHAPE_RULES: dict = {}  # id(op) -> (op, "first" | "broadcast" | "cat" | "reduce" | None)


def _meta_by_rule(node: Node, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """A meta value of node's shape (its traced dtype, its dims in the traced order) where a rule gives
    the shape from its arguments': a pointwise op broadcasts them, a softmax (or a cast) keeps the first
    one's, a cat sums its dim, a reduction drops (or keeps as 1) its dims; None for any other op, which
    runs its meta kernel. Raises as the kernel would where the arguments' shapes do not fit (the shrink
    changed what the program computes)."""
    target = node.target
    found = _SHAPE_RULES.get(id(target))
    if found is None or found[0] is not target:
        rule = None
        if isinstance(target, torch._ops.OpOverload) and len(target._schema.returns) == 1:
            rule = "first" if target in _SHAPE_OF_FIRST else "cat" if target == aten.cat.default else \
                "reduce" if target in _REDUCTIONS else "broadcast" if torch.Tag.pointwise in target.tags else None
        found = _SHAPE_RULES[id(target)] = (target, rule)
    rule, value = found[1], node.meta.get("val")
    if rule is None or not isinstance(value, torch.Tensor) or value._has_symbolic_sizes_strides or 0 in value.stride():
        return None
    if rule == "cat":
        shape = _cat_shape(args, kwargs)
    elif rule == "reduce":
        shape = _reduced_shape(args, kwargs)
    else:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            return None
        if rule == "first":
            shape = tuple(tensors[0].shape)
            if target in _SAME_SHAPES and tuple(tensors[1].shape) != shape:
                raise RuntimeError(f"{target}: grad {list(shape)} and output {list(tensors[1].shape)} differ")
        else:
            shape = _broadcast([tuple(t.shape) for t in tensors])
    if shape is None or len(shape) != value.dim():
        return None
    stored, inverse = _layout(value, list(shape))
    return _arranged(torch.empty(stored, dtype=value.dtype, device="meta"), inverse, list(shape))


def _cat_shape(args: tuple, kwargs: dict) -> Optional[tuple]:
    """aten.cat's shape (RuntimeError, as its kernel, where the inputs' other dims differ; None where
    a legacy empty 1-D input or an unusual argument leaves it to the kernel)."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors) or \
            any(t.dim() == 1 and t.shape[0] == 0 for t in tensors) or type(dim) is not int:
        return None
    rank = tensors[0].dim()
    if not -rank <= dim < rank:
        raise IndexError(f"cat: dim {dim} out of range for {rank} dims")
    dim %= rank
    first = list(tensors[0].shape)
    for t in tensors[1:]:
        shape = list(t.shape)
        if len(shape) != rank or shape[:dim] + shape[dim + 1:] != first[:dim] + first[dim + 1:]:
            raise RuntimeError(f"cat: sizes of tensors must match except in dimension {dim}: {first} and {shape}")
    return tuple(first[:dim] + [sum(t.shape[dim] for t in tensors)] + first[dim + 1:])


def _reduced_shape(args: tuple, kwargs: dict) -> Optional[tuple]:
    """A reduction's shape over its dims (all of them for none or []), kept as 1 with keepdim."""
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not isinstance(x, torch.Tensor) or type(keepdim) is not bool:
        return None
    rank = x.dim()
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        dims = range(rank)
    elif type(dims) is int:
        dims = [dims]
    elif not all(type(d) is int for d in dims):
        return None
    if rank == 0:
        return None
    if any(not -rank <= d < rank for d in dims):
        raise IndexError(f"dim {list(dims)} out of range for {rank} dims")
    reduced = {d % rank for d in dims}
    return tuple(1 if d in reduced else n for d, n in enumerate(x.shape) if keepdim or d not in reduced)


def _broadcast(shapes: list) -> tuple:
    """The broadcast of int shapes (RuntimeError, as torch's, where they do not broadcast)."""
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, n in enumerate(s, rank - len(s)):
            if n != 1:
                if out[i] not in (1, n):
                    raise RuntimeError(f"shapes {[list(x) for x in shapes]} do not broadcast")
                out[i] = n
    return tuple(out)


def _sampled_positions(node: Node, problem: _Problem) -> Optional[torch.Tensor]:
    """For an ``arange`` as long as a sampled size: start + step * (the sampled rows), else None."""
    start, end, step = 0, None, 1
    if node.target == aten.arange.default:
        end = node.args[0]
    elif node.target == aten.arange.start:
        start, end = node.args[:2]
    else:
        start, end, step = node.args[:3]
    if not all(isinstance(x, int) for x in (start, end, step)) or step == 0:
        return None
    length = -(-(end - start) // step)
    for size, rows in problem.rows.items():
        if size.real == length:
            return start + step * rows
    return None


def _widened(tree: Any, dtype: torch.dtype) -> Any:
    """Every float tensor and float dtype of the arguments in ``dtype`` (complex: its complex type)."""
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64

    def one(x):
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            return x.to(complex_dtype if x.is_complex() else dtype)
        if isinstance(x, torch.dtype) and (x.is_floating_point or x.is_complex):
            return complex_dtype if x.is_complex else dtype
        return x

    return _mapped(tree, one)


def _remapped(tree: Any, values: dict) -> Any:
    """Integer arguments equal to a changed size, replaced by its length in the problem."""
    return _mapped(tree, lambda x: values.get(x, x) if type(x) is int else x)


def _mapped(tree: Any, fn) -> Any:
    """fn applied to every leaf of an argument tree of lists, tuples and dicts (pytree's walk costs ~4x)."""
    if isinstance(tree, list):  # (fx's immutable_list too)
        return [_mapped(x, fn) for x in tree]
    if isinstance(tree, tuple):
        items = [_mapped(x, fn) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, dict):
        return {k: _mapped(v, fn) for k, v in tree.items()}
    return fn(tree)


# -- comparing ---------------------------------------------------------------------------------
def _difference(expected: Any, got: Any, probe: str = "uniform", exact: Any = None,
                overflowed: bool = False) -> Optional[str]:
    """How got differs from expected (None: equal within the dtype's tolerance); ``exact``, where
    given, is the subgraph's value in float64: twice eager's own error is allowed on top.
    ``overflowed``: only the elements finite on both sides are compared."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"is a sequence of {len(expected)}, the replacement gives {type(got).__name__}"
        for i, (e, g) in enumerate(zip(expected, got)):
            x = exact[i] if isinstance(exact, (tuple, list)) and len(exact) == len(expected) else None
            difference = _difference(e, g, probe, x, overflowed)
            if difference:
                return f"[{i}] {difference}"
        return None
    if not isinstance(expected, torch.Tensor):
        if isinstance(expected, float) and isinstance(got, float) and math.isnan(expected) and math.isnan(got):
            return None
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
        exact = torch.view_as_real(exact) if isinstance(exact, torch.Tensor) and exact.is_complex() else None
    if not expected.is_floating_point():
        if torch.equal(expected, got):
            return None
        wrong = (expected != got).sum().item()
        return f"has {wrong} of {expected.numel()} integer values different"
    numel, rms = expected.numel(), None
    if expected.dim() > 1 and numel > COMPARE_ELEMENTS:  # (an updated cache: its written rows differ, if any)
        whole, width = expected, expected.shape[-1]
        rows = _differing_rows(expected.reshape(-1, width), got.reshape(-1, width))
        if not rows.numel():
            return None
        if rows.numel() * width <= COMPARE_ELEMENTS:  # (copied; where most rows differ, the whole is compared)
            if isinstance(exact, torch.Tensor) and exact.shape == whole.shape:
                exact = exact.reshape(-1, width)[rows]
            expected, got = expected.reshape(-1, width)[rows], got.reshape(-1, width)[rows]
            rms = functools.partial(_finite_rms, whole)  # (a row's tolerance floor, where one exceeds its own)
    elif torch.equal(expected, got):
        return None
    if _all_finite(expected) and _all_finite(got):  # (then equal bits would be equal values: not equal)
        return _beyond_tolerance(expected, got, probe, exact, finite=True, numel=numel, rms=rms)
    if _same_bits(expected, got):  # equal NaNs too
        return None
    e_finite, g_finite = torch.isfinite(expected), torch.isfinite(got)
    if overflowed:  # (exact, the subgraph in a wider dtype, is finite where eager is)
        both = e_finite & g_finite
        exact = torch.where(both, exact, 0) if isinstance(exact, torch.Tensor) and exact.shape == both.shape else None
        return _beyond_tolerance(torch.where(both, expected, 0), torch.where(both, got, 0), probe, exact, finite=True,
                                 numel=numel, rms=rms)
    lost = int((e_finite & ~g_finite).sum())
    if lost:
        return f"is finite at {lost} of {numel} elements where the replacement is not"
    if probe == "magnitudes":
        pass  # where eager itself overflowed, the replacement may be more precise
    elif probe == "infinities":
        gained = int((~e_finite & g_finite).sum())
        if gained:
            return f"is infinite or NaN at {gained} of {numel} elements where the replacement is finite"
    else:
        e_special, g_special = (t[~e_finite].float().nan_to_num() for t in (expected, got))
        if not (torch.equal(e_finite, g_finite) and torch.equal(e_special, g_special)):
            count = int((e_finite != g_finite).sum()) or int((e_special != g_special).sum())
            return (f"is NaN or infinite where the replacement is not, or another infinity, at {count} of "
                    f"{numel} elements")
        del e_special, g_special
    del e_finite, g_finite
    return _beyond_tolerance(expected, got, probe, exact, numel=numel, rms=rms)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """Every element of got is the very value of expected's (NaNs where it has NaNs): no probe can find
    a difference then."""
    bits = _BITS.get(expected.element_size())
    if bits is None or expected.is_neg() or got.is_neg():
        return False
    try:
        return torch.equal(expected.view(bits), got.view(bits))
    except RuntimeError:  # (a layout that cannot be viewed so: compared by value)
        return False


def _differing_rows(expected: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """The indices of the rows of two [rows, width] tensors that are not bit for bit the same (a row
    left out holds the same values, NaNs included: nothing to compare in it)."""
    bits = _BITS.get(expected.element_size())
    try:
        differ = expected.view(bits) != got.view(bits) if bits and not (expected.is_neg() or got.is_neg()) else None
    except RuntimeError:  # (a layout that cannot be viewed so: compared by value, NaNs always differ)
        differ = None
    if differ is None:
        differ = expected != got
    return differ.view(torch.uint8).amax(-1).nonzero().view(-1)  # (amax of bytes: ~2x a bool any() here)


def _finite_rms(values: torch.Tensor) -> float:
    """The rms of values over their finite elements (NaN and infinities count as 0), block by block."""
    precise = torch.float64 if values.dtype == torch.float64 else torch.float32
    rows = values.reshape(-1, values.shape[-1] if values.dim() else 1)
    step = max(1, COMPARE_ELEMENTS // max(rows.shape[1], 1))
    total = 0.0
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        block = torch.where(torch.isfinite(block), block, 0)
        total += float(torch.linalg.vector_norm(block, dtype=precise)) ** 2
    return (total / max(values.numel(), 1)) ** 0.5


def _all_finite(values: torch.Tensor) -> bool:
    """No element is NaN or infinite: in one pass, cheaper than ``isfinite``. A 16-bit float's min and
    max are (NaN propagates; ~3x its sum in float32 here), a wider one's sum is, or, where the sum
    overflows, every element is."""
    if not values.numel():
        return True
    if values.element_size() <= 2:
        low, high = torch.aminmax(values)
        return math.isfinite(float(low)) and math.isfinite(float(high))
    wide = torch.float64 if values.dtype == torch.float64 else torch.float32
    return math.isfinite(float(values.sum(dtype=wide))) or bool(torch.isfinite(values).all())


def _beyond_tolerance(expected: torch.Tensor, got: torch.Tensor, probe: str, exact: Any,
                      finite: bool = False, numel: Optional[int] = None, rms=None) -> Optional[str]:
    """The finite elements' comparison, block by block of rows (a few MB of temporaries at most; a larger
    output comes here as its rows that differ, :func:`_difference`). ``numel``, ``rms``: for those rows,
    the whole output's element count and how to compute its rms over its finite elements."""
    numel = expected.numel() if numel is None else numel
    precise = torch.float64 if expected.dtype == torch.float64 else torch.float32
    width = expected.shape[-1] if expected.dim() else 1
    e_all, g_all = expected.reshape(-1, width), got.reshape(-1, width)
    x_all = exact.reshape(-1, width) if isinstance(exact, torch.Tensor) and exact.shape == expected.shape \
        and exact.is_floating_point() else None
    step = max(1, COMPARE_ELEMENTS // max(width, 1))
    eps = torch.finfo(expected.dtype).eps
    rel, absolute = TOLERANCE_EPS.get(expected.dtype, (16, 16))

    def judged(everything: float) -> tuple:
        """(elements beyond tolerance, the worst (expected, got), the largest difference) with each row's
        scale at least ``everything``."""
        blocks = ((e_all[r:r + step], g_all[r:r + step], None if x_all is None else x_all[r:r + step])
                  for r in range(0, e_all.shape[0], step))
        bad, worst, worst_at, largest = 0, 0.0, None, 0.0
        for e, g, x in blocks:
            e, g = e.to(precise), g.to(precise)
            compared = None if finite else torch.isfinite(e)
            if not finite:
                e, g = torch.where(compared, e, 0), torch.where(compared, g, 0)
            scale = e.pow(2).mean(-1, keepdim=True).sqrt_().clamp_(min=everything)  # the rms of each row
            err = (e - g).abs_()
            if not err.numel():
                continue
            block_largest = float(err.max())
            largest = max(largest, block_largest)
            if block_largest <= 0.5 * absolute * eps * float(scale.min()):  # within every element's tolerance by
                continue  # half its smallest part: none of the block differs
            # (the magnitudes probe: large values lose digits to cancellation in any kernel, a relative floor)
            floor = absolute * eps + (MAGNITUDES_RTOL if probe == "magnitudes" else 0.0)
            slack = err.sub_(e.abs().mul_(rel * eps)).sub_(scale * floor)
            if x is not None:  # eager's own error, the largest of the row (it varies element by element)
                compared = torch.isfinite(e) if compared is None else compared
                own = (e - torch.where(compared, x.to(precise), 0)).abs_().nan_to_num_(0)
                slack -= own.amax(-1, keepdim=True).mul_(4)
            if float(slack.max()) > 0:
                over = slack > 0
                bad += int(over.sum())
                value, where = slack.reshape(-1).max(0)
                if worst_at is None or float(value) > worst:
                    worst, worst_at = float(value), (float(e.reshape(-1)[where]), float(g.reshape(-1)[where]))
        return bad, worst_at, largest

    bad, worst_at, largest = judged(0.0)
    if bad and probe != "magnitudes":  # (the magnitudes probe scales blocks apart: each row is its own scale)
        # a row's scale is at least the whole output's rms (over its finite elements), which only allows more
        bad, worst_at, largest = judged(rms() if rms is not None else _finite_rms(expected))
    if bad:
        return (f"differs at {bad} of {numel} elements (by up to {largest:.3g}; "
                f"e.g. {worst_at[0]:.4g} vs {worst_at[1]:.4g}, {expected.dtype})")
    return None


# -- helpers -----------------------------------------------------------------------------------
def _topological(nodes: list) -> list:
    """nodes, each after the ones of them it reads: in graph order (FX orders nodes by position)."""
    return sorted(dict.fromkeys(nodes))

