"""A model zoo of real model code: Hugging Face transformers' own model classes (tiny configs
built in code, random weights, no downloads), one entry per family, each with the fused ops
its RoPE and attention should become. The coverage benchmark (``benchmarks/coverage.py``)
and the tests compile the same entries.

Each entry is a model factory with the contract of ``npu-fuse explain module:callable``::

    npu-fuse explain npu_fuse_backend.model_zoo:deepseek_v3 --training

returns ``(model, inputs)``. Expected fusions count per layer, plus ``once`` per model (the first
layer's norm of the embeddings). Attention is transformers' eager implementation, so softmax
backward is in the graph (SDPA hides it). transformers is an optional dependency: installed
by the ``zoo`` extra (``pip install -e '.[zoo]'``) and the ``test`` extra.
"""

import dataclasses
from typing import Callable

import torch

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 64, 4, 2, 128, 128


def _import_transformers():
    try:
        import transformers
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":
            raise
        raise ModuleNotFoundError("npu_fuse's model zoo builds transformers' own model classes, and transformers is "
                                  "not installed: pip install -e '.[zoo]' (or transformers==5.23.0)",
                                  name="transformers") from None
    return transformers


@dataclasses.dataclass
class Family:
    """One model family: how to build it, and per layer the fused ops its code should give."""

    name: str
    config: Callable[[int], object]  # layers -> a transformers config
    model_class: str  # the transformers class, e.g. "LlamaForCausalLM"
    forward: dict  # fused op -> sites per layer in the forward (or inference) graph
    backward: dict  # fused op -> sites per layer in the backward graph of a training step
    once: dict = dataclasses.field(default_factory=dict)  # fused op -> sites per model in the forward graph
    routers: int = 0  # MoE router softmaxes per layer: their backward has no scale, a near-miss saying so

    def build(self, layers: int = 1, seed: int = 0) -> torch.nn.Module:
        transformers = _import_transformers()
        torch.manual_seed(seed)
        config = self.config(layers)
        config._attn_implementation = "eager"
        return getattr(transformers, self.model_class)(config)

    def expected(self, kind: str, layers: int) -> dict:
        forward = kind in ("forward", "inference")
        counts = {op: n * layers for op, n in (self.forward if forward else self.backward).items()}
        for op, n in (self.once.items() if forward else ()):
            counts[op] = counts.get(op, 0) + n
        return counts


def _common(layers: int, **extra) -> dict:
    return {**dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                   attention_dropout=0.0), **extra}


def _config(name: str, **extra) -> Callable[[int], object]:
    def make(layers: int):
        import transformers

        return getattr(transformers, name)(**_common(layers, **extra))

    return make


def _partial(factor: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}}


def _gptj(layers: int):
    import transformers

    return transformers.GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=HEADS, rotary_dim=8,
                                   n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)


def _gpt_neox(layers: int):
    import transformers

    return transformers.GPTNeoXConfig(**_common(layers, **_partial(0.25)), attention_probs_dropout_prob=0.0,
                                      hidden_dropout=0.0, use_parallel_residual=True)


def _falcon(layers: int):
    import transformers

    return transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                                     num_attention_heads=HEADS, multi_query=True, alibi=False,
                                     new_decoder_architecture=False, attention_dropout=0.0, hidden_dropout=0.0)


def _deepseek_v3(layers: int):
    import transformers

    return transformers.DeepseekV3Config(
        **_common(layers, num_key_value_heads=HEADS), q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True,
        # dense MLPs only: the MoE layers' data-dependent expert routing is not what this zoo measures
        first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32)


def _deepseek_v2(layers: int):
    import transformers

    return transformers.DeepseekV2Config(
        **_common(layers, num_key_value_heads=HEADS), q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_group=1, topk_group=1)


def _llama4(layers: int):
    import transformers

    # every layer a RoPE layer (no_rope_layers: 1 = uses RoPE), dense MLPs, chunked attention
    return transformers.Llama4TextConfig(**_common(layers, head_dim=16), intermediate_size_mlp=INTERMEDIATE,
                                         num_local_experts=2, moe_layers=[], no_rope_layers=[1] * layers,
                                         attention_chunk_size=4)


def _phi3_longrope(layers: int):
    import transformers

    half = HIDDEN // HEADS // 2
    scaling = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
               "short_factor": [1.0 + 0.1 * i for i in range(half)],
               "long_factor": [1.5 + 0.1 * i for i in range(half)]}
    return transformers.Phi3Config(**_common(layers, pad_token_id=0, original_max_position_embeddings=64),
                                   rope_parameters=scaling)


def _bloom(layers: int):
    import transformers

    return transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=layers, n_head=HEADS,
                                    attention_dropout=0.0, hidden_dropout=0.0)


def _qwen_vl(name: str):
    def make(layers: int):
        import transformers

        text = _common(layers, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0})
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)
        if name == "Qwen2_5_VLConfig":
            vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=HIDDEN, intermediate_size=32)
        return getattr(transformers, name)(text_config=text, vision_config=vision)

    return make


ROPE = {"rotary_mul": 2}  # q and k
ROPE_BACKWARD = {"rotary_mul_backward": 2}
SOFTMAX_BACKWARD = {"softmax_grad_ext": 1}
TRAINING = {**ROPE_BACKWARD, **SOFTMAX_BACKWARD}
# RMSNorm decoders: the residual add before each layer's second norm and the next layer's (or the final)
# norm, and the first layer's norm of the embeddings
NORMS = {"add_rms_norm": 2}
FIRST_NORM = {"rms_norm": 1}

FAMILIES = [
    Family("llama", _config("LlamaConfig"), "LlamaForCausalLM", {**ROPE, **NORMS},
           TRAINING, FIRST_NORM),
    Family("qwen2", _config("Qwen2Config"), "Qwen2ForCausalLM", {**ROPE, **NORMS},
           TRAINING, FIRST_NORM),
    Family("qwen3", _config("Qwen3Config", head_dim=16), "Qwen3ForCausalLM",
           {**ROPE, **NORMS, "rms_norm": 2}, TRAINING, FIRST_NORM),  # + q/k norms
    Family("mistral", _config("MistralConfig"), "MistralForCausalLM", {**ROPE, **NORMS},
           TRAINING, FIRST_NORM),
    Family("gemma", _config("GemmaConfig", head_dim=16), "GemmaForCausalLM", {**ROPE, **NORMS},
           TRAINING, FIRST_NORM),  # gamma = 1 + weight
    Family("phi3", _config("Phi3Config", pad_token_id=0), "Phi3ForCausalLM", {**ROPE, **NORMS},
           TRAINING, FIRST_NORM),
    Family("phi (partial half)", _config("PhiConfig", **_partial(0.5)), "PhiForCausalLM", ROPE,
           TRAINING),
    Family("stablelm (partial half)", _config("StableLmConfig", **_partial(0.25)), "StableLmForCausalLM", ROPE,
           TRAINING),
    Family("gpt-neox (partial half)", _gpt_neox, "GPTNeoXForCausalLM", ROPE, TRAINING),
    Family("gpt-j (partial interleave)", _gptj, "GPTJForCausalLM", {"inplace_partial_rotary_mul": 2},
           TRAINING),
    Family("cohere (interleave)", _config("CohereConfig"), "CohereForCausalLM", {**ROPE, "rms_norm": 1},
           TRAINING, FIRST_NORM),  # its LayerNorm: the RMSNorm of x - mean
    Family("falcon", _falcon, "FalconForCausalLM", ROPE, TRAINING),
    Family("deepseek-v3 (interleave)", _deepseek_v3, "DeepseekV3ForCausalLM",
           {"interleave_rope": 2, **NORMS, "rms_norm": 2},  # + the q and kv latents' norms
           {"interleave_rope_backward": 2, **SOFTMAX_BACKWARD}, FIRST_NORM),
    # chosen for their differences: MoE routers, QK-norm placement, rope scalings, M-RoPE, complex RoPE, MLA
    Family("qwen3-moe (MoE router, QK-norm per head)", _config("Qwen3MoeConfig", head_dim=16, num_experts=4,
                                                              num_experts_per_tok=2, moe_intermediate_size=32),
           "Qwen3MoeForCausalLM", {**ROPE, **NORMS, "rms_norm": 2}, TRAINING, FIRST_NORM, routers=1),
    Family("mixtral (MoE router)", _config("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
           "MixtralForCausalLM", {**ROPE, **NORMS}, TRAINING, FIRST_NORM, routers=1),
    Family("olmo2 (QK-norm on the whole projections)", _config("Olmo2Config"), "Olmo2ForCausalLM",
           {**ROPE, "rms_norm": 4}, TRAINING, {"add_rms_norm": 1}),  # post-norms: only the final norm follows an add,
    Family("gemma3 (QK-norm, sliding-window layers)", _config("Gemma3TextConfig", head_dim=16, sliding_window=4),
           "Gemma3ForCausalLM", {**ROPE, **NORMS, "rms_norm": 4}, TRAINING, FIRST_NORM),
    Family("granite (embedding/attention/residual multipliers)", _config("GraniteConfig"), "GraniteForCausalLM",
           {**ROPE, **NORMS}, TRAINING, FIRST_NORM),
    Family("glm4 (partial interleave, repeat_interleave tables)", _config("Glm4Config", head_dim=16, pad_token_id=0),
           "Glm4ForCausalLM",
           {"inplace_partial_rotary_mul": 2, **NORMS, "rms_norm": 2}, TRAINING, FIRST_NORM),
    # q's complex RoPE on its q_pe split is a partial RoPE of q (the in-place op, in the backward too: the
    # adjoint of a rotation by freqs_cis is the rotation by conj(freqs_cis)); k_pe's is rotary_mul
    Family("deepseek-v2 (complex RoPE on an MLA split)", _deepseek_v2, "DeepseekV2ForCausalLM",
           {"inplace_partial_rotary_mul": 1, "rotary_mul": 1, **NORMS, "rms_norm": 1},  # + the kv latent's norm
           {"inplace_partial_rotary_mul": 1, "rotary_mul": 1, **SOFTMAX_BACKWARD}, FIRST_NORM),
    Family("llama4 (complex RoPE, L2 QK-norm, chunked attention)", _llama4, "Llama4ForCausalLM",
           {**ROPE, **NORMS, "rms_norm": 2}, {"rotary_mul": 2, **SOFTMAX_BACKWARD}, FIRST_NORM),  # + the L2 QK-norms
    Family("phi3-longrope (LongRoPE scaled tables)", _phi3_longrope, "Phi3ForCausalLM", {**ROPE, **NORMS}, TRAINING,
           FIRST_NORM),
    Family("starcoder2 (biases, LayerNorm)", _config("Starcoder2Config"), "Starcoder2ForCausalLM", ROPE, TRAINING),
    Family("cohere2 (interleave, sliding-window layers)", _config("Cohere2Config", sliding_window=4),
           "Cohere2ForCausalLM", {**ROPE, "rms_norm": 1}, TRAINING, FIRST_NORM),
    Family("ernie4_5 (interleave, repeat_interleave tables)", _config("Ernie4_5Config", head_dim=16),
           "Ernie4_5ForCausalLM", {**ROPE, **NORMS}, TRAINING, FIRST_NORM),
    Family("minicpm3 (MLA-style q/k split RoPE)", _config("MiniCPM3Config", num_key_value_heads=HEADS, q_lora_rank=32,
                                                         kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                         v_head_dim=16),
           "MiniCPM3ForCausalLM", {**ROPE, **NORMS, "rms_norm": 2}, TRAINING, FIRST_NORM),
    Family("exaone4 (QK-norm, sliding window)", _config("Exaone4Config", sliding_window=4), "Exaone4ForCausalLM",
           {**ROPE, "rms_norm": 4}, TRAINING, {"add_rms_norm": 1}),  # post-norms, as OLMo2,
    Family("qwen2-vl (M-RoPE sections)", _qwen_vl("Qwen2VLConfig"), "Qwen2VLForConditionalGeneration",
           {**ROPE, **NORMS}, TRAINING, FIRST_NORM),
    Family("qwen2_5-vl (M-RoPE sections)", _qwen_vl("Qwen2_5_VLConfig"), "Qwen2_5_VLForConditionalGeneration",
           {**ROPE, **NORMS}, TRAINING, FIRST_NORM),
    # no RoPE: ALiBi; its scores are ``baddbmm(alibi, q, k, alpha=1/sqrt(d))``, whose backward scales both
    # matmuls of the softmax backward: the scale moves in front of them
    Family("bloom (ALiBi, baddbmm's alpha)", _bloom, "BloomForCausalLM", {}, SOFTMAX_BACKWARD),
]
BY_NAME = {f.name.split(" ")[0]: f for f in FAMILIES}


def example_inputs(batch: int = 2, seq: int = 8) -> dict:
    torch.manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (batch, seq))}


def _factory(family: Family) -> Callable:
    def make(layers: int = 1):
        return family.build(layers), example_inputs()

    make.__doc__ = f"{family.model_class} (tiny config) and its inputs, for ``npu-fuse explain``."
    return make


# model factories by family name (``npu-fuse explain npu_fuse_backend.model_zoo:llama``)
globals().update({name.replace("-", "_"): _factory(family) for name, family in BY_NAME.items()})
