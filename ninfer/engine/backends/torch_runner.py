"""The torch ModelRunner: the readable reference backend, on CPU or CUDA.

One `run(batch)` is one forward over every sequence's new tokens (decode rows of all lanes
share each matmul), K/V written into the pages the scheduler assigned, logits only for rows
that sample, then `ninfer.engine.sampler.sample`.
"""
from __future__ import annotations

import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.batch import ScheduledBatch, SequenceWork, StepOutput
from ninfer.engine.config import ModelConfig
from ninfer.engine.models.layers import AttentionMetadata, KVCache
from ninfer.engine.models.llama import LlamaModel
from ninfer.engine.models.qwen3 import Qwen3Model
from ninfer.engine.request import SamplingParams
from ninfer.errors import ConfigError, NInferError

MODEL_CLASSES: dict[str, type[LlamaModel]] = {"llama": LlamaModel, "qwen3": Qwen3Model}


def kv_bytes_per_token(config: ModelConfig, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None) -> int:
    """Bytes of K and V per token over all layers, for a runner built with these arguments
    (lets a loader size the page pool before building the runner)."""
    device = torch.device(device)
    dtype = dtype if dtype is not None else default_dtype(device)
    elem = torch.empty(0, dtype=attention_dtype(device, dtype)).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem


def attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Attention and KV run in float32 on CPU: torch's CPU attention is several times faster in
    float32 than in bf16 at decode shapes (measured, docs/PERF.md), and it is the exact path."""
    return torch.float32 if device.type == "cpu" else dtype


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 weights and matmuls: on CPU it halves weight traffic and enables the packed decode
    kernels; default-model decode 58-70 tok/s vs 15.8 in f32 on 2 cores (docs/PERF.md)."""
    return torch.bfloat16


class TorchModelRunner:
    """ModelRunner over torch tensors. `dtype` None picks `default_dtype(device)`; pass
    torch.float32 for a reference-exact run (all weights expanded to f32)."""

    def __init__(self, artifact: Artifact, *, num_pages: int, page_size: int = 64, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ConfigError(f"num_pages and page_size must be positive (got {num_pages}, {page_size})")
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        self.kv_dtype = attention_dtype(self.device, self.dtype)
        self.config: ModelConfig = artifact.meta.config
        self.page_size = page_size
        self.num_pages = num_pages
        self.vocab_size = self.config.vocab_size
        c = self.config
        self.kv_bytes_per_token = kv_bytes_per_token(c, self.device, self.dtype)
        pack = self.device.type == "cpu" and self.dtype == torch.bfloat16  # the packed kernels are CPU ones
        with torch.inference_mode():
            self.model = MODEL_CLASSES[c.architecture].from_artifact(
                artifact, self.dtype, self.device, attn_dtype=self.kv_dtype, pack=pack)
            self.kv = KVCache(c, num_pages, page_size, self.kv_dtype, self.device)

    @torch.inference_mode()
    def batch_logits(self, batch: ScheduledBatch, all_rows: bool = False) -> torch.Tensor:
        """Forward the batch (writing its K/V). -> float32 logits: [sampling seqs, vocab], one row
        per seq with sample=True in batch order; with all_rows, [batch.num_tokens, vocab]."""
        return self._forward(batch.seqs, self.kv, all_rows)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Write the batch's K/V into its pages, run the model, sample where asked."""
        from ninfer.engine.sampler import sample

        logits = self._forward(batch.seqs, self.kv, all_rows=False)
        sampling = [s for s in batch.seqs if s.sample]
        if not sampling:
            return StepOutput(sampled={})
        tokens, logprobs = sample(logits, sampling)
        out = StepOutput(sampled={s.seq_id: t for s, t in zip(sampling, tokens)})
        for s, lp in zip(sampling, logprobs):
            if lp is not None:
                out.logprobs[s.seq_id] = lp
        return out

    @torch.inference_mode()
    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy K/V of page src into page dst, every layer (copy-on-write of a shared page)."""
        if not copies:
            return
        for src, dst in copies:
            if not (0 <= src < self.num_pages and 0 <= dst < self.num_pages):
                raise NInferError(f"page copy {src} -> {dst} outside 0..{self.num_pages - 1}")
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        for cache in (*self.kv.k, *self.kv.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 for a fresh single sequence, on a private page set
        (the runner's own cache is untouched)."""
        num_pages = -(-len(token_ids) // self.page_size)
        kv = KVCache(self.config, num_pages, self.page_size, self.kv_dtype, self.device)
        seq = SequenceWork(seq_id=-1, token_ids=list(token_ids), start_pos=0,
                           block_table=list(range(num_pages)), sample=False, sampling=SamplingParams())
        return self._forward([seq], kv, all_rows=True)

    def _forward(self, seqs: list[SequenceWork], kv: KVCache, all_rows: bool) -> torch.Tensor:
        for s in seqs:
            if not s.token_ids:
                raise NInferError(f"sequence {s.seq_id} has no tokens to compute")
            if any(not 0 <= p < kv.num_pages for p in s.block_table):
                raise NInferError(f"sequence {s.seq_id}: block table has page ids outside 0..{kv.num_pages - 1}")
        meta, positions = AttentionMetadata.build(
            [(s.start_pos, len(s.token_ids), s.block_table) for s in seqs], self.page_size, self.device)
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=self.device)
        hidden = self.model.forward(input_ids, positions, meta, kv)  # [T, hidden]
        if not all_rows:
            rows = [m.offset + m.num_tokens - 1 for m, s in zip(meta.seqs, seqs) if s.sample]
            if not rows:
                return hidden.new_empty(0, self.vocab_size, dtype=torch.float32)
            hidden = hidden[rows] if len(rows) < hidden.shape[0] else hidden
        return self.model.compute_logits(hidden)
