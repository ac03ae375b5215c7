"""npu_fuse::mla_preprocess -> custom GE op MlaPreprocess (ATB's MlaPreprocessOperation).

Decision: the custom ``MlaPreprocess`` op, not torchair's ``MlaProlog*``. Our op mirrors
ATB's contract: one fused wdqkv weight split at 1536, RMSNorm betas, int32 bias +
descale dequantization, four cache modes with NZ caches. MlaProlog* takes separate dq and
dkv weights, gamma-only norms, other quant scales and a "PA_BSND" cache mode, so mapping
onto it would change the math. Inputs keep ATB's 24-input order; the caches are mutated
in place, so they are also the same-named outputs that torchair binds back to them.
"""

import torch
from torchair import ge
from torchair._ge_concrete_graph.fx2ge_converter import register_fx_node_ge_converter

# ATB's input order (seed 003, section 4.1)
INPUT_ORDER = ("input", "gamma0", "beta0", "quant_scale0", "quant_offset0", "wdqkv", "descale0", "bias0", "gamma1",
               "beta1", "quant_scale1", "quant_offset1", "wuq", "descale1", "bias1", "gamma2", "cos", "sin", "wuk",
               "kv_cache", "kv_cache_rope", "slotmapping", "ctkv_scale", "q_nope_scale")


@register_fx_node_ge_converter(torch.ops.npu_fuse.mla_preprocess.default)
def convert_mla_preprocess(input, gamma0, beta0, wdqkv, descale0, gamma1, beta1, wuq, descale1, gamma2, cos, sin,
                           wuk, kv_cache, kv_cache_rope, slotmapping, quant_scale0=None, quant_offset0=None,
                           bias0=None, quant_scale1=None, quant_offset1=None, bias1=None, ctkv_scale=None,
                           q_nope_scale=None, cache_mode=0, quant_mode=0, epsilon=1e-6, meta_outputs=None):
    given = dict(locals())
    outputs = ge.custom_op(
        "MlaPreprocess",
        inputs={name: given[name] for name in INPUT_ORDER},
        outputs=["q_out0", "kv_cache", "q_out1", "kv_cache_rope"],
        attrs={"wdq_dim": ge.attr.Int(1536), "q_rope_dim": ge.attr.Int(64), "k_rope_dim": ge.attr.Int(64),
               "epsilon": ge.attr.Float(epsilon), "q_rotary_coeff": ge.attr.Int(2), "k_rotary_coeff": ge.attr.Int(2),
               "transpose_wdq": ge.attr.Bool(True), "transpose_wuq": ge.attr.Bool(True),
               "transpose_wuk": ge.attr.Bool(False), "cache_mode": ge.attr.Int(cache_mode),
               "quant_mode": ge.attr.Int(quant_mode)},
    )
    return outputs[0], outputs[2]
