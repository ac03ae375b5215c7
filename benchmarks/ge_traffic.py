"""GE graph traffic: node count and bytes moved, unfused vs fused, per model and per fused region.

Each case is compiled twice through torchair's real FX->GE conversion (offline, the CANN proxy of
tests/torchair_offline.py): without and with the npu_fuse torchair pre-pass. Bytes moved is a
model: the sum over compute nodes (not Data, Const, NetOutput) of their input and output bytes, from
the tensor descs of the GE graph after torchair's GE passes (shape from the desc or the FX value
torchair records on it; an output whose shape torchair leaves to GE's inference counts as large as
the node's largest input). A fused region is the GE nodes converted from the FX nodes one rewrite
inserted; its unfused subgraph, the GE nodes converted from the FX nodes it replaced.

Goal: every fused region moves fewer bytes than its unfused subgraph, and no graph copies a
mutated input. Cases are a list: the MLA decode rows go in ``CASES``. Unfused, their cache write
(scatter_) becomes ScatterElements, which writes a whole new cache that torchair's runner copies back
into the input on every call; fused, ScatterNdUpdate writes the token rows into the input in place
(the bytes model still counts its whole cache in and out).
Run: python benchmarks/ge_traffic.py
"""

import contextlib
import dataclasses
import re
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
from common import table, write_results  # noqa: E402
from torchair_offline import ge_graphs_of, load_torchair_offline  # noqa: E402

import npu_fuse_backend as nf  # noqa: E402
from npu_fuse_backend.demo_models import (  # noqa: E402
    DecoderConfig, DeepSeekMLA, GPTJModel, LlamaModel, MLAConfig, mla_decode_inputs,
)

NOT_COMPUTE = {"Data", "Const", "NetOutput"}
DTYPE_BYTES = {"DT_FLOAT": 4, "DT_FLOAT16": 2, "DT_BF16": 2, "DT_INT8": 1, "DT_UINT8": 1, "DT_INT16": 2,
               "DT_INT32": 4, "DT_INT64": 8, "DT_BOOL": 1, "DT_DOUBLE": 8}


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[[], Callable]  # the function to compile
    inputs: Callable[[], list]
    training: bool
    socs: tuple = ("Ascend910B", "Ascend950")
    unfused_converts: bool = True  # False: only the fused graph has a GE conversion (no baseline)


def _hidden(seq=16, hidden=256):
    return lambda: [torch.randn(2, seq, hidden), torch.arange(seq).expand(2, seq)]


def _attention(q, k, v):
    return torch.softmax((q @ k.transpose(-1, -2)) * 0.125, dim=-1) @ v


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _partial_rope_on_input(x, cos, sin):
    s = x[..., :64]
    x[..., :64] = s * cos + _rotate_every_two(s) * sin
    return cos.sum()  # x is only updated: nothing else reads it


def _llama():
    return LlamaModel(DecoderConfig(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512))


def _gptj():
    return GPTJModel(DecoderConfig(hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=512, rotary_dim=32))


# DeepSeek-V3's hidden size, 32 heads, a 32768-slot paged cache (37.7 MB bf16). The cache is written
# with scatter_ (aten.scatter.src), which torchair converts unfused (it has no index_put converter).
MLA_DECODE = MLAConfig(hidden=7168, heads=32, block_size=128, num_blocks=256, cache_write="scatter")


def _mla(quant: bool):
    def make():
        return DeepSeekMLA(MLA_DECODE, quant=quant).to(torch.bfloat16).eval()

    return make


def _mla_decode_step(tokens=8, step=3):
    def inputs():
        x, cos, sin, slots, context = mla_decode_inputs(MLA_DECODE, tokens, step)
        cache = torch.zeros(MLA_DECODE.num_blocks, MLA_DECODE.block_size, 1, 576, dtype=torch.bfloat16)
        return [x, cos, sin, slots, cache, context]

    return inputs


CASES = [
    Case("llama inference", _llama, _hidden(), False),
    Case("llama training", _llama, _hidden(), True),
    Case("gptj partial-rope inference", _gptj, _hidden(), False),
    Case("gptj partial-rope training", _gptj, _hidden(), True),
    Case("attention training", lambda: _attention,
         lambda: [torch.randn(2, 4, 64, 64, requires_grad=True) for _ in range(3)], True),
    Case("in-place partial rope on an input", lambda: _partial_rope_on_input,
         lambda: [torch.randn(2, 16, 4, 128), torch.randn(2, 1, 1, 64), torch.randn(2, 1, 1, 64)], False),
    Case("deepseek mla decode bf16", _mla(False), _mla_decode_step(), False),
    # unfused, aten._int_mm has no GE converter: no baseline graph
    Case("deepseek mla decode w8a8", _mla(True), _mla_decode_step(), False, unfused_converts=False),
]


# -- bytes of the GE graph -------------------------------------------------------------------------
def _shape(desc):
    if len(desc.shape.dim):
        return list(desc.shape.dim)
    meta = desc.attr["_meta"].s.decode() if "_meta" in desc.attr else ""
    match = re.search(r"shape=torch\.Size\(\[([^\]]*)\]\)", meta)
    if match is None:
        return None
    return [int(d) for d in match.group(1).split(",") if d.strip()]


def _bytes(desc):
    from torchair._ge_concrete_graph import ge_ir_pb2

    shape = _shape(desc)
    if shape is None or any(d < 0 for d in shape):
        return None
    numel = 1
    for d in shape:
        numel *= d
    return numel * DTYPE_BYTES.get(ge_ir_pb2.DataType.Name(desc.dtype), 4)


def node_bytes(op) -> int:
    ins = [b for b in map(_bytes, op.input_desc) if b is not None]
    largest_input = max(ins, default=0)
    outs = [largest_input if b is None else b for b in map(_bytes, op.output_desc)]
    return sum(ins) + sum(outs)


def compute_nodes(graph):
    return [op for op in graph.op if op.type not in NOT_COMPUTE]


# -- which FX node each GE node was converted from --------------------------------------------------
@contextlib.contextmanager
def recording_origins(origins: dict):
    """origins[graph name][GE op name] = FX node name, recorded around torchair's node conversion."""
    from torchair import npu_fx_compiler

    converter = npu_fx_compiler._NpuGraphConverter
    run_node = converter.run_node

    def recorded(self, n):
        ge_graph = self._graph.graph
        before = len(ge_graph.op)
        try:
            return run_node(self, n)
        finally:
            per_graph = origins.setdefault(ge_graph.name, {})
            for op in ge_graph.op[before:]:
                per_graph[op.name] = n.name

    converter.run_node = recorded
    try:
        yield
    finally:
        converter.run_node = run_node


def convert(case: Case, soc: str, fused: bool):
    """(GE graphs, FX snapshots after the pre-pass, GE op origins, reports)."""
    from torchair.configs.compiler_config import CompilerConfig

    from npu_fuse_backend.lowering.npu import torchair_pre_pass

    fx = []
    pre_pass = torchair_pre_pass(nf.run_fusion_passes) if fused else None

    def snapshot(gm, inputs, config):
        if pre_pass is not None:
            pre_pass(gm, inputs, config)
        fx.append({n.name: [a.name for a in n.all_input_nodes] for n in gm.graph.nodes})

    cfg = CompilerConfig()
    cfg.post_grad_custom_pre_pass = snapshot
    origins = {}
    torch.manual_seed(0)
    fn = case.make()
    nf.clear_reports()
    with recording_origins(origins), nf.config.patch(soc=soc), torch.set_grad_enabled(case.training):
        graphs = ge_graphs_of(fn, *case.inputs(), fusion=False, config=cfg)
    return graphs, fx, origins, nf.get_reports() if fused else []


def regions(fused_fx: dict, unfused_fx: dict, matches: list) -> list:
    """[(match, set of FX node names)]: the nodes new after the pass (the rewrites' and what torchair's
    pre-pass made of them), split into connected components, each paired with the match whose
    replacement it holds (``Match.nodes_inserted``; two replacements that touch, as chained
    add_rms_norms do, stay apart), or else with the matches left, in graph order."""
    new = [n for n in fused_fx if n not in unfused_fx]
    owner = {n: i for i, m in enumerate(matches) for n in m.nodes_inserted}
    component = {n: n for n in new}

    def root(n):
        while component[n] != n:
            n = component[n]
        return n

    for n in new:
        for a in fused_fx[n]:
            if a in component and not (a in owner and n in owner and owner[a] != owner[n]):
                component[root(a)] = root(n)
    groups = {}
    for n in new:
        groups.setdefault(root(n), []).append(n)
    order = {n: i for i, n in enumerate(fused_fx)}
    parts = sorted(groups.values(), key=lambda g: min(order[n] for n in g))
    if len(parts) != len(matches):
        raise RuntimeError(f"{len(parts)} inserted regions for {len(matches)} matches")
    by_match, unowned = {}, []
    for part in parts:
        owners = {owner[n] for n in part if n in owner}
        if len(owners) > 1 or owners & set(by_match):
            raise RuntimeError(f"a region of {len(part)} nodes holds the replacements of matches {sorted(owners)}")
        if owners:
            by_match[owners.pop()] = part
        else:
            unowned.append(part)
    unfused_order = {n: i for i, n in enumerate(unfused_fx)}
    rest = sorted(set(range(len(matches))) - set(by_match), key=lambda i: unfused_order.get(matches[i].anchor, 0))
    by_match.update(zip(rest, unowned))
    return [(matches[i], set(by_match[i])) for i in range(len(matches))]


def region_bytes(graph, origins: dict, fx_nodes: set) -> tuple:
    ops = [op for op in compute_nodes(graph) if origins.get(op.name) in fx_nodes]
    return len(ops), sum(node_bytes(op) for op in ops)


def main():
    load_torchair_offline()
    from ge_conformance import check_graph, input_copies

    graph_rows, region_rows = [], []
    for case in CASES:
        for soc in case.socs:
            fused, fused_fx, fused_origins, reports = convert(case, soc, fused=True)
            if case.unfused_converts:
                plain, plain_fx, plain_origins, _ = convert(case, soc, fused=False)
            else:
                plain, plain_fx, plain_origins = [None] * len(fused), [None] * len(fused), {}
            for i, (u, f) in enumerate(zip(plain, fused)):
                kind = reports[i].kind
                assert check_graph(f, soc) == [], f"{case.name} {soc}: non-conformant GE graph"
                f_nodes = compute_nodes(f)
                f_bytes = sum(map(node_bytes, f_nodes))
                u_nodes = compute_nodes(u) if u is not None else None
                u_bytes = sum(map(node_bytes, u_nodes)) if u is not None else None
                graph_rows.append({
                    "case": case.name, "soc": soc, "graph": kind, "fused ops": len(reports[i].matches),
                    "nodes unfused": len(u_nodes) if u is not None else "no GE", "nodes fused": len(f_nodes),
                    "MB unfused": u_bytes / 2**20 if u is not None else "no GE", "MB fused": f_bytes / 2**20,
                    "fused/unfused": f_bytes / u_bytes if u is not None else "-",
                    "input copies": len(input_copies(f))})
                if u is None:
                    print(graph_rows[-1], flush=True)
                    continue
                for match, inserted in regions(fused_fx[i], plain_fx[i], reports[i].matches):
                    n_u, b_u = region_bytes(u, plain_origins.get(u.name, {}), {match.anchor, *match.nodes_replaced})
                    n_f, b_f = region_bytes(f, fused_origins.get(f.name, {}), inserted)
                    region_rows.append({
                        "case": case.name, "soc": soc, "graph": kind, "fused op": match.op, "at": match.anchor,
                        "GE nodes unfused": n_u, "GE nodes fused": n_f, "KB unfused": b_u / 1024,
                        "KB fused": b_f / 1024, "fused/unfused": b_f / b_u if b_u else float("nan"),
                        "fewer bytes": b_f < b_u})
                print(graph_rows[-1], flush=True)
    worse = [r for r in region_rows if not r["fewer bytes"]]
    notes = (__doc__.split("\n\n")[1] + "\n\n" +
             f"{len(region_rows)} fused regions, {len(region_rows) - len(worse)} move fewer bytes than their unfused "
             f"subgraph; graphs with a copy of a mutated input: {sum(r['input copies'] > 0 for r in graph_rows)}.")
    markdown = ("## Graphs\n\n" + table(graph_rows, list(graph_rows[0])) +
                "\n\n## Fused regions\n\n" + table(region_rows, list(region_rows[0])))
    path = write_results("ge_traffic", {"graphs": graph_rows, "regions": region_rows}, notes, markdown)
    print(f"wrote {path}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
