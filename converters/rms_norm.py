"""npu_fuse::rms_norm / add_rms_norm / rms_norm_backward -> GE RmsNorm / AddRmsNorm / RmsNormGrad,
as torchair converts torch_npu's npu_rms_norm / npu_add_rms_norm / npu_rms_norm_backward
(W ``GC/ge_converter/custom/npu_rms_norm.py``, ``npu_add_rms_norm.py``, ``npu_rms_norm_backward.py``).

IR (ON ``norm/rms_norm{,_grad}/op_host/*_def.cpp``, ``norm/add_rms_norm/op_host/add_rms_norm_def.cpp``):
``RmsNorm(x, gamma) -> (y, rstd)``, ``AddRmsNorm(x1, x2, gamma) -> (y, rstd, x)``, both with the
Float attr ``epsilon`` (default 1e-6); ``RmsNormGrad(dy, x, rstd, gamma) -> (dx, dgamma)`` (note the
input order). One AICore config each on ascend910b, ascend910_93 and ascend950: every target SoC,
"generic" included, has them, and the dtypes the op's contract allows are their op-def columns.
"""

import torch
from torchair._ge_concrete_graph import ge_apis as ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
from torchair.ge._ge_graph import Tensor

from npu_fuse_backend.converters.common import declare_ge_ops
from npu_fuse_backend.soc import A2_A3, ASCEND950, GENERIC

SOCS = (*A2_A3, ASCEND950, GENERIC)
declare_ge_ops("rms_norm", {soc: ("RmsNorm",) for soc in SOCS})
declare_ge_ops("add_rms_norm", {soc: ("AddRmsNorm",) for soc in SOCS})
declare_ge_ops("rms_norm_backward", {soc: ("RmsNormGrad",) for soc in SOCS})


@declare_supported([
    Support(F32(2, 8, 64), F32(64)),
    Support(BF16(2, 8, 64), BF16(64), epsilon=1e-5),
    Support(F16(4, 2, 8, 16), F32(16)),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.rms_norm.default)
def convert_rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6, meta_outputs=None):
    return ge.RmsNorm(x, gamma, epsilon=epsilon)


@declare_supported([
    Support(F32(2, 8, 64), F32(2, 8, 64), F32(64)),
    Support(BF16(2, 8, 64), BF16(2, 8, 64), BF16(64), epsilon=1e-5),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.add_rms_norm.default)
def convert_add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-6, meta_outputs=None):
    return ge.AddRmsNorm(x1, x2, gamma, epsilon=epsilon)


@declare_supported([
    Support(F32(2, 8, 64), F32(2, 8, 64), F32(64), F32(2, 8, 1)),
    Support(BF16(2, 8, 64), BF16(2, 8, 64), F32(64), F32(2, 8, 1)),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.rms_norm_backward.default)
def convert_rms_norm_backward(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, meta_outputs=None):
    return ge.RmsNormGrad(dy, x, rstd, gamma)
