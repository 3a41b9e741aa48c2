"""POST /slots/{id}?action=save|restore|erase: persist a retained session to a slot file, restore
one, or evict one (spec: Slots). Without --slot-save-path the route answers 501.

The engine copies the session off the device (or installs a restored one) on its worker thread
through Engine.call_on_worker; the file is written or read and verified here on a worker thread, so the
event loop never waits on the disk. One slot action runs at a time: a second one meanwhile is
409 slot_busy.
"""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from ninfer.errors import RequestError
from ninfer.server.http import Call

ACTIONS = ("save", "restore", "erase")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_DEVICE_NAMES = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}
_DIGEST = re.compile(r"^[0-9a-f]{16}$")


def check_filename(name: Any) -> str:
    """A slot file name as the spec allows it, lowercased; raises 400 invalid_filename."""
    def bad(why: str) -> RequestError:
        return RequestError(f"filename {why}", param="filename", code="invalid_filename")

    if not isinstance(name, str):
        raise bad("must be a string of 1-128 characters of [A-Za-z0-9._-]")
    if not _NAME.match(name):
        raise bad("must be 1-128 characters of [A-Za-z0-9._-]")
    if name.startswith(".") or name.endswith("."):
        raise bad("may not start or end with a dot")
    lower = name.lower()
    if lower.split(".", 1)[0] in _DEVICE_NAMES:
        raise bad(f"{name!r} is a Windows device name")
    return lower


def _busy() -> RequestError:
    return RequestError("another slot action is in progress; retry", status=409, code="slot_busy",
                        type="invalid_request_error")


async def handle_slot_action(call: Call) -> None:
    state = call.state
    folder = state.config.slot_save_path
    if not folder:
        raise RequestError("slot persistence is disabled: start the server with --slot-save-path DIR",
                           status=501, code="slot_persistence_disabled", type="not_supported_error")
    snap = state.loaded.engine.snapshot()
    raw_id = call.extra["slot_id"]
    if not raw_id.isdigit() or not 0 <= int(raw_id) < snap.max_private_continuations:
        raise RequestError(f"slot {raw_id!r} does not exist: ids are 0..{snap.max_private_continuations - 1}",
                           param="id_slot", code="invalid_slot")
    slot = int(raw_id)
    action = call.query.get("action")
    if action not in ACTIONS:
        raise RequestError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}", param="action",
                           code="invalid_action")
    body = call.json() if call.body.strip() or action != "erase" else {}
    if_digest = body.get("if_digest")
    if if_digest is not None and (not isinstance(if_digest, str) or not _DIGEST.match(if_digest.lower())):
        raise RequestError("if_digest must be a session digest (16 hex characters)", param="if_digest",
                           code="invalid_request")
    if_digest = if_digest.lower() if if_digest is not None else None
    filename = check_filename(body.get("filename")) if action != "erase" else None
    lock: asyncio.Lock = state.slot_lock
    if lock.locked():
        raise _busy()
    async with lock:
        run = _ACTIONS[action]
        await run(call, slot, Path(folder), filename, if_digest)


# the engine's tier modules load torch: imported where an action runs, after the model is up
# (the server app imports without torch; tests/test_layering.py)


async def _on_engine(call: Call, fn) -> Any:
    from ninfer.engine.tiers import SlotError

    engine = call.state.loaded.engine
    try:
        return await asyncio.wrap_future(engine.call_on_worker(fn))
    except SlotError as e:
        if e.reason == "mismatch":
            raise RequestError(e.message, status=409, code="slot_session_mismatch", param="if_digest") from None
        code = "slot_restore_failed" if e.reason == "restore" else "slot_save_failed"
        raise RequestError(e.message, code=code) from None


async def _save(call: Call, slot: int, folder: Path, filename: str, if_digest: str | None) -> None:
    from ninfer.engine.session_files import write_session_file

    t0 = time.perf_counter()
    tiers = call.state.loaded.engine.tiers
    img = await _on_engine(call, lambda: tiers.save_slot(slot, if_digest))
    if tiers.writer is not None:
        tiers.writer.supersede(filename)  # an explicit save supersedes the spills still waiting
    try:
        written = await asyncio.to_thread(write_session_file, folder / filename, tiers.compat, [img], kind="slot",
                                          model=call.state.model_id)
    except OSError as e:
        raise RequestError(f"cannot write {filename}: {e.strerror or e}", code="slot_save_failed") from None
    await _on_engine(call, lambda: tiers.bind(slot, filename, img.digest))
    await call.respond(200, {"id_slot": slot, "filename": filename, "n_saved": len(img.session),
                             "n_written": written, "session_digest": img.digest,
                             "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})


async def _restore(call: Call, slot: int, folder: Path, filename: str, if_digest: str | None) -> None:
    from ninfer.engine.session_files import SessionFileError, read_session_file

    t0 = time.perf_counter()
    tiers = call.state.loaded.engine.tiers
    await asyncio.to_thread(tiers.flush_writes)  # read the newest state of the file
    try:
        _, images, n_read = await asyncio.to_thread(read_session_file, folder / filename, tiers.compat)
        if len(images) != 1:
            raise SessionFileError(f"{filename} holds {len(images)} sessions, not one slot")
    except SessionFileError as e:
        await _on_engine(call, lambda: tiers.erase_slot(slot, None))  # a failed restore leaves the slot empty
        raise RequestError(e.message, code="slot_restore_failed", param="filename") from None
    img = images[0]
    await _on_engine(call, lambda: tiers.restore_slot(slot, img, filename))
    await call.respond(200, {"id_slot": slot, "filename": filename, "n_restored": len(img.session),
                             "n_read": n_read, "session_digest": img.digest,
                             "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})


async def _erase(call: Call, slot: int, folder: Path, filename: str | None, if_digest: str | None) -> None:
    tiers = call.state.loaded.engine.tiers
    n = await _on_engine(call, lambda: tiers.erase_slot(slot, if_digest))
    await call.respond(200, {"id_slot": slot, "n_erased": n})


_ACTIONS = {"save": _save, "restore": _restore, "erase": _erase}
