"""The model pool (server/router.py) with stand-in Engines: name resolution, LRU under
--models-max that never touches a model with requests in flight, autoload, failed loads, an
Engine-wide failure (unload, reload on the next request), idle unload, the status feed."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from ninfer.errors import ArtifactError, RequestError
from ninfer.server.config import ServerConfig
from ninfer.server.router import ModelPool, ModelSpec, PoolOptions


class FakeEngine:
    def __init__(self) -> None:
        self.failed: str | None = None
        self.stopped = False
        from ninfer.engine.suspend import Residency
        self.residency = Residency(releasable_bytes=100)

    def suspend(self):
        import concurrent.futures

        from ninfer.engine.suspend import MemoryMove
        self.residency.state, self.residency.last_suspend = "suspended", MemoryMove(0.0, 10, 90, 0)
        self.residency.suspends += 1
        future = concurrent.futures.Future()
        future.set_result(self.residency)
        return future

    def configure_suspend(self, options):
        import concurrent.futures

        self.residency.options = options
        future = concurrent.futures.Future()
        future.set_result(self.residency)
        return future

    def resume(self):
        import concurrent.futures

        from ninfer.engine.suspend import MemoryMove
        self.residency.state, self.residency.last_resume = "resident", MemoryMove(0.0, 10, 90, 90)
        self.residency.resumes += 1
        future = concurrent.futures.Future()
        future.set_result(self.residency)
        return future

    def snapshot(self) -> SimpleNamespace:
        return SimpleNamespace(max_concurrency=1, max_pending_requests=4, kv_capacity_tokens=1024, running=0, waiting=0)

    def shutdown(self) -> None:
        self.stopped = True


class Loads:
    """Loaders that record what they started; a name in `fail` fails to load; a name in `gate`
    waits for its event before finishing."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.engines: dict[str, list[FakeEngine]] = {}
        self.fail: set[str] = set()
        self.gate: dict[str, threading.Event] = {}

    def spec(self, name: str, aliases: tuple[str, ...] = (), suspend: bool = False) -> ModelSpec:
        def load():
            self.started.append(name)
            if name in self.gate:
                self.gate[name].wait(5)
            if name in self.fail:
                raise ArtifactError(f"{name}.ninfer: not a model")
            engine = FakeEngine()
            self.engines.setdefault(name, []).append(engine)
            facts = SimpleNamespace(sampler_presets={}, path=f"/m/{name}.ninfer", logits_size=8, max_context=512)
            loaded = SimpleNamespace(engine=engine, facts=facts, model_id=name, backend="torch", device="cpu",
                                     max_context=512, tokenizer=None)
            return loaded, ServerConfig(model_suspend=suspend)
        return ModelSpec(name=name, path=f"/m/{name}.ninfer", aliases=aliases, load=load)


def pool_of(loads: Loads, names: list[str], **options) -> ModelPool:
    specs = [loads.spec(n, (f"{n}-alias",)) for n in names]
    return ModelPool(ServerConfig(), specs, PoolOptions(router=True, **options))


async def settle(pool: ModelPool, name: str, status: str) -> None:
    slot = pool.find(name)
    for _ in range(500):
        if slot.status == status:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name} stayed {slot.status}, expected {status}")


def test_resolution_names_aliases_and_most_recently_used() -> None:
    async def main() -> None:
        loads = Loads()
        pool = pool_of(loads, ["a", "b"], models_max=0)
        assert pool.resolve("a-alias").name == "a"
        with pytest.raises(RequestError) as e:
            pool.resolve("c")
        assert (e.value.status, e.value.code) == (404, "model_not_found")
        with pytest.raises(RequestError) as e:
            pool.resolve(None)  # nothing loaded, several models: it must be named
        assert e.value.status == 400
        for name in ("b", "a"):
            pool.release(pool.find(name)) if await pool.acquire(pool.find(name)) else None
        assert pool.resolve(None).name == "a"  # the most recently used
        with pytest.raises(RequestError) as e:
            pool.peek("c")
        assert e.value.code == "model_not_found"
        assert pool.peek("b").model_id == "b"  # read-only: no load, no use
        assert pool.resolve(None).name == "a"
        state = await pool.acquire(pool.find("a-alias"))
        assert state.names == ("a", "a-alias")
        pool.release(pool.find("a"))

    asyncio.run(main())


def test_models_max_swaps_the_least_recently_used_idle_model() -> None:
    async def main() -> None:
        loads = Loads()
        pool = pool_of(loads, ["a", "b", "c"], models_max=2)
        for name in ("a", "b"):
            await pool.acquire(pool.find(name))
            pool.release(pool.find(name))
        await pool.acquire(pool.find("a"))  # a is now the most recently used (and stays held)
        pool.release(pool.find("a"))
        await pool.acquire(pool.find("c"))
        assert [pool.find(n).status for n in "abc"] == ["loaded", "unloaded", "loaded"]
        assert loads.engines["b"][0].stopped and not loads.engines["a"][0].stopped
        pool.release(pool.find("c"))

    asyncio.run(main())


def test_a_model_with_a_request_in_flight_is_never_unloaded_for_another() -> None:
    async def main() -> None:
        loads = Loads()
        pool = pool_of(loads, ["a", "b"], models_max=1)
        a = pool.find("a")
        await pool.acquire(a)  # a request runs on a
        waiter = asyncio.ensure_future(pool.acquire(pool.find("b")))
        await asyncio.sleep(0.3)
        assert not waiter.done() and a.status == "loaded" and not loads.engines["a"][0].stopped
        assert "b" not in loads.started
        pool.release(a)  # the request ends: now b gets the room
        state = await asyncio.wait_for(waiter, 5)
        assert state.model_id == "b" and a.status == "unloaded" and loads.engines["a"][0].stopped
        pool.release(pool.find("b"))

    asyncio.run(main())


def test_autoload_off_refuses_and_a_failed_load_is_reported_then_retried() -> None:
    async def main() -> None:
        loads = Loads()
        pool = pool_of(loads, ["a", "bad"], models_max=0, autoload=False)
        with pytest.raises(RequestError) as e:
            await pool.acquire(pool.find("a"))
        assert (e.value.status, e.value.code) == (503, "model_not_loaded")
        state = await pool.acquire(pool.find("a"), autoload=True)  # ?autoload=1
        assert state.model_id == "a"
        pool.release(pool.find("a"))
        loads.fail.add("bad")
        events = pool.subscribe()
        bad = pool.find("bad")
        with pytest.raises(RequestError) as e:
            await pool.load(bad)
        assert (e.value.status, e.value.code) == (503, "model_load_failed")
        assert "not a model" in e.value.message
        assert bad.status == "unloaded" and bad.failed and "not a model" in bad.error
        seen = [events.get_nowait() for _ in range(events.qsize())]
        assert [ev["data"]["status"] for ev in seen] == ["loading", "unloaded"]
        assert seen[-1]["data"]["failed"] is True and seen[-1]["model"] == "bad"
        loads.fail.clear()
        assert (await pool.load(bad)).model_id == "bad"  # the next request tries again
        assert not bad.failed and loads.started.count("bad") == 2

    asyncio.run(main())


def test_waiters_share_one_load() -> None:
    async def main() -> None:
        loads = Loads()
        loads.gate["a"] = threading.Event()
        pool = pool_of(loads, ["a"], models_max=1)
        slot = pool.find("a")
        waiters = [asyncio.ensure_future(pool.acquire(slot)) for _ in range(3)]
        await settle(pool, "a", "loading")
        loads.gate["a"].set()
        states = await asyncio.wait_for(asyncio.gather(*waiters), 5)
        assert len({id(s) for s in states}) == 1 and loads.started == ["a"] and slot.running == 3
        for _ in states:
            pool.release(slot)

    asyncio.run(main())


def test_engine_failure_unloads_on_a_router_and_the_next_request_reloads() -> None:
    async def main() -> None:
        loads = Loads()
        pool = pool_of(loads, ["a"], models_max=1)
        slot = pool.find("a")
        await pool.acquire(slot)
        loads.engines["a"][0].failed = "RuntimeError: boom"
        pool.check()
        assert slot.status == "unloading" and slot.failed  # waits for the running request
        await asyncio.sleep(0.05)
        assert slot.status == "unloading"
        pool.release(slot)
        await settle(pool, "a", "unloaded")
        assert "boom" in slot.error
        state = await pool.acquire(slot)
        assert state.loaded.engine is loads.engines["a"][1] and not slot.failed
        pool.release(slot)

    asyncio.run(main())


def test_engine_failure_of_a_single_model_server_is_handed_to_the_runner() -> None:
    async def main() -> None:
        loads = Loads()
        pool = ModelPool(ServerConfig(), [loads.spec("only")], PoolOptions(router=False))
        seen = []
        pool.on_engine_failure = lambda slot, why: seen.append(why)
        await pool.load(pool.find("only"))
        assert pool.ready
        assert pool.resolve("any name").name == "only"  # the adapter decides about names
        loads.engines["only"][0].failed = "boom"
        pool.check()
        assert seen == ["boom"] and pool.find("only").status == "loaded"

    asyncio.run(main())


def test_idle_models_unload_after_unload_idle_seconds_and_use_is_only_requests() -> None:
    async def main() -> None:
        loads = Loads()
        pool = pool_of(loads, ["a", "b"], models_max=0, unload_idle_seconds=10)
        a, b = pool.find("a"), pool.find("b")
        await pool.acquire(a)
        await pool.acquire(b)
        pool.release(b)
        t = b.last_used
        pool.peek("b")  # polling does not count as use
        assert b.last_used == t
        pool.check(now=t + 11)
        assert b.status == "unloading" and a.status == "loaded"  # a request still runs on a
        await settle(pool, "b", "unloaded")
        pool.release(a)
        pool.check(now=a.last_used + 5)
        assert a.status == "loaded"

    asyncio.run(main())


def test_models_max_puts_a_suspending_model_to_sleep_and_wakes_it() -> None:
    async def main() -> None:
        loads = Loads()
        pool = ModelPool(ServerConfig(), [loads.spec("a", suspend=True), loads.spec("b")],
                         PoolOptions(router=True, models_max=1))
        a, b = pool.find("a"), pool.find("b")
        await pool.acquire(a)
        pool.release(a)
        events = pool.subscribe()
        await pool.acquire(b)  # a sleeps (keeps its Engine) instead of unloading
        pool.release(b)
        assert a.status == "sleeping" and not loads.engines["a"][0].stopped
        assert loads.engines["a"][0].residency.state == "suspended"
        state = await pool.acquire(a)  # wakes a: b (no --model-suspend) is unloaded for the room
        pool.release(a)
        assert state.loaded.engine is loads.engines["a"][0] and loads.started.count("a") == 1
        assert a.status == "loaded" and b.status == "unloaded"
        seen = [(e["model"], e["data"]["status"]) for e in [events.get_nowait() for _ in range(events.qsize())]]
        assert ("a", "sleeping") in seen and seen[-1] == ("a", "loaded")
        assert pool.residency(a)["state"] == "resident" and pool.residency(a)["resume_count"] == 1
        with pytest.raises(RequestError) as e:
            await pool.sleep(b)
        assert e.value.code == "model_not_loaded"
        await pool.acquire(a)
        with pytest.raises(RequestError) as e:
            await pool.sleep(a)
        assert (e.value.status, e.value.code) == (409, "model_busy")
        pool.release(a)

    asyncio.run(main())


def test_sleep_idle_seconds_puts_an_idle_suspending_model_to_sleep() -> None:
    async def main() -> None:
        loads = Loads()
        pool = ModelPool(ServerConfig(), [loads.spec("a", suspend=True), loads.spec("b")],
                         PoolOptions(router=True, models_max=0, sleep_idle_seconds=5))
        a, b = pool.find("a"), pool.find("b")
        for slot in (a, b):
            await pool.acquire(slot)
            pool.release(slot)
        pool.check(now=max(a.last_used, b.last_used) + 6)
        await asyncio.sleep(0.05)
        assert a.status == "sleeping" and b.status == "loaded"  # b cannot sleep: no --model-suspend

    asyncio.run(main())
