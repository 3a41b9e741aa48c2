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
