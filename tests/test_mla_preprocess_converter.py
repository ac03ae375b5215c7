"""The MLA prologue through torchair's real FX->GE conversion, checked against CANN's IR (offline proxy).

Per SoC the fused op becomes MlaPreprocess writing a scratch cache (Atlas A2/A3) or the stages in
ordinary GE ops (Ascend950, generic), and in both the cache rows are written into the graph-input
cache by ScatterNdUpdate, whose TensorMove torchair removes: no copy of the cache per call.
"""

import functools

import pytest
import torch

import npu_fuse_backend as nf
from npu_fuse_backend.demo_models import DeepSeekMLA, MLAConfig, mla_decode_inputs
from npu_fuse_backend.lowering.ops import mla_preprocess as M
from torchair_offline import ge_graphs_of, hidden_ops, load_torchair_offline, op_types, torchair_dir

pytestmark = pytest.mark.skipif(not (torchair_dir() / "torchair").is_dir(),
                                reason="torchair not fetched: run `make test`")

SOCS = ["generic", "Ascend910B", "Ascend950"]
TOKENS = 4


def decode_inputs(cfg):
    x, cos, sin, slots, ctx = mla_decode_inputs(cfg, TOKENS, 1)
    slots[1] = -1  # the last slot of the cache, as eager indexing reads it
    cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, 576, dtype=torch.bfloat16)
    return x, cos, sin, slots, cache, ctx


@functools.lru_cache(maxsize=None)
def decode_graph(quant: bool, soc: str, fusion: bool = True):
    """(GE graph of one decode step of the DeepSeek MLA module, fused ops reported)."""
    cfg = MLAConfig()
    torch.manual_seed(0)
    model = DeepSeekMLA(cfg, quant=quant).to(torch.bfloat16).eval()
    nf.clear_reports()
    with nf.config.patch(soc=soc), torch.no_grad():
        (graph,) = ge_graphs_of(model, *decode_inputs(cfg), fusion=fusion)
    return graph, [m.op for r in nf.get_reports() for m in r.matches]


def nodes(graph, op_type):
    return [op for op in graph.op if op.type == op_type]


def producer(graph, tensor):
    name = tensor.split(":")[0]
    return next(op for op in graph.op if op.name == name)


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "w8a8"])
def test_decode_step_conforms_to_cann_and_copies_no_cache(quant, soc):
    from ge_conformance import check_graph, input_copies

    graph, fused = decode_graph(quant, soc)
    assert fused == ["mla_preprocess"]
    assert [str(v) for v in check_graph(graph, soc)] == []
    assert input_copies(graph) == []  # the cache (a graph input) is updated in place
    (scatter,) = nodes(graph, "ScatterNdUpdate")
    cache = producer(graph, scatter.input[0])
    assert cache.type == "Data" and list(cache.output_desc[0].shape.dim) == [16, 16, 1, 576]
    types = set(op_types(graph))
    if soc == "Ascend910B":
        assert "MlaPreprocess" in types and "RotaryPositionEmbedding" not in types
    else:  # no MlaPreprocess on Ascend950; a generic graph must run on every SoC
        assert "MlaPreprocess" not in types and "RotaryPositionEmbedding" in types


@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "w8a8"])
def test_mla_preprocess_node_is_the_op_def_with_a_scratch_cache(quant):
    load_torchair_offline()
    from npu_fuse_backend.converters import mla_preprocess as conv
    from torchair._ge_concrete_graph import ge_ir_pb2
    from torchair.ge._ge_graph import DataType

    graph, _ = decode_graph(quant, "Ascend910B")
    (op,) = nodes(graph, "MlaPreprocess")
    assert [d.name for d in op.input_desc] == list(conv.GE_INPUTS) and all(op.input)
    assert [d.name for d in op.output_desc] == conv.GE_OUTPUTS
    assert op.attr["wdq_dim"].i == 1536 and op.attr["cache_mode"].i == 0 and op.attr["quant_mode"].i == 0
    assert op.attr["do_rms_norm"].b == quant  # the unquantized path has no input norm in the op
    assert op.attr["transepose_wuk"].b and "transpose_wuk" not in op.attr
    layouts = {d.name: d.layout for d in op.input_desc}
    assert layouts["wdqkv"] == layouts["wuq"] == "FRACTAL_NZ" and layouts["kv_cache"] == "ND"
    inputs = dict(zip(conv.GE_INPUTS, op.input))
    slots = producer(graph, inputs["slot_mapping"])
    assert slots.type == "Const" and slots.attr["value"].t.desc.dtype == ge_ir_pb2.DataType.Value("DT_INT32")
    assert torch.equal(torch.frombuffer(bytearray(slots.attr["value"].t.data), dtype=torch.int32),
                       torch.arange(TOKENS, dtype=torch.int32))  # token t at scratch slot t
    assert producer(graph, inputs["kv_cache"]).type == "Fill"  # a scratch cache, never the model's
    descale = producer(graph, inputs["descale_0"])  # float32 with bf16 input: the model's scale cast, or ones
    if quant:
        assert descale.type == "Cast" and descale.attr["dst_type"].i == DataType.DT_FLOAT
    else:
        value = producer(graph, descale.input[1])
        assert descale.type == "Fill" and value.attr["value"].t.desc.dtype == ge_ir_pb2.DataType.Value("DT_FLOAT")


def test_the_unfused_module_does_not_convert_on_ascend950_the_fused_one_does():
    with pytest.raises(Exception, match="index_put"):
        decode_graph(False, "Ascend950", fusion=False)
    assert decode_graph(False, "Ascend950")[1] == ["mla_preprocess"]


def test_a_cann_without_mla_preprocess_gets_the_stages_in_ordinary_ops():
    from ge_conformance import check_graph, input_copies

    cfg = MLAConfig()
    torch.manual_seed(0)
    model = DeepSeekMLA(cfg, quant=True).to(torch.bfloat16).eval()
    with hidden_ops("MlaPreprocess"), nf.config.patch(soc="Ascend910B"), torch.no_grad():
        (graph,) = ge_graphs_of(model, *decode_inputs(cfg))
    assert "MlaPreprocess" not in op_types(graph) and "ScatterNdUpdate" in op_types(graph)
    assert check_graph(graph, "Ascend910B") == [] and input_copies(graph) == []


def _direct_call(cache_mode, dtype=torch.bfloat16, quantized=False, heads=16):
    """(step, args): one direct op call whose every tensor is a graph input (Data i = args[i])."""
    from mla_inputs import make_inputs, positional_and_keywords

    a, kw = make_inputs(tokens=TOKENS, heads=heads, cache_mode=cache_mode, quantized=quantized, dtype=dtype)
    if cache_mode == M.KVCACHE:
        del a["kv_cache_rope"]  # unused: made inside the step, not a graph input
    names = list(a)

    def step(*args):
        for t in args:  # dynamo makes graph inputs in the order of first use: make it the order of args
            t.shape
        given = dict(zip(names, args))
        given.setdefault("kv_cache_rope", torch.empty(0))
        positional, given = positional_and_keywords(given)
        q0, _, q1, _ = M.mla_preprocess(*positional, **given, **kw)
        return q0, q1

    return step, [a[n] for n in names]


def test_a_direct_krope_ctkv_call_scatters_both_caches():
    from ge_conformance import check_graph, input_copies

    step, args = _direct_call(M.KROPE_CTKV, torch.float16)
    with nf.config.patch(soc="Ascend910B"), torch.no_grad():
        (graph,) = ge_graphs_of(step, *args)
    assert check_graph(graph, "Ascend910B") == []
    scatters = nodes(graph, "ScatterNdUpdate")
    assert [producer(graph, s.input[0]).type for s in scatters] == ["TensorMove", "Data"]
    # torchair binds only the last op's output: the 512-wide ctkv cache goes without a copy, the
    # 64-wide rope cache keeps one
    rope_copy = producer(graph, scatters[0].input[0])
    assert input_copies(graph) == [rope_copy.name]
    assert list(producer(graph, rope_copy.input[0]).output_desc[0].shape.dim) == [4, 16, 1, 64]


def test_float16_w8a8_descale_goes_to_mla_preprocess_as_int64_float_bits(recwarn):
    """The float32 bits widened to int64 without a Cast of the Bitcast, which torchair's symbolic
    shape inference of MlaPreprocess cannot follow (it warned "infer and generate sym shape failed")."""
    from ge_conformance import check_graph, input_copies

    step, args = _direct_call(M.KVCACHE, torch.float16, quantized=True)
    with nf.config.patch(soc="Ascend910B"), torch.no_grad():
        (graph,) = ge_graphs_of(step, *args)
    from torchair.ge._ge_graph import DataType

    assert not [w for w in recwarn if "infer and generate sym shape failed" in str(w.message)]
    assert check_graph(graph, "Ascend910B") == [] and input_copies(graph) == []
    (op,) = nodes(graph, "MlaPreprocess")
    reshape = producer(graph, dict(zip([d.name for d in op.input_desc], op.input))["descale_1"])
    widened = producer(graph, reshape.input[0])
    pack = producer(graph, widened.input[0])
    bits = producer(graph, pack.input[0])
    data = producer(graph, bits.input[0])
    assert (reshape.type, widened.type, pack.type, bits.type, data.type) == \
        ("Reshape", "Bitcast", "Pack", "Bitcast", "Data")
    assert widened.attr["type"].dt == DataType.DT_INT64 and bits.attr["type"].dt == DataType.DT_INT32


def test_nz_cache_modes_are_refused_by_the_conversion_with_the_reason():
    step, args = _direct_call(M.NZCACHE)
    with nf.config.patch(soc="Ascend910B"), torch.no_grad(), \
            pytest.raises(Exception, match="under torchair: cache_mode 3: the GE conversion writes ND caches"):
        ge_graphs_of(step, *args)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("cache_mode", [M.KVCACHE, M.KROPE_CTKV])
@pytest.mark.parametrize("dtype, quantized", [(torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)],
                         ids=["bf16-w8a8", "fp16-w8a8", "bf16"])
def test_the_ge_graph_computes_what_the_op_computes(soc, cache_mode, dtype, quantized):
    """The emitted GE graph, run op by op (tests/ge_eval.py; MlaPreprocess as its contract), gives
    the reference kernel's outputs and caches, a negative slot included (make_inputs: slot -1)."""
    from ge_eval import run_graph

    step, args = _direct_call(cache_mode, dtype, quantized)
    with nf.config.patch(soc=soc), torch.no_grad():
        (graph,) = ge_graphs_of(step, *[t.clone() for t in args])
        expected_args = [t.clone() for t in args]
        expected = step(*expected_args)
    got_args = [t.clone() for t in args]
    outputs = run_graph(graph, got_args)
    for g, e in zip(outputs[:2], expected):
        torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)
    cache = next(i for i, t in enumerate(args) if t.dim() == 4 and t.shape[-1] in (512, 576))
    torch.testing.assert_close(got_args[cache].float(), expected_args[cache].float(), atol=2e-2, rtol=2e-2)
    for i, (before, e) in enumerate(zip(args, expected_args)):  # other mutated inputs: written back from
        if i != cache and not torch.equal(before, e):  # a graph output by torchair's runner
            assert any(o.shape == e.shape and torch.allclose(o.float(), e.float(), atol=2e-2, rtol=2e-2)
                       for o in outputs[2:])


def test_a_direct_call_outside_mla_preprocess_limits_gets_the_stage_ops_on_atlas_a2():
    from ge_conformance import check_graph, input_copies
    from ge_eval import run_graph

    step, args = _direct_call(M.KVCACHE, quantized=True, heads=8)  # MlaPreprocess takes 16/32/64/128 heads
    with nf.config.patch(soc="Ascend910B"), torch.no_grad():
        (graph,) = ge_graphs_of(step, *[t.clone() for t in args])
        expected = step(*[t.clone() for t in args])
    assert "MlaPreprocess" not in op_types(graph)
    assert check_graph(graph, "Ascend910B") == [] and input_copies(graph) == []
    for got, want in zip(run_graph(graph, [t.clone() for t in args]), expected):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
