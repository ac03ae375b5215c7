"""Tensor parallel: a Llama-style attention with its heads sharded over 2 CPU ranks (gloo),
the output projection's partial sums all-reduced with functional collectives as real TP
code writes them, compiled with npu_fuse on each rank: RoPE fuses on every rank next to
the collectives, and every rank's result equals eager's (and the unsharded module's)."""

import json
import logging
import math
import socket

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch import nn
from models import rotate_half

WORLD = 2
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ = 64, 4, 2, 16, 8


class Attention(nn.Module):
    """Llama attention over ``heads`` query heads and ``kv_heads`` key/value heads; with a
    group, the heads are this rank's shard and the output projection's partial sums are
    all-reduced (column-parallel q/k/v, row-parallel o)."""

    def __init__(self, heads=HEADS, kv_heads=KV_HEADS, group=None):
        super().__init__()
        self.heads, self.kv_heads, self.group = heads, kv_heads, group
        self.q_proj = nn.Linear(HIDDEN, heads * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), dim=-1)
        out = self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, -1))
        if self.group is not None:
            out = funcol.all_reduce(out, "sum", self.group)
        return out


def shard(full: Attention, rank: int, group) -> Attention:
    """This rank's heads: rows of q/k/v (column parallel), columns of o (row parallel)."""
    heads, kv_heads = HEADS // WORLD, KV_HEADS // WORLD
    part = Attention(heads, kv_heads, group)
    rows = lambda w, n: w[rank * n * HEAD_DIM:(rank + 1) * n * HEAD_DIM]  # noqa: E731
    with torch.no_grad():
        part.q_proj.weight.copy_(rows(full.q_proj.weight, heads))
        part.k_proj.weight.copy_(rows(full.k_proj.weight, kv_heads))
        part.v_proj.weight.copy_(rows(full.v_proj.weight, kv_heads))
        part.o_proj.weight.copy_(full.o_proj.weight[:, rank * heads * HEAD_DIM:(rank + 1) * heads * HEAD_DIM])
    return part


def inputs():
    x = torch.randn(2, SEQ, HIDDEN)
    freqs = torch.outer(torch.arange(SEQ).float(), 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    emb = torch.cat([freqs, freqs], -1).expand(2, SEQ, HEAD_DIM)
    return x, emb.cos(), emb.sin()


class GraphsAfterPasses(logging.Handler):
    """Keeps the graphs npu_fuse logs after its passes (the ``npu_fuse_graphs`` artifact)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.graphs = []

    def emit(self, record):
        if " after npu_fuse's passes" in record.getMessage():
            self.graphs.append(record.getMessage())


def run_rank(rank: int, port: int, out_dir: str) -> None:
    import npu_fuse_backend as nf
    from npu_fuse_backend.report import graphs_log

    graphs = GraphsAfterPasses()
    graphs_log.addHandler(graphs)
    graphs_log.setLevel(logging.DEBUG)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # every rank builds the same full module and inputs
        full, args = Attention(), inputs()
        part = shard(full, rank, dist.group.WORLD)
        with torch.no_grad(), nf.config.patch(fallback="aot_eager"):
            eager = part(*args)
            compiled = torch.compile(part, backend="npu_fuse", fullgraph=True)(*args)
            unsharded = full(*args)
        (graph,) = graphs.graphs
        result = {
            "fused": [m.op for r in nf.get_reports() for m in r.matches],
            "near_misses": [n.reason for r in nf.get_reports() for n in r.near_misses],
            "diff_vs_eager": (compiled - eager).abs().max().item(),
            "diff_vs_unsharded": (compiled - unsharded).abs().max().item(),
            "graph_has": [op for op in ("npu_fuse.rotary_mul", "_c10d_functional.all_reduce",
                                        "_c10d_functional.wait_tensor") if op in graph],
        }
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_heads_sharded_over_two_ranks_fuse_rope_on_every_rank(tmp_path):
    mp.start_processes(run_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["fused"] == ["rotary_mul", "rotary_mul"], result  # q and k of this rank's heads
        assert result["near_misses"] == []
        assert len(result["graph_has"]) == 3, result  # the fused op next to the collectives
        assert result["diff_vs_eager"] <= 1e-5 and result["diff_vs_unsharded"] <= 1e-5, result
