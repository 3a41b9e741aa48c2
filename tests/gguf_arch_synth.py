"""GGUF files of tiny Hugging Face llama / mistral / qwen2 / gemma3 models, written the way llama.cpp's
convert_hf_to_gguf.py writes them: gguf-py's tensor map for the architecture, llama's q/k rows
permuted (LlamaModel, which MistralForCausalLM also goes through), gemma3's `1 + w` norms, and the
keys each converter sets (sliding window, rope scaling, soft-capping)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_synth import add_byte_level_vocab, add_model_keys, llama_permute, write_tensors

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "gemma3": gguf.MODEL_ARCH.GEMMA3}


def arch_tensors(arch: str, state: dict[str, np.ndarray], cfg: dict) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (Hugging Face name, values), as the converter changes them."""
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg["num_hidden_layers"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, t in state.items():
        hf_name = name.replace("model.language_model.", "model.")
        t = t.astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            t = llama_permute(t, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            t = llama_permute(t, kv_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + 1
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        out[gname] = (hf_name, t)
    return out


def write_arch_gguf(path: Path, arch: str, state: dict[str, np.ndarray], cfg: dict, tokenizer_json: dict,
                    linear_type: Q = Q.F32, keys: dict[str, Any] | None = None) -> dict[str, tuple[str, np.ndarray]]:
    """A GGUF of architecture `arch` from a Hugging Face config dict and its tensors, with a byte-level
    vocabulary from `tokenizer_json`; `keys`: extra `{arch}.KEY` values (sliding_window, rope scaling).
    -> GGUF name -> (Hugging Face name, the values the file holds)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    add_model_keys(w, cfg)
    for k, v in (keys or {}).items():
        if isinstance(v, str):
            w.add_string(f"{arch}.{k}", v)
        elif isinstance(v, int):
            w.add_uint32(f"{arch}.{k}", v)
        else:
            w.add_float32(f"{arch}.{k}", float(v))
    add_byte_level_vocab(w, tokenizer_json, cfg["vocab_size"], "smollm", 1, 2)
    return write_tensors(w, arch_tensors(arch, state, cfg), lambda _, v: Q.F32 if v.ndim == 1 else linear_type)
