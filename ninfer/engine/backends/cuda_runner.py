"""The cuda ModelRunner: ninfer's NVRTC kernels over weights and a paged KV cache in device memory.

A step splits its sequences in two paths:
- decode rows (one new token of a sequence already generating; at most 8 at a time): embedding,
  per layer rmsnorm -> gemv qkv -> rope_kv_write -> paged_attention_decode -> gemv o_proj ->
  rmsnorm_residual -> gemv gate_up -> swiglu -> gemv down, then the final norm, gemv lm_head to fp32
  logits and sample_tokens; replayed from a CUDA graph per row count (cuda_graphs.py).
- prompt rows (prefill, chunks, prefix-hit suffixes): the same layers with torch.mm (cuBLAS) on
  dense weights (quantized weights dequantized per projection on the fly) and paged_attention_prefill;
  rows that sample take the lm_head gemv and the sampler like decode rows.

Activations, the KV cache and the norm weights are bf16, or fp32 with dtype=torch.float32 (the
faithful mode: every kernel computes in fp32 anyway, so then only the summation order differs from
an fp32 reference). Linear weights keep their stored format: int8/int4 groupwise, bf16, or f32/f16
as bf16 (fp32 in the fp32 mode).

Batch invariance: every kernel computes a row from that row alone, the attention split depends only
on a sequence's own length, and cuBLAS always sees blocks of exactly PREFILL_ROWS rows (padded), so
a row's bits do not depend on the other rows of the batch or on where a prefix hit starts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ninfer.engine.backends.cuda_graphs import MAX_DECODE_ROWS, Activations, DecodeGraphs, DecodeState
from ninfer.engine.batch import ScheduledBatch, SequenceWork, StepOutput
from ninfer.engine.config import ModelConfig
from ninfer.engine.models.layers import rope_inv_freq
from ninfer.engine.quant import TensorFormat, dequantize
from ninfer.errors import ConfigError
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler, default_cache_dir

PREFILL_ROWS = 128  # cuBLAS row block: every prompt matmul is [PREFILL_ROWS, K] @ [K, N]
PARTITION = 512  # decode attention split-K partition (keys); fixed, for batch invariance
DTYPES = {torch.bfloat16: TensorFormat("bf16"), torch.float32: TensorFormat("f32")}  # activation dtypes
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class Weight:
    """A linear weight [N, K] as quant.py stores it (parts '', '.scales', '.mins'); fused
    projections are their row blocks concatenated, which holds for the quantized parts too."""

    fmt: TensorFormat
    parts: dict[str, torch.Tensor]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype` (the stored tensor where it already is one, else a fresh expanded copy)."""
        w = self.parts[""]
        return w if w.dtype == dtype and not self.fmt.quantized else dequantize(self.fmt, self.parts, dtype)


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor  # [hidden], activation dtype like every vector here
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None
    o_proj: Weight  # [hidden, heads * head_dim]
    post_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]


def _gemv_ok(fmt: TensorFormat, k: int) -> bool:
    """Whether the gemv kernel takes this format at input width k (launchers.gemv's checks)."""
    if fmt.format in ("bf16", "f32"):
        return k % L.GEMV_CHUNK[L.GEMV_FORMATS[fmt.format]] == 0
    if fmt.format not in ("int8", "int4"):
        return False
    code = 1 if fmt.format == "int8" else (2 if fmt.symmetric else 3)
    chunk, g = L.GEMV_CHUNK[code], fmt.group_size
    return k % chunk == 0 and g % chunk == 0 and k % g == 0


class _Loader:
    """Turns an artifact's stored parts (on the device) into fused Weights and vectors in the
    activation dtype."""

    def __init__(self, artifact, device: torch.device, dtype: torch.dtype) -> None:
        self.parts: dict[str, dict[str, torch.Tensor]] = artifact.load_parts(device)
        self.formats: dict[str, TensorFormat] = artifact.meta.tensor_formats
        self.dtype = dtype

    def tensor(self, name: str) -> torch.Tensor:
        return dequantize(self.formats[name], self.parts[name], self.dtype).contiguous()

    def linear(self, names: list[str]) -> Weight:
        fmts = [self.formats[n] for n in names]
        k = self.parts[names[0]][""].shape[1] * (2 if fmts[0].format == "int4" else 1)
        if all(f == fmts[0] for f in fmts) and _gemv_ok(fmts[0], k) and (
                fmts[0].quantized or fmts[0].format == "bf16"):  # bf16 is exact in either dtype
            return Weight(fmts[0], {sfx: torch.cat([self.parts[n][sfx] for n in names]).contiguous()
                                    for sfx in self.parts[names[0]]})
        # f32/f16, mixed formats or shapes the gemv kernel does not take: the activation dtype
        return Weight(DTYPES[self.dtype], {"": torch.cat([dequantize(self.formats[n], self.parts[n], self.dtype)
                                                          for n in names]).contiguous()})

    def drop(self, names: list[str]) -> None:
        for n in names:
            self.parts.pop(n, None)


class CudaModelRunner:
    """ModelRunner on one CUDA device over the kernels of ninfer/kernels.

    cuda_graph: replay decode from CUDA graphs (False: launch every kernel each step).
    kernel_cache_dir: where compiled cubins are kept (None: `default_cache_dir()`).
    dtype: the activation and KV dtype, torch.bfloat16 or torch.float32.
    """

    def __init__(self, artifact, *, num_pages: int, page_size: int = 64, device: str = "cuda",
                 cuda_graph: bool = True, kernel_cache_dir: Path | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ConfigError(f"num_pages and page_size must be positive (got {num_pages}, {page_size})")
        if dtype not in DTYPES:
            raise ConfigError(f"the cuda backend computes in bfloat16 or float32, not {dtype}")
        self.dtype = dtype
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(f"the cuda backend runs on a CUDA device, got {device!r}")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        c: ModelConfig = artifact.meta.config
        self.config = c
        self.page_size = page_size
        self.num_pages = num_pages
        self.vocab_size = c.vocab_size
        self.kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dtype.itemsize
        self._check_shapes(c)
        self.kc = KernelCompiler(kernel_cache_dir if kernel_cache_dir is not None else default_cache_dir(),
                                 device=self.device.index)
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim ** -0.5
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        with torch.cuda.device(self.device), torch.inference_mode():
            self._load(artifact)
            # RoPE tables [max_positions, head_dim / 2] fp32, llama3 scaling included via inv_freq
            self.cos, self.sin = L.rope_cos_sin(c.head_dim, c.max_position_embeddings, c.rope_theta, self.device,
                                                inv_freq=rope_inv_freq(c))
            shape = (num_pages, page_size, c.num_key_value_heads, c.head_dim)
            self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_hidden_layers)]
            self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_hidden_layers)]
            self.max_context = min(c.max_position_embeddings, num_pages * page_size)
            max_pages = -(-self.max_context // page_size)
            self.state = DecodeState(hidden=c.hidden_size, qkv=self.q_size + 2 * self.kv_size, attn=self.q_size,
                                     inter=c.intermediate_size, vocab=c.vocab_size, heads=c.num_attention_heads,
                                     head_dim=c.head_dim, max_pages=max_pages,
                                     max_parts=-(-self.max_context // PARTITION), device=self.device, dtype=dtype)
        self.graphs = DecodeGraphs(self._decode_step, self.device, enabled=cuda_graph)

    @staticmethod
    def _check_shapes(c: ModelConfig) -> None:
        gqa = c.num_attention_heads // c.num_key_value_heads
        if c.head_dim not in (64, 128, 256) or gqa * c.head_dim > 2048:
            raise ConfigError(f"the cuda backend's attention takes head_dim 64/128/256 with at most 2048 query "
                              f"dims per kv head; this model has head_dim {c.head_dim}, {gqa} heads per kv head")
        if c.hidden_size % 8 or c.intermediate_size % 8:
            raise ConfigError("the cuda backend needs hidden and intermediate sizes that are multiples of 8")

    def _load(self, artifact) -> None:
        c = self.config
        w = _Loader(artifact, self.device, self.dtype)
        self.layers: list[Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            self.layers.append(Layer(
                input_norm=w.tensor(p + "input_layernorm.weight"),
                qkv=w.linear(qkv),
                qkv_bias=torch.cat([w.tensor(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
                if c.attention_bias else None,
                q_norm=w.tensor(p + "self_attn.q_norm.weight") if c.qk_norm else None,
                k_norm=w.tensor(p + "self_attn.k_norm.weight") if c.qk_norm else None,
                o_proj=w.linear([p + "self_attn.o_proj.weight"]),
                post_norm=w.tensor(p + "post_attention_layernorm.weight"),
                gate_up=w.linear(gate_up),
                down=w.linear([p + "mlp.down_proj.weight"]),
            ))
            w.drop([n for n in w.formats if n.startswith(p)])  # copies made: keep peak memory near 1x
        emb_name = "model.embed_tokens.weight"
        fmt = w.formats[emb_name]
        H = c.hidden_size
        if fmt.quantized and H % fmt.group_size == 0 and fmt.group_size % 8 == 0 and _gemv_ok(fmt, H):
            self.embed = Weight(fmt, dict(w.parts[emb_name]))
        else:  # the embedding kernel copies rows of the activation dtype
            self.embed = Weight(DTYPES[self.dtype], {"": w.tensor(emb_name)})
        self.lm_head = self.embed if c.tie_word_embeddings else w.linear(["lm_head.weight"])
        self.norm = w.tensor("model.norm.weight")

    # -- public ------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Write the batch's K/V into its pages, run the model, sample where asked."""
        out, _ = self._execute(batch, keep_logits=False)
        return out

    def run_with_logits(self, batch: ScheduledBatch) -> tuple[StepOutput, torch.Tensor]:
        """`run`, plus the fp32 logits the sampler saw: [sampling seqs, vocab], one row per seq
        with sample=True in batch order (a copy)."""
        out, logits = self._execute(batch, keep_logits=True)
        rows = [logits[s.seq_id] for s in batch.seqs if s.sample]
        return out, (torch.stack(rows) if rows else torch.empty(0, self.vocab_size, device=self.device))

    def batch_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Like the torch runner's: forward the batch (K/V written) -> logits of its sampling rows."""
        return self.run_with_logits(batch)[1]

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy K/V of page src into page dst, every layer (copy-on-write of a shared page)."""
        if not copies:
            return
        for src, dst in copies:
            if not (0 <= src < self.num_pages and 0 <= dst < self.num_pages):
                raise ValueError(f"page copy {src} -> {dst} outside 0..{self.num_pages - 1}")
        with torch.cuda.device(self.device), torch.inference_mode():
            src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
            for cache in (*self.k_cache, *self.v_cache):
                cache.index_copy_(0, dst, cache.index_select(0, src))

    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 for a fresh single sequence, on private pages (the runner's
        cache is untouched); each row is what a sampling step at that position would see."""
        n = len(token_ids)
        if not 0 < n <= self.config.max_position_embeddings or any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"forward_logits takes 1..{self.config.max_position_embeddings} ids in 0..{self.vocab_size - 1}")
        with torch.cuda.device(self.device), torch.inference_mode():
            pages = -(-n // self.page_size)
            c = self.config
            shape = (pages, self.page_size, c.num_key_value_heads, c.head_dim)
            k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
            v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
            seq = SequenceWork(seq_id=-1, token_ids=list(token_ids), start_pos=0, block_table=list(range(pages)),
                               sample=False, sampling=None)  # type: ignore[arg-type]
            hidden = self._prefill_forward([seq], k_cache, v_cache)  # [n, hidden]
            logits = torch.empty(n, self.vocab_size, dtype=torch.float32, device=self.device)
            for s in range(0, n, MAX_DECODE_ROWS):
                L.gemv(self.kc, hidden[s:s + MAX_DECODE_ROWS], self.lm_head.fmt, self.lm_head.parts,
                       logits[s:s + MAX_DECODE_ROWS])
            return logits

    # -- one step ----------------------------------------------------------------------------

    def _execute(self, batch: ScheduledBatch, keep_logits: bool) -> tuple[StepOutput, dict[int, torch.Tensor]]:
        for s in batch.seqs:
            self._validate(s)
        # Decode rows: one token of a sequence that has generated before. A prompt's last token
        # goes the prompt way even alone, so its bits match a run without a prefix hit.
        decode = [s for s in batch.seqs if len(s.token_ids) == 1 and s.sample and s.output_token_ids]
        prompt = [s for s in batch.seqs if not (len(s.token_ids) == 1 and s.sample and s.output_token_ids)]
        out = StepOutput(sampled={})
        logits: dict[int, torch.Tensor] = {}
        with torch.cuda.device(self.device), torch.inference_mode():
            if prompt:
                hidden = self._prefill_forward(prompt, self.k_cache, self.v_cache)
                ends = np.cumsum([len(s.token_ids) for s in prompt]) - 1
                rows = [(int(e), s) for e, s in zip(ends, prompt) if s.sample]
                for g in range(0, len(rows), MAX_DECODE_ROWS):
                    group = rows[g:g + MAX_DECODE_ROWS]
                    m = len(group)
                    idx = torch.tensor([r for r, _ in group], dtype=torch.int64, device=self.device)
                    self.state.act.x[:m].copy_(hidden.index_select(0, idx))
                    self._load_sampling([s for _, s in group])
                    self._logits_and_sample(m)
                    self._collect([s for _, s in group], out, logits if keep_logits else None)
            for g in range(0, len(decode), MAX_DECODE_ROWS):
                group = decode[g:g + MAX_DECODE_ROWS]
                parts = self._load_decode(group)
                self.graphs.run(len(group), parts)
                self._collect(group, out, logits if keep_logits else None)
        return out, logits

    def _validate(self, s: SequenceWork) -> None:
        if not s.token_ids:
            raise ValueError(f"sequence {s.seq_id} has no tokens to compute")
        end = s.start_pos + len(s.token_ids)
        if s.start_pos < 0 or end > self.max_context:
            raise ValueError(f"sequence {s.seq_id}: positions {s.start_pos}..{end - 1} outside 0..{self.max_context - 1}")
        used = s.block_table[:-(-end // self.page_size)]
        if len(used) * self.page_size < end or any(not 0 <= p < self.num_pages for p in used):
            raise ValueError(f"sequence {s.seq_id}: block table does not cover {end} tokens with pages "
                             f"in 0..{self.num_pages - 1}")
        if any(not 0 <= t < self.vocab_size for t in s.token_ids):
            raise ValueError(f"sequence {s.seq_id}: token id outside 0..{self.vocab_size - 1}")

    def _collect(self, seqs: list[SequenceWork], out: StepOutput, logits: dict[int, torch.Tensor] | None) -> None:
        """Read the sampled ids of state rows [:len(seqs)]; logprob rows (so the token and its record
        agree) and structured-output rows (their grammar mask) are sampled again by the torch sampler."""
        st = self.state
        tokens = st.tokens[:len(seqs)].tolist()
        want = [i for i, s in enumerate(seqs) if s.sampling.logprobs or s.token_mask is not None]
        if want:
            from ninfer.engine.sampler import sample

            rows = torch.tensor(want, dtype=torch.int64, device=self.device)
            lp_tokens, records = sample(st.logits.index_select(0, rows), [seqs[i] for i in want])
            for i, t, rec in zip(want, lp_tokens, records):
                tokens[i] = t
                if rec is not None:
                    out.logprobs[seqs[i].seq_id] = rec
        for s, t in zip(seqs, tokens):
            out.sampled[s.seq_id] = t
        if logits is not None:
            for i, s in enumerate(seqs):
                logits[s.seq_id] = st.logits[i].clone()

    # -- inputs ------------------------------------------------------------------------------

    def _load_sampling(self, seqs: list[SequenceWork]) -> None:
        """Sampler parameters and penalty counts of `seqs` into state rows [:len(seqs)]."""
        st, n = self.state, len(seqs)
        f32 = np.zeros((5, MAX_DECODE_ROWS), dtype=np.float32)
        i64 = np.zeros((2, MAX_DECODE_ROWS), dtype=np.int64)
        top_k = np.zeros(MAX_DECODE_ROWS, dtype=np.int32)
        for i, s in enumerate(seqs):
            sp = s.sampling
            f32[:, i] = (sp.temperature if not sp.greedy else 0.0, sp.top_p, sp.min_p,
                         sp.presence_penalty, sp.frequency_penalty)
            seed = s.seed & _MASK64
            i64[:, i] = (seed - (1 << 64) if seed >= 1 << 63 else seed, len(s.output_token_ids))
            top_k[i] = min(max(sp.top_k, 1), L.TOPK_MAX)
            if sp.presence_penalty or sp.frequency_penalty:  # rows without penalties ignore their counts
                if s.output_token_ids:
                    ids = torch.tensor(s.output_token_ids, dtype=torch.int64).to(self.device)
                    st.counts[i].copy_(torch.bincount(ids, minlength=self.vocab_size))
                else:
                    st.counts[i].zero_()
        st.f32.copy_(torch.from_numpy(f32.reshape(-1)))
        st.i64.copy_(torch.from_numpy(i64.reshape(-1)))
        st.top_k[:n].copy_(torch.from_numpy(top_k[:n]))

    def _load_decode(self, seqs: list[SequenceWork]) -> int:
        """Decode inputs of `seqs` into state rows [:n]; returns the attention split bucket."""
        st, n, ps = self.state, len(seqs), self.page_size
        R, mp = MAX_DECODE_ROWS, st.max_pages
        i32 = np.zeros(DecodeState.HEAD + n * mp, dtype=np.int32)
        longest = 1
        for i, s in enumerate(seqs):
            pos = s.start_pos
            ctx = pos + 1
            longest = max(longest, ctx)
            pages = s.block_table[:-(-ctx // ps)]
            i32[i] = s.token_ids[0]
            i32[R + i] = pos
            i32[2 * R + i] = pages[pos // ps] * ps + pos % ps
            i32[3 * R + i] = ctx
            base = DecodeState.HEAD + i * mp
            i32[base:base + len(pages)] = pages
        self._load_sampling(seqs)  # top_k, the 5th block of i32, comes from here
        head = torch.from_numpy(i32)
        st.i32[:4 * R].copy_(head[:4 * R])
        st.i32[DecodeState.HEAD:DecodeState.HEAD + n * mp].copy_(head[DecodeState.HEAD:])
        needed = -(-longest // PARTITION)
        return min(1 << (needed - 1).bit_length(), st.max_parts)

    # -- forwards ----------------------------------------------------------------------------

    def _embed(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        if self.embed.fmt.quantized:
            L.embedding_quant(self.kc, ids, self.embed.fmt, self.embed.parts, out)
        else:
            L.embedding(self.kc, ids, self.embed.parts[""], out)

    def _layers(self, n: int, a: Activations, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                project: Callable[[Weight, torch.Tensor, torch.Tensor], None],
                attend: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """All layers over rows [:n] of `a`: a.residual holds the embeddings on entry, a.x the final
        normed hidden on exit. project(w, x, y) writes y = x @ w^T; attend(layer, q, out)."""
        c, kc, eps = self.config, self.kc, self.eps
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        r, x = a.residual[:n], a.x[:n]
        L.rmsnorm_residual(kc, r, self.layers[0].input_norm, x, eps)
        for i, layer in enumerate(self.layers):
            project(layer.qkv, a.x, a.qkv)
            qkv = a.qkv[:n]
            if layer.qkv_bias is not None:
                qkv.add_(layer.qkv_bias)
            # views of the fused row: q [n, Hq, D], k/v [n, Hkv, D]
            q = qkv[:, :self.q_size].view(n, Hq, D)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(n, Hkv, D)
            v = qkv[:, self.q_size + self.kv_size:].view(n, Hkv, D)
            L.rope_kv_write(kc, q, k, v, self.cos, self.sin, a.positions[:n], a.slots[:n], k_cache[i], v_cache[i],
                            layer.q_norm, layer.k_norm, eps)
            attend(i, q, a.attn[:n].view(n, Hq, D))
            project(layer.o_proj, a.attn, a.proj)
            L.rmsnorm_residual(kc, a.proj[:n], layer.post_norm, x, eps, residual=r)
            project(layer.gate_up, a.x, a.gate_up)
            L.swiglu(kc, a.gate_up[:n], a.act[:n])
            project(layer.down, a.act, a.proj)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            L.rmsnorm_residual(kc, a.proj[:n], nxt, x, eps, residual=r)

    def _decode_step(self, n: int, parts: int) -> None:
        """The captured step over state rows [:n]: embedding .. sampled tokens; no host sync."""
        st, kc = self.state, self.kc
        a = st.act
        workspace = st.workspace(n, parts)
        tables, lens = st.block_tables[:n], st.context_lens[:n]

        def project(w: Weight, x: torch.Tensor, y: torch.Tensor) -> None:
            L.gemv(kc, x[:n], w.fmt, w.parts, y[:n])

        def attend(i: int, q: torch.Tensor, out: torch.Tensor) -> None:
            L.paged_attention_decode(kc, q, self.k_cache[i], self.v_cache[i], tables, lens, parts * PARTITION, out,
                                     self.scale, PARTITION, workspace)

        self._embed(st.ids[:n], a.residual[:n])
        self._layers(n, a, self.k_cache, self.v_cache, project, attend)
        self._logits_and_sample(n)

    def _logits_and_sample(self, n: int) -> None:
        """state.x[:n] (final normed hidden) -> state.logits[:n] fp32 -> state.tokens[:n]."""
        st = self.state
        L.gemv(self.kc, st.act.x[:n], self.lm_head.fmt, self.lm_head.parts, st.logits[:n])
        L.sample_tokens(self.kc, st.logits[:n], st.temperature[:n], st.top_k[:n], st.top_p[:n], st.min_p[:n],
                        st.seeds[:n], st.steps[:n], st.tokens[:n], st.counts[:n], st.presence[:n],
                        st.frequency[:n])

    def _prefill_forward(self, seqs: list[SequenceWork], k_cache: list[torch.Tensor],
                         v_cache: list[torch.Tensor]) -> torch.Tensor:
        """Every token of `seqs` through the model (K/V written into the given caches).
        -> final normed hidden [tokens, hidden] (a view of scratch)."""
        c, kc, ps = self.config, self.kc, self.page_size
        n = sum(len(s.token_ids) for s in seqs)
        rows = -(-n // PREFILL_ROWS) * PREFILL_ROWS
        ids, positions, slots = [], [], []
        max_pages = max(-(-(s.start_pos + len(s.token_ids)) // ps) for s in seqs)
        tables = np.zeros((len(seqs), max_pages), dtype=np.int32)
        for b, s in enumerate(seqs):
            end = s.start_pos + len(s.token_ids)
            pages = s.block_table[:-(-end // ps)]
            tables[b, :len(pages)] = pages
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, end))
            slots.extend(pages[p // ps] * ps + p % ps for p in range(s.start_pos, end))
        cu = np.concatenate([[0], np.cumsum([len(s.token_ids) for s in seqs])]).astype(np.int32)
        host = np.concatenate([np.asarray(ids, np.int32), np.asarray(positions, np.int32),
                               np.asarray(slots, np.int32), cu, np.asarray([s.start_pos for s in seqs], np.int32),
                               tables.reshape(-1)])
        dev = torch.from_numpy(host).to(self.device)
        S = len(seqs)
        ids_d, pos_d, slot_d = dev[:n], dev[n:2 * n], dev[2 * n:3 * n]
        cu_d, start_d = dev[3 * n:3 * n + S + 1], dev[3 * n + S + 1:3 * n + 2 * S + 1]
        tables_d = dev[3 * n + 2 * S + 1:].view(S, max_pages)
        max_ctx = max(s.start_pos + len(s.token_ids) for s in seqs)
        a = Activations.allocate(rows, c.hidden_size, self.q_size + 2 * self.kv_size, self.q_size,
                                 c.intermediate_size, self.device, pos_d, slot_d, self.dtype)

        def project(w: Weight, x: torch.Tensor, y: torch.Tensor) -> None:
            dense_t = w.dense(self.dtype).t()  # [K, N]
            for r0 in range(0, rows, PREFILL_ROWS):
                torch.mm(x[r0:r0 + PREFILL_ROWS], dense_t, out=y[r0:r0 + PREFILL_ROWS])

        def attend(i: int, q: torch.Tensor, out: torch.Tensor) -> None:
            L.paged_attention_prefill(kc, q, k_cache[i], v_cache[i], tables_d, cu_d, start_d, max_ctx, out,
                                      self.scale)

        self._embed(ids_d, a.residual[:n])
        self._layers(n, a, k_cache, v_cache, project, attend)
        return a.x[:n]
