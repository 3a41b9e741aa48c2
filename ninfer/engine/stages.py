"""Pipeline stages (--devices, --stage-layers): one model split by layers over several devices.

A stage is a contiguous slice of the decoder layers with its own device, ops, weights and pools.
Nothing here knows an architecture: a stage's model is the architecture's ONE model class loaded
from a sliced config (`stage_config`: its layers only, so layer and pool indices are the stage's
own) through a `StageReader`, which maps its layers to the artifact's names and loads the
embedding only on the first stage and the lm_head only on the last. One step runs the stages in
order (`forward_stages`): each stage's forward takes the previous stage's residual stream in
place of its embedding and the previous stage's normed output in place of its first input norm
(`HandOff`). A stage before the last reads the next stage's first input norm as its "final norm"
(every architecture's final norm reads like its input norms), so its normed output is exactly what
one device computes there: stages give the bits of one device. The last stage's final normed
hidden goes to the lm_head and the sampler.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.spec import ATTENTION, LINEAR_ATTENTION
from ninfer.engine.models.weights import WeightReader
from ninfer.errors import ConfigError

MIN_STAGES, MAX_STAGES = 2, 8


# ---- options ----------------------------------------------------------------------------------

def parse_devices(value: str | None, backend: str) -> list[str] | None:
    """--devices A,B,...: CUDA indices ("0", "cuda:0"), or "cpu" on the torch backend; 2 to 8
    entries, a device may repeat (two stages on one device). None when not given."""
    if value is None or value == "":
        return None
    names = [v.strip() for v in str(value).split(",")]
    if not MIN_STAGES <= len(names) <= MAX_STAGES:
        raise ConfigError(f"--devices takes {MIN_STAGES} to {MAX_STAGES} devices, got {len(names)} ({value!r})")
    devices = []
    for name in names:
        if name == "cpu":
            if backend == "cuda":
                raise ConfigError("--devices cpu: the cuda backend runs on CUDA devices (use --backend torch)")
            devices.append("cpu")
        elif name.removeprefix("cuda:").isdigit():
            devices.append(f"cuda:{int(name.removeprefix('cuda:'))}")
        else:
            raise ConfigError(f"--devices: {name!r} is not a CUDA device index (0, cuda:1) or cpu")
    if len({d == "cpu" for d in devices}) > 1:
        raise ConfigError(f"--devices {value}: list CUDA devices or cpu, not both")
    return devices


def parse_stage_layers(value: str | None) -> list[int] | None:
    """--stage-layers A,B,...: positive layer counts (checked against the model by `check_split`)."""
    if value is None or value == "":
        return None
    try:
        counts = [int(v) for v in str(value).split(",")]
    except ValueError:
        raise ConfigError(f"--stage-layers takes comma-separated layer counts, got {value!r}") from None
    return counts


def check_split(stage_layers: list[int], devices: list[str], num_layers: int) -> None:
    """--stage-layers must give each device at least one layer and sum to the model's layers."""
    if len(stage_layers) != len(devices):
        raise ConfigError(f"--stage-layers lists {len(stage_layers)} stages for {len(devices)} --devices")
    if any(n < 1 for n in stage_layers):
        raise ConfigError(f"--stage-layers {','.join(map(str, stage_layers))}: every stage needs at least one layer")
    if sum(stage_layers) != num_layers:
        raise ConfigError(f"--stage-layers {','.join(map(str, stage_layers))} sums to {sum(stage_layers)}, but the "
                          f"model has {num_layers} layers")


def balanced_split(num_layers: int, weights: list[float]) -> list[int]:
    """Layers per stage in proportion to `weights` (e.g. each device's free memory), every stage at
    least one, summing to num_layers (largest remainders take the leftover layers)."""
    n = len(weights)
    if num_layers < n:
        raise ConfigError(f"the model has {num_layers} layers, fewer than the {n} --devices")
    total = sum(max(w, 0.0) for w in weights)
    shares = [max(w, 0.0) / total * num_layers if total > 0 else num_layers / n for w in weights]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > num_layers:  # the minimum of one pushed past the total: take from the largest
        counts[max(range(n), key=lambda i: counts[i])] -= 1
    order = sorted(range(n), key=lambda i: (counts[i] - shares[i], i))
    k = 0
    while sum(counts) < num_layers:
        counts[order[k % n]] += 1
        k += 1
    return counts


def memory_split(num_layers: int, devices: list[str]) -> list[int]:
    """The default split: by each device's free memory (a device listed twice shares its memory);
    on CPU stages, equal."""
    if devices[0] == "cpu":
        return balanced_split(num_layers, [1.0] * len(devices))
    import torch

    free = {d: torch.cuda.mem_get_info(torch.device(d))[0] for d in set(devices)}
    return balanced_split(num_layers, [free[d] / devices.count(d) for d in devices])


# ---- a stage ------------------------------------------------------------------------------------

def stage_config(config: ModelConfig, first: int, count: int) -> ModelConfig:
    """The config of layers [first, first + count): every per-layer field sliced, no MTP layers."""
    types = config.layer_types[first:first + count] if config.layer_types else None
    return replace(config, num_hidden_layers=count, layer_types=types, mtp_layers=0)


@dataclass
class StagePlan:
    """Stage i's place in the model: layers [first, first + count) on `device`, and its attention
    and linear-attention layers as ranges of the whole model's per-kind numbering (pool indices)."""

    index: int
    device: str
    first: int
    count: int
    attention: tuple[int, int]
    recurrent: tuple[int, int]
    last: bool

    @property
    def is_first(self) -> bool:
        return self.index == 0


def plan_stages(kinds: tuple[str, ...], devices: list[str], stage_layers: list[int]) -> list[StagePlan]:
    check_split(stage_layers, devices, len(kinds))
    plans, first = [], 0
    for i, (device, count) in enumerate(zip(devices, stage_layers)):
        before, mine = kinds[:first], kinds[first:first + count]
        a0, r0 = before.count(ATTENTION), before.count(LINEAR_ATTENTION)
        plans.append(StagePlan(i, device, first, count, (a0, a0 + mine.count(ATTENTION)),
                               (r0, r0 + mine.count(LINEAR_ATTENTION)), i == len(devices) - 1))
        first += count
    return plans


def final_norm_name(plan: StagePlan) -> str:
    """The norm a stage ends with: the model's final norm on the last stage, else the input norm of
    the next stage's first layer (the hand-off carries its output)."""
    return "model.norm.weight" if plan.last else f"model.layers.{plan.first + plan.count}.input_layernorm.weight"


def stage_names(plan: StagePlan, tensor_names: list[str], tied: bool) -> set[str]:
    """The stored tensors stage `plan` reads: its layers', its final norm, the embedding on the
    first stage (and on the last when tied: it is the lm_head), the lm_head on the last."""
    layers = {f"model.layers.{i}." for i in range(plan.first, plan.first + plan.count)}
    wanted = {final_norm_name(plan)}
    if plan.is_first or (plan.last and tied):
        wanted.add("model.embed_tokens.weight")
    if plan.last:
        wanted.add("lm_head.weight")
    return {n for n in tensor_names if n in wanted or any(n.startswith(p) for p in layers)}


class StageReader(WeightReader):
    """The WeightReader of one stage: layer i of the stage's config is layer first + i of the
    artifact; weights the stage does not hold (the embedding past the first stage, the lm_head
    before the last) read as None."""

    def __init__(self, artifact: Any, ops: Any, device: Any, plan: StagePlan) -> None:
        names = stage_names(plan, list(artifact.meta.tensor_formats), artifact.meta.config.tie_word_embeddings)
        self.parts = artifact.load_parts(device, names=names)
        self.formats = dict(artifact.meta.tensor_formats)
        self.ops = ops
        self.plan = plan

    def _name(self, name: str) -> str:
        if name == "model.norm.weight":
            return final_norm_name(self.plan)
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            return f"model.layers.{self.plan.first + int(index)}.{rest}"
        return name

    def float32(self, name: str):
        return super().float32(self._name(name))

    def linear(self, names: list[str], bias: list[str] | None = None, **options: Any) -> Any:
        if names == ["lm_head.weight"] and not self.plan.last:
            return None
        return super().linear([self._name(n) for n in names], [self._name(n) for n in bias] if bias else None,
                              **options)

    def embedding(self, name: str, lm_head: bool) -> Any:
        head = lm_head and self.plan.last
        if not self.plan.is_first and not head:
            return None
        return super().embedding(name, head)

    def select_rows(self, name: str, rows, as_name: str) -> str:
        super().select_rows(self._name(name), rows, self._name(as_name))
        return as_name  # the stage's own name: linear() maps it again

    def release(self, prefix: str) -> None:
        super().release(self._name(prefix))


@dataclass
class Stage:
    """One built stage: its plan, config slice, ops and model (the architecture's class)."""

    plan: StagePlan
    config: ModelConfig
    ops: Any
    model: Any

    @property
    def device(self) -> str:
        return self.plan.device


def build_stages(artifact: Any, plans: list[StagePlan], make_ops: Callable[[StagePlan, ModelConfig], Any],
                 model_class: type) -> list[Stage]:
    """Load every stage: its ops from make_ops(plan, stage config), its weights on its device."""
    c = artifact.meta.config
    stages = []
    for plan in plans:
        sc = stage_config(c, plan.first, plan.count)
        with device_scope(plan.device):
            ops = make_ops(plan, sc)
            model = model_class.load(StageReader(artifact, ops, ops.device, plan), sc)
        stages.append(Stage(plan, sc, ops, model))
    return stages


# ---- one step through the stages -----------------------------------------------------------------

def device_scope(device: Any):
    """Where a stage's work is launched: its CUDA device current (our kernels launch on the
    current device's stream), nothing to do on CPU."""
    import contextlib

    import torch

    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def copy_across(dst: Any, src: Any) -> None:
    """dst <- src between stages: on one device or between peers a direct copy (torch orders it
    after the source device's work and before the destination's); between CUDA devices without
    peer access, through pinned host memory, the destination's stream waiting for the download."""
    import torch

    a, b = src.device, dst.device
    if a == b or a.type != "cuda" or b.type != "cuda" or torch.cuda.can_device_access_peer(b.index, a.index):
        dst.copy_(src)
        return
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)  # the caching host allocator reuses it safely
    with torch.cuda.device(a):
        host.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    with torch.cuda.device(b):
        torch.cuda.current_stream().wait_event(done)
        dst.copy_(host, non_blocking=True)


def moved(t: Any, device: Any) -> Any:
    """t on `device`, through `copy_across` (t itself when it is there already)."""
    import torch

    device = torch.device(device)
    if t.device == device:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    copy_across(out, t)
    return out


class HandOff:
    """A stage's ops as its model sees them: the ops themselves, except that with `incoming` (the
    previous stage's residual stream and normed output; None on the first stage) `embed` returns a
    copy of that residual and the norm of it that follows (the first layer's input norm) returns
    a copy of that normed output. `residual` is the stream the forward updated in place: what the
    next stage takes."""

    def __init__(self, ops: Any, incoming: tuple[Any, Any] | None) -> None:
        self._ops = ops
        self._incoming = incoming
        self.residual = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def embed(self, ids: Any, w: Any, scale: float = 1.0) -> Any:
        if self._incoming is None:
            self.residual = self._ops.embed(ids, w, scale)
        else:  # a copy: the forward updates it in place, and a decode graph's inputs must stay
            self.residual = moved(self._incoming[0], self._ops.device).clone()
        return self.residual

    def rms_norm(self, x: Any, w: Any, eps: float) -> Any:
        if self._incoming is not None and x is self.residual:
            normed, self._incoming = self._incoming[1], None  # once: the stage's first input norm
            return moved(normed, self._ops.device).clone()
        return self._ops.rms_norm(x, w, eps)


def stage_forward(stage: Stage, input_ids: Any, incoming: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """One stage's forward over the step its ops began, from the previous stage's (residual,
    normed output) -> (its normed output, its residual stream; None for the whole model on one device)."""
    if incoming is None and stage.plan.last:  # one device: the plain forward, nothing to hand on
        return stage.model.forward(stage.ops, input_ids), None
    ops = HandOff(stage.ops, incoming)
    x = stage.model.forward(ops, input_ids)
    return x, ops.residual


def forward_stages(stages: list[Stage], input_ids: Any, begin: Callable[[Stage], None]) -> Any:
    """The model over the stages in order; begin(stage) starts the step on that stage's ops (its
    context: inputs on its device, its slice of the pools). -> the last stage's normed hidden."""
    incoming = x = None
    for stage in stages:
        with device_scope(stage.ops.device):
            begin(stage)
            x, residual = stage_forward(stage, moved(input_ids, stage.ops.device), incoming)
            incoming = (residual, x)
    return x


def stage_spec(spec: Any, plan: StagePlan) -> Any:
    """The model's StateSpec cut to a stage's layers (its pool sizes; the state shapes stay)."""
    return replace(spec, kinds=spec.kinds[plan.first:plan.first + plan.count])


def whole_model(kinds: tuple[str, ...], device: str) -> StagePlan:
    """The one stage of a single-device runner."""
    return StagePlan(0, device, 0, len(kinds), (0, kinds.count(ATTENTION)), (0, kinds.count(LINEAR_ATTENTION)), True)


def stage_memory(stages: list[Stage], kv: list[Any], states: list[Any]) -> list[dict[str, Any]]:
    """Per stage: its device, layers and the bytes of its weights, KV pages and recurrent state
    (kv / states: each stage's pool tensors)."""
    from ninfer.engine.backends.torch_runner import tensor_bytes

    return [{"stage": s.plan.index, "device": str(s.device), "layers": [s.plan.first, s.plan.first + s.plan.count - 1],
             "weights_bytes": tensor_bytes(s.model), "kv_bytes": tensor_bytes(k),
             "state_bytes": tensor_bytes(r)} for s, k, r in zip(stages, kv, states)]


# ---- start-up ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pipeline:
    """--devices and --stage-layers as the loader takes them (stage_layers None: memory split)."""

    devices: tuple[str, ...]
    stage_layers: tuple[int, ...] | None = None

    @classmethod
    def from_flags(cls, devices: str | None, stage_layers: str | None, backend: str) -> Pipeline | None:
        """The options' values checked on their own (the model checks the layer counts later)."""
        parsed = parse_devices(devices, backend)
        counts = parse_stage_layers(stage_layers)
        if parsed is None:
            if counts is not None:
                raise ConfigError("--stage-layers needs --devices")
            return None
        if counts is not None and len(counts) != len(parsed):
            raise ConfigError(f"--stage-layers lists {len(counts)} stages for {len(parsed)} --devices")
        return cls(tuple(parsed), tuple(counts) if counts is not None else None)

    def check(self, backend: str, num_layers: int) -> list[int]:
        """Check the devices against the backend and machine, and the split against the model;
        -> layers per stage (the memory split when --stage-layers was not given)."""
        devices = list(self.devices)
        if devices[0] == "cpu" and backend == "cuda":
            raise ConfigError("--devices cpu: the cuda backend runs on CUDA devices (use --backend torch)")
        if devices[0] != "cpu":
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            missing = [d for d in devices if int(d.split(":")[1]) >= count]
            if missing:
                raise ConfigError(f"--devices {','.join(self.devices)}: {missing[0]} does not exist "
                                  f"({count} CUDA devices visible)")
        if self.stage_layers is not None:
            check_split(list(self.stage_layers), devices, num_layers)
            return list(self.stage_layers)
        return memory_split(num_layers, devices)


def auto_kv_tokens(kinds: tuple[str, ...], devices: list[str], split: list[int], bytes_per_token: int,
                   budget: Callable[[str], int]) -> int:
    """--kv-capacity auto over stages: the most tokens every device holds, each device paying the
    K/V of the attention layers of the stages it holds (budget(device): its bytes for KV)."""
    plans = plan_stages(kinds, devices, split)
    attention = max(kinds.count(ATTENTION), 1)
    share: dict[str, int] = {}
    for p in plans:
        share[p.device] = share.get(p.device, 0) + p.attention[1] - p.attention[0]
    per_layer = bytes_per_token / attention
    return min(int(max(budget(d), 0) // max(per_layer * n, 1)) for d, n in share.items() if n) \
        if any(share.values()) else 1 << 40
