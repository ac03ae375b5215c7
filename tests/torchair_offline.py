"""Load torchair (inside a torch_npu wheel) on a machine without CANN or an NPU.

torch_npu is installed by ``make test`` into ``.cache/torch_npu`` with
``pip install --target``: off every default import path, so no other process in
the environment sees it (an installed torch_npu breaks ``import torch`` unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0). Only torchair's Python part is imported; its
native module is replaced by the stub ``shared/reference/torchair-offline.md``
describes, enough for the FX->GE conversion to run for real.
"""

import os
import signal
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_NPU_DIR = Path(os.environ.get("NPU_FUSE_TORCH_NPU_DIR", REPO / ".cache" / "torch_npu"))


def torchair_dir() -> Path:
    return TORCH_NPU_DIR / "torch_npu" / "dynamo"


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
    stub.check_cann_compat = lambda *a: ""
    stub.get_registered_ir_def = lambda op: ("SUCCESS", [], [], [])
    sys.modules[stub.__name__] = stub
    saved = [(s, signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)]
    import torchair

    for s, handler in saved:  # torchair installs handlers that swallow the signals
        signal.signal(s, handler)
    return torchair


def ge_graphs_of(fn, *args, dynamic=False, fusion=True):
    """Compile fn through AOTAutograd + the npu_fuse passes + torchair's FX->GE
    conversion, run it eagerly, and return the GE GraphDefs (fw, then bw if any)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torchair = load_torchair_offline()
    from torchair.configs.compiler_config import CompilerConfig

    from npu_fuse_backend.lowering.npu import load_converters
    from npu_fuse_backend import run_fusion_passes

    load_converters()
    to_ge = torchair.get_compiler(CompilerConfig())
    graphs = []

    def one(gm, inputs):
        if fusion:
            run_fusion_passes(gm, "torchair")
        graphs.append(to_ge(gm, inputs).runner.graph._proto)  # built, never loaded
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=one, bw_compiler=one, keep_inference_input_mutations=True)
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.sum().backward()
    return graphs


def op_types(graph) -> list:
    return [op.type for op in graph.op]
