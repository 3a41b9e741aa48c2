"""Hosting the app in-process with Granian's embedded server.

The port is bound before the model loads, so a clash fails in milliseconds; the model loads on
a background thread while every route answers 503 model_loading; SIGINT/SIGTERM stop cleanly.
Exit statuses (ninfer.errors.ExitCode): 0 after a requested stop, 1 when start-up fails, 2 when the
engine fails later, 130 when a signal ends start-up (the loading thread cannot be interrupted, so
that path leaves with os._exit: a normal interpreter exit under a thread still inside torch or a
converter aborts natively).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ninfer.errors import ConfigError, ExitCode
from ninfer.server.app import App
from ninfer.server.config import ServerConfig
from ninfer.server.reqlog import RequestLog
from ninfer.server.router import ModelPool, ModelSpec, PoolOptions
from ninfer.version import version_string

log = logging.getLogger("ninfer.server")
CONFIRM_SECONDS = 5.0  # the window for the second Ctrl+C
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def check_bindable(host: str, port: int, option: str = "--port") -> None:
    """Bind and release (host, port) with SO_REUSEADDR only: a listener already there (Granian's
    SO_REUSEPORT one included) makes this fail, where Granian itself would share the port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"{option} {port}: {host}:{port} is already in use by another process") from None
        raise ConfigError(f"{option} {port}: cannot listen on {host}:{port} ({e.strerror})") from None
    finally:
        sock.close()


def api_base(host: str, port: int) -> str:
    """The URL a client should use: a wildcard bind is announced through loopback."""
    shown = WILDCARDS.get(host, host)
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/v1"


# dead-peer detection on every accepted connection (spec: TCP keepalive and a 15 s retransmission
# limit): an idle peer is probed after 5 s, every 5 s, and dropped after 3 unanswered probes; data
# unacknowledged for 15 s ends the connection. With the 5 s SSE heartbeat a dead or unacknowledging
# peer is cancelled within about 20 s, waiting and prefilling requests included.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 5, 3
USER_TIMEOUT_MS = 15_000


def tune_listener(fd: int) -> None:
    """Set keepalive and TCP_USER_TIMEOUT on a listening socket; Linux copies them to every
    connection it accepts (nginx's listen so_keepalive relies on the same)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
            if hasattr(socket, name):  # Linux; other systems keep their defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.close()


def _granian_server(app: App, host: str, port: int, log_level: str) -> Any:
    from granian.constants import Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    class TunedServer(Server):
        """Granian's embedded server with one listener built here (instead of one per worker
        inside Granian on Linux), so its socket options can be set before it accepts."""

        def _init_shared_socket(self) -> None:
            super()._init_shared_socket()
            if self._ssp is not None:  # Linux: build the one listener the worker will use
                self._shd = self._ssp.build()
                self._sfd = self._shd.get_fd()
                self._ssp = None
            tune_listener(self._sfd)

    level = {"trace": "debug", "off": "critical"}.get(log_level, log_level)
    return TunedServer(app, address=host, port=port, interface=Interfaces.ASGI, log_enabled=log_level == "debug",
                       log_level=LogLevels(level), backlog=1024)


async def _wait_listening(host: str, port: int, deadline: float) -> None:
    target = WILDCARDS.get(host, host)
    while True:
        try:
            _, writer = await asyncio.open_connection(target, port)
        except OSError:
            if time.monotonic() > deadline:
                raise ConfigError(f"--port {port}: the server did not start listening on {host}:{port}") from None
            await asyncio.sleep(0.02)
            continue
        writer.close()
        return


def serve_forever(config: ServerConfig, models: list[ModelSpec], announce: Callable[[str], None] = print,
                  options: PoolOptions | None = None) -> NoReturn:
    """Bind, load the start-up models in the background, serve until SIGINT/SIGTERM, then end the
    process with its exit status (0 stopped, 1 start-up failed, 2 Engine-wide failure, 130
    interrupted). `config` is the process's (listener, auth, logs); each model carries its own."""
    check_bindable(config.host, config.port)
    if config.stats_port is not None:
        check_bindable(config.host, config.stats_port, "--stats-port")
    reqlog = RequestLog()
    if config.request_log_jsonl is not None:
        reqlog = open_request_log(config.request_log_jsonl, [m.path for m in models],
                                  config.request_log_max_mib * 1024 * 1024, config.request_log_keep)
    try:
        code = asyncio.run(_serve(config, models, options or PoolOptions(), reqlog, announce))
    finally:
        reqlog.close()
    _leave(code)


def _leave(code: int) -> NoReturn:
    """End the process without interpreter finalization, everything written and flushed.
    Granian's Rust worker threads wind down on their own after stop(); one that touches an
    interpreter which is finalizing panics and aborts the process (exit 134/135 instead of the
    server's status), which a stop soon after start makes likely."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def open_request_log(value: str, model_paths: list[str], max_bytes: int = 0, keep: int = 4) -> RequestLog:
    """--request-log-jsonl FILE: appended (rotated at `max_bytes`, 0: never); its folder must
    exist, and it must not be a model."""
    path = Path(value).expanduser().resolve()
    for model_path in model_paths:
        if model_path and Path(model_path).expanduser().exists() and path == Path(model_path).expanduser().resolve():
            raise ConfigError(f"--request-log-jsonl {value}: that is the model file")
    if not path.parent.is_dir():
        raise ConfigError(f"--request-log-jsonl {value}: the folder {path.parent} does not exist")
    try:
        return RequestLog(path, max_bytes=max_bytes, keep=keep)
    except OSError as e:
        raise ConfigError(f"--request-log-jsonl {value}: cannot open it ({e.strerror})") from None


async def _serve(config: ServerConfig, models: list[ModelSpec], options: PoolOptions, reqlog: RequestLog,
                 announce: Callable[[str], None]) -> int:
    loop = asyncio.get_running_loop()
    pool = ModelPool(config, models, options, reqlog)
    servers = [_granian_server(App(pool), config.host, config.port, config.log_level)]
    if config.stats_port is not None:
        servers.append(_granian_server(App(pool, stats_only=True), config.host, config.stats_port,
                                       config.log_level))
    stop = asyncio.Event()
    outcome = {"code": ExitCode.OK}

    def request_stop(code: int = 0) -> None:
        if not stop.is_set():
            outcome["code"] = code
            stop.set()

    last_press: list[float] = []
    abandon_save = threading.Event()  # one more Ctrl+C during the stop: no prefix-cache save

    def on_interrupt() -> None:
        """Ctrl+C: before ready it ends start-up; serving, a second press within 5 s stops (the
        first only says so); during the stop it exits at once, abandoning a prefix-cache save
        (its temporary file deleted, the previous file kept)."""
        if stop.is_set():
            abandon_save.set()
            if config.prefix_cache_file:
                from ninfer.engine.session_files import tmp_path
                tmp_path(Path(config.prefix_cache_file)).unlink(missing_ok=True)
            os._exit(ExitCode.INTERRUPTED)
        now = time.monotonic()
        if pool.ready and not (last_press and now - last_press[-1] <= CONFIRM_SECONDS):
            last_press[:] = [now]
            log.warning("Press Ctrl+C again within %g s to %s", CONFIRM_SECONDS,
                        "save the prefix cache and close" if config.prefix_cache_file
                        else "close (without --prefix-cache-file)")
            return
        request_stop()

    def on_engine_failure(slot: Any, failed: str) -> None:
        """A single-model server stops with status 2 (a supervisor restarts it)."""
        print(f"error: the engine failed: {failed}", file=sys.stderr)
        request_stop(ExitCode.ENGINE_FAILED)

    pool.on_engine_failure = on_engine_failure
    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    loop.add_signal_handler(signal.SIGTERM, request_stop)  # stops at once
    serving = [asyncio.ensure_future(s.serve()) for s in servers]
    tasks: list[asyncio.Future] = []
    try:
        await _wait_listening(config.host, config.port, time.monotonic() + 10)
        announce(f"ninfer {version_string()} listening on {config.host}:{config.port}"
                 + (f" (stats on port {config.stats_port})" if config.stats_port else ""))
        announce(f"API base: {api_base(config.host, config.port)}")
        starting = asyncio.ensure_future(pool.start_up())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set() and not starting.done():
            _abandon_start_up(reqlog, announce)
        stopper.cancel()
        if starting.exception() is not None:  # a single-model server's model failed to load
            slot = next(iter(pool.slots.values()))
            print(f"error: {slot.error}", file=sys.stderr)
            return ExitCode.FAILED
        if pool.router:
            announce(f"router ready: {len(pool.slots)} models ({', '.join(pool.slots)}); "
                     f"at most {options.models_max or 'unlimited'} loaded; serving")
        else:
            state = next(iter(pool.slots.values())).state
            announce(f"model {state.model_id} ready (context {state.loaded.max_context}); serving")
        tasks.append(asyncio.ensure_future(pool.watch()))
        if config.log_stats_interval_ms:
            tasks.append(asyncio.ensure_future(_report_throughput(pool, config.log_stats_interval_ms / 1e3)))
        async with _panel(pool, on_interrupt):
            await stop.wait()
        for task in tasks:
            task.cancel()
        loaded = [(s.state.loaded.engine, s.state.config) for s in pool.slots.values()
                  if s.state is not None and s.state.loaded is not None]
        pool.close()
        await pool.unload_all()
        saved = await _save_prefix_caches(loaded, abandon_save)
        announce("server stopped" + (f"; {saved}" if saved else ""))
        return outcome["code"]
    finally:
        for s in servers:
            s.stop()
        await asyncio.gather(*serving, return_exceptions=True)


def _abandon_start_up(reqlog: RequestLog, announce: Callable[[str], None]) -> None:
    """A stop before ready: say so and leave at once with 130. The loading thread may be deep in
    torch or a converter and cannot be stopped; exiting the interpreter around it would abort
    natively ("terminate called without an active exception"), so the process ends here."""
    announce("stopped during start-up")
    reqlog.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ExitCode.INTERRUPTED)


async def _save_prefix_caches(loaded: list[tuple[Any, ServerConfig]], abandon: threading.Event) -> str:
    """--prefix-cache-file: save each stopped engine's retained sessions; the result lines."""
    lines = []
    for engine, config in loaded:
        if not config.prefix_cache_file:
            continue
        log.warning("Closing: saving the prefix cache | Press Ctrl+C again to exit without saving")
        try:
            n = await asyncio.to_thread(engine.save_prefix_cache, abandon)
        except Exception as e:  # noqa: BLE001 - reported; the previous file is kept
            lines.append(f"prefix cache not saved: {e}")
            continue
        lines.append(f"prefix cache saved: {n} sessions to {config.prefix_cache_file}")
    return "; ".join(lines)


def _panel(pool: ModelPool, on_interrupt: Callable[[], None]) -> contextlib.AbstractAsyncContextManager:
    """The Textual statistics panel when on (the default), on an interactive stderr, at info
    verbosity or more; redirected output gets plain records and no control sequences."""
    config = pool.config
    if not (config.log_stats_panel and sys.stderr.isatty() and config.log_level in ("trace", "debug", "info")):
        return contextlib.nullcontext()
    from ninfer.cli.panel import stats_panel

    def gauges() -> tuple[int, int]:
        snaps = [s.state.loaded.engine.snapshot() for s in pool.slots.values()
                 if s.state is not None and s.state.loaded is not None]
        return sum(s.running for s in snaps), sum(s.waiting for s in snaps)

    return stats_panel(pool.reqlog.stats, gauges, on_interrupt)


async def _report_throughput(pool: ModelPool, interval: float) -> None:
    """The throughput record of each loaded model every `interval` seconds, from engine snapshot
    deltas (a model loaded meanwhile starts its first interval now)."""
    before: dict[int, tuple[Any, float]] = {}  # id(engine) -> (snapshot, time)
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        current: dict[int, tuple[Any, float]] = {}
        for slot in pool.slots.values():
            if slot.state is None or slot.state.loaded is None:
                continue
            engine = slot.state.loaded.engine
            after = engine.snapshot()
            if id(engine) in before:
                snap0, t0 = before[id(engine)]
                pool.reqlog.throughput(snap0, after, now - t0, model=slot.name if pool.router else None)
            current[id(engine)] = (after, now)
        before = current
