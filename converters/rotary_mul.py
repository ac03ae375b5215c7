"""npu_fuse::rotary_mul(_backward) -> GE RotaryMul / RotaryPositionEmbedding(+Grad).

Atlas A2/A3 run half mode on ``RotaryMul`` and interleave on
``RotaryPositionEmbedding(mode=1)``; Ascend950 runs both on
``RotaryPositionEmbedding`` with the mode attribute. The backward uses
``RotaryMulGrad`` where its kernel applies (A2/A3, half, static head dim a
multiple of 64, x given), else ``RotaryPositionEmbeddingGrad``.
"""

from typing import Optional

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge._ge_graph import Tensor, TensorSpec

from ..soc import ASCEND950, resolve_soc

MODES = {"half": 0, "interleave": 1}


@declare_supported([
    Support(F32(2, 128, 8, 128), F32(1, 128, 1, 128), F32(1, 128, 1, 128)),
    Support(F16(2, 8, 128, 64), F16(1, 1, 128, 64), F16(1, 1, 128, 64)),
    Support(BF16(2, 128, 8, 128), BF16(2, 128, 1, 128), BF16(2, 128, 1, 128), rotary_mode="interleave"),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.rotary_mul.default)
def convert_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half",
                       meta_outputs: TensorSpec = None):
    if resolve_soc() != ASCEND950 and rotary_mode == "half":
        return ge.RotaryMul(x, r1, r2)
    return ge.RotaryPositionEmbedding(x, r1, r2, mode=MODES[rotary_mode])


def _rotary_mul_grad_applies(x, rotary_mode: str) -> bool:
    if x is None:  # RotaryMulGrad needs x; RotaryPositionEmbeddingGrad takes it as optional
        return False
    head_dim = x.symsize[-1]
    return (resolve_soc() != ASCEND950 and rotary_mode == "half"
            and isinstance(head_dim, int) and head_dim % 64 == 0)


@declare_supported([
    Support(F32(2, 128, 8, 128), F32(2, 128, 8, 128), F32(1, 128, 1, 128), F32(1, 128, 1, 128)),
    Support(BF16(2, 128, 8, 64), BF16(2, 128, 8, 64), BF16(1, 128, 1, 64), BF16(1, 128, 1, 64),
            rotary_mode="interleave"),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.rotary_mul_backward.default)
def convert_rotary_mul_backward(grad: Tensor, x: Optional[Tensor], r1: Tensor, r2: Tensor, rotary_mode: str = "half",
                                need_backward: bool = True, meta_outputs=None):
    if _rotary_mul_grad_applies(x, rotary_mode):
        return ge.RotaryMulGrad(x, r1, r2, grad, need_backward=need_backward)
    # torchair's RotaryPositionEmbeddingGrad API requires x. Without x (a fused
    # backward graph: need_backward is False) any tensor of x's shape will do, since
    # dx does not depend on x and dcos/dsin are then not used.
    return ge.RotaryPositionEmbeddingGrad(grad, r1, r2, grad if x is None else x, mode=MODES[rotary_mode])
