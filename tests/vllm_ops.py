"""vLLM's ``_C::rotary_embedding`` for tests: the real op where vLLM is installed, else a stand-in.

The stand-in has vLLM's schema (``vllm/_custom_ops.py`` calls it so) and computes what vLLM's
kernels compute on their common ground (``csrc/cpu/pos_encoding.cpp``,
``csrc/pos_encoding_kernels.cu``): query ``[T, N * head_size]`` and key ``[T, K * head_size]``
rotated in place at ``cos_sin_cache[positions]``, one position per row (cos | sin halves), the
first ``rotary_dim`` elements of each head, neox halves or GPT-J pairs; it raises where the CUDA
kernel checks and the CPU kernel does not (positions of another length). ``tests/test_vllm.py`` checks
the stand-in against vLLM's CPU kernel where both exist.
"""

import torch

SCHEMA = ("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
          "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()")


def _vllm_loaded() -> bool:
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C.rotary_embedding)
    except ImportError:
        return False
    return True


REAL = _vllm_loaded()


def rotate_reference(positions, x, head_size, cos_sin_cache, is_neox):
    """x [T, H * head_size] rotated as vLLM's kernels do (a new tensor; fp32 compute, one rounding)."""
    rotary_dim = cos_sin_cache.shape[1]
    tokens = x.shape[0]
    if positions.numel() != tokens:
        raise RuntimeError(f"query, key and positions must have the same number of tokens ({tokens} rows, "
                           f"{positions.numel()} positions)")
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    heads = x.float().reshape(tokens, -1, head_size).clone()
    part = heads[..., :rotary_dim]
    if is_neox:
        x1, x2 = part.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = part[..., ::2], part[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    heads[..., :rotary_dim] = rotated
    return heads.reshape(x.shape).to(x.dtype)


if not REAL:
    _lib = torch.library.Library("_C", "FRAGMENT")
    _lib.define(SCHEMA)

    def _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0,
                          inverse=False):
        if rope_dim_offset != 0 or inverse:
            raise RuntimeError("stand-in of _C::rotary_embedding: rope_dim_offset and inverse are not supported "
                               "(as on vLLM's CPU build)")
        for x in (query, key):
            if x is not None:
                x.copy_(rotate_reference(positions, x, head_size, cos_sin_cache, is_neox))

    _lib.impl("rotary_embedding", _rotary_embedding, "CompositeExplicitAutograd")

    @torch.library.register_fake("_C::rotary_embedding", lib=_lib)
    def _(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
        return None

rotary_embedding = torch.ops._C.rotary_embedding
