"""Qwen3.5 (qwen3_5) from users' files, checked on CPU in float32 against transformers'
Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration on the tiny fixtures (conftest.tiny_qwen3_5_dirs):
Hugging Face folders (text and multimodal) and llama.cpp-style qwen35 GGUF files through the real
converters; chunked prefill and mixed batches against one-shot prefill; the synthetic shapes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_synth import reorder_v_heads, write_qwen35_gguf
from torch_model_helpers import GREEDY, hf_greedy, hf_logits, hf_with_weights

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.config import ModelConfig
from ninfer.engine.convert import convert
from ninfer.engine.models import expected_weights
from ninfer.engine.request import SamplingParams

transformers = pytest.importorskip("transformers")

# f32 on the same weights: measured max |Δlogit| ~4e-7 (logits up to ~1.4).
F32_LOGIT_TOL = 1e-4
GREEDY_STEPS = 32
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183],
           [17, 923, 40211, 5, 5, 5, 880, 12, 31999, 7, 64, 1024, 2048, 4096, 77, 301, 19, 2, 48000, 3, 9, 10]]


def long_prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner_for(artifact: Artifact, slots: int = 4, num_pages: int = 48) -> TorchModelRunner:
    return TorchModelRunner(artifact, num_pages=num_pages, page_size=16, dtype=torch.float32, num_state_slots=slots)


def work(seq_id: int, tokens: list[int], start: int, pages: list[int], slot: int, sample: bool = False,
         generated: list[int] | None = None) -> SequenceWork:
    return SequenceWork(seq_id=seq_id, token_ids=tokens, start_pos=start, block_table=pages, sample=sample,
                        sampling=GREEDY if sample else SamplingParams(), output_token_ids=list(generated or []),
                        state_slot=slot)


def greedy_lanes(runner: TorchModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy decode of the prompts as lanes of one batch, each in its own state slot (the last slots,
    so slot != lane) on interleaved pages: one step prefills all, then one token per lane a step."""
    n = len(prompts)
    pages_each = -(-(max(map(len, prompts)) + steps) // runner.page_size)
    tables = [[i + n * j for j in range(pages_each)][::-1] for i in range(n)]
    slots = [runner.num_state_slots - 1 - i for i in range(n)]
    outs: list[list[int]] = [[] for _ in prompts]
    pending, starts = [list(p) for p in prompts], [0] * n
    for _ in range(steps):
        seqs = [work(i, pending[i], starts[i], tables[i], slots[i], True, outs[i]) for i in range(n)]
        sampled = runner.run(ScheduledBatch(seqs)).sampled
        for i in range(n):
            outs[i].append(sampled[i])
            starts[i] += len(pending[i])
            pending[i] = [sampled[i]]
    return outs


@pytest.fixture(scope="module")
def q35(tiny_qwen3_5_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """get(kind, weights) -> the fixture folder converted (cached); hf(kind) -> transformers' model."""
    root = tmp_path_factory.mktemp("qwen3_5_ninfer")
    arts: dict[tuple[str, str], Artifact] = {}
    models: dict[str, object] = {}

    def get(kind: str, weights: str = "keep") -> Artifact:
        if (kind, weights) not in arts:
            out = convert(tiny_qwen3_5_dirs[kind], root / f"{kind}-{weights}.ninfer", weights=weights, progress=False)
            arts[kind, weights] = Artifact.open(out)
        return arts[kind, weights]

    def hf(kind: str):
        if kind not in models:
            cls = {"causal": transformers.Qwen3_5ForCausalLM,
                   "multimodal": transformers.Qwen3_5ForConditionalGeneration}[kind]
            models[kind] = cls.from_pretrained(str(tiny_qwen3_5_dirs[kind]), dtype=torch.float32).eval()
        return models[kind]

    return get, hf


def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ---- Hugging Face folders ---------------------------------------------------------------------------

def test_hf_causal_logits_and_greedy_match_transformers(q35, tiny_qwen3_5_dirs) -> None:
    get, hf = q35
    art, model = get("causal"), hf("causal")
    assert set(art.meta.tensor_formats) == set(_hf_state(tiny_qwen3_5_dirs["causal"]))
    assert {f.format for f in art.meta.tensor_formats.values()} == {"f32"}
    cfg = art.meta.config
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (cfg.partial_rotary_factor, cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (0.25, 2, 4)
    runner = runner_for(art)
    for ids in PROMPTS:
        assert (runner.forward_logits(ids) - hf_logits(model, ids)).abs().max().item() < F32_LOGIT_TOL
    ours = greedy_lanes(runner, PROMPTS, GREEDY_STEPS)
    assert ours == [hf_greedy(model, ids, GREEDY_STEPS) for ids in PROMPTS]


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_hf_weight_modes_keep_small_tensors_f32(weights: str, q35, tiny_qwen3_5_dirs) -> None:
    """Norms, conv taps, A_log and dt_bias stay float32 whatever the mode; the linear weights take it.
    Logits match transformers on the artifact's own (rounded) weights."""
    get, _ = q35
    art = get("causal", weights)
    fmt = art.meta.tensor_formats
    for sfx in ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight",
                "input_layernorm.weight"):
        assert fmt[f"model.layers.0.{sfx}"].format == "f32", sfx
    assert fmt["model.layers.3.self_attn.q_norm.weight"].format == "f32"
    for sfx in ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_b.weight", "linear_attn.out_proj.weight"):
        assert fmt[f"model.layers.0.{sfx}"].format == weights, sfx
    state = _hf_state(tiny_qwen3_5_dirs["causal"])
    dq = art.load_dequantized()
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert torch.equal(dq[conv], state[conv])
    model = hf_with_weights(tiny_qwen3_5_dirs["causal"], dq)
    runner = runner_for(art)
    ids = PROMPTS[1]
    assert (runner.forward_logits(ids) - hf_logits(model, ids)).abs().max().item() < F32_LOGIT_TOL


def test_hf_multimodal_checkpoint(q35, tiny_qwen3_5_dirs) -> None:
    """Qwen3_5ForConditionalGeneration as shipped: text_config unwrapped, model.language_model.* renamed,
    the vision tower and mtp.* left out, tied embeddings; logits equal the multimodal model's on text."""
    get, hf = q35
    art = get("multimodal")
    cfg = art.meta.config
    assert cfg.architecture == "qwen3_5" and cfg.tie_word_embeddings and cfg.num_hidden_layers == 8
    assert set(art.meta.tensor_formats) == set(expected_weights(cfg))
    state = _hf_state(tiny_qwen3_5_dirs["multimodal"])
    assert any(k.startswith("mtp.") for k in state) and any(k.startswith("model.visual.") for k in state)
    parts = art.load_parts()
    name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(parts[name][""], state["model.language_model.layers.3.self_attn.q_proj.weight"])
    assert art.meta.special_tokens.eos_token == "<|im_end|>"
    runner = runner_for(art)
    model = hf("multimodal")
    for ids in PROMPTS:
        assert (runner.forward_logits(ids) - hf_logits(model, ids)).abs().max().item() < F32_LOGIT_TOL


def test_from_hf_derives_layer_types_from_interval(tiny_qwen3_5_dirs) -> None:
    raw = json.loads((tiny_qwen3_5_dirs["causal"] / "config.json").read_text())
    listed = ModelConfig.from_hf(raw)
    raw.pop("layer_types")
    assert ModelConfig.from_hf(raw).layer_types == listed.layer_types  # transformers' default interval 4
    raw["full_attention_interval"] = 2
    assert ModelConfig.from_hf(raw).layer_types == ["linear_attention", "full_attention"] * 4


# ---- llama.cpp GGUF (qwen35) -------------------------------------------------------------------------

def _write_gguf(folder: Path, path: Path, linear_type: Q) -> dict[str, tuple[str, np.ndarray]]:
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    embed = Q.F32 if linear_type == Q.F32 else Q.Q8_0
    return write_qwen35_gguf(path, load_file(str(folder / "model.safetensors")), cfg, tokenizer, linear_type, embed)


def test_gguf_f32_matches_transformers(q35, tiny_qwen3_5_dirs, tmp_path: Path) -> None:
    """A qwen35 GGUF as llama.cpp's converter writes it (value heads tiled, 1 + w norms, A = -exp(A_log),
    squeezed conv taps) comes back as the Hugging Face weights and config, and the same logits."""
    get, hf = q35
    folder = tiny_qwen3_5_dirs["causal"]
    held = _write_gguf(folder, tmp_path / "tiny-qwen3.5-F32.gguf", Q.F32)
    assert held["blk.0.ssm_a"][1].max() < 0 and held["blk.0.ssm_conv1d.weight"][1].ndim == 2
    art = Artifact.open(convert(tmp_path / "tiny-qwen3.5-F32.gguf", tmp_path / "g.ninfer", progress=False))
    ref_cfg = get("causal").meta.config.to_dict()
    cfg = art.meta.config.to_dict()
    assert cfg.pop("rms_norm_eps") == pytest.approx(ref_cfg.pop("rms_norm_eps"))  # stored as float32
    assert cfg == ref_cfg
    state = _hf_state(folder)
    weights = art.load_dequantized()
    assert set(weights) == set(state)
    for name, want in state.items():
        got = weights[name]
        if name.endswith(("A_log", "norm.weight")) and not name.endswith("linear_attn.norm.weight"):
            assert torch.allclose(got, want, rtol=0, atol=1e-6), name  # (1 + w) - 1, log(exp(x)) round
        else:
            assert torch.equal(got, want), name  # moved, not recomputed
    runner = runner_for(art)
    for ids in PROMPTS:
        assert (runner.forward_logits(ids) - hf_logits(hf("causal"), ids)).abs().max().item() < F32_LOGIT_TOL


def _untile(gname: str, values: np.ndarray, c: ModelConfig) -> np.ndarray:
    """The test's own inverse of the value-head reorder, for the 2-D weights llama.cpp reorders."""
    nk, r, dv = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, c.linear_value_head_dim
    qk = 2 * nk * c.linear_key_head_dim
    if gname.endswith("attn_qkv.weight"):
        return np.concatenate([values[:qk], reorder_v_heads(values[qk:], 0, r, nk, dv)])
    if gname.endswith("attn_gate.weight"):
        return reorder_v_heads(values, 0, r, nk, dv)
    if gname.endswith(("ssm_beta.weight", "ssm_alpha.weight")):
        return reorder_v_heads(values, 0, r, nk, 1)
    if gname.endswith("ssm_out.weight"):
        return reorder_v_heads(values, 1, r, nk, dv)
    return values


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_gguf_quantized_keep_is_bit_exact(qtype: Q, tiny_qwen3_5_dirs, tmp_path: Path) -> None:
    """Reordered quantized weights move whole 32-blocks back: kept in their format, bit-exact."""
    folder = tiny_qwen3_5_dirs["causal"]
    path = tmp_path / f"tiny-qwen3.5-{qtype.name}.gguf"
    held = _write_gguf(folder, path, qtype)
    art = Artifact.open(convert(path, tmp_path / "q.ninfer", progress=False))
    c = art.meta.config
    fmt = art.meta.tensor_formats
    want_fmt = {"format": "int8", "group_size": 32, "symmetric": True} if qtype == Q.Q8_0 else \
        {"format": "int4", "group_size": 32, "symmetric": True}
    for sfx in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        assert fmt[f"model.layers.4.linear_attn.{sfx}.weight"].to_dict() == want_fmt, sfx
    weights = art.load_dequantized()
    state = _hf_state(folder)
    for gname, (name, values) in held.items():
        if values.ndim == 2 and "conv1d" not in gname:
            assert torch.equal(weights[name], torch.from_numpy(_untile(gname, values, c))), gname
            ref = state[name]
            rel = ((weights[name] - ref).norm() / ref.norm()).item()
            assert rel < (0.01 if qtype == Q.Q8_0 else 0.2), (name, rel)  # quantization error only


# ---- one forward, any split: chunked prefill and mixed batches ---------------------------------------

def test_chunked_prefill_equals_one_shot(q35) -> None:
    """150 tokens as 64 + 64 + 22 carrying state (K/V pages and the recurrent slot) == one shot."""
    get, _ = q35
    runner = runner_for(get("causal"))
    ids = long_prompt(150)
    ref = runner.forward_logits(ids)
    pages, rows, start = [9, 3, 7, 1, 5, 0, 8, 2, 6, 4], [], 0
    for n in (64, 64, 22):
        batch = ScheduledBatch([work(0, ids[start:start + n], start, pages, slot=2)])
        rows.append(runner.batch_logits(batch, all_rows=True))
        start += n
    assert (torch.cat(rows) - ref).abs().max().item() < F32_LOGIT_TOL


def test_batch_of_different_lengths_equals_each_alone(q35) -> None:
    """Three sequences (7, 33, 90 tokens) prefilled in one step, then continued in one step by 1, 16
    and 5 tokens, each in its own slot and pages: every row equals the sequence computed alone."""
    get, _ = q35
    runner = runner_for(get("causal"))
    full = [long_prompt(n, seed=s) for n, s in ((8, 1), (49, 2), (95, 3))]
    first = (7, 33, 90)
    pages = [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]]
    slots = [3, 0, 2]
    refs = [runner.forward_logits(ids) for ids in full]
    out = runner.batch_logits(ScheduledBatch([work(i, full[i][:first[i]], 0, pages[i], slots[i]) for i in range(3)]),
                              all_rows=True)
    for ref, rows in zip(refs, out.split(list(first))):
        assert (rows - ref[:len(rows)]).abs().max().item() < F32_LOGIT_TOL
    out = runner.batch_logits(ScheduledBatch([work(i, full[i][first[i]:], first[i], pages[i], slots[i])
                                              for i in range(3)]), all_rows=True)
    for ref, n0, rows in zip(refs, first, out.split([len(f) - n for f, n in zip(full, first)])):
        assert (rows - ref[n0:]).abs().max().item() < F32_LOGIT_TOL


def test_state_copy_resumes_a_checkpoint(q35) -> None:
    """A prefix's state copied to another slot (ScheduledBatch.state_copies) continues like the whole."""
    get, _ = q35
    runner = runner_for(get("causal"))
    ids = long_prompt(60, seed=4)
    ref = runner.forward_logits(ids)
    runner.batch_logits(ScheduledBatch([work(0, ids[:40], 0, [4, 5, 6], slot=1)]))
    # the copy reads the prefix's pages; its own tokens 40.. go to the rest of page 6 and page 7
    batch = ScheduledBatch([work(1, ids[40:], 40, [4, 5, 6, 7], slot=3)], state_copies=[(1, 3)])
    assert (runner.batch_logits(batch, all_rows=True) - ref[40:]).abs().max().item() < F32_LOGIT_TOL


# ---- synthetic shapes --------------------------------------------------------------------------------

def test_synthetic_qwen3_5_shapes() -> None:
    from ninfer.engine.synthetic import SHAPES

    sizes = {}
    for name in ("qwen3.5-0.8b", "qwen3.5-9b"):
        c = ModelConfig(**SHAPES[name])
        assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (c.num_hidden_layers // 4)
        sizes[name] = sum(math.prod(s) for s in expected_weights(c).values())
    # text-model parameters: the 0.8B's language model (its vision tower is the rest), the 9B
    assert 0.7e9 < sizes["qwen3.5-0.8b"] < 0.8e9 and 8.5e9 < sizes["qwen3.5-9b"] < 9.5e9


def test_synthetic_qwen3_5_weights_as_transformers_inits_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Norms around 0 (1 + w), the gated norm and dt_bias 1, A_log = log(U(0.01, 16)): finite logits."""
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact

    tiny = dict(SHAPES["qwen3.5-0.8b"], vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                layer_types=["linear_attention"] * 3 + ["full_attention"])
    monkeypatch.setitem(SHAPES, "tiny-qwen3.5", tiny)
    art = SyntheticArtifact("tiny-qwen3.5", "f32", seed=1)
    w = art.load_dequantized()
    assert not w["model.norm.weight"].any() and not w["model.layers.3.self_attn.q_norm.weight"].any()
    assert (w["model.layers.0.linear_attn.norm.weight"] == 1).all()
    assert (w["model.layers.0.linear_attn.dt_bias"] == 1).all()
    a_log = w["model.layers.1.linear_attn.A_log"]
    assert (a_log >= math.log(0.01)).all() and (a_log <= math.log(16)).all() and a_log.unique().numel() == 4
    logits = runner_for(art).forward_logits(list(range(40)))
    assert torch.isfinite(logits).all() and logits.std() > 0


# ---- the engine: checkpoints --------------------------------------------------------------------------

def test_engine_resumes_a_hybrid_conversation_only_at_its_checkpoint(q35) -> None:
    """Through the real Engine and scheduler: the next turn of a retained conversation resumes exactly
    at its executed frontier (state copied from the checkpoint, K/V pages shared) and samples what a
    run without reuse samples; a prompt that leaves the conversation inside it reuses nothing."""
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.engine import Engine
    from ninfer.engine.request import PreparedRequest
    from ninfer.engine.tokenizer import Tokenizer

    artifact = q35[0]("causal")
    runner = TorchModelRunner(artifact, num_pages=64, page_size=16, dtype=torch.float32, num_state_slots=3)
    engine = Engine(runner, Tokenizer.from_metadata(artifact.meta), SchedulerConfig(max_concurrency=1),
                    model_max_context=1024)
    engine.start()

    def run(rid: str, prompt: list[int], **kw: object) -> tuple[list[int], object]:
        ids, final = [], None
        sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
        for ev in engine.submit(PreparedRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                                max_tokens=6, ignore_eos=True, **kw)):
            ids += ev.token_ids
            logprobs.setdefault(rid, []).extend(lp.logprob for lp in ev.logprobs)
            final = ev
        return ids, final

    logprobs: dict[str, list[float]] = {}

    try:
        first = long_prompt(75, seed=3)
        ids, final = run("t1", first)
        assert final.usage.cached_tokens == 0
        frontier = len(first) + len(ids) - 1  # the last sampled token is not in the state yet
        turn2 = first + ids + long_prompt(20, seed=4)
        ids2, final2 = run("t2", turn2)
        assert final2.usage.cached_tokens == final2.timings.cache_n == frontier
        fresh, final3 = run("t3", turn2, cache_prompt=False)
        assert final3.usage.cached_tokens == 0 and fresh == ids2
        # the same distributions too, not just the same argmax (fp32: only summation order differs)
        assert len(logprobs["t2"]) == 6 and np.allclose(logprobs["t2"], logprobs["t3"], atol=1e-5), logprobs
        branch = first[:50] + long_prompt(30, seed=5)  # leaves the retained conversation at token 50
        _, final4 = run("t4", branch)
        assert final4.usage.cached_tokens == 0
        snap = engine.snapshot()
        assert snap.state_slots_total == 3
    finally:
        engine.shutdown()


def _complete(engine, rid: str, prompt: list[int], **kw: object) -> tuple[list[int], list[float], object]:
    """Greedy, 6 tokens, with logprobs: (token ids, their logprobs, the final event)."""
    from ninfer.engine.request import PreparedRequest

    ids, lps, final = [], [], None
    sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    for ev in engine.submit(PreparedRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                            max_tokens=6, ignore_eos=True, **kw)):
        ids += ev.token_ids
        lps += [lp.logprob for lp in ev.logprobs]
        final = ev
    return ids, lps, final


def test_engine_resumes_a_hybrid_prompt_at_a_page_checkpoint(q35, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real Engine: turn 1's 75-token prompt captures a page checkpoint at 64 (pages of 16); a prompt
    with its first 70 tokens and another tail resumes exactly there (64 cached: pages shared, the checkpoint's
    state copied) and samples what a run without reuse samples. With the capture copy skipped it does not."""
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.engine import Engine
    from ninfer.engine.loader import resolve_state_slots
    from ninfer.engine.scheduler import Scheduler
    from ninfer.engine.tokenizer import Tokenizer

    artifact = q35[0]("causal")
    config = SchedulerConfig(max_concurrency=1)
    slots = resolve_state_slots(artifact.meta.config, config)
    assert slots == 2 * 1 + 2 * 2  # a working and a capture slot per lane, two checkpoints per entry
    first = long_prompt(75, seed=3)
    branch = first[:70] + long_prompt(12, seed=6)

    def serve(skip_captures: bool) -> tuple[list[int], list[float], list[int], list[float]]:
        if skip_captures:
            monkeypatch.setattr(Scheduler, "_with_captures",
                                lambda self, batch: (self._captures.clear(), batch)[1])
        runner = TorchModelRunner(artifact, num_pages=64, page_size=16, dtype=torch.float32, num_state_slots=slots)
        engine = Engine(runner, Tokenizer.from_metadata(artifact.meta), config, model_max_context=1024)
        engine.start()
        try:
            _, _, final = _complete(engine, "t1", first)
            assert final.usage.cached_tokens == 0
            (entry,) = engine.snapshot().continuations
            assert entry.n_tokens == 80 and [n for n, _ in entry.page_checkpoints] == [64]
            ids, lps, final = _complete(engine, "t2", branch)
            assert final.usage.cached_tokens == final.timings.cache_n == 64
            fresh, fresh_lps, final = _complete(engine, "t3", branch, cache_prompt=False)
            assert final.usage.cached_tokens == 0 and len(lps) == len(fresh_lps) == 6
            return ids, lps, fresh, fresh_lps
        finally:
            engine.shutdown()
            monkeypatch.undo()

    ids, lps, fresh, fresh_lps = serve(skip_captures=False)
    assert ids == fresh and np.allclose(lps, fresh_lps, atol=1e-5), (lps, fresh_lps)
    _, stale_lps, _, fresh_lps = serve(skip_captures=True)  # the checkpoint slot never got the state
    assert not np.allclose(stale_lps, fresh_lps, atol=1e-5)
