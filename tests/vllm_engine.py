"""vLLM's CPU build on a tiny local Llama: the model, and engines with and without npu_fuse.

Used by ``tests/test_vllm.py`` (one engine per fresh process) and ``benchmarks/vllm_serving.py``
(both engines in one process, rounds interleaved). Needs vLLM (``pip install '.[vllm]'``, see the
README), never the network: the model is random weights and a word-level tokenizer written to a
local folder, loaded with ``HF_HUB_OFFLINE=1``.

    python tests/vllm_engine.py model DIR
    python tests/vllm_engine.py run --model DIR --custom-ops all --npu-fuse --report-file F --out OUT.json
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = ["w1 w2 w3 w4", "w7 w8", "w100 w200 w300", "w42"]
MAX_TOKENS = 8
# the environment every engine runs in (the caller adds a fresh VLLM_CACHE_ROOT)
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def write_tiny_llama(folder: str, layers: int = 2) -> str:
    """A randomly initialised Llama (hidden 128, 4 heads, 2 KV heads, head dim 32) and a
    word-level tokenizer ("w0" ... "w507"), saved to folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return _write_tokenizer(folder)


def write_tiny_deepseek_v2(folder: str, layers: int = 2) -> str:
    """A randomly initialised DeepSeek-V2 (MLA: q_lora_rank 64, kv_lora_rank 512, rope dim 64,
    4 heads; dense MLPs), saved to folder; vLLM's CPU MLA backends want bf16."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                              first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                              pad_token_id=0)
    DeepseekV2ForCausalLM(config).save_pretrained(folder)
    return _write_tokenizer(folder)


def _write_tokenizer(folder: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(508)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)
    return folder


def make_engine(model: str, custom_ops: str, npu_fuse: bool, report_file=None, enforce_eager: bool = False,
                dtype: str = "float32"):
    """``vllm.LLM`` on the tiny model; with npu_fuse, our pass in its compile."""
    from vllm import LLM

    compilation = {"custom_ops": [custom_ops]}
    if npu_fuse:
        import npu_fuse.vllm

        compilation = npu_fuse.vllm.compilation_config(compilation, report_file=report_file)
    return LLM(model=model, dtype=dtype, enforce_eager=enforce_eager, max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=128, compilation_config=compilation)


def generate(llm, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list:
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(args) -> dict:
    start = time.perf_counter()
    llm = make_engine(args.model, args.custom_ops, args.npu_fuse, args.report_file, args.enforce_eager, args.dtype)
    started = time.perf_counter()
    tokens = generate(llm)
    result = {"tokens": tokens, "engine_start_s": started - start, "generate_s": time.perf_counter() - started}
    Path(args.out).write_text(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model", help="write a tiny model to a folder")
    model.add_argument("folder")
    model.add_argument("--arch", choices=["llama", "deepseek_v2"], default="llama")
    engine = sub.add_parser("run", help="start one engine, generate greedily, write the tokens as JSON")
    engine.add_argument("--model", required=True)
    engine.add_argument("--custom-ops", choices=["all", "none"], default="none")
    engine.add_argument("--npu-fuse", action="store_true")
    engine.add_argument("--report-file")
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--dtype", default="float32")
    engine.add_argument("--out", required=True)
    args = parser.parse_args()
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    if args.command == "model":
        (write_tiny_deepseek_v2 if args.arch == "deepseek_v2" else write_tiny_llama)(args.folder)
    else:
        print(json.dumps(run(args)))


if __name__ == "__main__":  # vLLM spawns its engine process: the work must not run on import
    sys.exit(main())
