"""npu_fuse::mla_preprocess against an independent stage-by-stage golden, in every mode."""

import pytest
import torch
from torch.library import opcheck

from npu_fuse_backend.lowering.ops import mla_preprocess as M
from mla_inputs import make_inputs, positional_and_keywords

MODES = [(cache, quant, quantized) for cache in range(4) for quant, quantized in ((0, True), (1, True), (0, False))]


def golden(a, cache_mode, quant_mode, eps=1e-6):
    """ATB's pipeline written out again, stage by stage, with loops where ATB's goldens loop."""
    dtype = a["input"].dtype
    f = lambda t: t.double()

    def rms(x, gamma, beta=None):
        y = f(x) / torch.sqrt((f(x) ** 2).mean(-1, keepdim=True) + eps) * f(gamma)
        return y + f(beta) if beta is not None else y

    def linear_quant(h, gamma, beta, scale, offset, w, descale, bias):
        y = rms(h, gamma, beta).to(dtype).double()
        if quant_mode == 0:
            q = (y / f(scale) + f(offset)).round().clamp(-128, 127)
            token = torch.ones(y.shape[0], 1, dtype=torch.float64)
        else:
            token = y.abs().amax(-1, keepdim=True) / 127.0
            q = (y / token).round().clamp(-128, 127)
        acc = q @ f(w).t() + f(bias)  # exact in float64 for int8 operands
        return (acc * f(descale) * token).to(dtype), q

    stages = {}
    if a["wdqkv"].dtype == torch.int8:
        qkv, stages["x_int8"] = linear_quant(a["input"], a["gamma0"], a["beta0"], a["quant_scale0"], a["quant_offset0"],
                                             a["wdqkv"], a["descale0"], a["bias0"])
        q, stages["q_latent_int8"] = linear_quant(qkv[:, :1536], a["gamma1"], a["beta1"], a["quant_scale1"],
                                                  a["quant_offset1"], a["wuq"], a["descale1"], a["bias1"])
    else:
        qkv = (f(a["input"]) @ f(a["wdqkv"]).t()).to(dtype)
        q = (rms(qkv[:, :1536], a["gamma1"], a["beta1"]).to(dtype).double() @ f(a["wuq"]).t()).to(dtype)
    stages["qkv"] = qkv
    heads = a["wuk"].shape[0]
    q = q.reshape(-1, heads, 192)
    cos, sin = f(a["cos"]), f(a["sin"])

    def rope(x, c, s):  # rotary coeff 2: halves
        x = f(x)
        return x * c + torch.cat([-x[..., 32:], x[..., :32]], -1) * s

    stages["q_rope"] = rope(q[..., 128:], cos[:, None], sin[:, None]).to(dtype)
    stages["k_rope"] = rope(qkv[:, 2048:], cos, sin).to(dtype)
    stages["ctkv"] = rms(qkv[:, 1536:2048], a["gamma2"]).to(dtype)
    stages["q_nope_absorbed"] = torch.einsum("tnd,ndc->tnc", f(q[..., :128]), f(a["wuk"])).to(dtype)

    kv_cache, kv_rope = a["kv_cache"].clone(), a["kv_cache_rope"].clone()
    block_size = kv_cache.shape[1]
    for t, slot in enumerate(a["slotmapping"].tolist()):
        block, offset = divmod(slot % (kv_cache.shape[0] * block_size), block_size)  # -1: the last slot
        if cache_mode == 0:
            kv_cache[block, offset, 0] = torch.cat([stages["ctkv"][t], stages["k_rope"][t]])
            continue
        ctkv = stages["ctkv"][t]
        if cache_mode == 2:
            ctkv = (f(ctkv) * f(a["ctkv_scale"])).round().clamp(-128, 127).to(torch.int8)
        for cache, row in ((kv_cache, ctkv), (kv_rope, stages["k_rope"][t])):
            if cache_mode == 1:
                cache[block, offset, 0] = row
            else:  # NZ: element d of the row lives at flat [block][d // c0][offset][d % c0]
                c0 = 32 if cache.dtype == torch.int8 else 16
                flat = cache.view(-1)
                dim = row.numel()
                for d0 in range(0, dim, c0):
                    start = block * block_size * dim + (d0 // c0) * block_size * c0 + offset * c0
                    flat[start:start + c0] = row[d0:d0 + c0]
    if cache_mode == 0:
        q_out0, q_out1 = torch.cat([stages["q_nope_absorbed"], stages["q_rope"]], -1), None
    else:
        q_out0, q_out1 = stages["q_nope_absorbed"], stages["q_rope"]
        if cache_mode == 2:
            scale = f(a["q_nope_scale"]).reshape(1, -1, 1)
            q_out0 = (f(q_out0) * scale).round().clamp(-128, 127).to(torch.int8)
    return stages, q_out0, q_out1, kv_cache, kv_rope


def run_op(a, kw):
    args, extra = positional_and_keywords(a)
    return M.mla_preprocess(*args, **extra, **kw)


def close(got, expected, int_tolerance=1):
    if got.dtype == torch.int8:  # rounding of a value at .5 may differ by one step
        assert (got.int() - expected.int()).abs().max() <= int_tolerance
    else:
        torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("cache_mode, quant_mode, quantized", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_stage_and_output_matches_the_golden(cache_mode, quant_mode, quantized, dtype):
    a, kw = make_inputs(dtype=dtype, cache_mode=cache_mode, quant_mode=quant_mode, quantized=quantized)
    stages, q0, q1, kv, kv_rope = golden(a, cache_mode, quant_mode)
    ours = M.mla_preprocess_stages({**{k: None for k in ("quant_scale0", "quant_offset0", "bias0", "quant_scale1",
                                                           "quant_offset1", "bias1")}, **a, **kw, "epsilon": 1e-6})
    for name in ("x_int8", "q_latent_int8"):
        if name in stages:
            close(ours[name], stages[name].to(torch.int8))
    for name in ("qkv", "q_rope", "k_rope", "ctkv", "q_nope_absorbed"):
        close(ours[name], stages[name])
    cache_in, rope_in = a["kv_cache"].clone(), a["kv_cache_rope"].clone()
    out0, kv_out, out1, kv_rope_out = run_op(a, kw)
    assert kv_out is a["kv_cache"] and kv_rope_out is a["kv_cache_rope"]  # outputs alias the caches
    close(out0, q0)
    if q1 is not None:
        close(out1, q1)
    close(kv_out, kv)
    if cache_mode:
        close(kv_rope_out, kv_rope)
    slots = a["slotmapping"].tolist()
    assert slots[0] == -1  # token 0 writes the last slot, as cache.view(-1, D)[-1] = row does
    count = kv_out.shape[0] * kv_out.shape[1]
    written = (kv_out != cache_in).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(written) <= {(s % count) // kv_out.shape[1] for s in slots} and kv_out.shape[0] - 1 in written
    if not cache_mode:
        assert torch.equal(a["kv_cache_rope"], rope_in)


@pytest.mark.parametrize("cache_mode", range(4))
def test_opcheck(cache_mode):
    a, kw = make_inputs(cache_mode=cache_mode)
    args, extra = positional_and_keywords(a)
    opcheck(torch.ops.npu_fuse.mla_preprocess.default, tuple(args), {**extra, **kw})


def _broken(**changes):
    a, kw = make_inputs(tokens=4, heads=2)
    for key, value in changes.items():
        (kw if key in kw else a)[key] = value(a) if callable(value) else value
    return a, kw


@pytest.mark.parametrize("changes, message", [
    (dict(cache_mode=4), "cache_mode must be"),
    (dict(quant_mode=2), "quant_mode 2 is not supported"),
    (dict(quant_mode=3), "quant_mode 3 is not supported"),
    (dict(input=lambda a: a["input"].float()), "input must be \\[tokens, hidden\\] float16/bfloat16"),
    (dict(input=lambda a: a["input"][:, :1024]), "hidden size must be 7168 or in 2048..8192"),
    (dict(wuk=lambda a: a["wuk"][:, :64]), "wuk must be \\[heads, 128, 512\\]"),
    (dict(wdqkv=lambda a: a["wdqkv"][:2000]), "wdqkv must be \\[2112, 2048\\]"),
    (dict(wuq=lambda a: a["wuq"].half()), "weights must be int8"),
    (dict(cos=lambda a: a["cos"][:, :32]), "cos must be \\[4, 64\\]"),
    (dict(slotmapping=lambda a: a["slotmapping"].float()), "slotmapping must be int32/int64"),
    (dict(kv_cache=lambda a: torch.zeros(2, 200, 1, 576, dtype=torch.bfloat16)), "block_size must be in \\[1, 128\\] or 256"),
    (dict(kv_cache=lambda a: a["kv_cache"][..., :512]), "kv_cache must be \\[blocks, block_size, 1, 576\\]"),
    (dict(quant_scale0=None), "quant_scale0 must be a \\[1\\] torch.bfloat16 tensor"),
])
def test_each_limit_has_a_clear_error(changes, message):
    a, kw = _broken(**changes)
    with pytest.raises(ValueError, match=message):
        run_op(a, kw)


def test_the_npu_size_ranges_are_lifted_only_inside_the_validators_context():
    """The hidden-size and token ranges are the NPU kernel's, not the computation's: translation
    validation runs the op at shrunk sizes inside ``size_limits_lifted``; everywhere else they hold."""
    from npu_fuse_backend.lowering.registry import size_limits_lifted

    a, kw = _broken(input=lambda a: a["input"][:, :1024], wdqkv=lambda a: a["wdqkv"][:, :1024],
                    gamma0=lambda a: a["gamma0"][:1024], beta0=lambda a: a["beta0"][:1024])
    with size_limits_lifted():
        q0 = run_op(a, kw)[0]
    assert q0.shape[0] == 4 and torch.isfinite(q0.float()).all()
    with pytest.raises(ValueError, match="hidden size must be 7168 or in 2048..8192, got 1024"):
        run_op(a, kw)  # (the context restored the check)
    with size_limits_lifted(), pytest.raises(ValueError, match="wdqkv must be \\[2112, 1024\\]"):
        run_op({**a, "wdqkv": a["wdqkv"][:2000]}, kw)  # what the computation needs stays checked


def test_with_the_limits_lifted_the_latent_sizes_come_from_the_arguments_and_must_agree():
    """The shrunk problem of a validation shrinks q_lora, kv_lora and nope too (a fused projection's rows
    follow them): the op computes the same at any, so only the NPU kernel fixes 1536/512/64/128."""
    from npu_fuse_backend.lowering.registry import size_limits_lifted

    q_lora, kv_lora, nope = 13, 7, 5
    a, kw = make_inputs(tokens=4, heads=2, quantized=False)
    a.update(wdqkv=a["wdqkv"][:q_lora + kv_lora + 64], descale0=a["descale0"][:q_lora + kv_lora + 64],
             gamma1=a["gamma1"][:q_lora], beta1=a["beta1"][:q_lora], gamma2=a["gamma2"][:kv_lora],
             wuq=a["wuq"].view(2, 192, -1)[:, :nope + 64, :q_lora].reshape(-1, q_lora),
             descale1=a["descale1"][:2 * (nope + 64)], wuk=a["wuk"][:, :nope, :kv_lora].contiguous(),
             kv_cache=a["kv_cache"][..., :kv_lora + 64].contiguous())
    with size_limits_lifted():
        q = run_op(a, kw)[0]
        assert q.shape == (4, 2, kv_lora + 64) and torch.isfinite(q.float()).all()
        with pytest.raises(ValueError, match=f"wuk must be \\[heads, {nope}, {kv_lora}\\]"):
            run_op({**a, "wuk": a["wuk"][:, :, :kv_lora - 1]}, kw)
        with pytest.raises(ValueError, match="rope dim \\(cos's last\\) must be even, got 63"):
            run_op({**a, "cos": a["cos"][:, :63], "sin": a["sin"][:, :63]}, kw)
    with pytest.raises(ValueError, match="wuk must be \\[heads, 128, 512\\]"):
        run_op(a, kw)  # (outside the validator: DeepSeek's sizes)


def test_token_limit_and_nz_block_size():
    a, kw = make_inputs(tokens=4, cache_mode=3)
    a["kv_cache"] = torch.zeros(4, 64, 1, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="NZ cache\\) needs block_size 128"):
        run_op(a, kw)
    with torch._subclasses.FakeTensorMode() as fake:
        a, kw = make_inputs(tokens=4)
        a = {k: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
        a["input"] = fake.from_tensor(torch.empty(1025, 2048, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="token count must be in 1..1024"):
            run_op(a, kw)


@pytest.mark.parametrize("cache_mode", range(4))
@pytest.mark.parametrize("negative", ["first", "all"])
def test_functional_decomposition_matches_the_in_place_op(cache_mode, negative):
    """What inductor compiles (no mutation, static shapes) writes exactly what the op writes."""
    a, kw = make_inputs(cache_mode=cache_mode)
    if negative == "all":
        count = a["kv_cache"].shape[0] * a["kv_cache"].shape[1]
        a["slotmapping"] = a["slotmapping"] % count - count
    copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    out0, kv, out1, kv_rope = run_op(a, kw)
    (f0, f1), (f_kv, f_kv_rope) = M.mla_preprocess_functional(**copy, **kw, epsilon=1e-6)
    assert torch.equal(f0, out0) and torch.equal(f1, out1)
    assert torch.equal(f_kv, kv) and torch.equal(f_kv_rope, kv_rope)


def test_refuses_inputs_that_require_grad():
    a, kw = make_inputs()
    a["wuk"].requires_grad_()
    with pytest.raises(RuntimeError, match="inference op with no autograd"):
        run_op(a, kw)
    with torch.no_grad():
        run_op(a, kw)


@pytest.mark.parametrize("cache_mode", [0, 3])
@pytest.mark.parametrize("slot", [64, -65, 1000])
def test_an_out_of_range_slot_is_an_index_error_and_writes_nothing(cache_mode, slot):
    """Python indexing: -S..S-1 are slots (S = blocks * block_size), anything else is refused,
    by the reference kernel and by the decomposition (one index_put, whose bounds check inductor
    compiles in as well; in a parallel kernel it aborts, so it is not run compiled here)."""
    a, kw = make_inputs(cache_mode=cache_mode, blocks=4, block_size=16)
    count = a["kv_cache"].shape[0] * a["kv_cache"].shape[1]
    a["slotmapping"][1] = slot * count // 64
    before, before_rope = a["kv_cache"].clone(), a["kv_cache_rope"].clone()
    with pytest.raises(IndexError, match=f"out of range for a cache of {count} slots"):
        run_op(a, kw)
    assert torch.equal(a["kv_cache"], before) and torch.equal(a["kv_cache_rope"], before_rope)
    with pytest.raises(IndexError, match="out of bounds"):
        M.mla_preprocess_functional(**a, **kw, epsilon=1e-6)


@pytest.mark.parametrize("changes, message", [
    (dict(kv_cache=lambda a: a["kv_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
     "kv_cache must be contiguous"),
    (dict(quant_scale0=lambda a: a["quant_scale0"].float()), "quant_scale0 must be a \\[1\\] torch.bfloat16 tensor"),
    (dict(quant_offset1=lambda a: a["quant_offset1"].float()), "quant_offset1 must be a \\[1\\] int8 tensor"),
    (dict(bias0=lambda a: a["bias0"].long()), "bias0 must be \\[2112\\] int32"),
    (dict(descale1=lambda a: a["descale1"].double()), "descale1 must be \\[384\\] float32/float16/bfloat16"),
    (dict(gamma1=lambda a: a["gamma1"].float()), "gamma1 must be torch.bfloat16"),
    (dict(cos=lambda a: a["cos"].half()), "cos must be torch.bfloat16"),
    (dict(gamma0=lambda a: a["gamma0"][:100]), "gamma0 must be \\[2048\\] torch.bfloat16"),
    (dict(wuk=lambda a: a["wuk"].to("meta")), "every tensor must be on input's device cpu, got wuk on meta"),
])
def test_every_bad_input_is_a_clear_error(changes, message):
    a, kw = _broken(**changes)
    with pytest.raises(ValueError, match=message):
        run_op(a, kw)
    fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode, pytest.raises(ValueError, match=message):  # the fake kernel checks the same rules
        run_op({k: fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}, kw)


# -- the eager NPU kernel, against torch_npu's ATB binding as the wheel registers it ----------------
def atb_schema():
    """``atb::npu_mla_preprocess``'s schema, read from the torch_npu wheel's op library (torch_npu
    itself cannot be imported here)."""
    import re

    from torchair_offline import TORCH_NPU_DIR

    library = TORCH_NPU_DIR / "torch_npu" / "lib" / "libop_plugin_atb.so"
    if not library.is_file():
        pytest.skip("torch_npu not fetched: run `make test`")
    found = re.search(rb"npu_mla_preprocess\(Tensor input[ -~]*?\) -> \([ -~]*?\)", library.read_bytes())
    return torch._C.parse_schema("atb::" + found.group(0).decode())


def fake_atb(calls):
    """torch_npu.atb.npu_mla_preprocess as its schema and doc define it: every call checked against
    the schema; ATB's semantics (skip slot < 0, string modes, int64 fp16 descale) run on the reference."""
    schema = atb_schema()
    positional = [a for a in schema.arguments if not a.kwarg_only]
    keywords = {a.name: a for a in schema.arguments if a.kwarg_only}

    def npu_mla_preprocess(*args, **kwargs):
        calls.append(kwargs)
        assert len(args) == len(positional), f"{len(args)} positional arguments, the schema has {len(positional)}"
        assert set(kwargs) <= set(keywords), f"unknown keywords {set(kwargs) - set(keywords)}"
        for spec, value in [*zip(positional, args), *((keywords[k], v) for k, v in kwargs.items())]:
            if not isinstance(spec.type, torch.OptionalType):
                assert isinstance(value, torch.Tensor), f"{spec.name} is a Tensor in the schema, got {value!r}"
        assert kwargs["cache_mode"] in ("krope_ctkv", "int8_nzcache", "nzcache")
        assert kwargs["quant_mode"] in ("per_tensor_quant_asymm", "per_token_quant_symm")
        a = dict(zip([p.name for p in positional], args), **kwargs)
        assert a["slotmapping"].dtype == torch.int32 and bool((a["slotmapping"] >= 0).all())  # ATB skips < 0
        for name in ("descale0", "descale1"):
            if a[name].dtype == torch.int64:  # fp16: the float32 bits
                a[name] = a[name].to(torch.int32).view(torch.float32)
        a.update(cache_mode={"krope_ctkv": 1, "int8_nzcache": 2, "nzcache": 3}[a["cache_mode"]],
                 quant_mode={"per_tensor_quant_asymm": 0, "per_token_quant_symm": 1}[a["quant_mode"]],
                 epsilon=M.ATB_EPSILON)
        q0, q1 = M._run(a)
        return q0, a["kv_cache"], q1, a["kv_cache_rope"]

    return npu_mla_preprocess


@pytest.mark.parametrize("cache_mode", [0, 1, 3])
@pytest.mark.parametrize("dtype, quantized", [(torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)])
def test_npu_kernel_calls_atb_as_its_schema_says_and_keeps_the_ops_meaning(monkeypatch, cache_mode, dtype, quantized):
    import npu_fuse_backend as nf

    calls = []
    monkeypatch.setattr(M, "_atb_mla_preprocess", lambda: fake_atb(calls))
    a, kw = make_inputs(dtype=dtype, cache_mode=cache_mode, quantized=quantized)
    a["slotmapping"][1] = -2  # Python indexing: the second slot from the end
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    q0, q1 = M._run({**M.bind_args((), {**expected, **kw}), "epsilon": M.ATB_EPSILON})
    with nf.config.patch(soc="Ascend910B"):
        got = M.mla_preprocess_npu({**M.bind_args((), {**a, **kw}), "epsilon": M.ATB_EPSILON})
    assert len(calls) == 1
    torch.testing.assert_close(got[0].float(), q0.float(), atol=0, rtol=0)
    torch.testing.assert_close(got[1].float(), q1.float(), atol=0, rtol=0)
    for cache in ("kv_cache", "kv_cache_rope"):
        assert torch.equal(a[cache], expected[cache])


def test_npu_kernel_runs_the_reference_where_atb_has_no_kernel(monkeypatch):
    import npu_fuse_backend as nf

    monkeypatch.setattr(M, "_atb_mla_preprocess", lambda: pytest.fail("ATB called"))
    a, kw = make_inputs()
    for soc, eps in (("Ascend950", M.ATB_EPSILON), ("Ascend910B", 1e-5)):  # no ATB kernel; another epsilon
        with nf.config.patch(soc=soc):
            M.mla_preprocess_npu({**M.bind_args((), {**a, **kw}), "epsilon": eps})


def test_npu_kernel_is_registered_for_the_op():
    from npu_fuse_backend.lowering import registry

    assert any(fn is M._mla_preprocess_npu for _, fn in registry._npu_kernels)
