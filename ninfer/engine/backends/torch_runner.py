"""The torch ModelRunner: the readable reference backend, on CPU or CUDA.

One `run(batch)` is one forward of the model's one definition (models/<arch>.py) over every
sequence's new tokens, through the torch ops (ops/torch_ops.py): decode rows of all lanes share each
matmul, K/V go into the pages the scheduler assigned, recurrent state into each sequence's state
slot, logits only for rows that sample, then `ninfer.engine.sampler.sample`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.mtp_drafts import MtpDrafts
from ninfer.engine.batch import ScheduledBatch, SequenceWork, StepOutput
from ninfer.engine.config import ModelConfig
from ninfer.engine.models import architecture, state_spec
from ninfer.engine.models.weights import WeightReader
from ninfer.engine.ops.cpu_native_ops import NativeCpuOps
from ninfer.engine.ops.torch_ops import KV_DTYPES, KVCache, RecurrentStates, TorchOps
from ninfer.engine.request import SamplingParams
from ninfer.engine.speculative import sample_rows
from ninfer.engine.stages import (Stage, StagePlan, build_stages, forward_stages, memory_split, plan_stages,
                                  stage_memory, stage_spec, whole_model)
from ninfer.engine.suspend import restore_snapshot, snapshot_bytes, take_snapshot
from ninfer.errors import ConfigError, NInferError


CPU_KERNELS = ("auto", "torch")  # the runner's cpu_kernels choices


def kv_bytes_per_token(config: ModelConfig, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None, kv_dtype: str = "auto") -> int:
    """Bytes of K and V per token over all attention layers, for a runner built with these
    arguments (lets a loader size the page pool before building the runner). int8 adds one fp16
    scale per token and head to K and to V."""
    device = torch.device(device)
    dtype = dtype if dtype is not None else default_dtype(device)
    spec = state_spec(config)
    if kv_dtype in ("int8", "fp8"):  # fp8: the cuda backend's size, for sizing the pool
        return spec.kv_bytes_per_token(1) + spec.num_attention_layers * 2 * spec.attention.kv_heads * 2
    if kv_dtype == "bf16":
        return spec.kv_bytes_per_token(2)
    elem = torch.empty(0, dtype=attention_dtype(device, dtype)).element_size()
    return spec.kv_bytes_per_token(elem)


def attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Attention and KV run in float32 on CPU: torch's CPU attention is several times faster in
    float32 than in bf16 at decode shapes (measured, docs/PERF.md), and it is the exact path."""
    return torch.float32 if device.type == "cpu" else dtype


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 weights and matmuls: on CPU it halves weight traffic and enables the packed decode
    kernels; default-model decode 58-70 tok/s vs 15.8 in f32 on 2 cores (docs/PERF.md)."""
    return torch.bfloat16


def check_state_slots(config: ModelConfig, num_state_slots: int) -> None:
    if state_spec(config).recurrent is not None and num_state_slots <= 0:
        raise ConfigError(f"{config.architecture} keeps recurrent state: the runner needs state slots")


class TorchModelRunner:
    """ModelRunner over torch tensors. `dtype` None picks `default_dtype(device)`; pass
    torch.float32 for a reference-exact run (all weights expanded to f32). num_state_slots:
    recurrent-state slots (models with linear-attention layers; one per running sequence and one
    per retained checkpoint). thread_adapter: a `cpu_threads.ThreadAdapter` that `run` ticks.
    kv_dtype: the KV cache's storage (--kv-dtype auto|bf16|int8, see torch_ops.KVCache).
    devices / stage_layers: pipeline stages (--devices, --stage-layers; engine/stages.py): one
    stage per device (a device may repeat), stage_layers layers each (None: an even split on CPU,
    by free memory on CUDA); `device` is then ignored. cpu_kernels: "auto" runs CPU decode rows on the
    native kernels (ops/cpu_native_ops.py) when they build and load, else on the torch ops (one log
    line says why); "torch": the torch ops always. kernel_cache_dir: where the kernels' library is
    built (None: `kernels.compiler.default_cache_dir()`)."""

    def __init__(self, artifact: Artifact, *, num_pages: int, page_size: int = 64, device: str = "cpu",
                 dtype: torch.dtype | None = None, num_state_slots: int = 0, mtp_draft_tokens: int = 0,
                 thread_adapter=None, kv_dtype: str = "auto", devices: list[str] | None = None,
                 stage_layers: list[int] | None = None, cpu_kernels: str = "auto",
                 kernel_cache_dir: Path | None = None) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype {kv_dtype} is not supported by the torch backend "
                              f"(it takes {', '.join(KV_DTYPES)}; fp8 needs the cuda backend)")
        self.kv_storage = kv_dtype
        if num_pages <= 0 or page_size <= 0:
            raise ConfigError(f"num_pages and page_size must be positive (got {num_pages}, {page_size})")
        self.device = torch.device(devices[0] if devices else device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        self.kv_dtype = attention_dtype(self.device, self.dtype)
        self.config: ModelConfig = artifact.meta.config
        c = self.config
        check_state_slots(c, num_state_slots)
        self.spec = state_spec(c)
        self.page_size = page_size
        self.num_pages = num_pages
        self.thread_adapter = thread_adapter  # cpu_threads.ThreadAdapter: re-checks the load between steps
        self.num_state_slots = num_state_slots if self.spec.recurrent else 0
        self.vocab_size = c.vocab_size
        self.kv_bytes_per_token = kv_bytes_per_token(c, self.device, self.dtype, kv_dtype)
        pack = self.device.type == "cpu" and self.dtype == torch.bfloat16  # the packed kernels are CPU ones
        head = architecture(c).mtp_head
        if mtp_draft_tokens and (head is None or not c.mtp_layers):
            raise ConfigError(f"--spec mtp needs an artifact that carries MTP layers (mtp.* tensors); this "
                              f"{c.architecture} artifact has none")
        if mtp_draft_tokens >= page_size:
            raise ConfigError(f"--draft-tokens {mtp_draft_tokens} must be below the page size {page_size}")
        if mtp_draft_tokens and devices:
            raise ConfigError("--spec mtp with --devices is not supported yet (use --spec lookup)")
        if cpu_kernels not in CPU_KERNELS:
            raise ConfigError(f"cpu kernels {cpu_kernels!r} is not one of {', '.join(CPU_KERNELS)}")
        self.cpu_kernels = None  # kernels.cpu_native.CpuKernels, when decode rows run on them
        if pack and cpu_kernels == "auto":
            from ninfer.kernels import cpu_native
            from ninfer.kernels.compiler import default_cache_dir
            self.cpu_kernels = cpu_native.decode_kernels(kernel_cache_dir or default_cache_dir())
        self._artifact, self._pack = artifact, pack  # what a resume after a suspend reads again
        with torch.inference_mode():
            if devices:
                split = stage_layers or memory_split(len(self.spec.kinds), devices)
                plans = plan_stages(self.spec.kinds, devices, split)
                self.stages = build_stages(artifact, plans, self._stage_ops, architecture(c).model)
            else:
                ops = self._stage_ops(None, c)
                reader = WeightReader(artifact, ops, self.device)
                self.stages = [Stage(whole_model(self.spec.kinds, str(self.device)), c, ops,
                                     architecture(c).model.load(reader, c))]
            # the last stage computes the logits (and, on one device, is the whole model)
            self.ops, self.model = self.stages[-1].ops, self.stages[-1].model
            self.kv = self._kv(num_pages)
            self.states = self._states(self.num_state_slots)
            # --spec mtp: the MTP head drafts each sampling row's next round (backends/mtp_drafts.py)
            self.mtp = MtpDrafts(head.load(reader, c), self.model, self.ops, self.spec, num_pages, page_size,
                                 self.kv_dtype, self.device, mtp_draft_tokens) if mtp_draft_tokens else None
        self.mtp_draft_tokens = mtp_draft_tokens
        self._verify_states: RecurrentStates | None = None  # the last forward's per-token states of verify rows
        self._verify_rows: dict[int, int] = {}  # seq_id -> its first flat row in the last forward

    def _stage_ops(self, plan: StagePlan | None, config: ModelConfig) -> TorchOps:
        device = torch.device(plan.device) if plan is not None else self.device
        if self.cpu_kernels is not None:
            return NativeCpuOps(config, self.dtype, self.kv_dtype, device, self.cpu_kernels)
        return TorchOps(config, self.dtype, self.kv_dtype, device, pack=self._pack)

    def _kv(self, num_pages: int) -> KVCache:
        """A KV pool of num_pages pages: each stage's layers on its device."""
        parts = [KVCache(stage_spec(self.spec, s.plan), num_pages, self.page_size, self.kv_dtype,
                         torch.device(s.device), self.kv_storage) for s in self.stages]
        return parts[0] if len(parts) == 1 else KVCache.join(parts)

    def device_memory(self) -> list[dict]:
        """Per stage (one without --devices): device, layers, bytes of weights, KV and state."""
        if self.stages is None:  # suspended: nothing held
            return []
        if getattr(self, "_memory", None) is None or self._memory[0] is not self.stages:  # built once per load
            kv = [self.kv.layers(*s.plan.attention).tensors() for s in self.stages]
            states = [[*st.conv, *st.ssm] for st in (self.states.layers(*s.plan.recurrent) for s in self.stages)] \
                if self.states is not None else [[] for _ in self.stages]
            self._memory = (self.stages, stage_memory(self.stages, kv, states))
        return self._memory[1]

    # ---- suspend (engine/suspend.py): give the memory back, take it again ---------------------

    def resident_bytes(self) -> int:
        """Bytes a suspend releases: weights, the KV pool and the state pool (and the MTP head's)."""
        return tensor_bytes((self.stages, self.suspend_caches(), self.mtp))

    @property
    def weights_artifact(self) -> Artifact:
        """Where the weights are read from (again, at a resume)."""
        return self._artifact

    def suspend_caches(self) -> dict[str, list[torch.Tensor]]:
        """The persistent state a suspend keeps: KV by page (the MTP head's too), recurrent state by slot."""
        return self._caches(self.kv, self.states, self.mtp)

    @staticmethod
    def _caches(kv: KVCache, states: RecurrentStates | None, mtp: MtpDrafts | None) -> dict[str, list[torch.Tensor]]:
        return {"k": kv.k, "v": kv.v, **({"k_scale": kv.k_scale, "v_scale": kv.v_scale} if kv.k_scale else {}),
                **({"conv": states.conv, "ssm": states.ssm} if states is not None else {}),
                **({"mtp_k": mtp.kv.k, "mtp_v": mtp.kv.v} if mtp is not None else {})}

    @torch.inference_mode()
    def release_memory(self, pages: list[int], slots: list[int], reserved: dict | None = None) -> tuple[dict, int, int]:
        """Copy the live KV pages and state slots to host memory (into `reserved`, when given), then
        drop the weights and the pools. -> (snapshot, its bytes, weight bytes released)."""
        if len(self.stages) > 1:
            raise NInferError("suspend with --devices is not supported yet")
        snapshot = take_snapshot(self.suspend_caches(), pages, slots, self.device, reserved)
        weight_bytes = tensor_bytes((self.model, self.ops, self.mtp.head if self.mtp is not None else None))
        self.model = self.ops = self.kv = self.states = self.mtp = self.stages = None  # type: ignore[assignment]
        self._verify_states = None
        release_device_memory(self.device)
        return snapshot, snapshot_bytes(snapshot), weight_bytes

    @torch.inference_mode()
    def restore_memory(self, snapshot: dict, weights: object | None = None) -> tuple[int, int, int]:
        """Read the weights again (from `weights`, a suspend's host copy, else the artifact), allocate
        the pools and copy the snapshot back into the same page and slot ids. -> (state bytes copied,
        weight bytes rebuilt, artifact bytes read)."""
        c = self.config
        source = weights if weights is not None else self._artifact
        ops = self._stage_ops(None, c)
        reader = WeightReader(source, ops, self.device)
        model = architecture(c).model.load(reader, c)
        self.stages = [Stage(whole_model(self.spec.kinds, str(self.device)), c, ops, model)]
        kv = self._kv(self.num_pages)
        states = self._states(self.num_state_slots)
        mtp = MtpDrafts(architecture(c).mtp_head.load(reader, c), model, ops, self.spec, self.num_pages,
                        self.page_size, self.kv_dtype, self.device, self.mtp_draft_tokens) \
            if self.mtp_draft_tokens else None
        state_bytes = restore_snapshot(self._caches(kv, states, mtp), snapshot, self.device)
        self.ops, self.model, self.kv, self.states, self.mtp = ops, model, kv, states, mtp
        weight_bytes = tensor_bytes((model, ops, mtp.head if mtp is not None else None))
        return state_bytes, weight_bytes, getattr(source, "payload_bytes", 0)

    def _states(self, slots: int) -> RecurrentStates | None:
        """A recurrent-state pool of `slots` slots (None for a pure-attention model)."""
        if not self.spec.recurrent:
            return None
        parts = [RecurrentStates(stage_spec(self.spec, s.plan), slots, self.kv_dtype, torch.device(s.device))
                 for s in self.stages]
        return parts[0] if len(parts) == 1 else RecurrentStates.join(parts)

    @torch.inference_mode()
    def batch_logits(self, batch: ScheduledBatch, all_rows: bool = False) -> torch.Tensor:
        """Forward the batch (writing its K/V and state). -> float32 logits: [sampling seqs, vocab],
        one row per seq with sample=True in batch order; with all_rows, [batch.num_tokens, vocab]."""
        self.copy_states(batch.state_copies)
        return self._forward(batch.seqs, self.kv, self.states, all_rows)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Run the batch's state copies, write its K/V and state, run the model, sample where asked."""
        if self.thread_adapter is not None:
            self.thread_adapter.tick()
        self.copy_states(batch.state_copies)
        hidden, offsets = self._hidden(batch.seqs, self.kv, self.states)
        logits = self._logits(hidden, offsets, batch.seqs, all_rows=False)
        out, accepted = sample_rows(logits, [s for s in batch.seqs if s.sample])
        for off, s in zip(offsets, batch.seqs):  # an embedding's rows: [tokens, hidden]
            if s.return_hidden:
                out.hidden[s.seq_id] = hidden[off:off + len(s.token_ids)]
        if self._verify_states is not None:  # back to the state after the last accepted input
            for s in batch.seqs:
                if s.num_drafts and accepted[s.seq_id] < s.num_drafts:
                    self._verify_states_restore(s, accepted[s.seq_id])
        if self.mtp is not None:
            self.mtp.step(batch.seqs, offsets, hidden, out, accepted)
        return out

    def _verify_states_restore(self, s: SequenceWork, accepted: int) -> None:
        row = self._verify_rows[s.seq_id] + accepted
        saved = self._verify_states
        for live, kept in zip((*self.states.conv, *self.states.ssm), (*saved.conv, *saved.ssm)):
            live[s.state_slot].copy_(kept[row])

    def context_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The context pools for host and disk tiers (engine/transfer.py): page-indexed tensors
        (K and V of every attention layer, int8 scales, and the MTP head's K/V under --spec mtp,
        whose pool shares the page ids) and slot-indexed ones (conv windows, delta-rule states)."""
        states = [*self.states.conv, *self.states.ssm] if self.states is not None else []
        return self.kv.tensors() + (self.mtp.kv.tensors() if self.mtp is not None else []), states

    @torch.inference_mode()
    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy K/V of page src into page dst, every layer (copy-on-write of a shared page)."""
        pairs = self._pairs(copies, self.num_pages, "page")
        self.kv.copy_pages(*pairs)
        if self.mtp is not None:
            self.mtp.copy_pages(*pairs)

    @torch.inference_mode()
    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy the recurrent state of slot src into slot dst, every layer (resuming a checkpoint)."""
        if copies and self.states is not None:
            self.states.copy_slots(*self._pairs(copies, self.num_state_slots, "state slot"))

    def _pairs(self, copies: list[tuple[int, int]], limit: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        for src, dst in copies:
            if not (0 <= src < limit and 0 <= dst < limit):
                raise NInferError(f"{what} copy {src} -> {dst} outside 0..{limit - 1}")
        return (torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device),
                torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 for a fresh single sequence, on a private page set and state
        (the runner's own caches are untouched)."""
        num_pages = -(-len(token_ids) // self.page_size)
        kv = self._kv(num_pages)
        seq = SequenceWork(seq_id=-1, token_ids=list(token_ids), start_pos=0, block_table=list(range(num_pages)),
                           sample=False, sampling=SamplingParams(), state_slot=0 if self.spec.recurrent else -1)
        return self._forward([seq], kv, self._states(1), all_rows=True)

    @torch.inference_mode()
    def mtp_fresh_drafts(self, token_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """The MTP head's drafts after token_ids[-1] for a fresh sequence, computed from scratch on
        private caches (the target over token_ids[:-1], the head over every pair), and the head's
        output at the last pair: a reference for the cached path. Needs mtp_draft_tokens."""
        assert self.mtp is not None and len(token_ids) >= 2
        inputs = list(token_ids[:-1])
        num_pages = -(-(len(token_ids) + self.mtp_draft_tokens) // self.page_size)
        kv = KVCache(self.spec, num_pages, self.page_size, self.kv_dtype, self.device, self.kv_storage)
        seq = SequenceWork(seq_id=-1, token_ids=inputs, start_pos=0, block_table=list(range(num_pages)), sample=True,
                           sampling=SamplingParams(), state_slot=0 if self.spec.recurrent else -1)
        hidden, offsets = self._hidden([seq], kv, self._states(1))
        fresh = MtpDrafts(self.mtp.head, self.model, self.ops, self.spec, num_pages, self.page_size, self.kv_dtype,
                          self.device, self.mtp_draft_tokens)
        out = StepOutput(sampled={-1: token_ids[-1]})
        fresh.step([seq], offsets, hidden, out, {})
        return out.drafts[-1], fresh.last_outputs[-1]

    def _forward(self, seqs: list[SequenceWork], kv: KVCache, states: RecurrentStates | None,
                 all_rows: bool) -> torch.Tensor:
        hidden, offsets = self._hidden(seqs, kv, states)
        return self._logits(hidden, offsets, seqs, all_rows)

    def _hidden(self, seqs: list[SequenceWork], kv: KVCache,
                states: RecurrentStates | None) -> tuple[torch.Tensor, list[int]]:
        """The model over every row (K/V and state written) -> final normed hidden [T, hidden] and
        each sequence's first row."""
        for s in seqs:
            if not s.token_ids:
                raise NInferError(f"sequence {s.seq_id} has no tokens to compute")
            if any(not 0 <= p < kv.num_pages for p in s.block_table):
                raise NInferError(f"sequence {s.seq_id}: block table has page ids outside 0..{kv.num_pages - 1}")
            if states is not None and not 0 <= s.state_slot < states.num_slots:
                raise NInferError(f"sequence {s.seq_id}: state slot {s.state_slot} outside 0..{states.num_slots - 1}")
        if states is not None:  # a sequence at position 0 starts from the empty state
            fresh = [s.state_slot for s in seqs if s.start_pos == 0]
            if fresh:
                states.zero(torch.tensor(fresh, dtype=torch.int64, device=self.device))
        verify = [s.num_drafts > 0 for s in seqs]
        num_tokens = sum(len(s.token_ids) for s in seqs)
        # the recurrent state after each token of a verify row (restored on rejection)
        self._verify_states = self._states(num_tokens) if states is not None and any(verify) else None
        spans = [(s.start_pos, len(s.token_ids), s.block_table, s.state_slot) for s in seqs]
        vs = self._verify_states
        offsets: list[int] = []

        def begin(stage: Stage) -> None:  # the step on one stage: its layers' slice of the pools
            a, r = stage.plan.attention, stage.plan.recurrent
            ctx = stage.ops.context(spans, kv.layers(*a), states.layers(*r) if states is not None else None, verify,
                                    vs.layers(*r) if vs is not None else None)
            offsets[:] = [m.offset for m in ctx.seqs]
            stage.ops.begin(ctx)

        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=self.device)
        hidden = forward_stages(self.stages, input_ids, begin)  # [T, hidden], on the last stage's device
        self._verify_rows = {s.seq_id: off for off, s in zip(offsets, seqs)}
        return hidden, offsets

    def _logits(self, hidden: torch.Tensor, offsets: list[int], seqs: list[SequenceWork],
                all_rows: bool) -> torch.Tensor:
        if not all_rows:  # the last row of each sampling sequence; every row of a verify row
            rows = [r for off, s in zip(offsets, seqs) if s.sample
                    for r in range(off + len(s.token_ids) - 1 - s.num_drafts, off + len(s.token_ids))]
            if not rows:
                return hidden.new_empty(0, self.vocab_size, dtype=torch.float32)
            hidden = hidden[rows] if len(rows) < hidden.shape[0] else hidden
        return self.model.compute_logits(self.ops, hidden)


def tensor_bytes(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from `root` (objects, lists, dicts)."""
    seen_storage: set[int] = set()
    seen: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storage:
                seen_storage.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, name, None))
    return total


def release_device_memory(device: torch.device) -> None:
    """Collect the dropped tensors and give their memory back: the CUDA cache on a GPU; on the host,
    glibc's free lists (freed arenas otherwise stay in the process's resident set)."""
    import ctypes
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass
