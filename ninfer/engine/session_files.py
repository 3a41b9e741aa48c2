"""Session images and the one file format every tier writes them in.

A SessionImage is a retained context-cache entry copied off the device: its token ids, its
session, the host copies of its KV pages and of its recurrent-state checkpoints. The host tier
holds images in memory; slot files (POST /slots/{id}?action=save), the prefix-cache file and the
disk tier hold them in files of this layout:

    b"NINFSES1"  | u64 header length | header (JSON, utf-8) | tensor bytes, in header order | sha256

The header names the kind, the model, the creation time, the compatibility profile of the
server that wrote it (artifact, weight formats, KV dtype, page size, state kinds and the layout
of every pool tensor) and per image its tokens and tensor shapes. The trailing sha256 covers
everything before it; a reader verifies it before it parses or allocates anything, so a torn or
corrupt file is refused whole. Writers write `.NAME.tmp` beside the target, fsync it and rename
it over the target, so a crash or kill -9 mid-write leaves the previous file as it was.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer.engine.digest import session_digest
from ninfer.engine.errors import EngineError

MAGIC = b"NINFSES1"
CHECKSUM_BYTES = 32
WRITE_CHUNK = 16 << 20  # bytes per write; a cancelled save stops between chunks


class SessionFileError(EngineError):
    """A session file that cannot be used: missing, torn, corrupt, or written for another server
    profile (the message names what differs)."""


class SaveCancelled(EngineError):
    """A save abandoned on request; the temporary file is gone and the previous file kept."""


@dataclass(slots=True)
class SessionImage:
    """One context-cache entry in host memory.

    tensors: the host copies, first one per page-indexed pool tensor ([n_pages, ...]: K and V of
    each attention layer, and any per-page scales), then one per slot-indexed pool tensor
    ([n_checkpoints, ...]: conv windows and delta-rule states), checkpoints in the order of
    `checkpoint_positions`. `ready` is a CUDA event the copies complete at (None: complete)."""

    token_ids: list[int]  # tokens whose KV the pages hold (the executed frontier)
    session: list[int]  # the conversation: token_ids plus any sampled token not yet executed
    page_checkpoints: list[int]  # positions of the page checkpoints (ascending, below the frontier)
    frontier_state: bool  # a hybrid model: the last checkpoint is the state after all token_ids
    n_pages: int
    tensors: list[torch.Tensor]
    ready: Any = None

    @property
    def checkpoint_positions(self) -> list[int]:
        return self.page_checkpoints + ([len(self.token_ids)] if self.frontier_state else [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def digest(self) -> str:
        return session_digest(self.session)

    def wait(self) -> None:
        """Block until the host copies are complete (an asynchronous device-to-host copy)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


def tmp_path(path: Path) -> Path:
    """The temporary name a save writes before renaming: hidden, beside the target."""
    return path.with_name(f".{path.name}.tmp")


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_session_file(path: Path, compat: dict[str, Any], images: list[SessionImage], *, kind: str,
                       model: str = "", cancel: threading.Event | None = None) -> int:
    """Write `images` to `path` atomically (temporary file, fsync, rename). Returns the bytes
    written. Raises SaveCancelled when `cancel` is set mid-write, OSError when the disk refuses;
    either way the temporary file is removed and a previous file at `path` is untouched."""
    header = {
        "kind": kind, "model": model, "created": time.time(), "compat": compat,
        "images": [{"token_ids": img.token_ids, "session": img.session, "page_checkpoints": img.page_checkpoints,
                    "frontier_state": img.frontier_state, "n_pages": img.n_pages, "digest": img.digest,
                    "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in img.tensors]}
                   for img in images],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    tmp = tmp_path(path)
    h = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as f:
            def put(b: bytes | memoryview) -> None:
                nonlocal written
                f.write(b)
                h.update(b)
                written += len(b)

            put(MAGIC)
            put(len(head).to_bytes(8, "little"))
            put(head)
            for img in images:
                img.wait()
                for t in img.tensors:
                    data = _bytes_of(t)
                    for i in range(0, len(data), WRITE_CHUNK):
                        if cancel is not None and cancel.is_set():
                            raise SaveCancelled(f"the save of {path} was abandoned; the previous file is kept")
                        put(data[i:i + WRITE_CHUNK])
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return written + CHECKSUM_BYTES


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_session_header(path: Path) -> dict[str, Any]:
    """The header alone (listing files without reading their payload). Raises SessionFileError."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise SessionFileError(f"{path.name} is not a ninfer session file")
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > os.fstat(f.fileno()).st_size:
                raise SessionFileError(f"{path.name} is truncated")
            return json.loads(f.read(n))
    except FileNotFoundError:
        raise SessionFileError(f"{path.name} does not exist") from None
    except (OSError, ValueError) as e:
        raise SessionFileError(f"{path.name} cannot be read: {e}") from None


def check_compat(have: dict[str, Any], want: dict[str, Any], name: str) -> None:
    """Raise SessionFileError naming the first profile key where a file (`have`) differs from this
    server (`want`)."""
    for key, value in want.items():
        if have.get(key) != value:
            raise SessionFileError(f"{name} was written for {key} {have.get(key)!r}; this server has {value!r}")


def read_session_file(path: Path, compat: dict[str, Any] | None) -> tuple[dict[str, Any], list[SessionImage], int]:
    """Read and verify a whole file: checksum first, then the compatibility profile (skipped when
    `compat` is None), then the images (host tensors). Returns (header, images, bytes read).
    Raises SessionFileError for a missing, torn, corrupt or incompatible file."""
    try:
        size = path.stat().st_size
        data = bytearray(size)
        with open(path, "rb") as f:
            if f.readinto(data) != size:
                raise SessionFileError(f"{path.name} changed while it was read")
    except FileNotFoundError:
        raise SessionFileError(f"{path.name} does not exist") from None
    except IsADirectoryError:
        raise SessionFileError(f"{path.name} is a folder") from None
    except OSError as e:
        raise SessionFileError(f"{path.name} cannot be read: {e.strerror}") from None
    body = memoryview(data)[:-CHECKSUM_BYTES] if size >= CHECKSUM_BYTES else memoryview(b"")
    if size < len(MAGIC) + 8 + CHECKSUM_BYTES or bytes(data[:len(MAGIC)]) != MAGIC:
        raise SessionFileError(f"{path.name} is not a ninfer session file")
    if hashlib.sha256(body).digest() != bytes(data[-CHECKSUM_BYTES:]):
        raise SessionFileError(f"{path.name} fails its checksum (torn or corrupt)")
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    offset = len(MAGIC) + 8 + n
    try:
        header = json.loads(bytes(data[len(MAGIC) + 8:offset]))
    except ValueError:
        raise SessionFileError(f"{path.name} has an unreadable header") from None
    if compat is not None:
        check_compat(header.get("compat") or {}, compat, path.name)
    images: list[SessionImage] = []
    for spec in header["images"]:
        tensors: list[torch.Tensor] = []
        for dtype_name, shape in spec["tensors"]:
            dtype = getattr(torch, dtype_name)
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            if offset + nbytes > len(body):
                raise SessionFileError(f"{path.name} holds less data than its header lists")
            raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(shape))
            offset += nbytes
        images.append(SessionImage(list(spec["token_ids"]), list(spec["session"]), list(spec["page_checkpoints"]),
                                   bool(spec["frontier_state"]), int(spec["n_pages"]), tensors))
    return header, images, size
