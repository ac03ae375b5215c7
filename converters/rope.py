"""npu_fuse::rotary_mul(_backward) -> GE RotaryMul / RotaryPositionEmbedding(+Grad), as torch_npu does.

Forward (torch_npu's npu_rotary_mul converter, W ``GC/ge_converter/custom/npu_rotary_mul.py``):
Atlas A2/A3 run half mode on ``RotaryMul`` (A2/A3 only) and interleave on
``RotaryPositionEmbedding(mode=1)``; Ascend950 runs both modes on ``RotaryPositionEmbedding``.
"generic" (no NPU known) uses ``RotaryPositionEmbedding``, the op every supported SoC has.

Backward: ``RotaryMulGrad`` (A2/A3) only where torch_npu's own converter would emit it
(W ``GC/ge_converter/custom/npu_rotary_mul_backward.py``): rank-4 static shapes, head dim a
multiple of 64, the product of x's dims that r1 broadcasts over <= 1024; plus half mode (it has
no mode attr), x given and r1, r2 of one shape. Otherwise ``RotaryPositionEmbeddingGrad``, whose
x input is optional in the op-def: without x (only dx wanted) it is left out, not faked.

The per-SoC shape limits are the ops' ``@soc_limits`` (lowering/ops/rope.py).
"""

from typing import Optional

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.compat_ir import IrDef
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge import attr
from torchair.ge._ge_graph import Tensor, TensorSpec

from npu_fuse_backend.soc import A2_A3, ASCEND950, GENERIC
from npu_fuse_backend.converters.common import declare_ge_ops, ir_op, target_soc

MODES = {"half": 0, "interleave": 1}
ROTARY_MUL_GRAD_MAX_BROADCAST = 1024
ROTARY_MUL_GRAD_HEAD_DIM_MULTIPLE = 64

# the RotaryPositionEmbeddingGrad op-def (OT @ 5871dd99), x optional
ROPE_GRAD_IR = (IrDef("RotaryPositionEmbeddingGrad")
                .input("dy", "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16")
                .input("cos", "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16")
                .input("sin", "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16")
                .optional_input("x", "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16")
                .attr("mode", attr.Int(0))
                .output("dx", "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16")
                .output("dcos", "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16")
                .output("dsin", "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16"))

declare_ge_ops("rotary_mul", {
    **{soc: ("RotaryMul", "RotaryPositionEmbedding") for soc in A2_A3},
    ASCEND950: ("RotaryPositionEmbedding",),
    GENERIC: ("RotaryPositionEmbedding",),
})
declare_ge_ops("rotary_mul_backward", {
    **{soc: ("RotaryMulGrad", "RotaryPositionEmbeddingGrad") for soc in A2_A3},
    ASCEND950: ("RotaryPositionEmbeddingGrad",),
    GENERIC: ("RotaryPositionEmbeddingGrad",),
})


@declare_supported([
    Support(F32(2, 128, 8, 128), F32(1, 128, 1, 128), F32(1, 128, 1, 128)),
    Support(F16(2, 8, 128, 64), F16(1, 1, 128, 64), F16(1, 1, 128, 64)),
    Support(BF16(2, 128, 8, 128), BF16(1, 128, 1, 128), BF16(1, 128, 1, 128), rotary_mode="interleave"),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.rotary_mul.default)
def convert_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half",
                       meta_outputs: TensorSpec = None):
    if target_soc() in A2_A3 and rotary_mode == "half":
        return ge.RotaryMul(x, r1, r2)
    return ge.RotaryPositionEmbedding(x, r1, r2, mode=MODES[rotary_mode])


def rotary_mul_grad_applies(grad: Tensor, x: Optional[Tensor], r1: Tensor, r2: Tensor, rotary_mode: str) -> bool:
    """torch_npu's guards for RotaryMulGrad (its converter raises outside them), and ours."""
    if target_soc() not in A2_A3 or rotary_mode != "half" or x is None:
        return False
    shapes = [t.symsize for t in (grad, x, r1, r2)]
    if any(len(s) != 4 or not all(isinstance(d, int) for d in s) for s in shapes) or shapes[2] != shapes[3]:
        return False
    broadcast = 1
    for x_dim, r_dim in zip(x.symsize, r1.symsize):
        if x_dim != r_dim:
            broadcast *= x_dim
    return broadcast <= ROTARY_MUL_GRAD_MAX_BROADCAST and x.symsize[-1] % ROTARY_MUL_GRAD_HEAD_DIM_MULTIPLE == 0


@declare_supported([
    Support(F32(2, 128, 8, 128), F32(2, 128, 8, 128), F32(1, 128, 1, 128), F32(1, 128, 1, 128)),
    Support(BF16(2, 128, 8, 64), BF16(2, 128, 8, 64), BF16(1, 128, 1, 64), BF16(1, 128, 1, 64),
            rotary_mode="interleave"),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.rotary_mul_backward.default)
def convert_rotary_mul_backward(grad: Tensor, x: Optional[Tensor], r1: Tensor, r2: Tensor, rotary_mode: str = "half",
                                need_backward: bool = True, meta_outputs=None):
    if rotary_mul_grad_applies(grad, x, r1, r2, rotary_mode):
        return ge.RotaryMulGrad(x, r1, r2, grad, need_backward=need_backward)
    return ir_op(ROPE_GRAD_IR, inputs={"dy": grad, "cos": r1, "sin": r2, "x": x}, outputs=["dx", "dcos", "dsin"],
                 attrs={"mode": attr.Int(MODES[rotary_mode])})
