"""npu_fuse::inplace_partial_rotary_mul(_backward) -> GE InplacePartialRotaryMul(Grad), as CANN defines them.

IR (OT @ 5871dd99 ``posembedding/inplace_partial_rotary_mul{,_grad}/op_host/*_def.cpp``):
``InplacePartialRotaryMul(x, cos, sin) -> x`` and ``InplacePartialRotaryMulGrad(dy, cos, sin) -> dy``,
attrs ``rotary_mode`` Int (1 = interleave, the only mode implemented) and ``partial_slice``
ListInt. Both update their first input in place: the output has the input's name, which is how
torchair binds the mutated tensor to the op's result.

SoCs: the forward op exists on ascend910b, ascend910_93 and ascend950 (and 960dt, 350); the Grad
op on ascend950 only. On Atlas A2/A3 and under "generic" the backward is the forward op with
transformed tables: per interleaved pair (2i, 2i+1) the adjoint of
``y = x*cos + R(x)*sin`` is ``dx[2i] = dy[2i]*cos[2i] + dy[2i+1]*sin[2i+1]``,
``dx[2i+1] = dy[2i+1]*cos[2i+1] - dy[2i]*sin[2i]``, i.e. the forward rotation with
``sin' = -swap_pairs(sin)``. sin is a small table (BS1D / B11D), so the swap (GatherV2 with a
constant permutation) and Neg cost little next to the slice of dy.

Dtypes: the forward op's (x, cos, sin) columns are (f16|f32|bf16 x3) and (f16|bf16, f32, f32);
other mixes (the fused op allows any float x with float tables) get their tables cast to x's
dtype. The Grad op takes every (dy, cos) pair.

No copy of a mutated graph input (the decision, with its evidence): torchair removes the
TensorMove that auto_functionalized_v2 puts before every in-place op only for the op types of
its fixed table (``graph_pass._get_output_to_input_ref_idx``); these ops are not in it, there is
no hook to add them, and no op of the table can both read x's slice and write it back (a
Scatter writing the rotated slice would need a second reader of the input, which blocks the
removal). So the torchair lowering re-inplaces instead, at the FX level, exactly as torchair
does for its own scatter ops (``patterns/_recover_view_inplace_pattern.py``, whose
``scatter_update_`` converter emits ``Scatter`` on the graph input and ``dont_prune_me``): when
x is a graph input that nothing else reads and whose new value only goes back into it, the op is
called on x itself (``lowering/npu.py::reinplace_graph_inputs``, GE mode only). Called that way,
the converters below get the graph input (a ``Data``) as x, emit the op on it (GE writes the
output named ``x`` into the input's memory) and keep it with ``dont_prune_me``: the GE graph
after torchair's GE passes has no TensorMove of x (tests/test_inplace_graph_inputs.py). A
mutated intermediate keeps torchair's copy (the old value may still be read).
"""

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.compat_ir import IrDef
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, Support
from torchair.ge import attr
from torchair.ge._ge_graph import DataType, Tensor

from npu_fuse_backend.soc import A2_A3, ASCEND950, GENERIC
from npu_fuse_backend.converters.common import declare_ge_ops, declare_in_place_on_graph_inputs, ir_op, keep, target_soc

ROTARY_MODES = {"interleave": 1}  # the op-defs define 0-3; only interleave (1) is implemented
FLOATS = "DT_FLOAT16, DT_FLOAT, DT_BF16"


def _ir(op_type: str, mutated: str) -> IrDef:
    return (IrDef(op_type).input(mutated, FLOATS).input("cos", FLOATS).input("sin", FLOATS)
            .attr("rotary_mode", attr.Int(0)).attr("partial_slice", attr.ListInt([0, 0]))
            .output(mutated, FLOATS))


IPRM_IR = _ir("InplacePartialRotaryMul", "x")
IPRM_GRAD_IR = _ir("InplacePartialRotaryMulGrad", "dy")
HALF_FLOATS = (DataType.DT_FLOAT16, DataType.DT_BF16)

declare_ge_ops("inplace_partial_rotary_mul", {
    soc: ("InplacePartialRotaryMul",) for soc in (*A2_A3, ASCEND950, GENERIC)})
declare_ge_ops("inplace_partial_rotary_mul_backward", {
    **{soc: ("InplacePartialRotaryMul", "GatherV2", "Neg") for soc in (*A2_A3, GENERIC)},
    ASCEND950: ("InplacePartialRotaryMulGrad",),
})
declare_in_place_on_graph_inputs(torch.ops.npu_fuse.inplace_partial_rotary_mul.default)
declare_in_place_on_graph_inputs(torch.ops.npu_fuse.inplace_partial_rotary_mul_backward.default)


def _attrs(rotary_mode: str, partial_slice) -> dict:
    if rotary_mode not in ROTARY_MODES:
        raise ValueError(f"InplacePartialRotaryMul implements rotary_mode 'interleave' only, got {rotary_mode!r}")
    return {"rotary_mode": attr.Int(ROTARY_MODES[rotary_mode]), "partial_slice": attr.ListInt(list(partial_slice))}


def _tables_for(x: Tensor, r1: Tensor, r2: Tensor):
    """cos/sin in a dtype the forward op's columns pair with x's."""
    if r1.dtype == x.dtype or (x.dtype in HALF_FLOATS and r1.dtype == DataType.DT_FLOAT):
        return r1, r2
    return ge.Cast(r1, dst_type=x.dtype), ge.Cast(r2, dst_type=x.dtype)


def _rotate_in_place(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str, partial_slice):
    cos, sin = _tables_for(x, r1, r2)
    # the last op emitted, its output named like its input x: torchair binds the update to it
    return keep(ir_op(IPRM_IR, inputs={"x": x, "cos": cos, "sin": sin}, outputs=["x"],
                      attrs=_attrs(rotary_mode, partial_slice)))


@declare_supported([
    Support(F16(2, 32, 8, 128), F16(2, 32, 1, 64), F16(2, 32, 1, 64), partial_slice=[0, 64]),
    Support(BF16(4, 128, 8, 64), BF16(4, 1, 1, 32), BF16(4, 1, 1, 32), partial_slice=[32, 64]),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.inplace_partial_rotary_mul.default)
def convert_inplace_partial_rotary_mul(x, r1, r2, rotary_mode="interleave", partial_slice=(0, 0),
                                       meta_outputs=None):
    _rotate_in_place(x, r1, r2, rotary_mode, partial_slice)


def swap_pairs_negated(sin: Tensor) -> Tensor:
    """-sin with the two entries of every interleaved pair along the last dim swapped."""
    length = sin.symsize[-1]
    perm = [i ^ 1 for i in range(length)]
    return ge.Neg(ge.GatherV2(sin, perm, [sin.rank - 1]))


@register_fx_node_ge_converter(torch.ops.npu_fuse.inplace_partial_rotary_mul_backward.default)
def convert_inplace_partial_rotary_mul_backward(grad, r1, r2, rotary_mode="interleave", partial_slice=(0, 0),
                                                meta_outputs=None):
    if target_soc() == ASCEND950:
        keep(ir_op(IPRM_GRAD_IR, inputs={"dy": grad, "cos": r1, "sin": r2}, outputs=["dy"],
                   attrs=_attrs(rotary_mode, partial_slice)))
        return
    _rotate_in_place(grad, r1, swap_pairs_negated(r2), rotary_mode, partial_slice)
