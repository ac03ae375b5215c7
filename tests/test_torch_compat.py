"""What differs between torch minors (npu_fuse_backend.torch_compat), on the torch that runs the suite
(make test-torch TORCH=2.10.0 takes the other branches)."""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from npu_fuse_backend import run_fusion_passes, torch_compat
from npu_fuse_backend.lowering.fallback import FusionPrePass


def test_concrete_hint_reads_a_symbols_traced_value():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    size = env.create_symintnode(env.create_symbol(7, ConstantSource("n")), hint=7)
    assert isinstance(size, torch.SymInt)
    assert torch_compat.concrete_hint(size) == 7 and torch_compat.concrete_hint(3) == 3
    assert torch_compat.concrete_hint(size * 2 > 10) is True


def test_custom_graph_passes_as_a_tuple():
    def user(graph):
        pass

    assert torch_compat.custom_graph_passes(None) == ()
    assert torch_compat.custom_graph_passes(user) == (user,)
    assert torch_compat.custom_graph_passes([user, user]) == (user, user)


class Recorded(CustomGraphPass):
    def __init__(self, calls, key="user-pass-v1"):
        self.calls, self.key = calls, key

    def __call__(self, graph):
        self.calls.append("user")

    def uuid(self):
        return self.key


def test_one_pre_pass_runs_the_users_after_ours_and_keys_the_cache_by_them():
    """torch 2.10's inductor takes one post-grad pre pass: ours runs the user's after itself."""
    calls = []

    def fusion_passes(gm, lowering):
        calls.append("ours")
        return run_fusion_passes(gm, lowering)

    graph = torch.fx.symbolic_trace(lambda x: x + 1).graph
    chained = FusionPrePass(fusion_passes, then=(Recorded(calls),))
    chained(graph)
    assert calls == ["ours", "user"]
    alone = FusionPrePass(fusion_passes).uuid()
    assert chained.uuid() not in (None, alone)
    assert chained.uuid() != FusionPrePass(fusion_passes, then=(Recorded(calls, "user-pass-v2"),)).uuid()
    # a plain function inductor cannot key: no key, so inductor bypasses its cache as for that pass alone
    assert FusionPrePass(fusion_passes, then=(lambda graph: None,)).uuid() is None


def test_no_module_but_torch_compat_branches_on_torchs_version():
    """Differences between minors are found by what torch has, in torch_compat, not by version checks
    spread through the passes (the CLI prints the version, torch_compat names it in a hint)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    version_check = re.compile(r"torch\.__version__\s*[<>=!]|TorchVersion|version\.parse|torch\.version\.__version__")
    offenders = [f"{path.relative_to(repo)}:{i}"
                 for folder in ("npu_fuse", "npu_fuse_backend", "lowering", "converters")
                 for path in (repo / folder).rglob("*.py")
                 for i, line in enumerate(path.read_text().splitlines(), 1) if version_check.search(line)]
    assert offenders == []
