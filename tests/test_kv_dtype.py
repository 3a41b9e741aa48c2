"""--kv-dtype on the torch backend: int8 quantization per token and head, paged attention over an
int8 (and bf16) cache against the float32 reference on fresh random data, a model run close to the
float32 cache, the pool's bytes per token, and the scales travelling with the pages to the tiers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner, kv_bytes_per_token
from ninfer.engine.ops.torch_ops import AttentionMetadata, int8_quantize, paged_attention
from ninfer.errors import ConfigError
from tests.test_torch_runner import DECODE, PROMPT_A, chunked_logits


def test_int8_quantize_error_is_within_half_a_step() -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    q, scale = int8_quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (50, 3)
    err = (q.float() * scale.float()[..., None] - x).abs()
    assert (err <= scale.float()[..., None] * 0.5 + 1e-12).all()
    assert q.abs().max() == 127


@pytest.mark.parametrize("storage", ["int8", "bf16"])
def test_paged_attention_over_a_compressed_cache_matches_float32(storage: str) -> None:
    torch.manual_seed(0)
    pages, ps, kvh, heads, d = 6, 4, 2, 4, 32
    q, k, v = torch.randn(10, heads, d), torch.randn(10, kvh, d), torch.randn(10, kvh, d)
    meta, _ = AttentionMetadata.build([(0, 10, [5, 1, 3])], ps, torch.device("cpu"))
    ref = paged_attention(q, k, v, torch.zeros(pages, ps, kvh, d), torch.zeros(pages, ps, kvh, d), meta)
    store = torch.int8 if storage == "int8" else torch.bfloat16
    kc, vc = torch.zeros(pages, ps, kvh, d, dtype=store), torch.zeros(pages, ps, kvh, d, dtype=store)
    scales = (torch.zeros(pages, ps, kvh, dtype=torch.float16), torch.zeros(pages, ps, kvh, dtype=torch.float16)) \
        if storage == "int8" else (None, None)
    out = paged_attention(q, k, v, kc, vc, meta, k_scale=scales[0], v_scale=scales[1])
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 2e-2, rel
    if storage == "int8":  # the cache holds int8 values and their scales
        assert kc.abs().max() == 127 and scales[0][5].min() > 0


@pytest.fixture(scope="module")
def llama(tiny_hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    from ninfer.engine.convert import convert

    root = tmp_path_factory.mktemp("kv_dtype")
    return Artifact.open(convert(tiny_hf_dirs["llama"], root / "llama.ninfer", weights="keep", progress=False))


def test_int8_cache_stays_close_to_the_float32_cache(llama: Artifact) -> None:
    tokens = PROMPT_A + DECODE
    pages = [3, 0, 7, 5]
    ref = chunked_logits(TorchModelRunner(llama, num_pages=8, page_size=4, dtype=torch.float32), 0, tokens,
                         [9, 4, 1, 1, 1], pages)
    runner = TorchModelRunner(llama, num_pages=8, page_size=4, dtype=torch.float32, kv_dtype="int8")
    ours = chunked_logits(runner, 0, tokens, [9, 4, 1, 1, 1], pages)
    delta = (ours - ref).abs().max().item()
    assert 0 < delta < 0.05 * ref.abs().max().item(), delta
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    page_tensors, _ = runner.context_tensors()
    n = runner.spec.num_attention_layers
    assert len(page_tensors) == 4 * n and page_tensors[0].dtype == torch.int8 and page_tensors[-1].dtype == torch.float16


def test_int8_pool_is_about_half_of_bf16(llama: Artifact) -> None:
    c = llama.meta.config
    bf16 = kv_bytes_per_token(c, "cpu", torch.bfloat16, "bf16")
    int8 = kv_bytes_per_token(c, "cpu", torch.bfloat16, "int8")
    assert int8 / bf16 == (c.head_dim + 2) / (2 * c.head_dim)
    assert kv_bytes_per_token(c, "cpu", torch.bfloat16, "auto") == 2 * bf16  # f32 attention on CPU
    with pytest.raises(ConfigError, match="fp8 needs the cuda backend"):
        TorchModelRunner(llama, num_pages=2, page_size=4, kv_dtype="fp8")


def _tiny_gemma3(softcap: float):
    """A random-weight gemma3 (sliding window 4 on three of four layers, two RoPE bases, final
    logit soft-capping) as an artifact over its fp32 weights; attention-score capping `softcap`."""
    import types

    from ninfer.engine.config import ModelConfig
    from ninfer.formats import TensorFormat
    from tests.test_architectures import _perturb, tiny_configs

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(31)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_configs()["gemma3"]).float().eval()
    _perturb(hf)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()
          if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    config = ModelConfig.from_hf(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
    config.attn_logit_softcapping = softcap
    meta = types.SimpleNamespace(config=config, tensor_formats={k: TensorFormat("f32") for k in sd})
    return types.SimpleNamespace(meta=meta, path="tiny-gemma3",
                                 load_parts=lambda device: {k: {"": v.to(device)} for k, v in sd.items()},
                                 load_dequantized=lambda: dict(sd))


@pytest.mark.parametrize("softcap", [0.0, 0.5])
def test_gemma3_window_and_softcap_over_an_int8_cache(softcap: float) -> None:
    """gemma3's sliding layers (window 4, so 16 tokens cross it many times) and score soft-capping
    read the int8 cache as they read the float32 one: chunked prefill and decode stay close to the
    float32 cache and pick the same argmax at nearly every position."""
    artifact = _tiny_gemma3(softcap)
    assert artifact.meta.config.sliding_window == 4
    tokens = PROMPT_A + DECODE
    pages = [3, 0, 7, 5]
    ref = chunked_logits(TorchModelRunner(artifact, num_pages=8, page_size=4, dtype=torch.float32), 0, tokens,
                         [9, 4, 1, 1, 1], pages)
    runner = TorchModelRunner(artifact, num_pages=8, page_size=4, dtype=torch.float32, kv_dtype="int8")
    ours = chunked_logits(runner, 0, tokens, [9, 4, 1, 1, 1], pages)
    delta = (ours - ref).abs().max().item()
    assert 0 < delta < 0.05 * ref.abs().max().item(), delta
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    assert runner.kv.k[0].dtype == torch.int8


@pytest.mark.slow
def test_lookup_speculation_over_an_int8_cache_commits_the_plain_greedy_tokens(smollm2_artifact: Path) -> None:
    """--spec lookup with --kv-dtype int8 (default model, float32 compute): verify rows write their
    K/V as int8 codes like decode rows do, and the rows of a rejected tail are rewritten later, so
    the committed tokens are plain int8 greedy's token for token."""
    from ninfer.engine.config import SchedulerConfig, SpecConfig
    from ninfer.engine.engine import Engine
    from ninfer.engine.request import PreparedRequest, SamplingParams
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(smollm2_artifact)
    tokenizer = Tokenizer.from_metadata(artifact.meta)
    runner = TorchModelRunner(artifact, num_pages=32, page_size=64, dtype=torch.float32, kv_dtype="int8")
    texts = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
             "List the numbers from 1 to 20, separated by commas."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in texts]

    def generate(spec):
        engine = Engine(runner, tokenizer, SchedulerConfig(prefix_reuse=False), model_max_context=2048, spec=spec)
        engine.start()
        try:
            outs = []
            for i, p in enumerate(prompts):
                ids = []
                for ev in engine.submit(PreparedRequest(request_id=f"r{i}", prompt_token_ids=p, max_tokens=32,
                                                        sampling=SamplingParams(temperature=0.0))):
                    assert ev.error is None, ev.error
                    ids += ev.token_ids
                outs.append(ids)
            return outs, engine.snapshot()
        finally:
            engine.shutdown()

    plain, _ = generate(None)
    spec, snap = generate(SpecConfig("lookup", draft_tokens=4, ngram_min=1, ngram_max=3))
    assert spec == plain
    assert snap.drafted_tokens > 0 and snap.accepted_tokens > 0


@pytest.mark.slow
def test_suspend_keeps_an_int8_cache_and_the_host_tier_works_after_the_resume(smollm2_artifact: Path) -> None:
    """--model-suspend with --kv-dtype int8 and a host tier (default model): the suspend snapshot
    carries the int8 scales with the codes, so the retained prefix is reused exactly after the
    resume; the host tier copies from and into the pools the resume allocated. Every turn equals
    the same turns on an engine that never slept."""
    from ninfer.engine.config import MemoryConfig, SchedulerConfig
    from ninfer.engine.loader import load_engine
    from ninfer.engine.request import PreparedRequest, SamplingParams

    def run(engine, prompt, rid):
        out, final = [], None
        for ev in engine.submit(PreparedRequest(rid, prompt, SamplingParams(temperature=0.0), max_tokens=8)):
            assert ev.error is None, ev.error
            out += ev.token_ids
            final = ev
        return out, final

    def turns(suspend: bool):
        m = load_engine(str(smollm2_artifact), backend="torch", announce=False, kv_dtype="int8",
                        scheduler=SchedulerConfig(max_context=1024, max_private_continuations=1),
                        memory=MemoryConfig(host_kv_bytes=256 << 20))
        engine = m.engine
        a = m.tokenizer.encode("The lighthouse keeper climbed the stairs and looked out at the sea. " * 5)
        b = m.tokenizer.encode("A recipe for bread: flour, water, salt and yeast. " * 3)
        try:
            first, _ = run(engine, a, "a")
            if suspend:
                assert engine.suspend().result(60).host_snapshot_bytes > 0
                engine.resume().result(120)
            second, final = run(engine, a + first, "b")
            assert final.usage.cached_tokens >= len(a) and final.reuse_tier == "device"
            run(engine, b, "c")  # the one private cell: a's conversation moves to the host tier
            third, final = run(engine, a + first + second, "d")
            assert final.usage.cached_tokens >= len(a) and final.reuse_tier == "host"
            return first, second, third
        finally:
            engine.shutdown()

    assert turns(True) == turns(False)
