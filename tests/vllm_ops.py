"""vLLM's ``_C::rotary_embedding`` for tests: the real op where vLLM is installed, else a stand-in.

The stand-in has vLLM's schema (``vllm/_custom_ops.py`` calls it so) and computes what vLLM's
kernels compute on their common ground (``csrc/cpu/pos_encoding.cpp``,
``csrc/pos_encoding_kernels.cu``): query ``[T, N * head_size]`` and key ``[T, K * head_size]``
rotated in place at ``cos_sin_cache[positions]``, one position per row (cos | sin halves), the
first ``rotary_dim`` elements of each head, neox halves or GPT-J pairs; it raises where the CUDA
kernel checks and the CPU kernel does not (positions of another length). ``tests/test_vllm.py`` checks
the stand-in against vLLM's CPU kernel where both exist.
"""

import importlib.util
import subprocess
import sys
from typing import Optional

import torch

SCHEMA = ("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
          "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()")


def _kernels_unusable() -> Optional[str]:
    """Why vLLM, installed, cannot load its kernels on this machine; None where it can, or is absent. Tried
    in a child first: vLLM's CPU build is compiled for AVX-512, and on a CPU without it the import dies of
    an illegal instruction (SIGILL, no exception to catch) and takes the test run with it; on one with
    AVX-512 but not its bf16 instructions, so does its bf16 rotary kernel: the child runs it too."""
    if importlib.util.find_spec("vllm") is None:
        return None
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        pass
    why = "an illegal instruction (SIGILL)" if probe.returncode in (-4, 132) else \
        f"exit status {probe.returncode}: {probe.stderr.strip()[-300:]}"
    cpu = "" if not flags else " (this CPU has no AVX-512, which vLLM's CPU build needs)" \
        if "avx512f" not in flags else " (this CPU has no AVX512-BF16)" if "avx512_bf16" not in flags else ""
    return f"vLLM is installed but its kernels fail here with {why}{cpu}"


# the import, then the rotary kernel in float32 and bfloat16 (what the tests call)
_PROBE = """
import torch, vllm._C
for dtype in (torch.float32, torch.bfloat16):
    q, k = torch.randn(3, 64, dtype=dtype), torch.randn(3, 32, dtype=dtype)
    torch.ops._C.rotary_embedding(torch.arange(3), q, k, 32, torch.randn(8, 32, dtype=dtype), True)
"""


UNUSABLE = _kernels_unusable()


def _vllm_loaded() -> bool:
    if UNUSABLE is not None:
        return False
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
