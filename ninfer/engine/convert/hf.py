"""Hugging Face model folder -> .ninfer: config.json, *.safetensors (one file or sharded with
model.safetensors.index.json), tokenizer.json, tokenizer_config.json / chat_template.jinja and
generation_config.json."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ninfer.engine.artifact import ArtifactMetadata, SpecialTokens, write_artifact
from ninfer.engine.config import ModelConfig
from ninfer.engine.convert.common import (check_weights_mode, encode_weight, float_format, progress_bar,
                                          sha256_file, stop_token_ids)
from ninfer.engine.models import architecture, expected_weights
from ninfer.engine.quant import TensorFormat
from ninfer.errors import ArtifactError, NInferError

# Keys some checkpoints carry that the model recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal checkpoints (Qwen3_5ForConditionalGeneration, what Qwen3.5 ships) nest the language
# model under `model.language_model.`; its tensors take our `model.` names. The vision tower
# (`model.visual.*`) is not part of text generation here and is skipped; the multi-token-prediction
# head (`mtp.*`, speculative drafts for --spec mtp) is kept for architectures that have one.
# Gemma3ForConditionalGeneration has the same nesting (`language_model.model.` in checkpoints saved
# before transformers 5), its vision tower under `vision_tower.` and `multi_modal_projector.`.
_PREFIX_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_SKIPPED_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                     "multi_modal_projector.")
_MTP_PREFIX = "mtp."
_SAMPLER_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _read_json(path: Path, src: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{src}: cannot read {path.name} ({e})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{src}: {path.name} is not a JSON object")
    return data


def _optional_json(path: Path, src: Path) -> dict[str, Any]:
    return _read_json(path, src) if path.is_file() else {}


def weight_files(src: Path) -> list[Path]:
    """The safetensors files holding the weights (from the shard index when there is one)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, src).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ArtifactError(f"{src}: model.safetensors.index.json has no weight_map")
        files = [src / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ArtifactError(f"{src}: shard {absent[0]} named in model.safetensors.index.json is missing")
        return files
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{src}: no *.safetensors weights (convert .bin checkpoints to safetensors first)")
    return files


def text_model_name(key: str, keep_mtp: bool = False) -> str | None:
    """Our name for a checkpoint tensor, None for one text generation does not use (an MTP head's
    tensors unless keep_mtp)."""
    if key.startswith(_SKIPPED_PREFIXES) or key.endswith(_SKIPPED_SUFFIXES):
        return None
    if key.startswith(_MTP_PREFIX) and not keep_mtp:
        return None
    for prefix, ours in _PREFIX_RENAMES:
        if key.startswith(prefix):
            return ours + key[len(prefix):]
    return key


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(src: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja = src / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if template is None and (src / "chat_template.json").is_file():
        template = _read_json(src / "chat_template.json", src).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int)]


def _special_tokens(src: Path, tokenizer_json: str, tok_cfg: dict[str, Any], gen_cfg: dict[str, Any],
                    hf_cfg: dict[str, Any]) -> SpecialTokens:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ArtifactError(f"{src}: tokenizer.json cannot be loaded ({e})") from None
    bos_text, eos_text = _token_text(tok_cfg.get("bos_token")), _token_text(tok_cfg.get("eos_token"))
    bos = tok.token_to_id(bos_text) if bos_text else None
    eos = tok.token_to_id(eos_text) if eos_text else None
    if bos is None:
        bos = _first_id(gen_cfg.get("bos_token_id", hf_cfg.get("bos_token_id")))
    if eos is None:
        eos = _first_id(gen_cfg.get("eos_token_id", hf_cfg.get("eos_token_id")))
    pad_text = _token_text(tok_cfg.get("pad_token"))
    pad = tok.token_to_id(pad_text) if pad_text else _first_id(gen_cfg.get("pad_token_id", hf_cfg.get("pad_token_id")))
    add_bos = tok_cfg.get("add_bos_token")
    if add_bos is None:  # Llama 3 style: the post-processor template starts with BOS
        post = json.loads(tokenizer_json).get("post_processor") or {}
        single = post.get("single") if post.get("type") == "TemplateProcessing" else None
        add_bos = bool(single) and "SpecialToken" in single[0]
    added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    stops = stop_token_ids(added, [eos, *_ids(gen_cfg.get("eos_token_id")), *_ids(hf_cfg.get("eos_token_id"))])
    return SpecialTokens(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, stop_token_ids=stops, add_bos_token=bool(add_bos),
        bos_token=tok.id_to_token(bos) if bos is not None else None,
        eos_token=tok.id_to_token(eos) if eos is not None else None,
    )


def _sampler_presets(gen_cfg: dict[str, Any]) -> dict[str, dict[str, float]]:
    if not gen_cfg.get("do_sample"):
        return {}
    preset = {k: float(gen_cfg[k]) for k in _SAMPLER_KEYS if isinstance(gen_cfg.get(k), (int, float))}
    return {"default": preset} if preset else {}


def convert_hf(src: str | Path, out: str | Path, weights: str = "keep", progress: bool = True) -> Path:
    """Convert a Hugging Face folder (any architecture of models/, multimodal ones as their language model) to a .ninfer artifact
    at `out`; raises ArtifactError."""
    from safetensors import SafetensorError, safe_open

    src, out = Path(src), Path(out)
    check_weights_mode(weights)
    if not (src / "config.json").is_file():
        raise ArtifactError(f"{src}: not a Hugging Face model folder (no config.json)")
    hf_cfg = _read_json(src / "config.json", src)
    try:
        config = ModelConfig.from_hf(hf_cfg)
    except NInferError as e:
        raise ArtifactError(f"{src}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{src}: config.json lacks or mistypes {e}") from None
    if not (src / "tokenizer.json").is_file():
        raise ArtifactError(f"{src}: no tokenizer.json")
    tokenizer_json = (src / "tokenizer.json").read_text(encoding="utf-8")
    tok_cfg = _optional_json(src / "tokenizer_config.json", src)
    gen_cfg = _optional_json(src / "generation_config.json", src)

    files = weight_files(src)
    keys: list[tuple[Path, str]] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys.extend((path, k) for k in f.keys())
        except (SafetensorError, OSError) as e:
            raise ArtifactError(f"{path}: not a readable safetensors file ({e})") from None
    expected = expected_weights(config)
    if architecture(config).mtp_head is not None:  # a whole MTP head is kept (--spec mtp); a partial one skipped
        with_mtp = dataclasses.replace(config, mtp_layers=1)
        head = {n for n in expected_weights(with_mtp) if n.startswith(_MTP_PREFIX)}
        if head <= {k for _, k in keys}:
            config, expected = with_mtp, expected_weights(with_mtp)
    keep_mtp = config.mtp_layers > 0

    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, TensorFormat] = {}
    handles: dict[Path, Any] = {}
    try:
        for path, key in progress_bar(keys, len(keys), f"converting {src.name}", progress):
            name = text_model_name(key, keep_mtp)
            if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            if name not in expected:
                raise ArtifactError(f"{path}: unexpected tensor {key} for architecture {config.architecture}")
            if name in formats:
                raise ArtifactError(f"{path}: tensor {key} duplicates {name}")
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            t = handles[path].get_tensor(key)
            if tuple(t.shape) != expected[name]:
                raise ArtifactError(f"{path}: tensor {key} has shape {list(t.shape)}, expected {list(expected[name])}")
            fmt, parts = encode_weight(name, float_format(t.dtype), {"": t}, tuple(t.shape), weights, config)
            formats[name] = fmt
            tensors.update({name + s: p for s, p in parts.items()})
    finally:
        handles.clear()
    missing = [n for n in expected if n not in formats]
    if missing:
        raise ArtifactError(f"{src}: missing tensor {missing[0]}")

    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(sha256_file(path).encode())
    meta = ArtifactMetadata(
        name=src.resolve().name,
        model_id=src.resolve().name,
        config=config,
        tensor_formats=formats,
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(src, tok_cfg),
        special_tokens=_special_tokens(src, tokenizer_json, tok_cfg, gen_cfg, hf_cfg),
        source={"kind": "hf", "sha256": digest.hexdigest(), "path": str(src.resolve()), "weights": weights},
        sampler_presets=_sampler_presets(gen_cfg),
    )
    return write_artifact(out, tensors, meta)
