"""What the converters declare beside their graph_convert functions, and what they share.

- ``declare_ge_ops(fused_op, {soc: GE op types | reason})``: the GE ops a converter emits
  for each target SoC (``generic`` included), or why it has none there (a SoC where the op
  itself has no kernel is the op's to say: ``unavailable_on`` beside it). The torchair
  lowering asks the installed CANN for each of them (``get_registered_ir_def``) and turns
  the fusions of an op whose GE ops are missing into near-misses (version tolerance).
- ``declare_in_place_on_graph_inputs(op)``: a mutating fused op whose converter may be
  called on a graph input directly (not only through auto_functionalized_v2's copy): its GE
  op writes the input in place (an output named like that input) and is kept alive with
  ``dont_prune_me``. The torchair lowering re-inplaces such calls (see ``lowering/npu.py``).
- ``target_soc()``: the SoC to convert for; an unrecognised NPU is a clear error.
- ``ir_op(...)``: build a node the way torchair's IrDef builders do: optional inputs left
  out when None, default-valued attrs left out, and ``check_cann_compat`` asked first.
"""

from typing import Optional, Union

import torch
from torchair._ge_concrete_graph.compat_ir import IrDef, ge_op
from torchair.ge._ge_graph import dont_prune_me

from npu_fuse_backend.lowering.registry import UNAVAILABLE
from npu_fuse_backend.soc import resolve_soc, unknown_soc_reason

GE_OPS: dict = {}  # fused op name -> {soc: tuple of GE op types, or the reason there is none}
IN_PLACE_ON_GRAPH_INPUTS: set = set()  # fused OpOverloads (mutating) converted in place on a graph input


def declare_ge_ops(fused_op: str, per_soc: dict[str, Union[tuple, str]]) -> None:
    """The SoCs where the op has no kernel at all come from the op's own table
    (``lowering.registry.unavailable_on``), with its reasons; ``per_soc`` names the others."""
    unavailable = UNAVAILABLE.get(getattr(torch.ops.npu_fuse, fused_op).default, {})
    restated = sorted(set(per_soc) & set(unavailable))
    if restated:
        raise ValueError(f"declare_ge_ops({fused_op!r}): {restated} are the op's unavailable_on SoCs; "
                         "their reasons are said once, beside the op")
    GE_OPS[fused_op] = {**unavailable, **per_soc}


def declare_in_place_on_graph_inputs(op) -> None:
    IN_PLACE_ON_GRAPH_INPUTS.add(op)


def target_soc() -> str:
    soc = resolve_soc()
    reason = unknown_soc_reason(soc)
    if reason:
        raise ValueError(f"npu_fuse converter: {reason}")
    return soc


def ir_op(ir: IrDef, inputs: dict, outputs: list, attrs: Optional[dict] = None):
    """One GE node of ``ir.op_type`` (inputs/attrs by IR name, in IR order)."""
    return ge_op(ir.op_type, inputs=inputs, outputs=outputs, attrs=attrs, ir=ir)


def keep(tensor):
    """Keep an in-place op whose output nobody reads (it updates a graph input) in the graph."""
    dont_prune_me(tensor)
    return tensor
