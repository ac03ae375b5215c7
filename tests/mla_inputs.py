"""Random but well-formed inputs for npu_fuse::mla_preprocess, in every cache/quant mode."""

import torch
def make_inputs(tokens=5, hidden=2048, heads=2, dtype=torch.bfloat16, cache_mode=0, quant_mode=0,
                quantized=True, blocks=4, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, lo=-1.0, hi=1.0: (torch.rand(*s, generator=g) * (hi - lo) + lo)
    if cache_mode in (2, 3): block_size = 128
    a = dict(input=r(tokens, hidden, lo=-2, hi=2).to(dtype), gamma0=r(hidden).to(dtype), beta0=r(hidden).to(dtype),
             gamma1=r(1536).to(dtype), beta1=r(1536).to(dtype), gamma2=r(512).to(dtype),
             cos=r(tokens, 64).to(dtype), sin=r(tokens, 64).to(dtype), wuk=r(heads, 128, 512, lo=-0.1, hi=0.1).to(dtype))
    if quantized:
        a.update(wdqkv=torch.randint(-128, 127, (2112, hidden), generator=g, dtype=torch.int8),
                 wuq=torch.randint(-128, 127, (heads * 192, 1536), generator=g, dtype=torch.int8),
                 descale0=torch.rand(2112, generator=g) / 1000, descale1=torch.rand(heads * 192, generator=g) / 1000,
                 quant_scale0=r(1, lo=0.5, hi=2).to(dtype), quant_offset0=torch.tensor([3], dtype=torch.int8),
                 quant_scale1=r(1, lo=0.5, hi=2).to(dtype), quant_offset1=torch.tensor([-2], dtype=torch.int8),
                 bias0=torch.randint(-10, 10, (2112,), generator=g, dtype=torch.int32),
                 bias1=torch.randint(-10, 10, (heads * 192,), generator=g, dtype=torch.int32))
    else:
        a.update(wdqkv=r(2112, hidden, lo=-0.05, hi=0.05).to(dtype), wuq=r(heads * 192, 1536, lo=-0.05, hi=0.05).to(dtype),
                 descale0=torch.ones(2112), descale1=torch.ones(heads * 192))
    width = 576 if cache_mode == 0 else 512
    a["kv_cache"] = (torch.randint(-128, 127, (blocks, block_size, 1, width), generator=g, dtype=torch.int8)
                     if cache_mode == 2 else r(blocks, block_size, 1, width).to(dtype))
    a["kv_cache_rope"] = r(blocks, block_size, 1, 64).to(dtype) if cache_mode else torch.empty(0, dtype=dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(torch.int32)
    slots[0] = -1
    a["slotmapping"] = slots
    if cache_mode == 2:
        a["ctkv_scale"] = torch.tensor([4.0], dtype=dtype); a["q_nope_scale"] = r(heads, lo=0.5, hi=2).to(dtype)
    return a, dict(cache_mode=cache_mode, quant_mode=quant_mode)


def positional_and_keywords(a: dict) -> tuple:
    """The op's required arguments of ``a`` in schema order, and the rest by name."""
    from npu_fuse_backend.lowering.ops.mla_preprocess import ARGUMENTS

    required = [name for name, _, has_default, _ in ARGUMENTS if not has_default]
    return [a[n] for n in required], {k: v for k, v in a.items() if k not in required}
