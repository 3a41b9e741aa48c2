"""One model of a server as configured (ModelSpec), the pool's options (PoolOptions) and its
runtime slot (ModelSlot: status, state, requests running and waiting), plus the small helpers
the pool (server/router.py) runs its loads and unloads with."""
from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.errors import ConfigError, RequestError
from ninfer.server.config import ServerConfig
from ninfer.server.state import ServerState

if TYPE_CHECKING:
    from ninfer.engine.loader import LoadedModel

STATUSES = ("unloaded", "loading", "loaded", "sleeping", "unloading")


@dataclass(slots=True)
class ModelSpec:
    """One model as configured: its names, where it comes from and how to start it."""

    name: str
    path: str  # as configured ("" for the default model)
    load: Callable[[], tuple[LoadedModel, ServerConfig]]  # blocking: a started Engine and its config
    aliases: tuple[str, ...] = ()
    args: tuple[str, ...] = ()  # its serve arguments, as GET /models shows them
    load_on_startup: bool = False


@dataclass(slots=True)
class PoolOptions:
    router: bool = False  # a catalog (unknown names 404) rather than one model
    models_max: int = 1  # most models loaded at once; 0: no limit
    autoload: bool = True  # load a model a request names (?autoload= overrides per request)
    unload_idle_seconds: float = 0.0  # 0: never
    sleep_idle_seconds: float = 0.0  # 0: never (needs --model-suspend)

    def __post_init__(self) -> None:
        if self.models_max < 0:
            raise ConfigError("--models-max must be >= 0 (0: no limit)")
        if self.unload_idle_seconds < 0 or self.sleep_idle_seconds < 0:
            raise ConfigError("--unload-idle-seconds and --sleep-idle-seconds must be >= 0")


@dataclass(slots=True)
class ModelSlot:
    spec: ModelSpec
    status: str = "unloaded"
    state: ServerState | None = None  # while loaded
    failed: bool = False  # the last load failed, or the Engine failed Engine-wide
    error: str | None = None
    attempts: int = 0  # loads started, so a waiter knows whether the one it waited for failed
    running: int = 0  # requests holding the loaded state
    waiting: int = 0  # requests waiting for it to load
    last_used: float = 0.0  # monotonic time of the last request's start or end
    loads: int = 0
    unloads: int = 0
    unload_task: asyncio.Future | None = field(default=None, repr=False)
    wake_task: asyncio.Future | None = field(default=None, repr=False)
    auto_resume: bool = True  # as the last suspend set it

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def names(self) -> tuple[str, ...]:
        return (self.spec.name, *self.spec.aliases)

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0


def model_error(message: str, status: int, code: str, kind: str = "invalid_request_error",
           param: str | None = "model") -> RequestError:
    return RequestError(message, status=status, code=code, type=kind, param=param)


def in_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run `fn` on a daemon thread; the result (or exception) arrives on the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            value, ok = fn(), True
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting coroutine
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed while this ran (a stop during a load)
            pass

    threading.Thread(target=run, name="ninfer-model", daemon=True).start()
    return future


def has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def free_memory() -> None:
    """Give an unloaded model's memory back: collect its tensors, then the CUDA cache if any."""
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
