"""npu_fuse::softmax_grad_ext -> GE SoftmaxGradExt (one fused op; axes = the last dim)."""

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge._ge_graph import Tensor, TensorSpec


@declare_supported([
    Support(F32(8, 32, 128, 128), F32(8, 32, 128, 128), F32(1), axes=[-1]),
    Support(F16(4, 1024), F16(4, 1024), F16(4, 1024), axes=[1]),
    Support(BF16(2, 8, 64, 64), BF16(2, 8, 64, 64), BF16(1), axes=[-1]),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.softmax_grad_ext.default)
def convert_softmax_grad_ext(grad: Tensor, x1: Tensor, x2: Tensor, axes=(-1,), keep_dims: bool = True,
                             meta_outputs: TensorSpec = None):
    return ge.SoftmaxGradExt(grad, x1, x2, axes=axes[0], keep_dims=keep_dims)
