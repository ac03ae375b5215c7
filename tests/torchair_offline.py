"""Load torchair (inside a torch_npu wheel) on a machine without CANN or an NPU.

torch_npu is installed by ``make test`` into ``.cache/torch_npu`` with
``pip install --target``: off every default import path, so no other process in
the environment sees it (an installed torch_npu breaks ``import torch`` unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0). Only torchair's Python part is imported; its
native module is replaced by a stub, enough for the FX->GE conversion to run for real.

The stub is a faithful proxy of the installed CANN's operator registry, not a yes-man:
``get_registered_ir_def(op)`` answers with the real IR of the op (``cann_ir``: CANN's
op-defs for the ops our converters emit, torchair's generated IR for its ordinary ops)
and "ERROR" for an op it does not know, and ``check_cann_compat`` fails an optional
input or attr a ``ge_op`` builder writes that the IR lacks. ``hidden_ops(...)`` makes
the proxy play an older CANN that lacks some ops.
"""

import contextlib
import os
import signal
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_NPU_DIR = Path(os.environ.get("NPU_FUSE_TORCH_NPU_DIR", REPO / ".cache" / "torch_npu"))

_table = None
_hidden: set = set()


def torchair_dir() -> Path:
    return TORCH_NPU_DIR / "torch_npu" / "dynamo"


def ir_table() -> dict:
    """{op type: cann_ir.OpIR} the proxy answers from."""
    global _table
    if _table is None:
        from cann_ir import load_ir_table

        _table = load_ir_table(torchair_dir() / "torchair")
    return _table


def known_ir(op_type: str):
    return None if op_type in _hidden else ir_table().get(op_type)


@contextlib.contextmanager
def hidden_ops(*op_types: str):
    """The proxy plays a CANN without these ops (``get_registered_ir_def`` fails for them)."""
    added = set(op_types) - _hidden
    _hidden.update(added)
    _forget_cached_answers()
    try:
        yield
    finally:
        _hidden.difference_update(added)
        _forget_cached_answers()


def _forget_cached_answers():
    """torchair caches check_cann_compat per (op, inputs, attrs): right for one CANN per
    process, stale once the proxy plays another."""
    if "torchair" in sys.modules:
        from torchair._ge_concrete_graph.compat_ir import is_cann_compat

        is_cann_compat.cache_clear()


def get_registered_ir_def(op_type: str) -> tuple:
    """GE's GetRegisteredIrDef as torchair's native module returns it."""
    ir = known_ir(op_type)
    if ir is None:
        return "ERROR", [], [], []
    return ("SUCCESS", *ir.registered_ir_def())


def check_cann_compat(op_type: str, optional_inputs=(), optional_attrs=()) -> str:
    """torchair's check_cann_compat: "" when the installed CANN has the op, each optional input
    a ``ge_op`` builder connects and each non-default attr it writes; else why not."""
    ir = known_ir(op_type)
    if ir is None:
        return f"op type {op_type} is not registered in the installed CANN"
    for name in optional_inputs:
        spec = ir.input(name)
        if spec is None or spec.kind != "optional":
            return f"op {op_type} of the installed CANN has no optional input {name!r}"
    for name in optional_attrs:
        if ir.attr(name) is None:
            return f"op {op_type} of the installed CANN has no attr {name!r}"
    return ""


def load_torchair_offline():
    if "torchair" in sys.modules:
        return sys.modules["torchair"]
    if not (torchair_dir() / "torchair").is_dir():
        raise FileNotFoundError(f"torchair not found under {torchair_dir()}; run `make test` to fetch it")
    sys.path.insert(0, str(torchair_dir()))
    stub = types.ModuleType("torchair.core._torchair")
    stub.TorchDataType = types.ModuleType("TorchDataType")
    stub.TorchDataType.__getattr__ = lambda name: 0
    stub.TorchNpuGraphBase = type("TorchNpuGraphBase", (), {"__init__": lambda self, name="": None})
    stub.InitializeGraphEngine = stub.FinalizeGraphEngine = stub.SetDebugLogPath = lambda *a: None
    stub.check_cann_compat = check_cann_compat
    stub.get_registered_ir_def = get_registered_ir_def
    sys.modules[stub.__name__] = stub
    saved = [(s, signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)]
    import torchair

    for s, handler in saved:  # torchair installs handlers that swallow the signals
        signal.signal(s, handler)
    return torchair


class ConvertedGraph:
    """A GE GraphDef (attribute reads go to it) and the names of the graph inputs (Data) the
    compiled function mutates."""

    def __init__(self, proto, mutated_inputs: tuple):
        self.proto = proto
        self.mutated_inputs = mutated_inputs

    def __getattr__(self, name):
        return getattr(self.proto, name)


def ge_graphs_of(fn, *args, dynamic=False, fusion=True, config=None):
    """Compile fn through AOTAutograd and torchair's compiler with the npu_fuse lowering's pre-pass
    (the fusion passes, version tolerance, re-inplacing), run it eagerly, and return the GE
    GraphDefs after torchair's GE passes (fw, then bw if any), built but never loaded. A graph
    with an op type the proxy does not know fails, as GE would fail it."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torchair = load_torchair_offline()
    from torchair.configs.compiler_config import CompilerConfig

    from npu_fuse_backend import run_fusion_passes
    from npu_fuse_backend.lowering.npu import load_converters, torchair_pre_pass

    load_converters()
    cfg = config or CompilerConfig()
    if fusion:
        cfg.post_grad_custom_pre_pass = torchair_pre_pass(run_fusion_passes)
    to_ge = torchair.get_compiler(cfg)
    graphs = []

    def one(gm, inputs):
        mutated = [n.args[0].name for n in gm.graph.nodes  # AOTAutograd's epilogue writes them back
                   if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"]
        proto = to_ge(gm, inputs).runner.graph._proto  # the passes run on torchair's copy of gm
        unknown = sorted({op.type for op in proto.op if known_ir(op.type) is None})
        if unknown:  # raw builders never ask the registry; GE would refuse the graph
            raise RuntimeError(f"GE op types not registered in the installed CANN: {unknown}")
        graphs.append(ConvertedGraph(proto, tuple(mutated)))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=one, bw_compiler=one, keep_inference_input_mutations=True,
                           decompositions=aten_decompositions())
    # SDPA's math form: on CPU tensors SDPA would pick a CPU-only flash kernel (no GE converter;
    # an NPU graph has the NPU's own attention op)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.sum().backward()
    return graphs


def aten_decompositions() -> dict:
    """aten ops torchair has no GE converter for, decomposed as inductor does, so that a training
    step of the demo models converts: silu_backward (torchair's converter raises)."""
    import torch
    from torch._decomp import get_decompositions

    return get_decompositions([torch.ops.aten.silu_backward.default])


def op_types(graph) -> list:
    return [op.type for op in graph.op]
