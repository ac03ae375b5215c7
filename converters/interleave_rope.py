"""npu_fuse::interleave_rope(_backward) -> GE InterleaveRope / RotaryPositionEmbedding(Grad) mode 3.

Atlas A2/A3 run the forward on ``InterleaveRope`` (x, cos, sin; float16/bfloat16, D = 64;
cos/sin (B, 1, S or 1, D)). Ascend950 has no InterleaveRope kernel: CANN's own fusion pass
turns it into ``RotaryPositionEmbedding(mode=3)`` (interleave-half, the same math), which
we emit directly. The backward exists only there: ``RotaryPositionEmbeddingGrad(mode=3)``,
whose optional x (read only for dcos/dsin) is left out. No one GE op does this on every SoC,
so under "generic" the torchair lowering reports the fusion as a near-miss (``declare_ge_ops``).
The limits are checked before a fusion stays (``@soc_limits`` beside the op).
"""

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge._ge_graph import Tensor, TensorSpec

from torchair.ge import attr

from npu_fuse_backend.soc import A2_A3, ASCEND950, GENERIC
from npu_fuse_backend.converters.common import declare_ge_ops, ir_op, target_soc
from npu_fuse_backend.converters.rope import ROPE_GRAD_IR

INTERLEAVE_HALF = 3  # RotaryPositionEmbedding's mode: de-interleave the pairs, then half rotation
NOT_PORTABLE = ("InterleaveRope exists on Atlas A2/A3 only and RotaryPositionEmbedding mode 3 on Ascend950 "
                "only; a generic GE graph uses only ops every SoC has")
declare_ge_ops("interleave_rope", {**{soc: ("InterleaveRope",) for soc in A2_A3},
                                   ASCEND950: ("RotaryPositionEmbedding",), GENERIC: NOT_PORTABLE})
declare_ge_ops("interleave_rope_backward", {  # A2/A3: the op's unavailable_on
    ASCEND950: ("RotaryPositionEmbeddingGrad",), GENERIC: NOT_PORTABLE})


@declare_supported([
    Support(F16(2, 8, 16, 64), F16(2, 1, 16, 64), F16(2, 1, 16, 64)),
    Support(BF16(4, 16, 1, 64), BF16(4, 1, 1, 64), BF16(4, 1, 1, 64)),
    Support(F32(2, 8, 16, 64), F32(2, 1, 16, 64), F32(2, 1, 16, 64)),  # Ascend950
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.interleave_rope.default)
def convert_interleave_rope(x: Tensor, cos: Tensor, sin: Tensor, meta_outputs: TensorSpec = None):
    if target_soc() == ASCEND950:
        return ge.RotaryPositionEmbedding(x, cos, sin, mode=INTERLEAVE_HALF)
    return ge.InterleaveRope(x, cos, sin)


@declare_supported([
    Support(BF16(2, 8, 16, 64), BF16(2, 1, 16, 64), BF16(2, 1, 16, 64)),
    Support(F32(2, 8, 16, 128), F32(1, 1, 16, 128), F32(1, 1, 16, 128)),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.interleave_rope_backward.default)
def convert_interleave_rope_backward(grad: Tensor, cos: Tensor, sin: Tensor, meta_outputs: TensorSpec = None):
    dx, _, _ = ir_op(ROPE_GRAD_IR, inputs={"dy": grad, "cos": cos, "sin": sin, "x": None},
                     outputs=["dx", "dcos", "dsin"], attrs={"mode": attr.Int(INTERLEAVE_HALF)})
    return dx
