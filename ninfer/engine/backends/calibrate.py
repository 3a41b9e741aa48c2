"""`ninfer calibrate`: time the cuda backend's candidate routes on this GPU for one model's shapes
and choose a DeviceProfile (ninfer/kernels/profile.py says what each choice is).

What is timed, all in bf16 activations, each figure the best of a few samples:
- gemv: per weight format (bf16, int8, int4 symmetric and asymmetric, random stored parts of the
  model's group size) x row count 1..8 x route (each of launchers.GEMV_ROUTES that takes every
  matrix of the model in that format, its weights packed as gemv_pack does), over the model's decode
  matmul shapes weighted by how often a step runs each; beside them cuBLAS (torch.mm on the
  dequantized bf16 weight, rows padded to 8). Each sample runs enough copies of a weight to
  exceed the L2 cache, captured in a CUDA graph, as a decode step reads them.
- mma_pipe: bf16 on the mma route (where it takes the model) with each of launchers.MMA_PIPES and with
  launchers.mma_variant's rule by shape (None), per row count, over the same shapes and weights.
- attention_partition: split-K decode attention over context lengths, 1 and 8 rows, on the decode
  attention route the model runs (DEFAULT_DECODE_ATTENTION where it takes the model; the route
  itself is not timed against the other yet).
- prompt_rows: the prompt route's cuBLAS row block over prompt lengths and the model's shapes.
- graph_rows: the whole decode step replayed from its CUDA graph per row count (models without
  recurrent state; with it, every count keeps its own graph).
The choices come from ninfer/kernels/selection.py (pure; the gemv by CalibrationPlan.gemv_policy:
latency, where one row decides, or throughput over all row counts). Needs a CUDA device.
"""
from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer.engine.ops.cuda_ops import Weight, block_mm, in_features, prompt_call_rows
from ninfer.engine.quant import DEFAULT_GROUP_SIZE
from ninfer.errors import ConfigError
from ninfer.formats import TensorFormat
from ninfer.kernels import launchers as L
from ninfer.kernels.profile import (ALL_ROWS, CUBLAS, DEFAULT_DECODE_ATTENTION, DEFAULT_GEMV_ROUTES, DEFAULT_PARTITION,
                                    DEFAULT_PROMPT_ROWS, DeviceKey, DeviceProfile, ProfileRequest, device_key, profile_path)
from ninfer.kernels.selection import pick, pick_first_point, pick_graph_rows
from ninfer.kernels.timing import sample_seconds

ROTATE_BYTES = 256 << 20  # a sample reads at least this much, beyond any L2
MAX_COPIES = 256
GEMV_FORMATS = {"bf16": TensorFormat("bf16"), "int8": TensorFormat("int8", DEFAULT_GROUP_SIZE),
                "int4_sym": TensorFormat("int4", DEFAULT_GROUP_SIZE, symmetric=True),
                "int4_asym": TensorFormat("int4", DEFAULT_GROUP_SIZE, symmetric=False)}

Progress = Callable[[str], None]  # called once per measurement, with what is being measured


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """What to measure. `quick` keeps a few points of each (tests, a short budget)."""

    rows: tuple[int, ...] = ALL_ROWS
    partitions: tuple[int, ...] = (32, 64, 128, 256, 512)
    contexts: tuple[int, ...] = (512, 2048, 8192, 32768)
    attention_rows: tuple[int, ...] = (1, 8)
    prompt_rows: tuple[int, ...] = (64, 128, 256)
    prompt_tokens: tuple[int, ...] = (128, 512, 2048)
    reps: int = 5
    gemv_policy: str = "latency"  # see choose()

    @classmethod
    def quick(cls) -> CalibrationPlan:
        return cls(rows=(1, 2, 8), partitions=(64, 256, 512), contexts=(512, 4096), attention_rows=(1, 8),
                   prompt_rows=(64, 128), prompt_tokens=(128, 512), reps=3)

    def for_model(self, max_context: int) -> CalibrationPlan:
        contexts = tuple(c for c in self.contexts if c <= max_context) or (min(self.contexts[0], max_context),)
        return dataclasses.replace(self, contexts=contexts)

    def steps(self, routes: int, graph: bool, pipes: int = 0) -> int:
        """Measurements `run` makes (for a progress bar); routes: (format, gemv route) pairs; pipes: the
        bf16 mma pipe candidates timed."""
        return (len(self.rows) * (routes + 1 + pipes) + len(self.partitions) * len(self.contexts)
                * len(self.attention_rows) + len(self.prompt_rows) * len(self.prompt_tokens)
                + (len(self.rows) if graph else 0))


@dataclass(frozen=True, slots=True)
class LinearShape:
    """A decode matmul [n, k] a step runs `count` times."""

    n: int
    k: int
    count: int


def decode_linear_shapes(model, vocab_size: int) -> list[LinearShape]:
    """The distinct matmul shapes of a loaded model's decode step (its cuda Weights, fused as the
    backend fused them) with their counts; the lm_head counted once, the embedding lookup not."""
    seen: dict[int, Weight] = {}

    def walk(obj, depth: int = 0) -> None:
        if depth > 6 or isinstance(obj, (torch.Tensor, str, int, float, type(None))):
            return
        if isinstance(obj, Weight):
            seen.setdefault(id(obj), obj)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x, depth + 1)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), depth + 1)
        elif hasattr(obj, "__dict__"):
            for name, x in vars(obj).items():
                if name != "embed":  # a lookup, not a matmul (a tied lm_head is reached as lm_head)
                    walk(x, depth + 1)

    walk(model)
    counts: dict[tuple[int, int], int] = {}
    for w in seen.values():
        first = w.segments[0] if w.segments else w  # a fused projection kept as runs of formats
        n, k = w.rows, in_features(first.fmt, first.parts[""])
        counts[(n, k)] = counts.get((n, k), 0) + 1
    return [LinearShape(n, k, 1 if n == vocab_size else c) for (n, k), c in sorted(counts.items())]


def random_parts(fmt: TensorFormat, n: int, k: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random stored parts of an [n, k] weight in `fmt` (the format's own part shapes and dtypes)."""
    parts = {}
    for sfx, shape in fmt.stored_shapes((n, k)).items():
        dtype = fmt.stored_dtypes()[sfx]
        if dtype.is_floating_point:
            parts[sfx] = (torch.randn(shape, device=device) * (0.02 if sfx == "" else 0.01)).to(dtype)
        else:
            info = torch.iinfo(dtype)
            parts[sfx] = torch.randint(info.min, info.max + 1, shape, dtype=dtype, device=device)
    return parts


def gemv_routes(fmt: TensorFormat, shapes: list[LinearShape]) -> tuple[str, ...]:
    """The gemv routes that take every matrix of the model in `fmt` with bf16 activations."""
    return tuple(r for r in L.GEMV_ROUTES if all(L.gemv_route_ok(r, fmt, s.k, torch.bfloat16, s.n) for s in shapes))


def _copies(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def _best(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    return min(sample_seconds(fn, device, reps=reps, graph=True))


class Calibrator:
    """Times the candidates of one model's shapes on one device (see the module docstring)."""

    def __init__(self, kc, shapes: list[LinearShape], config, device: torch.device, plan: CalibrationPlan,
                 group_size: int = DEFAULT_GROUP_SIZE, progress: Progress | None = None) -> None:
        self.kc, self.shapes, self.config, self.device, self.plan = kc, shapes, config, device, plan
        self.progress = progress or (lambda _what: None)
        self.formats = {key: (dataclasses.replace(f, group_size=group_size) if f.quantized else f)
                        for key, f in GEMV_FORMATS.items()}

    def _dense(self, s: LinearShape) -> list[torch.Tensor]:
        """Copies of a bf16 [k, n] (transposed) weight, enough to exceed the L2 cache."""
        return [(torch.randn(s.n, s.k, device=self.device) * 0.02).to(torch.bfloat16).t()
                for _ in range(_copies(2 * s.n * s.k))]

    def mma_pipe_candidates(self) -> tuple[int | None, ...]:
        """The bf16 mma pipes to time: the rule (None) and launchers.MMA_PIPES, where the mma route
        takes every bf16 matrix of the model; else none."""
        return (None, *L.MMA_PIPES) if "mma" in gemv_routes(self.formats["bf16"], self.shapes) else ()

    def mma_pipes(self) -> dict[int | None, dict[int, float]]:
        """{pipe (None: the rule by shape): {rows: seconds per step}} of bf16 on the mma route."""
        dev, plan, fmt = self.device, self.plan, self.formats["bf16"]
        candidates = self.mma_pipe_candidates()
        if not candidates:
            return {}
        x = torch.randn(L.MAX_GEMV_ROWS, max(s.k for s in self.shapes), device=dev).to(torch.bfloat16)
        weights = [(s, [L.gemv_pack("mma", fmt, random_parts(fmt, s.n, s.k, dev)) for _ in range(_copies(_bytes(fmt, s)))])
                   for s in self.shapes]
        table: dict[int | None, dict[int, float]] = {}
        for pipe in candidates:
            variant = None if pipe is None else {"MMA_PIPE": pipe}
            for rows in plan.rows:
                self.progress(f"gemv bf16 mma pipe {'rule' if pipe is None else pipe} x{rows}")
                table.setdefault(pipe, {})[rows] = sum(
                    s.count * self._gemv_one(x, fmt, copies, s, rows, "mma", variant) for s, copies in weights)
        return table

    def gemv(self) -> tuple[dict[str, dict[str, dict[int, float]]], dict[int, float]]:
        """{format: {route: {rows: seconds per step}}} and cuBLAS {rows: seconds per step}."""
        dev, plan = self.device, self.plan
        k_max = max(s.k for s in self.shapes)
        x = torch.randn(L.MAX_GEMV_ROWS, k_max, device=dev).to(torch.bfloat16)
        table: dict[str, dict[str, dict[int, float]]] = {}
        for key, fmt in self.formats.items():
            routes = gemv_routes(fmt, self.shapes)
            if not routes:
                continue  # no kernel takes every matrix of the model in this format at its group size
            weights = [(s, [random_parts(fmt, s.n, s.k, dev) for _ in range(_copies(_bytes(fmt, s)))])
                       for s in self.shapes]
            for route in routes:
                packed = [(s, [L.gemv_pack(route, fmt, parts) for parts in copies]) for s, copies in weights]
                for rows in plan.rows:
                    self.progress(f"gemv {key} {route} x{rows}")
                    table.setdefault(key, {}).setdefault(route, {})[rows] = sum(
                        s.count * self._gemv_one(x, fmt, copies, s, rows, route) for s, copies in packed)
                del packed
            del weights
        cublas: dict[int, float] = {}
        dense = [(s, self._dense(s)) for s in self.shapes]
        for rows in plan.rows:
            self.progress(f"cublas x{rows}")
            total = 0.0
            for s, copies in dense:
                xs = x[:rows, :s.k].contiguous()

                def run(copies=copies, xs=xs) -> None:
                    for w_t in copies:
                        block_mm(xs, w_t, L.MAX_GEMV_ROWS)
                total += s.count * _best(run, dev, plan.reps) / len(copies)
            cublas[rows] = total
        return table, cublas

    def _gemv_one(self, x: torch.Tensor, fmt: TensorFormat, copies: list[dict], s: LinearShape, rows: int,
                  route: str, variant: dict[str, int] | None = None) -> float:
        xs = x[:rows, :s.k].contiguous()
        out = torch.empty(rows, s.n, dtype=torch.bfloat16, device=self.device)

        def run() -> None:
            for parts in copies:
                L.gemv(self.kc, xs, fmt, parts, out, route=route, variant=variant)
        return _best(run, self.device, self.plan.reps) / len(copies)

    def attention(self) -> dict[int, dict[str, float]]:
        """{partition: {"r<rows>/c<context>": seconds}} for one layer's decode attention."""
        c, dev, plan = self.config, self.device, self.plan
        hq, hkv, d, page = c.num_attention_heads, c.num_key_value_heads, c.head_dim, 64
        route = DEFAULT_DECODE_ATTENTION
        if not L.attention_decode_route_ok(route, torch.bfloat16, d, hq // hkv, page):
            route = "warp"
        table: dict[int, dict[str, float]] = {}
        for rows in plan.attention_rows:
            for ctx in plan.contexts:
                pages = -(-ctx // page)
                nbytes = 2 * rows * pages * page * hkv * d * 2
                caches = [(torch.randn(rows * pages, page, hkv, d, device=dev).to(torch.bfloat16),
                           torch.randn(rows * pages, page, hkv, d, device=dev).to(torch.bfloat16))
                          for _ in range(_copies(nbytes))]
                q = torch.randn(rows, hq, d, device=dev).to(torch.bfloat16)
                out = torch.empty_like(q)
                tables = torch.arange(rows * pages, dtype=torch.int32, device=dev).view(rows, pages)
                lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
                for part in plan.partitions:
                    self.progress(f"attention x{rows} ctx {ctx} partition {part}")
                    parts = L.attention_parts(ctx, part)
                    ws = (torch.empty(rows, hq, parts, d, device=dev), torch.empty(rows, hq, parts, 2, device=dev))

                    def run(part=part, ws=ws) -> None:
                        for k_cache, v_cache in caches:
                            L.paged_attention_decode(self.kc, q, k_cache, v_cache, tables, lens, ctx, out,
                                                     d ** -0.5, part, ws, route=route)
                    table.setdefault(part, {})[f"r{rows}/c{ctx}"] = _best(run, dev, plan.reps) / len(caches)
                del caches
        return table

    def prompt_rows(self) -> dict[int, dict[int, float]]:
        """{row block: {prompt tokens: seconds}} of the prompt route's matmuls (lm_head excluded)."""
        dev, plan = self.device, self.plan
        shapes = [s for s in self.shapes if s.n != self.config.vocab_size]
        weights = [(s, (torch.randn(s.n, s.k, device=dev) * 0.02).to(torch.bfloat16).t()) for s in shapes]
        x = torch.randn(max(plan.prompt_tokens), max(s.k for s in shapes), device=dev).to(torch.bfloat16)
        table: dict[int, dict[int, float]] = {}
        for block in plan.prompt_rows:
            calls = [prompt_call_rows(w_t, block) for _, w_t in weights]  # as the prompt route runs
            for tokens in plan.prompt_tokens:
                self.progress(f"prompt rows {block} x{tokens} tokens")
                total = 0.0
                for (s, w_t), c in zip(weights, calls):
                    xs = x[:tokens, :s.k].contiguous()
                    total += s.count * _best(lambda xs=xs, w_t=w_t, c=c: block_mm(xs, w_t, block, c), dev, plan.reps)
                table.setdefault(block, {})[tokens] = total
        return table


def decode_step_times(runner, plan: CalibrationPlan, progress: Progress) -> dict[int, float]:
    """{rows: seconds} of the runner's whole decode step replayed from its graph (1 partition),
    over padding-like rows (one key of page 0, no K/V write); the runner's caches are scratch."""
    st = runner.state
    st.context_lens.fill_(1)
    st.kv_slots.fill_(-1)
    st.top_k.fill_(1)
    out: dict[int, float] = {}
    for rows in plan.rows:
        progress(f"decode step x{rows}")
        out[rows] = min(sample_seconds(lambda rows=rows: runner.graphs.run(rows, 1), runner.device,
                                       reps=plan.reps, inner=4))
    return out


GEMV_POLICIES = ("latency", "throughput")


def choose(gemv: dict, cublas: dict[int, float], attention: dict, prompt: dict,
           step: dict[int, float] | None, gemv_policy: str = "latency", mma_pipe: dict | None = None) -> dict:
    """The profile fields from the measurements (pure; see ninfer/kernels/selection.py). The gemv
    route per format and the bf16 mma pipe: latency (default): the fastest at one row (a single
    stream) decides, the other row counts break near-ties; throughput: the least relative time over
    all row counts. The pipe stays the rule by shape (None) unless another beats it."""
    if gemv_policy not in GEMV_POLICIES:
        raise ConfigError(f"gemv policy must be one of {', '.join(GEMV_POLICIES)}, got {gemv_policy!r}")

    def by_policy(candidates: dict, default):
        if gemv_policy == "latency" and any(1 in t for t in candidates.values()):
            return pick_first_point(candidates, default, first=1)
        return pick(candidates, default=default)

    routes = {}
    for key, by_route in gemv.items():
        candidates = dict(by_route)
        if key == "bf16" and cublas:
            candidates[CUBLAS] = cublas
        default = DEFAULT_GEMV_ROUTES[key] if DEFAULT_GEMV_ROUTES[key] in candidates else "warp"
        routes[key] = by_policy(candidates, default)
    graph_rows = ALL_ROWS
    if step:
        measured = pick_graph_rows(step)
        # counts not measured keep their own graph
        graph_rows = tuple(sorted(set(measured) | (set(ALL_ROWS) - set(step))))
    return {"gemv": routes, "mma_pipe": by_policy(mma_pipe, None) if mma_pipe else None,
            "attention_partition": pick(attention, default=DEFAULT_PARTITION),
            "prompt_rows": pick(prompt, default=DEFAULT_PROMPT_ROWS), "graph_rows": graph_rows}


def calibrate(artifact, *, device: torch.device, kernel_cache_dir, key: DeviceKey, plan: CalibrationPlan,
              progress: Progress | None = None, on_plan: Callable[[int], None] | None = None) -> DeviceProfile:
    """Load `artifact` on `device` with a scratch KV pool, time every candidate, choose."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.models import state_spec

    if device.type != "cuda":
        raise ConfigError("calibration needs a CUDA device")
    progress = progress or (lambda _what: None)
    c = artifact.meta.config
    recurrent = state_spec(c).recurrent is not None
    plan = plan.for_model(c.max_position_embeddings)
    quantized = [f.group_size for f in artifact.meta.tensor_formats.values() if f.quantized]

    def scratch_runner(profile: DeviceProfile | None = None) -> CudaModelRunner:
        return CudaModelRunner(artifact, num_pages=8, page_size=64, device=str(device), cuda_graph=True,
                               kernel_cache_dir=kernel_cache_dir, num_state_slots=8 if recurrent else 0,
                               profile=profile)

    with torch.cuda.device(device), torch.inference_mode():
        runner = scratch_runner()
        shapes = decode_linear_shapes(runner.model, c.vocab_size)
        group = quantized[0] if quantized else DEFAULT_GROUP_SIZE
        cal = Calibrator(runner.kc, shapes, c, device, plan, group_size=group, progress=progress)
        if on_plan is not None:
            on_plan(plan.steps(sum(len(gemv_routes(f, shapes)) for f in cal.formats.values()), graph=not recurrent,
                               pipes=len(cal.mma_pipe_candidates())))
        del runner
        _free_device_memory()
        gemv, cublas = cal.gemv()
        pipes = cal.mma_pipes()
        attention = cal.attention()
        prompt = cal.prompt_rows()
        chosen = choose(gemv, cublas, attention, prompt, None, plan.gemv_policy, pipes)
        step = None
        if not recurrent:
            # whole decode steps on the routes just chosen: padding n rows up to a larger graph
            # costs what those routes cost at the larger row count (the warp gemv's cost grows with
            # rows, the mma one's hardly does)
            runner = scratch_runner(DeviceProfile(**chosen))
            step = decode_step_times(runner, plan, progress)
            del runner
            _free_device_memory()
            chosen = choose(gemv, cublas, attention, prompt, step, plan.gemv_policy, pipes)
    measured = {"gemv": gemv, "cublas": cublas, "mma_pipe": {"rule" if p is None else p: t for p, t in pipes.items()},
                "attention": attention, "prompt_rows": prompt,
                "decode_step": step or {}, "shapes": [[s.n, s.k, s.count] for s in shapes]}
    return DeviceProfile(**chosen, device=key, calibrated_on=f"{artifact.meta.name} ({artifact.meta.architecture})",
                         measured=measured)


def _free_device_memory() -> None:
    gc.collect()  # the runner and its graphs' step function refer to each other
    torch.cuda.empty_cache()


def _bytes(fmt: TensorFormat, s: LinearShape) -> int:
    return sum(math.prod(shape) * fmt.stored_dtypes()[sfx].itemsize
               for sfx, shape in fmt.stored_shapes((s.n, s.k)).items())


def resolve_device_profile(request: ProfileRequest, artifact, *, device: str, kernel_cache_dir, cache_dir,
                           log: Callable[[str], None], plan: CalibrationPlan | None = None) -> DeviceProfile:
    """The profile a cuda run uses (ProfileRequest says how it is found); logs which one."""
    if request.mode == "off":
        profile = DeviceProfile(source="off (built-in defaults)")
        log(profile.describe())
        return profile
    dev = torch.device(device)
    key = device_key(dev.index or 0)
    path = request.path or profile_path(cache_dir, key)
    if request.mode == "auto" and path.is_file():
        try:
            profile = DeviceProfile.load(path)
        except ConfigError as e:
            if request.path is not None:
                raise
            log(f"device profile {path} is not usable ({e}); calibrating anew")
        else:
            if profile.device is not None and profile.device != key:
                log(f"device profile {path} was measured on {profile.device.gpu} (driver {profile.device.driver}, "
                    f"ninfer {profile.device.ninfer}); this is {key.gpu} (driver {key.driver}, ninfer {key.ninfer})")
            here = f"{artifact.meta.name} ({artifact.meta.architecture})"
            if profile.calibrated_on and profile.calibrated_on != here:
                log(f"device profile {path} was calibrated on {profile.calibrated_on}, this is {here}: its graph "
                    f"sizes follow that model's step times (`ninfer calibrate` this model to re-measure)")
            log(profile.describe())
            return profile
    log(f"calibrating the cuda routes of {key.gpu} for {artifact.meta.name} (device profile {path})")
    profile = calibrate(artifact, device=dev, kernel_cache_dir=kernel_cache_dir, key=key,
                        plan=plan or CalibrationPlan())
    profile.save(path)
    profile = DeviceProfile.load(path)
    log(profile.describe())
    return profile
