"""npu_fuse::inplace_partial_rotary_mul(_backward) -> custom GE ops InplacePartialRotaryMul(Grad).

Both ops mutate their first input. AOTAutograd gives them as auto_functionalized_v2,
which torchair converts by calling these converters with every argument by keyword
(the mutated tensor as a TensorMove copy) and binding the mutated input to the
same-named output of the op emitted here; so they return nothing.
"""

import torch
from torchair import ge
from torchair._ge_concrete_graph.fx2ge_converter import declare_supported, register_fx_node_ge_converter
from torchair._ge_concrete_graph.supported_declaration import BF16, F16, Support


def _attrs(rotary_mode, partial_slice):
    return {"rotary_mode": ge.attr.Str(rotary_mode), "partial_slice": ge.attr.ListInt(list(partial_slice))}


@declare_supported([
    Support(F16(2, 32, 8, 128), F16(2, 32, 1, 64), F16(2, 32, 1, 64), partial_slice=[0, 64]),
    Support(BF16(4, 128, 8, 64), BF16(4, 1, 1, 32), BF16(4, 1, 1, 32), partial_slice=[32, 64]),
])
@register_fx_node_ge_converter(torch.ops.npu_fuse.inplace_partial_rotary_mul.default)
def convert_inplace_partial_rotary_mul(x, r1, r2, rotary_mode="interleave", partial_slice=(0, 0),
                                       meta_outputs=None):
    ge.custom_op("InplacePartialRotaryMul", inputs={"x": x, "r1": r1, "r2": r2}, outputs=["x"],
                 attrs=_attrs(rotary_mode, partial_slice))


@register_fx_node_ge_converter(torch.ops.npu_fuse.inplace_partial_rotary_mul_backward.default)
def convert_inplace_partial_rotary_mul_backward(grad, r1, r2, rotary_mode="interleave", partial_slice=(0, 0),
                                                meta_outputs=None):
    ge.custom_op("InplacePartialRotaryMulGrad", inputs={"grad": grad, "r1": r1, "r2": r2}, outputs=["grad"],
                 attrs=_attrs(rotary_mode, partial_slice))
