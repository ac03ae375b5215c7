"""npu_fuse's fusion passes as a vLLM compile pass (imports vLLM's pass classes; ``import npu_fuse`` does not).

    from vllm import LLM
    import npu_fuse.vllm

    llm = LLM(model, compilation_config=npu_fuse.vllm.compilation_config({"custom_ops": ["all"]},
                                                                         report_file="fusions.jsonl"))
    npu_fuse.vllm.read_reports("fusions.jsonl")   # what vLLM's worker fused, per graph

See ``npu_fuse_backend.vllm`` and the README's "vLLM" section.
"""

from npu_fuse_backend.vllm import REPORT_FILE_ENV, NpuFusePass, compilation_config, read_reports

__all__ = ["REPORT_FILE_ENV", "NpuFusePass", "compilation_config", "read_reports"]
