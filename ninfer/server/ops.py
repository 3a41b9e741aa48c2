"""Operational endpoints: /health, /v1, /v1/models, /props, /v1/load, /stats, /metrics, /slots.

They read only published state (the engine's snapshot, the server's counters), so polling them
never waits on the engine.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ninfer.errors import RequestError
from ninfer.server.generate import sampler_params, session_digest
from ninfer.server.http import Call
from ninfer.server.tier_metrics import host_kv_bytes, tier_series
from ninfer.version import version_string

if TYPE_CHECKING:
    from ninfer.engine.loader import ModelFacts
    from ninfer.server.router import ModelPool, ModelSlot
    from ninfer.server.state import ServerState

API_INDEX = (
    ("GET", "/health", "process health and build version"),
    ("GET", "/openapi.json", "OpenAPI 3.1 description of every route"),
    ("GET", "/v1/load", "serving capacity, current load and monotonic token counters"),
    ("GET", "/metrics", "Prometheus text: llama.cpp's --metrics series plus ninfer's"),
    ("GET", "/stats", "the /v1/load snapshot plus the ingress peak and the engine counters"),
    ("GET", "/slots", "per-cell occupancy of the private context cache"),
    ("POST", "/slots/{id}", "save, restore or erase a retained session (?action=, needs --slot-save-path)"),
    ("GET", "/props", "llama.cpp-shaped server properties"),
    ("GET", "/v1", "this endpoint index"),
    ("GET", "/v1/models", "the served model alias, context limit, modalities and meta"),
    ("GET", "/v1/models/{id}", "lookup of the served alias"),
    ("GET", "/models", "every model of the catalog with its status (llama.cpp's router API)"),
    ("POST", "/models/load", "load a model, or wake it"),
    ("POST", "/models/unload", "unload a model once its requests have finished"),
    ("POST", "/models/sleep", "put an idle model to sleep (--model-suspend)"),
    ("POST", "/v1/models/{id}/suspend", "give an idle model's memory back (--model-suspend)"),
    ("POST", "/v1/models/{id}/resume", "take it again"),
    ("GET", "/v1/models/{id}/residency", "resident or suspended, and what a suspend moves"),
    ("GET", "/models/sse", "one server-sent event per model status change"),
    ("POST", "/v1/chat/completions", "OpenAI-style chat generation (also /chat/completions)"),
    ("POST", "/v1/completions", "OpenAI legacy completion of a raw prompt"),
    ("POST", "/completion", "llama.cpp's native completion of a raw prompt (also /completions)"),
    ("POST", "/tokenize", "the model's tokenizer, llama.cpp's shape"),
    ("POST", "/detokenize", "token ids to text"),
    ("POST", "/apply-template", "the prompt a chat request renders to"),
    ("POST", "/infill", "llama.cpp fill-in-the-middle (models with FIM tokens)"),
    ("POST", "/v1/embeddings", "OpenAI embeddings: the served model's pooled hidden states (also /embeddings)"),
    ("POST", "/v1/rerank", "documents ranked by relevance to a query (also /rerank, /v1/reranking, /reranking)"),
    ("POST", "/v1/messages", "Anthropic Messages"),
    ("POST", "/v1/responses", "OpenAI Responses"),
)


async def handle_health(call: Call) -> None:
    """200 while the server serves. A single-model server whose Engine failed answers 503 (a
    router reports a failed model in GET /models and loads it again on its next request)."""
    pool = call.pool
    if not pool.router:
        slot = next(iter(pool.slots.values()))
        failed = getattr(slot.state.loaded.engine, "failed", None) if slot.state is not None else None
        if failed:
            raise RequestError(f"the engine failed: {failed}", status=503, code="service_unavailable",
                               type="service_unavailable")
        if slot.status == "sleeping" and not slot.auto_resume:
            raise RequestError("the model is suspended and auto_resume is off: POST /v1/models/{id}/resume",
                               status=503, code="model_suspended", type="service_unavailable")
    await call.respond(200, {"status": "ok", "version": version_string()})


def model_object(state: ServerState) -> dict[str, Any]:
    """A loaded model's GET /v1/models entry."""
    assert state.loaded is not None
    facts = state.loaded.facts
    return {
        "id": state.model_id,
        "object": "model",
        "created": int(state.ready_unix),
        "owned_by": "ninfer",
        "max_model_len": facts.max_context,
        "context_window": facts.max_context,
        "context_length": facts.max_context,
        "modalities": {"vision": False},
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "meta": model_meta(facts),
    }


def catalog_object(pool: ModelPool, slot: ModelSlot) -> dict[str, Any]:
    """A model's GET /v1/models entry: the loaded model's facts, else its name; a router adds its
    aliases and status."""
    entry = model_object(slot.state) if slot.state is not None and slot.state.loaded is not None \
        else {"id": slot.name, "object": "model", "created": 0, "owned_by": "ninfer"}
    if pool.router:
        entry["aliases"] = list(slot.spec.aliases)
        entry["status"] = {"value": slot.status}
    return entry


def model_meta(facts: ModelFacts) -> dict[str, Any]:
    """llama.cpp's `meta` object of a model entry, from the engine's facts."""
    return {"n_vocab": facts.vocab_size, "n_ctx": facts.max_context, "n_ctx_train": facts.trained_context,
            "n_embd": facts.hidden_size, "n_params": facts.num_parameters, "size": facts.stored_bytes,
            "ftype": "+".join(facts.weight_formats)}


async def handle_models(call: Call) -> None:
    pool = call.pool
    await call.respond(200, {"object": "list", "data": [catalog_object(pool, s) for s in pool.slots.values()]})


async def handle_model(call: Call) -> None:
    model_id = call.extra["model_id"]
    slot = call.pool.find(model_id)
    if slot is None:
        raise RequestError(f"The model {model_id!r} does not exist", status=404, param="model",
                           code="model_not_found")
    await call.respond(200, catalog_object(call.pool, slot))


async def handle_index(call: Call) -> None:
    await call.respond(200, {
        "object": "ninfer.api_index",
        "model": call.state.model_id if call.state is not None else None,
        "models": [s.name for s in call.pool.slots.values()],
        "version": version_string(),
        "endpoints": [{"method": m, "path": p, "description": d} for m, p, d in API_INDEX],
    })


async def handle_props(call: Call) -> None:
    state = call.state
    s = state.base_sampling
    n_predict = state.config.default_max_tokens if state.config.default_max_tokens is not None else -1
    await call.respond(200, {
        "default_generation_settings": {
            "n_ctx": state.loaded.max_context,
            "speculative": False,
            "params": {"n_predict": n_predict, "max_tokens": n_predict, "temperature": s.temperature,
                       "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                       "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                       "seed": -1 if s.seed is None else s.seed},
        },
        "total_slots": state.loaded.engine.snapshot().max_concurrency,
        "kv_cache": kv_cache_props(state.loaded.engine),
        "devices": device_memory(state.loaded.engine),
        "model_alias": state.model_id,
        "model_path": state.config.model_path or state.loaded.facts.path,
        "modalities": {"vision": False, "audio": False},
        "build_info": f"ninfer {version_string()}",
        "endpoint_slots": True,
        "endpoint_props": True,
        "endpoint_metrics": True,
        "cors_proxy_enabled": False,
    })


def kv_cache_props(engine: Any) -> dict[str, Any]:
    """The KV pool as configured: storage dtype (--kv-dtype), bytes per token, capacity in tokens."""
    snap = engine.snapshot()
    runner = engine.runner
    tensors = runner.context_tensors()[0] if hasattr(runner, "context_tensors") else []
    return {"dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
            "bytes_per_token": getattr(runner, "kv_bytes_per_token", None),
            "capacity_tokens": snap.kv_capacity_tokens, "page_tokens": snap.kv_page_tokens}


def device_memory(engine: Any) -> list[dict[str, Any]]:
    """Per pipeline stage (one without --devices): its device, layers [first, last] and the bytes
    of its weights, KV pages and recurrent state on that device."""
    report = getattr(getattr(engine, "runner", None), "device_memory", None)
    return report() if report is not None else []


def _device_series(lines: list[str], stages: list[dict[str, Any]]) -> None:
    """ninfer:device_memory_bytes{device, kind}: the stages' bytes summed per device."""
    totals: dict[tuple[str, str], int] = {}
    for st in stages:
        for kind in ("weights", "kv", "state"):
            key = (st["device"], kind)
            totals[key] = totals.get(key, 0) + st[f"{kind}_bytes"]
    lines.append("# HELP ninfer:device_memory_bytes bytes of weights, KV pages and recurrent state per device")
    lines.append("# TYPE ninfer:device_memory_bytes gauge")
    for (device, kind), v in sorted(totals.items()):
        lines.append(f'ninfer:device_memory_bytes{{device="{device}",kind="{kind}"}} {v}')


def load_report(call: Call, obj: str) -> dict[str, Any]:
    state = call.state
    snap = state.loaded.engine.snapshot()
    return {
        "object": obj,
        "model": state.model_id,
        "uptime_seconds": state.uptime(),
        "capacity": {"max_concurrency": snap.max_concurrency, "max_pending_requests": snap.max_pending_requests,
                     "max_admitted_requests": snap.max_concurrency + snap.max_pending_requests,
                     "max_context": snap.max_context, "kv_capacity_tokens": snap.kv_capacity_tokens,
                     "kv_capacity_pages": snap.kv_capacity_pages, "kv_page_tokens": snap.kv_page_tokens,
                     # recurrent-state slots (hybrid models; 0 for pure attention): lanes + checkpoints
                     "device_state_slots": snap.state_slots_total,
                     "host_kv_bytes": snap.tiers.host_budget if snap.tiers is not None else 0},
        "requests": {"admitted": max(state.admitted, snap.admitted), "running": snap.running,
                     "prefilling": snap.prefilling, "decode_ready": snap.decode_ready, "waiting": snap.waiting},
        "occupancy": {"device_main_kv_pages": snap.kv_pages_used, "device_main_kv_tokens": snap.kv_tokens_used,
                      "device_state_slots": snap.state_slots_used, "host_kv_bytes": host_kv_bytes(snap.tiers)},
        "counters": {"computed_prefill_tokens": snap.computed_prefill_tokens,
                     "committed_decode_tokens": snap.committed_decode_tokens,
                     "reused_prompt_tokens": snap.reused_prompt_tokens,
                     "decode_rounds": snap.decode_rounds, "decode_row_rounds": snap.decode_row_rounds},
        **({"speculative": {"backend": snap.spec_method, "rounds": snap.spec_rounds,
                            "drafted_tokens": snap.drafted_tokens, "accepted_tokens": snap.accepted_tokens,
                            "fallback_steps": snap.spec_fallback_steps}} if snap.spec_method else {}),
    }


async def handle_load(call: Call) -> None:
    await call.respond(200, load_report(call, "ninfer.load"))


async def handle_stats(call: Call) -> None:
    state = call.state
    snap = state.loaded.engine.snapshot()
    report = load_report(call, "ninfer.stats")
    report["requests"]["peak_admitted"] = max(state.peak_admitted, snap.peak_admitted)
    uptime = state.uptime()
    report["tokens"] = {"prompt_tokens": snap.computed_prefill_tokens + snap.reused_prompt_tokens,
                        "computed_prefill_tokens": snap.computed_prefill_tokens,
                        "reused_prompt_tokens": snap.reused_prompt_tokens,
                        "predicted_tokens": snap.predicted_tokens_total,
                        "prompt_seconds": snap.prompt_seconds_total,
                        "predicted_seconds": snap.predicted_seconds_total}
    total_tokens = snap.computed_prefill_tokens + snap.committed_decode_tokens
    report["throughput_tokens_per_second"] = total_tokens / uptime if uptime > 0 else 0.0
    report["scheduler"] = {"prefill_units": snap.prefill_units, "decode_rounds": snap.decode_rounds,
                           "requests_finished": snap.requests_finished,
                           "requests_cancelled": snap.requests_cancelled,
                           "requests_failed": snap.requests_failed,
                           "requests_rejected": snap.requests_rejected + state.requests_rejected,
                           "waiting_expired": snap.waiting_expired}
    report["decode_batch"] = {"rounds": snap.decode_rounds, "row_rounds": snap.decode_row_rounds,
                              "mean_rows": snap.decode_row_rounds / snap.decode_rounds if snap.decode_rounds else 0.0}
    report["context_cache"] = {"retained_continuations": snap.retained_continuations,
                               "max_private_continuations": snap.max_private_continuations,
                               "prefix_cache_hit_tokens": snap.prefix_cache_hit_tokens,
                               "selections": dict(snap.context_selections)}
    now = time.monotonic()
    report["queue"] = {"depth": snap.waiting,
                       "entries": [{"request_id": q.request_id, "position": q.position,
                                    "wait_seconds": max(0.0, now - q.submitted_at)} for q in snap.queue]}
    await call.respond(200, report)


async def handle_slots(call: Call) -> None:
    """One entry per slot, idle ones included, as llama-server lists them: a slot is a private
    context-cache cell (the id_slot a response reported). A running request is shown on the cell it
    will publish into when nothing else changes the cache first: the lowest free cell, else the
    least recently used one (the cache's insert rule). Without a context cache the slots are the
    lanes. Each entry has llama-server's params: the running request's, the last retained
    request's, or the server's defaults."""
    state = call.state
    snap = state.loaded.engine.snapshot()
    defaults = sampler_params(state.base_sampling, state.config.default_max_tokens)
    cells = {c.slot: c for c in snap.continuations}
    count = snap.max_private_continuations or snap.max_concurrency
    # snap.continuations is least recently used first
    order = [i for i in range(count) if i not in cells] + [c.slot for c in snap.continuations]
    lane_at = dict(zip(order, sorted(snap.lanes, key=lambda lane: lane.lane)))
    digests: dict[int, tuple[str, ...]] = {}
    slots: list[dict[str, Any]] = []
    per_page: dict[str, int] = {}  # pipeline stages: K/V bytes of one page on each device
    stages = device_memory(state.loaded.engine)
    pages = getattr(getattr(state.loaded.engine, "runner", None), "num_pages", 0)
    if len(stages) > 1 and pages:
        for st in stages:
            per_page[st["device"]] = per_page.get(st["device"], 0) + st["kv_bytes"] // pages
    for i in range(count):
        entry: dict[str, Any] = {"id": i, "n_ctx": snap.max_context, "speculative": snap.spec_method is not None,
                                 "is_processing": i in lane_at, "retained": i in cells,
                                 "n_prompt_tokens": 0, "n_prompt_tokens_cache": 0,
                                 "params": state.slot_params.get(i, defaults)}
        c = cells.get(i)
        if c is not None:
            # a hybrid model's page checkpoints, then the endpoint checkpoint at the executed frontier
            frontiers = c.page_checkpoints + ((c.n_tokens, c.state_slot),)
            known = state.slot_digests.get(c.entry_id)
            digests[c.entry_id] = known or (session_digest(list(c.session)),
                                            *(session_digest(list(c.session[:n])) for n, _ in frontiers))
            session, *endpoints = digests[c.entry_id]
            checkpoints: list[dict[str, Any]] = []
            for (n, state_slot), digest in zip(frontiers, endpoints):
                checkpoints.append({"frontier": n, "session_digest": digest})
                if state_slot >= 0:  # a hybrid model: the recurrent-state slot the checkpoint occupies
                    checkpoints[-1]["state_slot"] = state_slot
            # the session depth as both counts
            entry.update(session_digest=session, checkpoints=checkpoints, n_pages=c.n_pages,
                         n_prompt_tokens=len(c.session), n_prompt_tokens_cache=len(c.session))
            if per_page:  # --devices: the K/V bytes the cell's pages hold on each device
                entry["device_kv_bytes"] = {d: c.n_pages * b for d, b in per_page.items()}
        lane = lane_at.get(i)
        if lane is not None:
            entry.update(lane=lane.lane, id_task=lane.request_id, n_prompt_tokens=lane.n_prompt_tokens,
                         n_prompt_tokens_cache=lane.n_cached_tokens, n_decoded=lane.n_output_tokens,
                         params=state.running_params.get(lane.request_id, defaults))
        slots.append(entry)
    state.slot_digests = digests  # only live entries stay memoized
    await call.respond(200, slots)


def _series(lines: list[str], name: str, kind: str, help_text: str, value: float | int,
            labelled: dict[str, float | int] | None = None, label: str = "") -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    if labelled is not None:
        for key, v in sorted(labelled.items()):
            lines.append(f'{name}{{{label}="{key}"}} {v}')
    else:
        lines.append(f"{name} {value}")


def metrics_text(call: Call) -> str:
    state = call.state
    snap = state.loaded.engine.snapshot()
    L: list[str] = []
    pt, ps = snap.prompt_tokens_total, snap.prompt_seconds_total
    dt, ds = snap.predicted_tokens_total, snap.predicted_seconds_total
    _series(L, "llamacpp:prompt_tokens_total", "counter", "prompt tokens computed by prefill; prefix-cache hits excluded", pt)
    _series(L, "llamacpp:prompt_seconds_total", "counter", "prefill execution time", ps)
    _series(L, "llamacpp:prompt_tokens_cached_total", "counter", "prompt tokens served from the context cache",
            snap.reused_prompt_tokens)
    _series(L, "llamacpp:tokens_predicted_total", "counter", "generated tokens, each request's first included", dt)
    _series(L, "llamacpp:tokens_predicted_seconds_total", "counter", "decode execution time", ds)
    _series(L, "llamacpp:prompt_tokens_seconds", "gauge", "prompt tokens over prefill seconds", pt / ps if ps > 0 else 0.0)
    _series(L, "llamacpp:predicted_tokens_seconds", "gauge", "decoded tokens over decode seconds", dt / ds if ds > 0 else 0.0)
    _series(L, "llamacpp:n_decode_total", "counter", "decode rounds executed", snap.decode_rounds)
    _series(L, "llamacpp:n_tokens_max", "counter", "largest observed n_tokens: the most tokens one sequence held",
            snap.max_sequence_tokens)
    _series(L, "llamacpp:n_busy_slots_per_decode", "gauge", "average requests per decode round",
            snap.decode_row_rounds / snap.decode_rounds if snap.decode_rounds else 0.0)
    _series(L, "llamacpp:kv_cache_usage_ratio", "gauge", "occupied share of the device KV cache",
            snap.kv_pages_used / snap.kv_capacity_pages if snap.kv_capacity_pages else 0.0)
    _series(L, "llamacpp:kv_cache_tokens", "gauge", "tokens held in the device KV cache", snap.kv_tokens_used)
    _series(L, "llamacpp:requests_processing", "gauge", "requests holding an execution lane", snap.running)
    _series(L, "llamacpp:requests_deferred", "gauge", "requests waiting for admission", snap.waiting)
    _series(L, "ninfer:requests_total", "counter", "requests completed with an outcome", state.requests_total)
    _series(L, "ninfer:requests_failed_total", "counter", "accepted requests that ended in an error", state.requests_failed)
    _series(L, "ninfer:requests_rejected_total", "counter", "generation requests rejected during preparation",
            state.requests_rejected)
    _series(L, "ninfer:requests_admitted", "gauge", "requests holding server ingress capacity, in any phase",
            max(state.admitted, snap.admitted))
    _series(L, "ninfer:prefix_cache_hit_tokens_total", "counter",
            "prompt tokens of completed requests served from a cached prefix", snap.prefix_cache_hit_tokens)
    _series(L, "ninfer:reused_prompt_tokens_total", "counter",
            "prompt tokens restored from the context cache instead of prefilled", snap.reused_prompt_tokens)
    _series(L, "ninfer:draft_tokens_total", "counter", "speculative draft tokens proposed for completed requests",
            snap.completed_drafted_tokens)
    _series(L, "ninfer:draft_accepted_tokens_total", "counter",
            "speculative draft tokens accepted for completed requests", snap.completed_accepted_tokens)
    _series(L, "ninfer:uptime_seconds", "gauge", "seconds since the Engine became ready", state.uptime())
    _series(L, "ninfer:context_cache_exhausted_requests_total", "counter",
            "requests failed because the context cache had no placement for them", snap.context_cache_exhausted)
    _series(L, "ninfer:engine_recoveries_total", "counter",
            "host-side worker failures the Engine survived instead of latching unavailable", snap.engine_recoveries)
    _series(L, "ninfer:waiting_cancelled_requests_total", "counter",
            "requests the client cancelled while they waited for admission", snap.waiting_cancelled)
    _series(L, "ninfer:waiting_expired_requests_total", "counter",
            "requests that reached --pending-timeout-ms before admission", snap.waiting_expired)
    _series(L, "ninfer:waiting_abandoned_seconds_total", "counter",
            "time those cancelled and expired requests had waited", snap.waiting_abandoned_seconds)
    _series(L, "ninfer:cancelled_prefills_total", "counter",
            "requests cancelled while their prompt prefilled", snap.cancelled_prefills)
    _series(L, "ninfer:cancelled_prefill_computed_tokens_total", "counter",
            "prompt tokens those requests had computed", snap.cancelled_prefill_computed_tokens)
    _series(L, "ninfer:cancelled_prefills_salvaged_total", "counter",
            "cancelled prefills the context cache kept at the point they reached", snap.cancelled_prefills_salvaged)
    selections = {k: v for k, v in snap.context_selections.items()}
    if selections:
        _series(L, "ninfer:context_selections_total", "counter",
                "admissions by the context-cache source they started from", 0, selections, "source")
    _series(L, "ninfer:context_occupancy", "gauge", "context-cache resources in use", 0,
            {"device_main_kv_pages": snap.kv_pages_used, "device_state_slots": snap.state_slots_used,
             "host_kv_bytes": host_kv_bytes(snap.tiers)}, "pool")
    tier_series(L, snap.tiers)
    _series(L, "ninfer:state_slots_total", "gauge",
            "recurrent-state slots (hybrid models; 0 for pure attention): one a lane plus checkpoints",
            snap.state_slots_total)
    _series(L, "ninfer:state_slots_used", "gauge",
            "recurrent-state slots held by admitted requests and retained checkpoints", snap.state_slots_used)
    _device_series(L, device_memory(state.loaded.engine))
    return "\n".join(L) + "\n"


async def handle_metrics(call: Call) -> None:
    await call.respond_raw(200, metrics_text(call).encode(),
                           [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
