"""npu_fuse::interleave_rope(_backward) -> GE InterleaveRope / RotaryPositionEmbedding(Grad) mode 3.

Atlas A2/A3 run the forward on ``InterleaveRope`` (x, cos, sin; float16/bfloat16, D = 64;
cos/sin (B, 1, S or 1, D)). Ascend950 has no InterleaveRope kernel: CANN's own fusion pass
turns it into ``RotaryPositionEmbedding(mode=3)`` (interleave-half, the same math), which
we emit directly. The backward exists only there: ``RotaryPositionEmbeddingGrad(mode=3)``
(dx does not depend on x; see the converter for what stands in for it). The limits are
checked before a fusion stays (``@soc_limits`` beside the op).
"""

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge._ge_graph import Tensor, TensorSpec

from ..soc import ASCEND950, resolve_soc

INTERLEAVE_HALF = 3  # RotaryPositionEmbedding's mode: de-interleave the pairs, then half rotation


@declare_supported([
    Support(F16(2, 8, 16, 64), F16(2, 1, 16, 64), F16(2, 1, 16, 64)),
    Support(BF16(4, 16, 1, 64), BF16(4, 1, 1, 64), BF16(4, 1, 1, 64)),
    Support(F32(2, 8, 16, 64), F32(2, 1, 16, 64), F32(2, 1, 16, 64)),  # Ascend950
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.interleave_rope.default)
def convert_interleave_rope(x: Tensor, cos: Tensor, sin: Tensor, meta_outputs: TensorSpec = None):
    if resolve_soc() == ASCEND950:
        return ge.RotaryPositionEmbedding(x, cos, sin, mode=INTERLEAVE_HALF)
    return ge.InterleaveRope(x, cos, sin)


@declare_supported([
    Support(BF16(2, 8, 16, 64), BF16(2, 1, 16, 64), BF16(2, 1, 16, 64)),
    Support(F32(2, 8, 16, 128), F32(1, 1, 16, 128), F32(1, 1, 16, 128)),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.interleave_rope_backward.default)
def convert_interleave_rope_backward(grad: Tensor, cos: Tensor, sin: Tensor, meta_outputs: TensorSpec = None):
    # x is an optional input of the GE op (only dcos/dsin read it), but torchair's builder marks it
    # required; any tensor of x's shape will do for dx, so the gradient stands in for it.
    dx, _, _ = ge.RotaryPositionEmbeddingGrad(grad, cos, sin, grad, mode=INTERLEAVE_HALF)
    return dx
