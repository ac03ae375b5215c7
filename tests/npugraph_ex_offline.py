"""Run npugraph_ex (inside a torch_npu wheel) on a machine without CANN or an NPU.

npugraph_ex is torch_npu's aclgraph backend: AOTAutograd, its FX passes (our pre-pass among
them), then a capture of the FX graph's eager NPU kernels into an aclgraph. Its Python part
imports without stubs (``torch_npu/dynamo`` on ``sys.path``, as for torchair,
``tests/torchair_offline.py``); what needs a device is the aclgraph runtime, so only that is
replaced, and everything up to the capture runs for real:

- ``AclGraph`` (the capture and replay, ``torch_npu.npu.NPUGraph``) -> :class:`EagerAclGraph`,
  which records the FX graph npugraph_ex hands it to capture (after all of npugraph_ex's
  passes) and, when called, runs it eagerly, as npugraph_ex's own ``force_eager`` does;
- ``import torch_npu``, which npugraph_ex does to check that the runtime exists (when it builds
  an ``AclConcreteGraph``), in the module its codegen writes and executes,  and when its
  static-kernel and tagged-event modules load, is answered by a module without a device
  API for those moments only; at every other time ``torch_npu`` stays out of
  ``sys.modules`` (npu_fuse reads its presence as "an NPU may be here").

- ``torch.npu``, the device module torch_npu adds to torch, of which npugraph_ex's passes read
  the stream API (the current stream's id, to tell the user's streams from the default one;
  ``Event``/``Stream`` in annotations), is a one-stream stand-in (:func:`npu_stream_api`) while
  npugraph_ex compiles and runs a graph.

torchair is loaded first (``tests/torchair_offline.py``) and its patches applied before npugraph_ex
is used, as npu_fuse's route does (``lowering/npugraph_ex.py``: loaded after npugraph_ex, torchair fails). At exit npugraph_ex resets Dynamo and uninstalls static kernels (importing torch_npu): that hook
is removed; its SIGINT/SIGTERM handlers, which swallow the signal, are restored.
"""

import atexit
import contextlib
import dataclasses
import functools
import signal
import sys
import types

import torch

from torchair_offline import load_torchair_offline, torchair_dir


@dataclasses.dataclass
class Capture:
    """One FX graph npugraph_ex would capture into an aclgraph: ``phase`` is npugraph_ex's compile
    phase ("forward" for forward and inference graphs, "backward"), ``graph_module`` the graph
    after all of npugraph_ex's passes, ``config`` the aclgraph options it would be captured with."""

    phase: str
    graph_module: object
    config: dict
    name: str = ""
    inputs: tuple = ()  # the arguments of its first run (copies taken before it ran)


CAPTURES: list = []


def npugraph_ex_available() -> bool:
    return (torchair_dir() / "npugraph_ex").is_dir()


@contextlib.contextmanager
def _runtime_present():
    """``import torch_npu`` succeeds (an empty module) inside this block only."""
    if "torch_npu" in sys.modules:
        yield
        return
    runtime = types.ModuleType("torch_npu")
    runtime.npu = types.ModuleType("torch_npu.npu")  # no device API: feature probes answer "absent"
    sys.modules["torch_npu"] = runtime
    try:
        yield
    finally:
        del sys.modules["torch_npu"]


class _DefaultStream:
    stream_id, device_index, device_type = 0, 0, 20  # PrivateUse1, as torch_npu's streams report


@contextlib.contextmanager
def npu_stream_api():
    """``torch.npu`` with one stream and no device, inside this block only (re-entrant)."""
    if hasattr(torch, "npu"):
        yield
        return
    npu = types.ModuleType("torch.npu")
    npu.Stream = _DefaultStream
    npu.Event = type("Event", (), {})
    npu.current_stream = _DefaultStream
    npu.__getattr__ = _device_call  # the rest of the API (compared with FX targets, never called here)
    torch.npu = npu
    try:
        yield
    finally:
        del torch.npu


@functools.lru_cache(None)
def _device_call(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def call(*args, **kwargs):
        raise RuntimeError(f"torch.npu.{name}: no NPU on this machine (npugraph_ex offline)")

    call.__name__ = name
    return call


class EagerAclGraph:
    """npugraph_ex's ``AclGraph`` without a device: built from the FX graph to capture (recorded in
    :data:`CAPTURES`) or from the forward function npugraph_ex's codegen writes (run eagerly)."""

    def __init__(self, fx_graph=None, fx_forward=None, config=None):
        from npugraph_ex._utils.graph_transform_observer import debug_ctx

        if (fx_graph is None) == (fx_forward is None):
            raise AssertionError("AclGraph takes exactly one of fx_graph and fx_forward")
        self.fx_graph, self.fx_forward, self.config = fx_graph, fx_forward, config or {}
        self.capture = None
        if fx_graph is not None:
            self.capture = Capture(getattr(debug_ctx, "phase", None), fx_graph, dict(self.config))
            CAPTURES.append(self.capture)

    def load(self, aclgraph_cache_info) -> None:
        self.cache_info = aclgraph_cache_info
        if self.capture is not None:
            self.capture.name = self.name
        else:  # the runtime of a graph recorded at compile time: its captures share the graph's name
            self.capture = next((c for c in reversed(CAPTURES) if c.name == self.name), None)

    @property
    def name(self) -> str:
        return self.cache_info.fx_graph_name

    def __call__(self, *args, **kwargs):
        if self.capture is not None and not self.capture.inputs:
            self.capture.inputs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        if self.fx_forward is not None:
            return self.fx_forward(*args, **kwargs)
        return self.fx_graph(*args, **kwargs)


def load_npugraph_ex_offline():
    if "npugraph_ex" in sys.modules:
        return sys.modules["npugraph_ex"]
    if not npugraph_ex_available():
        raise FileNotFoundError(f"npugraph_ex not found under {torchair_dir()}; run `make test` to fetch it")
    if str(torchair_dir()) not in sys.path:
        sys.path.insert(0, str(torchair_dir()))
    load_torchair_offline()  # first, as npu_fuse does (lowering/npugraph_ex.py: import_npugraph_ex)
    saved = [(s, signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)]
    import npugraph_ex

    for s, handler in saved:
        signal.signal(s, handler)
    atexit.unregister(npugraph_ex._finalize)

    from npugraph_ex import npu_fx_compiler

    with _runtime_present(), npu_stream_api():  # modules that import torch_npu when they load
        from npugraph_ex._acl_concrete_graph import acl_graph, fx2acl_converter  # static_kernel.py
        from npugraph_ex.ops import _tagged_event  # noqa: F401  (the stream passes' ops)

    acl_graph.AclGraph = fx2acl_converter.AclGraph = EagerAclGraph
    concrete_init = fx2acl_converter.AclConcreteGraph.__init__
    compile_py_code = npu_fx_compiler._compile_py_code

    def init_with_runtime(self, *args, **kwargs):
        with _runtime_present():
            concrete_init(self, *args, **kwargs)

    def compile_with_runtime(py_code):
        with _runtime_present():
            return compile_py_code(py_code)

    fx2acl_converter.AclConcreteGraph.__init__ = init_with_runtime
    npu_fx_compiler._compile_py_code = compile_with_runtime
    from npu_fuse_backend.lowering.npugraph_ex import import_npugraph_ex

    return import_npugraph_ex()  # as npu_fuse's route loads it: torchair's patches first


def npugraph_ex_run(fn, *args, backend=None, dynamic=False, training=None, **compile_kwargs) -> tuple:
    """Compile fn with ``backend`` (default: npu_fuse's npugraph_ex backend; ``compile_kwargs``:
    torch.compile's ``mode`` or ``options``), run it once (and a backward of its output's sum when
    it requires grad, or ``training``); returns (its output, the :class:`Capture` of every graph
    npugraph_ex would have captured, in compile order)."""
    import npu_fuse_backend as nf

    load_npugraph_ex_offline()
    CAPTURES.clear()
    torch._dynamo.reset()
    with npu_stream_api():
        out = torch.compile(fn, backend=backend or nf.get_npugraph_ex_backend(), dynamic=dynamic,
                            **compile_kwargs)(*args)
        if training if training is not None else (isinstance(out, torch.Tensor) and out.requires_grad):
            out.float().sum().backward()
    return out, list(CAPTURES)


def npugraph_ex_graphs_of(fn, *args, **kwargs) -> list:
    """:func:`npugraph_ex_run`'s captures."""
    return npugraph_ex_run(fn, *args, **kwargs)[1]
