"""npu_fuse::softmax_grad_ext -> GE SoftmaxGradExt (one fused op; axes = the last dim).

The op-def (ops-nn ``activation/softmax_grad_ext/op_host/softmax_grad_ext_def.cpp``) has one
AICore config, ascend950, so the fusion is offered there only: on Atlas A2/A3 the op's
``unavailable_on`` refuses it, and under "generic" (no NPU known; a GE graph may use only ops every
SoC has) the torchair lowering reports it as a near-miss (``declare_ge_ops``). A direct call of
the op elsewhere converts to what the unfused graph has, ``SoftmaxGrad`` and ``Mul`` (both on
every SoC). torchair's raw builder writes both attrs (axes Int, keep_dims Bool), as the op-def
types them.
"""

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge._ge_graph import Tensor, TensorSpec

from npu_fuse_backend.soc import ASCEND950, GENERIC
from npu_fuse_backend.converters.common import declare_ge_ops, target_soc

declare_ge_ops("softmax_grad_ext", {  # A2/A3: the op's unavailable_on
    ASCEND950: ("SoftmaxGradExt",),
    GENERIC: "the SoftmaxGradExt GE op exists on Ascend950 only; a generic GE graph uses only ops every SoC has",
})


@declare_supported([
    Support(F32(8, 32, 128, 128), F32(8, 32, 128, 128), F32(1), axes=[-1]),
    Support(F16(4, 1024), F16(4, 1024), F16(4, 1024), axes=[1]),
    Support(BF16(2, 8, 64, 64), BF16(2, 8, 64, 64), BF16(1), axes=[-1]),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.softmax_grad_ext.default)
def convert_softmax_grad_ext(grad: Tensor, x1: Tensor, x2: Tensor, axes=(-1,), keep_dims: bool = True,
                             meta_outputs: TensorSpec = None):
    if target_soc() == ASCEND950:
        return ge.SoftmaxGradExt(grad, x1, x2, axes=axes[0], keep_dims=keep_dims)
    return ge.Mul(ge.SoftmaxGrad(x1, grad, axes=list(axes)), x2)
