"""llama.cpp's router API over the server's models: GET /models, POST /models/load|unload|sleep and
GET /models/sse (the spec's "Several models (router)"). A single-model server answers them too,
its catalog being its one model."""
from __future__ import annotations

import asyncio
from typing import Any

from ninfer.errors import RequestError
from ninfer.server.http import Call
from ninfer.server.ops import model_object
from ninfer.server.router import ModelPool, ModelSlot
from ninfer.server.sse import KEEPALIVE, sse_data


def model_entry(pool: ModelPool, slot: ModelSlot) -> dict[str, Any]:
    """One GET /models entry: id, aliases, path, status {value, args, failed, error}; a loaded
    model adds its GET /v1/models fields."""
    status: dict[str, Any] = {"value": slot.status, "args": list(slot.spec.args)}
    if slot.failed:
        status.update(failed=True, error=slot.error)
    entry: dict[str, Any] = {"id": slot.name, "object": "model", "owned_by": "ninfer", "created": 0}
    if slot.state is not None and slot.state.loaded is not None:
        entry.update(model_object(slot.state))
    entry.update(aliases=list(slot.spec.aliases), path=slot.spec.path, status=status,
                 in_flight=slot.running, loads=slot.loads, unloads=slot.unloads)
    return entry


def _slot(call: Call) -> ModelSlot:
    body = call.json()
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise RequestError("model is required: the id of a model GET /models lists", param="model",
                           code="missing_required_parameter")
    slot = call.pool.find(name)
    if slot is None:
        raise RequestError(f"The model {name!r} does not exist; GET /models lists the models of this server",
                           status=404, param="model", code="model_not_found")
    return slot


async def handle_list(call: Call) -> None:
    pool = call.pool
    await call.respond(200, {"object": "list", "data": [model_entry(pool, s) for s in pool.slots.values()]})


async def handle_load(call: Call) -> None:
    """Load the model (making room under --models-max) and answer once it is loaded or failed."""
    slot = _slot(call)
    await call.pool.load(slot)
    await call.respond(200, {"success": True, "model": slot.name, "status": slot.status})


async def handle_unload(call: Call) -> None:
    """Unload the model once its running requests have finished; answers when it is unloaded."""
    slot = _slot(call)
    if slot.status not in ("unloaded",):
        if slot.status == "loading":
            raise RequestError(f"the model {slot.name!r} is still loading; unload it once it has loaded",
                               status=409, param="model", code="model_busy")
        await call.pool.start_unload(slot)
    await call.respond(200, {"success": True, "model": slot.name, "status": slot.status})


async def handle_sleep(call: Call) -> None:
    """Put an idle model to sleep (--model-suspend); 409 model_busy while it has requests."""
    slot = _slot(call)
    await call.pool.sleep(slot)
    await call.respond(200, {"success": True, "model": slot.name, "status": slot.status})


async def handle_model_action(call: Call) -> None:
    """POST /v1/models/{id}/suspend ({"auto_resume": bool}), POST .../resume, GET .../residency:
    each answers with the residency object."""
    pool = call.pool
    slot = pool.find(call.extra["model_id"])
    if slot is None:
        raise RequestError(f"The model {call.extra['model_id']!r} does not exist", status=404, param="model",
                           code="model_not_found")
    action = call.extra["action"]
    if action == "suspend":
        body = call.json() if call.body.strip() else {}
        auto_resume = body.get("auto_resume")
        if auto_resume is not None and not isinstance(auto_resume, bool):
            raise RequestError("auto_resume must be a boolean", param="auto_resume", code="invalid_value")
        report = await pool.sleep(slot, auto_resume)
    elif action == "resume":
        report = await pool.wake(slot)
    else:
        report = pool.residency(slot)
    await call.respond(200, report)


async def handle_sse(call: Call) -> None:
    """One `data:` event per model status change, `: keep-alive` comments in between; runs until
    the client disconnects or the server stops."""
    pool = call.pool
    queue = pool.subscribe()
    keepalive = pool.config.keepalive_seconds
    try:
        await call.start_stream()
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=keepalive)
            except asyncio.TimeoutError:
                await call.write(KEEPALIVE)
                continue
            if event is None:  # the server is stopping
                await call.end()
                return
            await call.write(sse_data(event))
    finally:
        pool.unsubscribe(queue)
