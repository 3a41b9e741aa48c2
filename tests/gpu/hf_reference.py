"""Hugging Face transformers as the independent reference for the GPU tests: a model built from our
ModelConfig with our (dequantized, HF-named) tensors, and an fp32 decode through its own KV cache."""
from __future__ import annotations

import inspect
import itertools

import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.ops.torch_ops import rope_inv_freq

# our architecture -> (transformers config class, model class); llama with a window is Mistral
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def hf_classes(config: ModelConfig) -> tuple[str, str]:
    return HF_CLASSES["mistral" if config.architecture == "llama" and config.sliding_window else config.architecture]


def hf_config(config: ModelConfig):
    """The transformers config of our ModelConfig. rope_theta / rope_scaling are the keywords both
    transformers 4.x and 5.x take (5.x folds them into rope_parameters); hf_model checks the result."""
    import transformers

    config_cls, _ = hf_classes(config)
    c = config
    if c.architecture == "gemma3":
        return transformers.Gemma3TextConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
            rope_parameters={"full_attention": {"rope_theta": c.rope_theta, **(c.rope_scaling or {"rope_type": "default"})},
                             "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
            sliding_window=c.sliding_window, layer_types=list(c.layer_types),
            query_pre_attn_scalar=int(c.query_pre_attn_scalar), final_logit_softcapping=c.final_logit_softcapping or None,
            attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=True)
    extra = {}
    if config_cls == "MistralConfig":
        extra["sliding_window"] = c.sliding_window
    if config_cls == "Qwen2Config" and c.sliding_window:
        first = c.layer_types.index("sliding_attention")
        extra.update(use_sliding_window=True, sliding_window=c.sliding_window, max_window_layers=first)
    return getattr(transformers, config_cls)(**extra,
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act="silu",
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias, attention_dropout=0.0, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, use_cache=True,
    )


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device):
    """A transformers model over `weights` (HF names -> logical tensors, already in the dtype and on
    the device wanted; they are used in place, not copied). Built on the meta device so an 8B fp32
    model costs its weights once. Raises if a tensor is missing or extra, or if transformers' RoPE
    frequencies differ from ours (a config keyword this transformers version read differently)."""
    import transformers

    cfg = hf_config(config)
    cfg._attn_implementation = "eager"  # plain matmul + fp32 softmax: the most literal reference
    _, model_cls = hf_classes(config)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg)
    weights = dict(weights)
    if config.tie_word_embeddings:  # the same tensor under both names: tied, and strict loading holds
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True, assign=True)
    # inv_freq is a non-persistent buffer, still on meta: rebuild the rotary module on the device
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)
    if hasattr(model.model, "embed_tokens") and hasattr(model.model.embed_tokens, "embed_scale"):
        model.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5, device=device)  # gemma3
    model.eval()
    meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    assert not meta, f"left on the meta device: {meta[:5]}"
    rotary = model.model.rotary_emb
    inv_freq = getattr(rotary, "full_attention_inv_freq", getattr(rotary, "inv_freq", None)).detach().float().cpu()
    assert torch.allclose(inv_freq, rope_inv_freq(config), rtol=1e-6, atol=0), "transformers' RoPE differs from ours"
    return model


@torch.inference_mode()
def hf_greedy_logits(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt in one forward, then `steps` decode steps through the model's KV cache, each fed
    the argmax of the previous row. -> (logits [len(prompt) + steps, vocab] fp32: the prompt's rows,
    then one row per fed token; the `steps` tokens fed). tokens[s] is the argmax of row
    len(prompt) - 1 + s."""
    device = model.model.embed_tokens.weight.device
    # the KV cache is `past_key_values` (in and out) in 4.x and early 5.x, `cache` in later 5.x
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    rows = [out.logits[0].float()]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                    **{cache_kw: getattr(out, cache_kw)})
        rows.append(out.logits[0].float())
    return torch.cat(rows), tokens
