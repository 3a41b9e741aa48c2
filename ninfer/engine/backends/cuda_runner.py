"""The cuda ModelRunner: the model's one forward (models/<arch>.py) over the cuda ops
(ops/cuda_ops.py), with weights, the paged KV cache and recurrent state in device memory.

What is the runner's own: the step's inputs on the device, the cache tensors, CUDA graphs and
sampling. A step splits its sequences in two routes:
- decode rows (one new token of a sequence already generating; at most 8 at a time): the forward
  on the decode route, then the lm_head gemv to fp32 logits and sample_tokens (grammar masks
  applied in the kernel, before the draw); replayed from a CUDA graph per row count and attention
  split bucket (cuda_graphs.py).
- verify rows (speculative decoding: the last token and K drafts): K + 1 decode rows of one
  sequence on the decode route, every position drawn by the kernel with its own step, penalty
  counts and grammar mask; the host applies the acceptance rule (ninfer.engine.speculative) and
  restores a hybrid model's state from the per-row states the step kept. A graph per (sequences,
  split bucket, verify width).
- prompt rows (prefill, chunks, prefix-hit suffixes): the forward on the prompt route (one
  sequence's chunk of up to 1,024 tokens replayed from a CUDA graph per 128-row bucket, where
  every launch of the model's prompt forward can be captured); rows that sample take the lm_head
  gemv and the sampler like decode rows.
The sampler is the one definition (ninfer.engine.sampler): the kernel draws every token; rows that
ask for logprobs get the records of the drawn token, computed from the same logits.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ninfer.engine.backends import vmm
from ninfer.engine.backends.cuda_graphs import (MAX_DECODE_ROWS, DecodeGraphs, DecodeState, PromptGraphs, PromptInputs,
                                                StagedGraphs)
from ninfer.engine.backends.torch_runner import check_state_slots, release_device_memory, tensor_bytes
from ninfer.engine.batch import ScheduledBatch, SequenceWork, StepOutput
from ninfer.engine.config import ModelConfig
from ninfer.engine.models import architecture, state_spec
from ninfer.engine.models.weights import WeightReader
from ninfer.engine.ops.cuda_ops import DTYPES, CudaContext, CudaOps
from ninfer.engine.ops.torch_ops import copy_rows
from ninfer.engine.sampler import fill_mask_row, logprob_records
from ninfer.engine.speculative import MAX_DRAFT_TOKENS, commit, position_rows
from ninfer.engine.stages import (Stage, StagePlan, build_stages, copy_across, forward_stages,
                                  memory_split, plan_stages, stage_forward, stage_memory, whole_model)
from ninfer.engine.transfer import indexable
from ninfer.engine.suspend import restore_snapshot, snapshot_bytes, take_snapshot
from ninfer.errors import ConfigError, NInferError
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler, default_cache_dir
from ninfer.kernels.profile import DeviceProfile

_MASK64 = (1 << 64) - 1
log = logging.getLogger("ninfer.engine.cuda")


# --kv-dtype -> the cache's storage dtype (None: the compute dtype)
KV_STORAGE = {"auto": None, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}

class CudaModelRunner:
    """ModelRunner on one CUDA device over the kernels of ninfer/kernels.

    cuda_graph: replay decode from CUDA graphs (False: launch every kernel each step).
    kernel_cache_dir: where compiled cubins are kept (None: `default_cache_dir()`).
    dtype: the activation and KV dtype, torch.bfloat16 or torch.float32.
    num_state_slots: recurrent-state slots (hybrid models; see TorchModelRunner).
    max_draft_tokens: the most drafts a verify row carries (speculative decoding; 0: none), which
    sizes the step buffers (MAX_DECODE_ROWS x (max_draft_tokens + 1) rows) and a hybrid model's
    per-row verify states.
    profile: the device profile's route choices (kernels/profile.py; None: the defaults).
    devices / stage_layers: pipeline stages (--devices, --stage-layers; engine/stages.py): one stage
    per CUDA device (a device may repeat), stage_layers layers each (None: split by free memory);
    `device` is then ignored. Each stage holds its layers' weights, K/V pages and recurrent state on
    its device and its own decode buffers and CUDA graphs; the last one holds the sampler.
    """

    def __init__(self, artifact, *, num_pages: int, page_size: int = 64, device: str = "cuda",
                 cuda_graph: bool = True, kernel_cache_dir: Path | None = None,
                 dtype: torch.dtype = torch.bfloat16, num_state_slots: int = 0, max_draft_tokens: int = 0,
                 profile: DeviceProfile | None = None, kv_dtype: str = "auto", devices: list[str] | None = None,
                 stage_layers: list[int] | None = None) -> None:
        # what a resume after a suspend builds again (engine/suspend.py)
        self._build_args = (artifact, dict(num_pages=num_pages, page_size=page_size, device=device,
                                           cuda_graph=cuda_graph, kernel_cache_dir=kernel_cache_dir, dtype=dtype,
                                           num_state_slots=num_state_slots, max_draft_tokens=max_draft_tokens,
                                           profile=profile, kv_dtype=kv_dtype, devices=devices,
                                           stage_layers=stage_layers))
        if not 0 <= max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"max_draft_tokens must be in 0..{MAX_DRAFT_TOKENS}")
        self.max_draft_tokens = max_draft_tokens
        if kv_dtype not in KV_STORAGE:
            raise ConfigError(f"--kv-dtype {kv_dtype}: the cuda backend takes {', '.join(KV_STORAGE)}")
        self.kv_storage = kv_dtype
        if num_pages <= 0 or page_size <= 0:
            raise ConfigError(f"num_pages and page_size must be positive (got {num_pages}, {page_size})")
        if dtype not in DTYPES:
            raise ConfigError(f"the cuda backend computes in bfloat16 or float32, not {dtype}")
        self.dtype = dtype
        if any(torch.device(d).type != "cuda" for d in devices or [device]):
            raise ConfigError(f"the cuda backend runs on CUDA devices, got {','.join(devices or [device])!r}")
        names = [torch.device(d) for d in devices or [device]]
        names = [torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device()) for d in names]
        self.device = names[-1]  # the last stage's: logits and the sampler
        c: ModelConfig = artifact.meta.config
        check_state_slots(c, num_state_slots)
        self.config = c
        self.spec = state_spec(c)
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_state_slots = num_state_slots if self.spec.recurrent else 0
        self.vocab_size = c.vocab_size
        if kv_dtype in ("int8", "fp8"):  # one byte a value plus an f16 scale per token and head, K and V
            a = self.spec.attention
            self.kv_bytes_per_token = self.spec.kv_bytes_per_token(1) + self.spec.num_attention_layers * 2 * a.kv_heads * 2
        else:
            self.kv_bytes_per_token = self.spec.kv_bytes_per_token(dtype.itemsize)
        self.profile = profile if profile is not None else DeviceProfile()
        self.partition = self.profile.attention_partition
        self._check_shapes(c)
        cache = kernel_cache_dir if kernel_cache_dir is not None else default_cache_dir()
        self.kcs = {d.index: KernelCompiler(cache, device=d.index) for d in names}  # one per device
        self.kc = self.kcs[self.device.index]
        with torch.inference_mode():
            if devices:
                plans = plan_stages(self.spec.kinds, [str(d) for d in names],
                                    stage_layers or memory_split(len(self.spec.kinds), [str(d) for d in names]))
                self.stages = build_stages(artifact, plans, self._stage_ops, architecture(c).model)
            else:
                with torch.cuda.device(self.device):
                    ops = self._stage_ops(None, c)
                    self.stages = [Stage(whole_model(self.spec.kinds, str(self.device)), c, ops,
                                         architecture(c).model.load(WeightReader(artifact, ops, self.device), c))]
            self.ops, self.model = self.stages[-1].ops, self.stages[-1].model  # the lm_head's stage
            self.k_cache, self.v_cache, self.k_scale, self.v_scale = self._kv(num_pages)
            self.conv, self.ssm = self._states(self.num_state_slots)
            self.max_context = min(c.max_position_embeddings, num_pages * page_size)
            rows = MAX_DECODE_ROWS * (max_draft_tokens + 1)
            # per stage its decode buffers on its device; the last one's also hold the sampler's
            self.stage_states = [DecodeState(
                vocab=c.vocab_size if s.plan.last else 1, heads=c.num_attention_heads, head_dim=c.head_dim,
                max_pages=-(-self.max_context // page_size),
                max_parts=L.attention_parts(self.max_context, self.partition),
                device=torch.device(s.device), rows=rows, hidden=c.hidden_size if len(self.stages) > 1 else 0,
                hidden_dtype=dtype) for s in self.stages]
            self.state = self.stage_states[-1]
            # a hybrid model's recurrent state after each verify row (restores a rejected tail)
            self.verify_conv, self.verify_ssm = self._states(rows if max_draft_tokens else 0)
        self._grammar_rows = [False] * rows  # state rows whose mask is a grammar's (else all set)
        self._while_running: Callable[[], None] | None = None  # run_overlapped's host turn
        # launch / collect: two launched steps' sampled ids in pinned memory, and their copies' events
        self._launches = 0
        self._drawn = [torch.zeros(MAX_DECODE_ROWS, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._drawn_at = [torch.cuda.Event() for _ in range(2)]
        graphs = [self._stage_graphs(i, cuda_graph) for i in range(len(self.stages))]
        self.graphs = graphs[0] if len(graphs) == 1 else StagedGraphs(graphs, self._hand_off)
        self._cuda_graph = cuda_graph
        self.prompt_graphs = self._prompt_graphs(cuda_graph)
        self._arenas: dict[str, vmm.Adopted] | None = None  # fix_addresses
        self._stash: dict[str, object] | None = None  # the objects over the arenas while suspended
        self._arenas_refused = False

    # the longest chunk a prompt graph takes: the default prefill chunk (--prefill-chunk)
    PROMPT_GRAPH_ROWS = 1024

    def _prompt_graphs(self, enabled: bool) -> PromptGraphs | None:
        """One sequence's prompt chunks through CUDA graphs (cuda_graphs.PromptGraphs), where every
        launch of the prompt forward can be captured: one stage, no recurrent state (its reset of a
        fresh sequence's slot is the host's), K/V in the compute dtype, prompt attention whose launch
        reads the sequence's extent from the device (the mma route), and no weight expanded per chunk
        (CudaOps.prompt_graph_ok)."""
        if not (enabled and len(self.stages) == 1 and not self.spec.recurrent and not self.k_scale
                and self.ops.prompt_graph_ok()):
            return None
        with torch.cuda.device(self.device):
            inputs = PromptInputs(self.PROMPT_GRAPH_ROWS, -(-self.max_context // self.page_size), self.device)
        return PromptGraphs(self._prompt_graph_forward, inputs, self.ops.profile.prompt_rows, self.device)

    def _prompt_graph_forward(self, rows: int) -> torch.Tensor:
        """The prompt forward a prompt graph captures: the first `rows` rows of its inputs."""
        st, stage = self.prompt_graphs.inputs, self.stages[0]

        def begin(stage: Stage) -> None:
            stage.ops.begin(CudaContext(
                decode=False, positions=st.positions[:rows], kv_slots=st.kv_slots[:rows],
                block_tables=st.block_tables, seq_lens=st.start_pos, max_context=self.max_context,
                cu_seqlens=st.cu_seqlens, state_slots=st.state_slots,
                **self._pools(stage.plan, self.k_cache, self.v_cache, self.k_scale, self.v_scale, self.conv,
                              self.ssm)))
        return forward_stages([stage], st.ids[:rows], begin)

    def _stage_graphs(self, i: int, enabled: bool) -> DecodeGraphs:
        """Stage i's decode graphs (captured on first use) on its device."""
        s = self.stages[i]
        return DecodeGraphs(lambda n, parts, width=1: self._stage_step(i, n, parts, width), torch.device(s.device),
                            enabled=enabled, preserve=(lambda n: self._preserve_states(i, n))
                            if s.plan.recurrent[1] > s.plan.recurrent[0] else None)

    def _stage_ops(self, plan: StagePlan | None, config: ModelConfig) -> CudaOps:
        device = torch.device(plan.device) if plan is not None else self.device
        return CudaOps(self.kcs[device.index], config, self.dtype, device, self.profile)

    def _hand_off(self, i: int, rows: int) -> None:
        """Decode: stage i's residual and normed rows into stage i + 1's input buffers (peer or host copy)."""
        here, there = self.stage_states[i], self.stage_states[i + 1]
        copy_across(there.hidden_in[:rows], here.hidden_out[:rows])
        copy_across(there.normed_in[:rows], here.normed_out[:rows])

    def device_memory(self) -> list[dict]:
        """Per stage (one without --devices): device, layers, bytes of weights, KV and state."""
        if self.stages is None:  # suspended
            return []
        if getattr(self, "_memory", None) is None or self._memory[0] is not self.stages:
            kv, states = [], []
            for s in self.stages:
                p = self._pools(s.plan, self.k_cache, self.v_cache, self.k_scale, self.v_scale, self.conv, self.ssm)
                kv.append([*p["k_cache"], *p["v_cache"], *p["k_scale"], *p["v_scale"]])
                states.append([*p["conv"], *p["ssm"]])
            self._memory = (self.stages, stage_memory(self.stages, kv, states))
        return self._memory[1]

    @staticmethod
    def _pools(plan: StagePlan, k_cache, v_cache, k_scale, v_scale, conv, ssm, verify_conv=None,
               verify_ssm=None) -> dict:
        """A stage's slice of per-layer pools, as CudaContext fields (its layers' own numbering)."""
        (a0, a1), (r0, r1) = plan.attention, plan.recurrent
        return {"k_cache": k_cache[a0:a1], "v_cache": v_cache[a0:a1], "k_scale": k_scale[a0:a1],
                "v_scale": v_scale[a0:a1], "conv": conv[r0:r1], "ssm": ssm[r0:r1],
                **({"verify_conv": verify_conv[r0:r1], "verify_ssm": verify_ssm[r0:r1]}
                   if verify_conv is not None else {})}

    # ---- suspend (engine/suspend.py): give the device memory back, take it again -------------

    def suspend_caches(self) -> dict[str, list[torch.Tensor]]:
        """The persistent state a suspend keeps: KV (and an int8 / fp8 cache's scales) by page,
        recurrent state by slot."""
        return {"k": self.k_cache, "v": self.v_cache, **({"k_scale": self.k_scale, "v_scale": self.v_scale}
                                                          if self.k_scale else {}),
                **({"conv": self.conv, "ssm": self.ssm} if self.conv else {})}

    @property
    def weights_artifact(self):
        """Where the weights are read from (again, at a resume)."""
        return self._build_args[0]

    def resident_bytes(self) -> int:
        """Device bytes a suspend releases: weights, KV and state pools, step inputs (graph pools not counted)."""
        return tensor_bytes((self.stages, self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                             self.conv, self.ssm, self.stage_states,
                             self.verify_conv, self.verify_ssm))

    @torch.inference_mode()
    def release_memory(self, pages: list[int], slots: list[int], reserved: dict | None = None,
                       weights_to_host: bool = False) -> tuple[dict, int, int]:
        """Copy the live KV pages and state slots to host memory (into the pinned `reserved` block,
        when given) and give the device memory back. At fixed addresses (`fix_addresses`): the
        step buffers and the ops' tables go to the host too (and the weights as they sit on the
        device with `weights_to_host`), then the arenas' physical memory is released; the CUDA
        Graphs stay. Otherwise weights, pools, step state and graphs are dropped.
        -> (snapshot, its state bytes, weight bytes)."""
        if len(self.stages) > 1:
            raise ValueError("suspend with --devices is not supported yet")
        if self._arenas is not None:
            return self._release_fixed(pages, slots, reserved, weights_to_host)
        with torch.cuda.device(self.device):
            snapshot = take_snapshot(self.suspend_caches(), pages, slots, self.device, reserved)
            torch.cuda.synchronize(self.device)
            weight_bytes = tensor_bytes((self.model, self.ops))
            for name in ("model", "ops", "k_cache", "v_cache", "k_scale", "v_scale", "conv", "ssm", "state",
                         "verify_conv", "verify_ssm", "graphs", "prompt_graphs", "stages", "stage_states"):
                setattr(self, name, None)
            release_device_memory(self.device)
        return snapshot, snapshot_bytes(snapshot), weight_bytes

    @torch.inference_mode()
    def restore_memory(self, snapshot: dict, weights: object | None = None) -> tuple[int, int, int]:
        """Take the device memory again and copy the snapshot into the same page and slot ids. At
        fixed addresses: map fresh memory at the same addresses, upload the weights (from the
        suspend's host copy, else built again from `weights` or the artifact) and copy the retained
        state back; the graphs replay as they are. Otherwise build the runner again (graphs are
        captured again on first use)."""
        if self._arenas is not None:
            return self._restore_fixed(snapshot, weights)
        artifact, kwargs = self._build_args
        source = weights if weights is not None else artifact
        self.__init__(source, **kwargs)
        self._build_args = (artifact, kwargs)  # the file stays the source of a later resume
        with torch.cuda.device(self.device):
            state_bytes = restore_snapshot(self.suspend_caches(), snapshot, self.device)
            torch.cuda.synchronize(self.device)
        return state_bytes, tensor_bytes((self.model, self.ops)), getattr(source, "payload_bytes", 0)

    # ---- fixed addresses (backends/vmm.py): what a suspend releases stays where it was ----------

    _SUSPENDED = ("model", "ops", "k_cache", "v_cache", "k_scale", "v_scale", "conv", "ssm", "state",
                  "verify_conv", "verify_ssm", "stages", "stage_states")

    @property
    def fixed_addresses(self) -> bool:
        return self._arenas is not None

    @torch.inference_mode()
    def fix_addresses(self) -> bool:
        """Move the KV and state pools, the step buffers with the ops' tables, and the weights into
        fixed-address arenas (CUDA virtual memory management), so that a suspend releases their
        physical memory and keeps the CUDA Graphs. Graphs captured before the move are dropped
        (captured again on first use). False, logged, when the device has no VMM or a tensor is
        also held from elsewhere: a suspend then rebuilds the runner."""
        if self._arenas is not None:
            return True
        if self._arenas_refused or len(self.stages) > 1:
            return False
        self._arenas_refused = True  # until it succeeds: asked once, logged once
        if not vmm.supported(self.device):
            log.info("model suspend: no CUDA virtual memory management on %s; a resume rebuilds the runner",
                     self.device)
            return False
        groups = {"pools": [self.k_cache, self.v_cache, self.k_scale, self.v_scale, self.conv, self.ssm],
                  "aux": [self.state, self.verify_conv, self.verify_ssm, self.ops],
                  "weights": vmm.Skip(self.model, (CudaOps,))}  # the ops are aux: snapshotted as they are
        for name, roots in groups.items():
            why = vmm.movable(vmm.storages(roots, self.device))
            if why is not None:
                log.warning("model suspend: the %s cannot move to fixed addresses (%s); a resume rebuilds the runner",
                            name, why)
                return False
        arenas: dict[str, vmm.Adopted] = {}
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            try:
                for name, roots in groups.items():
                    arenas[name] = vmm.adopt(roots, self.device, after=[a.arena for a in arenas.values()])
            except NInferError as e:  # what moved stays where it is (still correct, not releasable)
                log.warning("model suspend: fixed addresses failed (%s); a resume rebuilds the runner", e)
                return False
            if self.graphs is not None and self.graphs.captures:
                self.graphs = self._stage_graphs(0, self.graphs.enabled)
            if self.prompt_graphs is not None and self.prompt_graphs.captures:
                self.prompt_graphs = self._prompt_graphs(self._cuda_graph)
        self._arenas, self._arenas_refused = arenas, False
        log.debug("model suspend: %s at fixed addresses",
                  ", ".join(f"{name} {a.arena.nbytes / 2**20:.0f} MiB" for name, a in arenas.items()))
        return True

    def _release_fixed(self, pages: list[int], slots: list[int], reserved: dict | None,
                       weights_to_host: bool) -> tuple[dict, int, int]:
        weights, aux = self._arenas["weights"].arena, self._arenas["aux"].arena
        with torch.cuda.device(self.device):
            snapshot = take_snapshot(self.suspend_caches(), pages, slots, self.device, reserved)
            snapshot["aux"] = [aux.bytes_view().to("cpu")]
            state_bytes = snapshot_bytes(snapshot)
            if weights_to_host:
                device_weights = weights.bytes_view()
                host = torch.empty(device_weights.shape, dtype=torch.uint8, pin_memory=True)
                snapshot["weights"] = [host.copy_(device_weights)]
            torch.cuda.synchronize(self.device)
            self._stash = {name: getattr(self, name) for name in self._SUSPENDED}
            for name in self._SUSPENDED:  # nothing reaches the released memory while suspended
                setattr(self, name, None)
            self.prompt_graphs = None  # their pool (a chunk's activations) goes too: captured again after the resume
            for adopted in self._arenas.values():
                adopted.arena.release()
            release_device_memory(self.device)
        return snapshot, state_bytes, weights.nbytes

    def _restore_fixed(self, snapshot: dict, source: object | None) -> tuple[int, int, int]:
        weights = self._arenas["weights"].arena
        read = 0
        with torch.cuda.device(self.device):
            try:
                if "weights" in snapshot:  # the suspend's host copy, at bus speed
                    weights.restore()
                    weights.bytes_view().copy_(snapshot["weights"][0])
                else:  # built again (into ordinary memory) and copied to the fixed addresses
                    source = source if source is not None else self._build_args[0]
                    ops = CudaOps(self.kc, self.config, self.dtype, self.device, self.profile)
                    model = architecture(self.config).model.load(WeightReader(source, ops, self.device), self.config)
                    weights.restore()
                    vmm.copy_into(self._arenas["weights"], vmm.Skip(model, (CudaOps,)), self.device)
                    del model, ops
                    release_device_memory(self.device)  # before the pools take theirs
                    read = getattr(source, "payload_bytes", 0)
                pools = self._arenas["pools"].arena
                pools.restore()
                pools.bytes_view().zero_()  # free pages and slots read as a fresh pool's
                aux = self._arenas["aux"].arena
                aux.restore()
                aux.bytes_view().copy_(snapshot["aux"][0])
                for name, value in self._stash.items():
                    setattr(self, name, value)
                restore_snapshot(self.suspend_caches(), snapshot, self.device)
                torch.cuda.synchronize(self.device)
            except BaseException:
                torch.cuda.synchronize(self.device)
                for name in self._SUSPENDED:
                    setattr(self, name, None)
                for adopted in self._arenas.values():
                    adopted.arena.release()
                release_device_memory(self.device)
                raise
            self._stash = None
            self.prompt_graphs = self._prompt_graphs(self._cuda_graph)
        state_bytes = snapshot_bytes({k: v for k, v in snapshot.items() if k != "weights"})
        return state_bytes, weights.nbytes, read

    def _check_shapes(self, c: ModelConfig) -> None:
        gqa = c.num_attention_heads // c.num_key_value_heads
        if c.head_dim not in (64, 128, 256) or gqa * c.head_dim > 2048:
            raise ConfigError(f"the cuda backend's attention takes head_dim 64/128/256 with at most 2048 query "
                              f"dims per kv head; this model has head_dim {c.head_dim}, {gqa} heads per kv head")
        if c.hidden_size % 8 or c.intermediate_size % 8:
            raise ConfigError("the cuda backend needs hidden and intermediate sizes that are multiples of 8")
        r = self.spec.recurrent
        if r is not None and (r.key_dim not in (64, 128) or r.value_dim not in (64, 128) or r.conv_kernel > 8):
            raise ConfigError(f"the cuda backend's delta rule takes key/value head dims 64 or 128 and conv widths "
                              f"up to 8; this model has {r.key_dim}/{r.value_dim} and {r.conv_kernel}")

    def _layer_devices(self, kind: str) -> list[torch.device]:
        """The device of each attention (kind "attention") or linear-attention layer, by stage."""
        out = []
        for s in self.stages:
            lo, hi = s.plan.attention if kind == "attention" else s.plan.recurrent
            out += [torch.device(s.device)] * (hi - lo)
        return out

    def _kv(self, pages: int) -> tuple[list[torch.Tensor], ...]:
        """K and V caches per attention layer [pages, page_size, kv_heads, head_dim] in the compute
        dtype, or int8 / float8_e4m3fn codes with f16 scales [pages, page_size, kv_heads] (--kv-dtype);
        each on its stage's device."""
        a = self.spec.attention
        shape = (pages, self.page_size, a.kv_heads, a.head_dim)
        devices = self._layer_devices("attention")
        store = KV_STORAGE[self.kv_storage] or self.dtype
        codes = self.kv_storage in ("int8", "fp8")

        def scales() -> list[torch.Tensor]:
            return [torch.zeros(shape[:3], dtype=torch.float16, device=d) for d in devices] if codes else []

        return ([torch.zeros(shape, dtype=store, device=d) for d in devices],
                [torch.zeros(shape, dtype=store, device=d) for d in devices], scales(), scales())

    def _states(self, slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        r = self.spec.recurrent
        if r is None:
            return [], []
        devices = self._layer_devices("recurrent")
        return ([torch.zeros(slots, r.conv_dim, r.conv_kernel - 1, dtype=self.dtype, device=d) for d in devices],
                [torch.zeros(slots, r.value_heads, r.key_dim, r.value_dim, dtype=torch.float32, device=d)
                 for d in devices])

    # -- public ------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Run the batch's state copies, write its K/V and state, run the model, sample where asked."""
        out, _ = self._execute(batch, keep_logits=False)
        return out

    def run_overlapped(self, batch: ScheduledBatch, while_running: Callable[[], None]) -> StepOutput:
        """`run`, calling `while_running()` once: after the batch's device work is queued, before the
        first read that waits for it (the engine hands on the last step's events meanwhile)."""
        self._while_running = while_running
        try:
            out, _ = self._execute(batch, keep_logits=False)
        finally:
            self._host_turn()
        return out

    def launch(self, batch: ScheduledBatch) -> tuple[list[SequenceWork], int]:
        """Queue a decode step (every row a decode row; batch.follows: each row's input is the token
        the step launched just before sampled for the same row) and the copy of its sampled ids to
        the host, without waiting; `collect` reads them. Two launched steps may be in flight."""
        seqs = batch.seqs
        if len(seqs) > MAX_DECODE_ROWS or any(len(s.token_ids) != 1 or s.num_drafts or not s.sample for s in seqs):
            raise ValueError("launch takes one decode row per sequence, at most "
                             f"{MAX_DECODE_ROWS} (prompt and verify rows: run)")
        for s in seqs:
            self._validate(s, follows=batch.follows)
            if batch.follows and (s.sampling.presence_penalty or s.sampling.frequency_penalty or s.token_mask is not None):
                raise ValueError(f"sequence {s.seq_id}: a lookahead row cannot take penalties or a token mask "
                                 "(they need the token it follows)")
        st, n = self.state, len(seqs)
        slot = self._launches % 2
        self._launches += 1
        with torch.cuda.device(self.device), torch.inference_mode():
            rows = self._graph_rows(n)
            parts = self._load_decode(seqs, rows=rows)
            if batch.follows:  # same rows, same order as the step before: its draws are the inputs
                st.ids[:n].copy_(st.tokens[:n])
                for other in self.stage_states[:-1]:
                    copy_across(other.ids[:n], st.ids[:n])
            self.graphs.run(rows, parts)
        # the last stage's device: where the sampler wrote them. In inference mode: a runner built
        # again by restore_memory (itself in inference mode) made _drawn an inference tensor
        with torch.cuda.device(st.tokens.device), torch.inference_mode():
            self._drawn[slot][:n].copy_(st.tokens[:n], non_blocking=True)
            self._drawn_at[slot].record()
        return seqs, slot

    def collect(self, launched: tuple[list[SequenceWork], int]) -> StepOutput:
        """Wait for a launched step's sampled ids (not for any step launched after it)."""
        seqs, slot = launched
        self._drawn_at[slot].synchronize()
        tokens = self._drawn[slot][:len(seqs)].tolist()
        return StepOutput(sampled={s.seq_id: t for s, t in zip(seqs, tokens)})

    def _host_turn(self) -> None:
        """Give the host its turn (`run_overlapped`), once per step."""
        fn, self._while_running = self._while_running, None
        if fn is not None:
            fn()

    def run_with_logits(self, batch: ScheduledBatch) -> tuple[StepOutput, torch.Tensor]:
        """`run`, plus the fp32 logits the sampler saw: [sampling seqs, vocab], one row per seq
        with sample=True in batch order (a copy)."""
        out, logits = self._execute(batch, keep_logits=True)
        rows = [logits[s.seq_id] for s in batch.seqs if s.sample]
        return out, (torch.stack(rows) if rows else torch.empty(0, self.vocab_size, device=self.device))

    def batch_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Like the torch runner's: forward the batch (K/V written) -> logits of its sampling rows."""
        return self.run_with_logits(batch)[1]

    def context_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The context pools for host and disk tiers (engine/transfer.py): page-indexed tensors
        (K and V of every attention layer) and slot-indexed ones (conv windows, delta-rule states)."""
        return [*self.k_cache, *self.v_cache, *self.k_scale, *self.v_scale], [*self.conv, *self.ssm]

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy K/V of page src into page dst, every layer (copy-on-write of a shared page)."""
        self._copy(copies, self.num_pages, "page", (*self.k_cache, *self.v_cache, *self.k_scale, *self.v_scale))

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy the recurrent state of slot src into slot dst, every layer (resuming a checkpoint)."""
        self._copy(copies, self.num_state_slots, "state slot", (*self.conv, *self.ssm))

    def _copy(self, copies: list[tuple[int, int]], limit: int, what: str, tensors: tuple[torch.Tensor, ...]) -> None:
        if not copies:
            return
        for src, dst in copies:
            if not (0 <= src < limit and 0 <= dst < limit):
                raise ValueError(f"{what} copy {src} -> {dst} outside 0..{limit - 1}")
        with torch.cuda.device(self.device), torch.inference_mode():
            src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
            copy_rows(list(map(indexable, tensors)), src, dst)  # each layer on its stage's device

    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 for a fresh single sequence, on private pages and state (the
        runner's caches are untouched); each row is what a sampling step at that position would see."""
        n = len(token_ids)
        if not 0 < n <= self.config.max_position_embeddings or any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"forward_logits takes 1..{self.config.max_position_embeddings} ids in 0..{self.vocab_size - 1}")
        with torch.cuda.device(self.device), torch.inference_mode():
            pages = -(-n // self.page_size)
            k_cache, v_cache, k_scale, v_scale = self._kv(pages)
            conv, ssm = self._states(1)
            seq = SequenceWork(seq_id=-1, token_ids=list(token_ids), start_pos=0, block_table=list(range(pages)),
                               sample=False, sampling=None, state_slot=0 if self.spec.recurrent else -1)  # type: ignore[arg-type]
            hidden = self._prompt_forward([seq], k_cache, v_cache, conv, ssm, (k_scale, v_scale))  # [n, hidden]
            return self.model.compute_logits(self.ops, hidden)

    # -- one step ----------------------------------------------------------------------------

    def _execute(self, batch: ScheduledBatch, keep_logits: bool) -> tuple[StepOutput, dict[int, torch.Tensor]]:
        for s in batch.seqs:
            self._validate(s)
        self.copy_states(batch.state_copies)
        # Decode rows: one token of a sequence that has generated before. A prompt's last token
        # goes the prompt way even alone, so its bits match a run without a prefix hit.
        is_decode = [len(s.token_ids) == 1 and s.sample and bool(s.output_token_ids) for s in batch.seqs]
        verify = [s for s in batch.seqs if s.num_drafts]
        decode = [s for s, d in zip(batch.seqs, is_decode) if d]
        prompt = [s for s, d in zip(batch.seqs, is_decode) if not d and not s.num_drafts]
        if any(s.num_drafts > self.max_draft_tokens for s in verify):
            raise ValueError(f"a verify row carries more than the runner's {self.max_draft_tokens} drafts")
        out = StepOutput(sampled={})
        logits: dict[int, torch.Tensor] = {}
        st = self.state
        with torch.cuda.device(self.device), torch.inference_mode():
            if prompt:
                hidden = self._prompt_forward(prompt, self.k_cache, self.v_cache, self.conv, self.ssm,
                                              (self.k_scale, self.v_scale))
                self._host_turn()
                ends = np.cumsum([len(s.token_ids) for s in prompt]) - 1
                for e, s in zip(ends, prompt):  # an embedding's rows: [tokens, hidden]
                    if s.return_hidden:
                        out.hidden[s.seq_id] = hidden[int(e) + 1 - len(s.token_ids):int(e) + 1].clone()
                rows = [(int(e), s) for e, s in zip(ends, prompt) if s.sample]
                for g in range(0, len(rows), MAX_DECODE_ROWS):
                    group = rows[g:g + MAX_DECODE_ROWS]
                    m = len(group)
                    idx = torch.tensor([r for r, _ in group], dtype=torch.int64, device=self.device)
                    self._load_sampling([s for _, s in group])
                    st.upload(5 * st.rows)  # the sampler's parameters (i32: through top_k)
                    self.model.compute_logits(self.ops, hidden.index_select(0, idx), out=st.logits[:m])
                    self._sample(m)
                    self._collect([s for _, s in group], out, logits if keep_logits else None)
            for g in range(0, len(decode), MAX_DECODE_ROWS):
                group = decode[g:g + MAX_DECODE_ROWS]
                rows = self._graph_rows(len(group))
                parts = self._load_decode(group, rows=rows)
                self.graphs.run(rows, parts)  # every stage's graph in turn
                self._host_turn()
                self._collect(group, out, logits if keep_logits else None)
            for width in sorted({s.num_drafts + 1 for s in verify}):
                same = [s for s in verify if s.num_drafts + 1 == width]
                for g in range(0, len(same), MAX_DECODE_ROWS):
                    group = same[g:g + MAX_DECODE_ROWS]
                    parts = self._load_decode(group, width)
                    self.graphs.run(len(group), parts, width)
                    self._host_turn()
                    self._collect_verify(group, width, out, logits if keep_logits else None)
        return out, logits

    def _validate(self, s: SequenceWork, follows: bool = False) -> None:
        if not s.token_ids:
            raise ValueError(f"sequence {s.seq_id} has no tokens to compute")
        end = s.start_pos + len(s.token_ids)
        if s.start_pos < 0 or end > self.max_context:
            raise ValueError(f"sequence {s.seq_id}: positions {s.start_pos}..{end - 1} outside 0..{self.max_context - 1}")
        used = s.block_table[:-(-end // self.page_size)]
        if len(used) * self.page_size < end or any(not 0 <= p < self.num_pages for p in used):
            raise ValueError(f"sequence {s.seq_id}: block table does not cover {end} tokens with pages "
                             f"in 0..{self.num_pages - 1}")
        if not follows and any(not 0 <= t < self.vocab_size for t in s.token_ids):
            raise ValueError(f"sequence {s.seq_id}: token id outside 0..{self.vocab_size - 1}")
        if self.spec.recurrent and not 0 <= s.state_slot < self.num_state_slots:
            raise ValueError(f"sequence {s.seq_id}: state slot {s.state_slot} outside 0..{self.num_state_slots - 1}")

    def _collect(self, seqs: list[SequenceWork], out: StepOutput, logits: dict[int, torch.Tensor] | None) -> None:
        """Read the sampled ids of state rows [:len(seqs)], and the logprob records of the drawn
        tokens for rows that ask for them."""
        st = self.state
        tokens = st.tokens[:len(seqs)].tolist()
        if any(s.sampling.logprobs for s in seqs):
            for s, rec in zip(seqs, logprob_records(st.logits[:len(seqs)], seqs, tokens)):
                if rec is not None:
                    out.logprobs[s.seq_id] = rec
        for s, t in zip(seqs, tokens):
            out.sampled[s.seq_id] = t
        if logits is not None:
            for i, s in enumerate(seqs):
                logits[s.seq_id] = st.logits[i].clone()

    def _collect_verify(self, seqs: list[SequenceWork], width: int, out: StepOutput,
                        logits: dict[int, torch.Tensor] | None) -> None:
        """Verify rows: read the draws of every position, commit the accepted prefix (and its
        logprob records), restore the recurrent state of a rejected tail from the per-row states."""
        st = self.state
        T = len(seqs) * width
        draws = st.tokens[:T].tolist()
        rows = [r for s in seqs for r in position_rows(s)]
        records = logprob_records(st.logits[:T], rows, draws) if any(s.sampling.logprobs for s in seqs) \
            else [None] * T
        accepted: dict[int, int] = {}
        restore_rows, restore_slots = [], []
        for b, s in enumerate(seqs):
            commit(out, s, draws[b * width:(b + 1) * width], records[b * width:(b + 1) * width], accepted)
            if accepted[s.seq_id] < s.num_drafts and self.verify_conv:
                restore_rows.append(b * width + accepted[s.seq_id])
                restore_slots.append(s.state_slot)
            if logits is not None:
                logits[s.seq_id] = st.logits[b * width:(b + 1) * width].clone()
        if restore_rows:
            src = torch.tensor(restore_rows, dtype=torch.int64, device=self.device)
            dst = torch.tensor(restore_slots, dtype=torch.int64, device=self.device)
            for live, kept in zip((*self.conv, *self.ssm), (*self.verify_conv, *self.verify_ssm)):
                live.index_copy_(0, dst.to(live.device), kept.index_select(0, src.to(kept.device)))

    # -- inputs ------------------------------------------------------------------------------

    def _load_sampling(self, seqs: list[SequenceWork], rows: int | None = None) -> None:
        """Sampler parameters of `seqs` into the staging rows [:len(seqs)] (the caller uploads them),
        penalty counts and grammar masks into state rows [:len(seqs)] (rows [len(seqs):rows],
        padding, get greedy parameters)."""
        st, R = self.state, self.state.rows
        rows = len(seqs) if rows is None else rows
        st.stage()
        f32, i64, top_k = st.host_f32, st.host_i64, st.host_i32[4 * R:5 * R]
        f32.fill(0)
        i64.fill(0)
        top_k.fill(1)
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
            if s.token_mask is not None or self._grammar_rows[i]:
                fill_mask_row(st.masks[i], s.token_mask)
                self._grammar_rows[i] = s.token_mask is not None

    def _graph_rows(self, n: int) -> int:
        """The rows a decode step of n sequences runs: the profile's graph size for n, or n itself
        without graphs or with recurrent state (a padded row has no state slot of its own)."""
        if not self.graphs.enabled or self.spec.recurrent:
            return n
        return self.profile.graph_size(n)

    def _load_decode(self, seqs: list[SequenceWork], width: int = 1, rows: int | None = None) -> int:
        """Decode inputs of `seqs` into state rows [:n * width] (sequence-major: row b * width + i is
        position i of sequence b, its own query over its own context); state slots in rows [:n].
        With width 1, rows [n:rows] are padding (a graph of more rows): no K/V write (slot -1), one
        key of page 0, no state slot. Returns the attention split bucket."""
        st, n, ps = self.state, len(seqs), self.page_size
        R, mp, head_len = st.rows, st.max_pages, st.HEAD
        T = n * width
        rows = T if rows is None or width > 1 else rows
        self._load_sampling([r for s in seqs for r in (position_rows(s) if width > 1 else [s])], rows)  # top_k too
        i32 = st.host_i32
        i32[:4 * R] = 0
        i32[5 * R:6 * R] = 0
        i32[head_len:head_len + rows * mp] = 0
        i32[2 * R + T:2 * R + rows] = -1  # padding: no K/V write
        i32[3 * R + T:3 * R + rows] = 1  # padding: one key
        i32[5 * R + n:5 * R + rows] = -1  # padding: no state slot
        longest = 1
        for b, s in enumerate(seqs):
            i32[5 * R + b] = s.state_slot
            for i in range(width):
                r = b * width + i
                pos = s.start_pos + i
                ctx = pos + 1
                longest = max(longest, ctx)
                pages = s.block_table[:-(-ctx // ps)]
                i32[r] = s.token_ids[i]
                i32[R + r] = pos
                i32[2 * R + r] = pages[pos // ps] * ps + pos % ps
                i32[3 * R + r] = ctx
                base = head_len + r * mp
                i32[base:base + len(pages)] = pages
        st.upload(head_len + rows * mp)
        for other in self.stage_states[:-1]:  # the earlier stages read the same inputs on their devices
            copy_across(other.i32, st.i32)
        needed = L.attention_parts(longest, self.partition)
        return min(1 << (needed - 1).bit_length(), st.max_parts)

    # -- forwards ----------------------------------------------------------------------------

    def _stage_step(self, i: int, n: int, parts: int, width: int = 1) -> None:
        """Stage i's captured step over n sequences of `width` state rows each, from its decode
        buffers: the first stage embeds, a later one takes the residual rows handed to it; the last
        computes logits and samples, an earlier one leaves its residual in its output buffer. With
        one stage: embedding .. sampled tokens. No host sync."""
        stage, st = self.stages[i], self.stage_states[i]
        T = n * width
        stage.ops.begin(CudaContext(
            decode=True, positions=st.positions[:T], kv_slots=st.kv_slots[:T], block_tables=st.block_tables[:T],
            seq_lens=st.context_lens[:T], max_context=parts * self.partition, cu_seqlens=st.cu_seqlens[:n + 1],
            state_slots=st.state_slots[:n], workspace=st.workspace(T, parts), verify_width=width if width > 1 else 0,
            **self._pools(stage.plan, self.k_cache, self.v_cache, self.k_scale, self.v_scale, self.conv, self.ssm,
                          self.verify_conv, self.verify_ssm)))
        hidden, residual = stage_forward(stage, st.ids[:T], (st.hidden_in[:T], st.normed_in[:T]) if i else None)
        if stage.plan.last:
            stage.model.compute_logits(stage.ops, hidden, out=st.logits[:T])
            self._sample(T)
        else:
            st.hidden_out[:T].copy_(residual)
            st.normed_out[:T].copy_(hidden)

    def _preserve_states(self, i: int, n: int):
        """Save stage i's recurrent state of decode rows [:n] (a graph's warm-up run advances it)."""
        slots = self.stage_states[i].state_slots[:n].long()
        p = self._pools(self.stages[i].plan, self.k_cache, self.v_cache, self.k_scale, self.v_scale, self.conv,
                        self.ssm)
        tensors = (*p["conv"], *p["ssm"])
        saved = [t.index_select(0, slots) for t in tensors]

        def restore() -> None:
            for t, s in zip(tensors, saved):
                t.index_copy_(0, slots, s)
        return restore

    def _sample(self, n: int) -> None:
        """state.logits[:n] fp32 -> state.tokens[:n], grammar masks applied before the draw."""
        st = self.state
        L.sample_tokens(self.kc, st.logits[:n], st.masks[:n], st.temperature[:n], st.top_k[:n], st.top_p[:n],
                        st.min_p[:n], st.seeds[:n], st.steps[:n], st.tokens[:n], st.counts[:n], st.presence[:n],
                        st.frequency[:n])

    def _prompt_forward(self, seqs: list[SequenceWork], k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                        conv: list[torch.Tensor], ssm: list[torch.Tensor],
                        kv_scales: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])) -> torch.Tensor:
        """Every token of `seqs` through the model (K/V and state written into the given caches);
        one sequence's chunk of up to PROMPT_GRAPH_ROWS tokens into the runner's own caches from a
        prompt graph where the runner keeps them (_prompt_graphs). -> final normed hidden [tokens, hidden]."""
        ps = self.page_size
        n = sum(len(s.token_ids) for s in seqs)
        graphs = self.prompt_graphs
        rows = (graphs.rows(n) if graphs is not None and len(seqs) == 1 and k_cache is self.k_cache
                and seqs[0].start_pos + n <= self.max_context else 0)
        if rows:
            s = seqs[0]
            graphs.inputs.load(s.token_ids, s.start_pos, s.block_table[:-(-(s.start_pos + n) // ps)], ps,
                               s.state_slot, rows)
            try:
                return graphs.run(rows)[:n]
            except RuntimeError as e:  # a capture the forward's launches refused: eager from now on
                log.warning("prompt CUDA graphs off: the capture of %d rows failed (%s)", rows, e)
                self.prompt_graphs = None
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
        S = len(seqs)
        cu = np.concatenate([[0], np.cumsum([len(s.token_ids) for s in seqs])]).astype(np.int32)
        host = np.concatenate([np.asarray(ids, np.int32), np.asarray(positions, np.int32),
                               np.asarray(slots, np.int32), cu, np.asarray([s.start_pos for s in seqs], np.int32),
                               np.asarray([s.state_slot for s in seqs], np.int32), tables.reshape(-1)])
        o = 3 * n
        if conv:  # a sequence at position 0 starts from the empty state
            fresh = torch.tensor([s.state_slot for s in seqs if s.start_pos == 0], dtype=torch.int64)
            on: dict[torch.device, torch.Tensor] = {}
            for t in (*conv, *ssm):
                if t.device not in on:
                    on[t.device] = fresh.to(t.device)
                t.index_fill_(0, on[t.device], 0)
        inputs = torch.from_numpy(host)
        first = inputs.to(self.stages[0].device)

        def begin(stage: Stage) -> None:  # the inputs on the stage's device, its slice of the pools
            dev = first if torch.device(stage.device) == first.device else inputs.to(stage.device)
            stage.ops.begin(CudaContext(
                decode=False, positions=dev[n:2 * n], kv_slots=dev[2 * n:3 * n],
                block_tables=dev[o + 3 * S + 1:].view(S, max_pages), seq_lens=dev[o + S + 1:o + 2 * S + 1],
                max_context=max(s.start_pos + len(s.token_ids) for s in seqs), cu_seqlens=dev[o:o + S + 1],
                state_slots=dev[o + 2 * S + 1:o + 3 * S + 1],
                **self._pools(stage.plan, k_cache, v_cache, *kv_scales, conv, ssm)))
        return forward_stages(self.stages, first[:n], begin)
