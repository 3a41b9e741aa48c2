"""The models a server holds and their lifecycle: one Engine per loaded model, all in this process.

A single-model server is the one-model case of the same pool (its /models routes, idle unload and
reload work the same way); a router (--models-dir / --models-preset) holds a catalog and keeps at
most `models_max` loaded. Everything here runs on the asyncio thread; loads and unloads run their
blocking part on a daemon thread so that a stop never waits on a half-loaded model.

Lifecycle of a slot: unloaded -> loading -> loaded -> unloading -> unloaded (a failed load goes back
to unloaded with failed/error set). A request holds its slot from `acquire` to `release`; a slot
with requests running or waiting is never chosen to make room, and an unload waits for the running
ones to finish.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ninfer.errors import NInferError, RequestError
from ninfer.server.config import ServerConfig
from ninfer.server.model_slot import (STATUSES, ModelSlot, ModelSpec, PoolOptions, free_memory,  # noqa: F401
                                      has_loop, in_thread, model_error)
from ninfer.server.reqlog import RequestLog
from ninfer.server.response_store import ResponseStore
from ninfer.server.state import ServerState

log = logging.getLogger("ninfer.server")
ROOM_WAIT_SECONDS = 600.0  # a request that needs room waits this long for busy models (spec: ten minutes)
WATCH_SECONDS = 1.0  # how often engine failures and idle timers are checked


class ModelPool:
    """The server's models. `config` is the process's own (listener, auth, CORS, limits, logs)."""

    def __init__(self, config: ServerConfig, specs: list[ModelSpec], options: PoolOptions | None = None,
                 reqlog: RequestLog | None = None) -> None:
        self.config = config
        self.options = options or PoolOptions()
        self.reqlog = reqlog or RequestLog()
        self.responses = ResponseStore()  # stored Responses outlive any one model's Engine
        self.slots: dict[str, ModelSlot] = {s.name: ModelSlot(s) for s in specs}
        self.ready = self.options.router  # a single-model server is ready once its model first loads
        self.on_engine_failure: Callable[[ModelSlot, str], None] | None = None
        self._changed = asyncio.Event() if has_loop() else None
        self.closing = False
        self._subscribers: set[asyncio.Queue] = set()

    # ---- lookup (the one place a request's model name is resolved) --------------------------

    @property
    def router(self) -> bool:
        return self.options.router

    def find(self, name: str) -> ModelSlot | None:
        for slot in self.slots.values():
            if name in slot.names:
                return slot
        return None

    def resolve(self, name: str | None) -> ModelSlot:
        """The slot a request naming `name` (None or "": none) runs on. A router answers an unknown
        name with 404 model_not_found and no name with the most recently used loaded model; a
        single-model server runs everything on its model and leaves the name to the protocol
        adapter's check (params.check_model)."""
        if not self.router:
            return next(iter(self.slots.values()))
        if name:
            slot = self.find(name)
            if slot is None:
                raise model_error(f"The model {name!r} does not exist; GET /models lists the models of this server",
                             404, "model_not_found")
            return slot
        loaded = [s for s in self.slots.values() if s.status in ("loaded", "sleeping")]
        if loaded:
            return max(loaded, key=lambda s: s.last_used)
        if len(self.slots) == 1:
            return next(iter(self.slots.values()))
        raise model_error("no model is loaded: name one in model (GET /models lists them)", 400,
                     "missing_required_parameter")

    def peek(self, name: str | None) -> ServerState:
        """The state of a loaded model for a read-only route; it neither loads nor counts as use."""
        slot = self.resolve(name)
        if slot.state is None:
            raise model_error(f"the model {slot.name!r} is not loaded ({slot.status})", 503, "model_not_loaded",
                         "service_unavailable")
        return slot.state

    def default_state(self) -> ServerState | None:
        """The most recently used loaded model's state, if any."""
        loaded = [s for s in self.slots.values() if s.state is not None]
        return max(loaded, key=lambda s: s.last_used).state if loaded else None

    # ---- requests -----------------------------------------------------------------------------

    async def acquire(self, slot: ModelSlot, autoload: bool | None = None, wake: bool = True) -> ServerState:
        """Hold `slot` for one request, loading or waking it first (making room under --models-max)
        when allowed; `wake` False runs on a sleeping model as it is (host-only work: tokenize).
        Raises 503 model_not_loaded (no autoload), model_suspended (no auto-resume),
        model_load_failed, or 503 after ROOM_WAIT_SECONDS without room. Pair with `release`."""
        slot.waiting += 1
        try:
            if not wake and slot.status == "sleeping" and slot.state is not None:
                state = slot.state
            else:
                state = await self._until_loaded(slot, self.options.autoload if autoload is None else autoload,
                                                 request=True)
        finally:
            slot.waiting -= 1
        slot.running += 1
        slot.last_used = time.monotonic()
        return state

    def release(self, slot: ModelSlot) -> None:
        slot.running -= 1
        slot.last_used = time.monotonic()
        self._notify()

    async def _until_loaded(self, slot: ModelSlot, autoload: bool, request: bool = False) -> ServerState:
        deadline = time.monotonic() + ROOM_WAIT_SECONDS
        attempt: int | None = None  # the load this request waits on
        while True:
            if self.closing:
                raise model_error("the server is stopping", 503, "service_unavailable", "service_unavailable", None)
            if slot.status == "loaded" and slot.state is not None:
                return slot.state
            if slot.status == "sleeping" and (slot.wake_task is None or slot.wake_task.done()):
                if request and not slot.auto_resume:
                    raise model_error(f"the model {slot.name!r} is suspended and auto_resume is off: resume it first",
                                 503, "model_suspended", "service_unavailable")
                if not autoload:
                    raise model_error(f"the model {slot.name!r} is asleep and autoload is off: POST /models/load "
                                 "first, or send ?autoload=1", 503, "model_not_loaded", "service_unavailable")
                if self._make_room(slot):
                    slot.wake_task = asyncio.ensure_future(self._wake(slot))
                    await asyncio.shield(slot.wake_task)  # a failed resume raises to the waiters
                    continue
            if slot.status == "unloaded":
                if attempt is not None and slot.attempts == attempt and slot.failed:
                    raise model_error(f"the model {slot.name!r} failed to load: {slot.error}", 503, "model_load_failed",
                                 "service_unavailable")
                if not autoload:
                    raise model_error(f"the model {slot.name!r} is not loaded and autoload is off: POST /models/load "
                                 "first, or send ?autoload=1", 503, "model_not_loaded", "service_unavailable")
                if self._make_room(slot):
                    self._start_load(slot)
            if slot.status == "loading":
                attempt = slot.attempts
            await self._wait_change(deadline, slot)

    def _occupied(self, exclude: ModelSlot) -> int:
        """Models holding (or about to hold) their memory; a sleeping one gave it back."""
        return sum(1 for s in self.slots.values() if s is not exclude and s.status in ("loading", "loaded", "unloading"))

    def _make_room(self, slot: ModelSlot) -> bool:
        """True when `slot` may load now; else start unloading the least recently used idle model
        (if any) and return False: the caller waits for the change."""
        limit = self.options.models_max
        if not limit or self._occupied(slot) < limit:
            return True
        excess = self._occupied(slot) - limit + 1  # models that must go before this one loads
        if sum(1 for s in self.slots.values() if s is not slot and s.status == "unloading") >= excess:
            return False  # the room is on its way
        idle = [s for s in self.slots.values() if s is not slot and s.status == "loaded" and not s.busy]
        if idle:
            victim = min(idle, key=lambda s: s.last_used)
            if victim.state is not None and victim.state.config.model_suspend:
                log.info("putting model %s to sleep to make room for %s (--models-max %d)", victim.name, slot.name,
                         limit)
                self.start_sleep(victim)
                return self._occupied(slot) < limit
            log.info("unloading model %s to make room for %s (--models-max %d)", victim.name, slot.name, limit)
            self.start_unload(victim)
        return False

    async def _wait_change(self, deadline: float, slot: ModelSlot) -> None:
        event = self._event()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise model_error(f"no room to load the model {slot.name!r}: the loaded models stayed busy for "
                         f"{ROOM_WAIT_SECONDS:.0f} s", 503, "model_not_loaded", "service_unavailable")
        try:
            await asyncio.wait_for(event.wait(), timeout=min(remaining, WATCH_SECONDS))
        except asyncio.TimeoutError:
            pass

    # ---- lifecycle ----------------------------------------------------------------------------

    async def load(self, slot: ModelSlot) -> ServerState:
        """POST /models/load: load the model (making room) and wait until it is loaded or failed."""
        slot.waiting += 1
        try:
            return await self._until_loaded(slot, True)
        finally:
            slot.waiting -= 1

    def _start_load(self, slot: ModelSlot) -> None:
        slot.status = "loading"
        slot.attempts += 1
        slot.failed, slot.error = False, None
        self._publish(slot)
        asyncio.ensure_future(self._load(slot))

    async def _load(self, slot: ModelSlot) -> None:
        log.info("loading model %s%s", slot.name, f" from {slot.spec.path}" if slot.spec.path else "")
        t0 = time.monotonic()
        try:
            state = await in_thread(lambda: self._build_state(slot))
        except BaseException as e:  # noqa: BLE001 - a failed load is reported, the server goes on
            slot.status, slot.failed = "unloaded", True
            slot.error = str(e) if isinstance(e, NInferError) else f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", slot.name, slot.error)
            self._publish(slot)
            return
        slot.state, slot.status = state, "loaded"
        slot.loads += 1
        slot.last_used = time.monotonic()
        if not self.router and slot.spec.name != state.model_id:  # the one model's name is known now
            self.slots = {state.model_id: slot}
            slot.spec.name = state.model_id
        state.names = slot.names
        state.log_name = slot.name if self.router else None
        self._log_start(slot, state)
        log.info("model %s loaded in %.1f s (context %d)", slot.name, time.monotonic() - t0,
                 state.loaded.max_context)
        self.ready = True
        self._publish(slot)

    def _build_state(self, slot: ModelSlot) -> ServerState:
        """Blocking (a daemon thread): start the Engine and make the model's serving state."""
        loaded, config = slot.spec.load()
        if self.router:
            config.model_id = slot.name
        state = ServerState(config, reqlog=self.reqlog, responses=self.responses)
        try:
            state.set_ready(loaded)
        except BaseException:
            loaded.engine.shutdown()
            raise
        return state

    def _log_start(self, slot: ModelSlot, state: ServerState) -> None:
        loaded = state.loaded
        snap = loaded.engine.snapshot()
        self.reqlog.server_start(artifact=loaded.facts.path, model=state.model_id, backend=loaded.backend,
                                 device=loaded.device, max_context=loaded.max_context,
                                 max_concurrency=snap.max_concurrency, max_pending_requests=snap.max_pending_requests,
                                 kv_capacity_tokens=snap.kv_capacity_tokens,
                                 structured_output=state.config.structured_output,
                                 model_suspend=state.config.model_suspend,
                                 serve_args=list(slot.spec.args))  # the API key's value never appears

    def start_unload(self, slot: ModelSlot) -> asyncio.Future:
        """Begin unloading `slot` (status unloading at once); its running requests finish first."""
        if slot.unload_task is not None and not slot.unload_task.done():
            return slot.unload_task
        slot.status = "unloading"
        self._publish(slot)
        slot.unload_task = asyncio.ensure_future(self._unload(slot))
        return slot.unload_task

    async def _unload(self, slot: ModelSlot) -> None:
        while slot.running:
            await self._wait_change(float("inf"), slot)
        state, slot.state = slot.state, None
        if state is not None and state.loaded is not None:
            engine = state.loaded.engine
            state.loaded = None
            await in_thread(engine.shutdown)
            del engine, state
            await in_thread(free_memory)
        slot.status = "unloaded"
        slot.unloads += 1
        self.reqlog.forget_model(slot.name)
        log.info("model %s unloaded", slot.name)
        self._publish(slot)

    # ---- sleep (--model-suspend): the Engine gives its memory back and keeps its state --------

    def start_sleep(self, slot: ModelSlot, auto_resume: bool | None = None) -> asyncio.Future:
        """Put an idle loaded model to sleep: status sleeping at once (it no longer counts toward
        --models-max); the suspend itself runs on its Engine's worker. A suspend that fails
        (a request arrived first) leaves it loaded."""
        slot.status = "sleeping"
        slot.auto_resume = slot.state.config.auto_resume if auto_resume is None else auto_resume
        self._publish(slot)
        return asyncio.ensure_future(self._sleep(slot))

    async def _sleep(self, slot: ModelSlot) -> dict[str, Any]:
        engine = slot.state.loaded.engine
        try:
            residency = await asyncio.wrap_future(engine.suspend())
        except BaseException:
            if slot.status == "sleeping":
                slot.status = "loaded"
                self._publish(slot)
            raise
        log.info("model %s asleep: %.2f s, %d bytes of state kept", slot.name,
                 residency.last_suspend.seconds, residency.host_snapshot_bytes)
        return residency.to_dict()

    async def sleep(self, slot: ModelSlot, auto_resume: bool | None = None) -> dict[str, Any]:
        """POST /models/sleep, POST /v1/models/{id}/suspend: 409 model_busy with requests in flight."""
        if slot.status == "sleeping" and slot.state is not None:
            if auto_resume is not None:
                slot.auto_resume = auto_resume
            return self.residency(slot)
        if slot.status != "loaded" or slot.state is None:
            raise model_error(f"the model {slot.name!r} is not loaded ({slot.status})", 503, "model_not_loaded",
                         "service_unavailable")
        if not slot.state.config.model_suspend:
            raise model_error(f"the model {slot.name!r} was not started with --model-suspend", 400,
                         "model_suspend_disabled")
        if slot.busy:
            raise model_error(f"the model {slot.name!r} has requests in flight", 409, "model_busy")
        await self.start_sleep(slot, auto_resume)
        return self.residency(slot)

    async def wake(self, slot: ModelSlot) -> dict[str, Any]:
        """POST /v1/models/{id}/resume (and /models/load of a sleeping model)."""
        if slot.status == "sleeping":
            slot.waiting += 1
            try:
                await self._until_loaded(slot, True)
            finally:
                slot.waiting -= 1
        return self.residency(slot)

    async def _wake(self, slot: ModelSlot) -> None:
        engine = slot.state.loaded.engine
        residency = await asyncio.wrap_future(engine.resume())  # a failure stays asleep, last_error set
        slot.status = "loaded"
        slot.last_used = time.monotonic()
        log.info("model %s awake: %.2f s", slot.name, residency.last_resume.seconds)
        self._publish(slot)

    def residency(self, slot: ModelSlot) -> dict[str, Any]:
        """GET /v1/models/{id}/residency (a loaded or sleeping model)."""
        if slot.state is None or slot.state.loaded is None:
            raise model_error(f"the model {slot.name!r} is not loaded ({slot.status})", 503, "model_not_loaded",
                         "service_unavailable")
        return {"model": slot.name, "auto_resume": slot.auto_resume,
                **slot.state.loaded.engine.residency.to_dict()}

    async def unload_all(self) -> None:
        """At stop: shut every loaded Engine down (requests still running end with 503)."""
        for slot in self.slots.values():
            if slot.state is not None and slot.state.loaded is not None:
                await in_thread(slot.state.loaded.engine.shutdown)

    async def start_up(self) -> None:
        """Load the models marked load-on-startup (a single-model server's one model)."""
        for slot in self.slots.values():
            if slot.spec.load_on_startup and slot.status == "unloaded":
                try:
                    await self.load(slot)
                except RequestError:
                    if not self.router:
                        raise

    # ---- watching: Engine-wide failures and idle timers ---------------------------------------

    async def watch(self) -> None:
        """Every WATCH_SECONDS: a model whose Engine failed is unloaded (a router) or reported
        through on_engine_failure (a single-model server stops with status 2); an idle model past
        --unload-idle-seconds is unloaded. Only requests count as use."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            self.check()

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        idle_limit = self.options.unload_idle_seconds
        for slot in list(self.slots.values()):
            if slot.status != "loaded" or slot.state is None:
                continue
            failed = getattr(slot.state.loaded.engine, "failed", None)
            if failed:
                log.error("model %s: the engine failed: %s", slot.name, failed)
                slot.failed, slot.error = True, f"the engine failed: {failed}"
                if self.on_engine_failure is not None and not self.router:
                    self.on_engine_failure(slot, failed)
                else:
                    self.start_unload(slot)
                continue
            sleep_limit = self.options.sleep_idle_seconds
            if sleep_limit and slot.state.config.model_suspend and not slot.busy \
                    and now - slot.last_used >= sleep_limit:
                log.info("model %s idle for %.0f s: going to sleep (--sleep-idle-seconds)", slot.name, sleep_limit)
                asyncio.ensure_future(self._sleep_quietly(slot))
                continue
            if idle_limit and not slot.busy and now - slot.last_used >= idle_limit:
                log.info("model %s idle for %.0f s: unloading (--unload-idle-seconds)", slot.name, idle_limit)
                self.start_unload(slot)

    async def _sleep_quietly(self, slot: ModelSlot) -> None:
        try:
            await self.start_sleep(slot)
        except Exception as e:  # noqa: BLE001 - a request came first: it stays awake
            log.info("model %s stays awake: %s", slot.name, e)

    # ---- status reports and the /models/sse feed -----------------------------------------------

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def close(self) -> None:
        """At stop: requests waiting for a model end with 503 and every /models/sse stream ends
        (a None tells its handler to finish); no model loads any more."""
        self.closing = True
        for queue in self._subscribers:
            queue.put_nowait(None)
        self._notify()

    def status_event(self, slot: ModelSlot) -> dict[str, Any]:
        data: dict[str, Any] = {"status": slot.status}
        if slot.failed:
            data.update(failed=True, error=slot.error)
        return {"model": slot.name, "event": "model_status", "data": data}

    def _publish(self, slot: ModelSlot) -> None:
        event = self.status_event(slot)
        for queue in self._subscribers:
            queue.put_nowait(event)
        self._notify()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        """Wake every waiter: each re-checks its own condition."""
        event = self._event()
        self._changed = asyncio.Event()
        event.set()
