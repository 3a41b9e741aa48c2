"""The context tiers below the device pool: a host tier, a disk tier, slot files and the
prefix-cache file (spec: Slots, Disk tier, --host-kv-mib, --prefix-cache-file).

The device prefix cache (prefix_cache.py) tells ContextTiers of every involuntary eviction before
the entry's pages are released; the entry is copied off the device as a SessionImage (its KV
pages and its recurrent-state checkpoints, engine/transfer.py) and kept in the host tier, LRU
within its byte budget; what the host tier evicts spills to the disk tier, one file per session
keyed by the digest of its tokens, LRU within its own budget. Before the scheduler admits the
queue's head, `promote` looks for a host (or, with --disk-kv-restore, disk) image that serves
the head's prompt further than any device entry, and installs it into the device cache as an
ordinary entry, which admission then reuses. On the CPU (torch backend) the host tier is a
second copy store in RAM beside the page pool: same behaviour, no pinned memory.

Slot actions (save, restore, erase) and the prefix-cache file use the same images and the one
file format of session_files.py. Everything here runs on the engine's worker thread (through
Engine.call_on_worker for the server's requests), except file writes, which a BackgroundWriter runs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ninfer.engine.config import MemoryConfig
from ninfer.engine.digest import session_digest
from ninfer.engine.errors import EngineError
from ninfer.engine.kv_cache import PagePool, StatePool, pages_for_tokens
from ninfer.engine.prefix_cache import CacheEntry, PrefixCache, common_prefix_len
from ninfer.engine.session_files import (SessionFileError, SessionImage, read_session_file, read_session_header,
                                         write_session_file)
from ninfer.engine.transfer import TensorMover

log = logging.getLogger("ninfer.engine")
TIERS = ("device", "host", "disk")
MAX_WAITING_SPILLS = 2  # auto-saves waiting for the writer (spec)


class SlotError(EngineError):
    """A slot action that cannot run. reason: "empty" (nothing to save), "mismatch" (if_digest
    names another session), "restore" (the pool cannot hold the file's session)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def image_match(token_ids: list[int], checkpoints: list[int], prompt: list[int], max_tokens: int,
                hybrid: bool, page_size: int) -> int:
    """Tokens of `prompt` an image serves: its common prefix (capped at max_tokens) with paged
    attention alone; with recurrent state only its longest checkpoint on that prefix."""
    common = min(common_prefix_len(prompt, token_ids, page_size), max_tokens)
    if not hybrid:
        return common
    return max((n for n in checkpoints if n <= common), default=0)


@dataclass(slots=True, frozen=True)
class TierGauges:
    """Published with the engine snapshot: what each tier holds and what moved."""

    pages: dict[str, int]  # tier -> KV pages held (device: the pool's pages in use)
    bytes: dict[str, int]  # tier -> bytes held
    entries: dict[str, int]  # tier -> sessions held
    hits: dict[str, int]  # tier -> admissions that reused a prefix it supplied
    misses: dict[str, int]  # tier -> lookups it could not serve
    transfer_bytes: dict[tuple[str, str], int]  # (main_kv | state, d2h | h2d) -> bytes copied
    spills: int = 0  # sessions written to the disk tier
    auto_saves: int = 0  # sessions written back to their slot file on eviction
    host_budget: int = 0  # the host tier's capacity in bytes (0: no host tier)
    disk_budget: int = 0


class BackgroundWriter:
    """One thread that writes files in submission order. Jobs carry a key (the file) so a newer
    action on that file can drop the jobs still waiting for it."""

    def __init__(self) -> None:
        self._jobs: deque[tuple[str, str, Callable[[], None]]] = deque()  # (key, kind, job)
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ninfer-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, kind: str, job: Callable[[], None], limit: int | None = None) -> bool:
        """Queue a job; False (not queued) when `limit` jobs of this kind already wait."""
        with self._cv:
            if limit is not None and sum(1 for _, k, _ in self._jobs if k == kind) >= limit:
                return False
            self._jobs.append((key, kind, job))
            self._cv.notify_all()
            return True

    def supersede(self, key: str) -> int:
        """Drop the waiting jobs for `key`; returns how many."""
        with self._cv:
            before = len(self._jobs)
            self._jobs = deque(j for j in self._jobs if j[0] != key)
            return before - len(self._jobs)

    def flush(self) -> None:
        """Wait until every queued job has run."""
        with self._cv:
            while self._jobs or self._busy:
                self._cv.wait()

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                _, _, job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception:  # a failed write is logged; the tier treats the file as absent
                log.exception("tier writer: a write failed")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


class HostTier:
    """Session images in host memory, least recently used first, within `budget` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._images: OrderedDict[int, SessionImage] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._images)

    @property
    def n_pages(self) -> int:
        return sum(img.n_pages for img in self._images.values())

    def images(self) -> list[SessionImage]:
        """Least recently used first."""
        return list(self._images.values())

    def put(self, img: SessionImage) -> list[SessionImage]:
        """Keep `img` as the most recent; returns the images that no longer fit (LRU first; `img`
        itself when it alone exceeds the budget). An image of the same tokens is replaced."""
        if img.nbytes > self.budget:
            return [img]
        for key, old in list(self._images.items()):
            if old.token_ids == img.token_ids:
                self._remove(key)
        self._images[self._next] = img
        self._next += 1
        self.nbytes += img.nbytes
        out = []
        while self.nbytes > self.budget:
            out.append(self._remove(next(iter(self._images))))
        return out

    def _remove(self, key: int) -> SessionImage:
        img = self._images.pop(key)
        self.nbytes -= img.nbytes
        return img

    def best(self, prompt: list[int], max_tokens: int, hybrid: bool, page_size: int) -> tuple[int, int] | None:
        """(key, tokens served) of the image serving `prompt` furthest, or None."""
        best = None
        for key, img in reversed(self._images.items()):
            n = image_match(img.token_ids, img.checkpoint_positions, prompt, max_tokens, hybrid, page_size)
            if n > 0 and (best is None or n > best[1]):
                best = (key, n)
        return best

    def tokens_of(self, key: int) -> list[int]:
        return self._images[key].token_ids

    def take(self, key: int) -> SessionImage:
        return self._remove(key)

    def clear(self) -> None:
        self._images.clear()
        self.nbytes = 0


@dataclass(slots=True)
class _DiskEntry:
    token_ids: list[int]
    checkpoints: list[int]
    n_pages: int
    nbytes: int
    last_used: float


class DiskTier:
    """Session files under `root/<profile>/`, one per session, named by the digest of its
    tokens, least recently used first within `budget` bytes. The profile folder (a hash of the
    compatibility profile) keeps one model's or KV format's files from ever meeting another's."""

    def __init__(self, root: Path, budget: int, compat: dict[str, Any], writer: BackgroundWriter, model: str) -> None:
        digest = hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = root / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self.compat = compat
        self.writer = writer
        self.model = model
        self._lock = threading.Lock()  # the index: the writer thread adds, the engine reads
        self._index: dict[str, _DiskEntry] = {}
        for path in self.dir.glob("*.kvs"):
            try:
                head = read_session_header(path)
                img = head["images"][0]
                checkpoints = list(img["page_checkpoints"]) + ([len(img["token_ids"])] if img["frontier_state"] else [])
                self._index[path.stem] = _DiskEntry(list(img["token_ids"]), checkpoints, int(img["n_pages"]),
                                                    path.stat().st_size, path.stat().st_mtime)
            except (SessionFileError, KeyError, IndexError, OSError):
                path.unlink(missing_ok=True)
        self.spills = 0

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._index.values())

    @property
    def n_pages(self) -> int:
        with self._lock:
            return sum(e.n_pages for e in self._index.values())

    def put(self, img: SessionImage) -> None:
        """Write `img` on the writer thread (an identical prefix is stored once)."""
        key = session_digest(img.token_ids)
        with self._lock:
            if key in self._index:
                self._index[key].last_used = time.time()
                return

        def job() -> None:
            path = self.dir / f"{key}.kvs"
            n = write_session_file(path, self.compat, [img], kind="disk", model=self.model)
            with self._lock:
                self._index[key] = _DiskEntry(list(img.token_ids), img.checkpoint_positions, img.n_pages, n,
                                              time.time())
                self.spills += 1
                self._trim()

        self.writer.submit(key, "disk", job)

    def _trim(self) -> None:
        while sum(e.nbytes for e in self._index.values()) > self.budget and self._index:
            key = min(self._index, key=lambda k: self._index[k].last_used)
            del self._index[key]
            (self.dir / f"{key}.kvs").unlink(missing_ok=True)

    def best(self, prompt: list[int], max_tokens: int, hybrid: bool, page_size: int) -> tuple[str, int] | None:
        best = None
        with self._lock:
            for key, e in self._index.items():
                n = image_match(e.token_ids, e.checkpoints, prompt, max_tokens, hybrid, page_size)
                if n > 0 and (best is None or n > best[1]):
                    best = (key, n)
        return best

    def tokens_of(self, key: str) -> list[int]:
        with self._lock:
            return self._index[key].token_ids

    def load(self, key: str) -> SessionImage | None:
        """The image under `key`, or None when its file is gone or fails its checksum (a miss;
        the file is removed)."""
        path = self.dir / f"{key}.kvs"
        try:
            _, images, _ = read_session_file(path, self.compat)
        except SessionFileError as e:
            log.warning("disk tier: %s; treated as a miss", e)
            with self._lock:
                self._index.pop(key, None)
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            if key in self._index:
                self._index[key].last_used = time.time()
        return images[0]


@dataclass(slots=True)
class _Binding:
    filename: str
    depth: int  # session tokens at the last explicit save or restore: a spill never writes fewer


@dataclass(slots=True)
class _Counters:
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    transfer_bytes: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(o, d): 0 for o in ("main_kv", "state") for d in ("d2h", "h2d")})
    auto_saves: int = 0


class ContextTiers:
    """The host and disk tiers, slot files and the prefix-cache file over one engine's pools."""

    def __init__(self, config: MemoryConfig, compat: dict[str, Any], mover: TensorMover | None,
                 cache: PrefixCache | None, pool: PagePool, state_pool: StatePool | None, model: str = "",
                 reserved_pages: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        # pages the running requests may still allocate (Scheduler.outstanding_pages): an install
        # never takes them, as admission never does
        self.reserved_pages = reserved_pages
        self.mover = mover
        self.cache = cache
        self.pool = pool
        self.state_pool = state_pool
        self.model = model
        layout = ([[str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for t in mover.page_tensors + mover.slot_tensors]
                  if mover is not None else [])
        # what a file must match to be restored here (JSON-normal: lists, not tuples)
        kv_dtype = layout[0][0] if layout else None
        self.compat = json.loads(json.dumps({**compat, "kv_dtype": kv_dtype, "page_size": pool.page_size,
                                             "layout": layout}))
        usable = mover is not None and cache is not None
        self.host = HostTier(config.host_kv_bytes) if usable and config.host_kv_bytes > 0 else None
        self.writer = BackgroundWriter() if usable and (config.disk_path or config.auto_save_evicted) else None
        self.disk = (DiskTier(Path(config.disk_path), config.disk_bytes, self.compat, self.writer, model)
                     if usable and config.disk_path else None)
        self.slot_dir = Path(config.slot_save_path) if config.slot_save_path else None
        self._bindings: dict[int, _Binding] = {}  # entry id -> its slot file (auto-save)
        self._promoted: dict[int, str] = {}  # entry id -> the tier it was installed from
        self._looked: int | None = None  # the queue head `promote` last served
        self.counters = _Counters()
        if cache is not None:
            cache.listener = self

    @property
    def hybrid(self) -> bool:
        return self.state_pool is not None

    # ---- the device cache's listener ---------------------------------------------------

    def evicted(self, entry: CacheEntry) -> None:
        """An entry leaves the device involuntarily: copy it down (and to its slot file)."""
        binding = self._bindings.pop(entry.entry_id, None)
        self._promoted.pop(entry.entry_id, None)
        auto = binding is not None and self.config.auto_save_evicted and self.writer is not None
        if self.host is None and self.disk is None and not auto:
            return
        img = self.capture(entry)
        if auto:
            self._auto_save(img, binding)
        self._demote(img)

    def superseded(self, entry_ids: list[int], new_entry: CacheEntry) -> None:
        """A longer entry replaced these: continuing a conversation keeps its slot-file binding."""
        for entry_id in entry_ids:
            self._promoted.pop(entry_id, None)
            binding = self._bindings.pop(entry_id, None)
            if binding is not None:
                self._bindings[new_entry.entry_id] = binding

    # ---- moving images -------------------------------------------------------------------

    def capture(self, entry: CacheEntry) -> SessionImage:
        """A host copy of a device entry (its pages and checkpoint states); the entry stays."""
        assert self.mover is not None
        checkpoints = entry.checkpoints()
        tensors, ready = self.mover.read(entry.pages, [slot for _, slot in checkpoints])
        img = SessionImage(list(entry.token_ids), list(entry.session), [n for n, _ in entry.page_checkpoints],
                           entry.state_slot >= 0, len(entry.pages), tensors, ready)
        self._count_transfer(img, "d2h")
        return img

    def _count_transfer(self, img: SessionImage, direction: str) -> None:
        t = self.counters.transfer_bytes
        t["main_kv", direction] += img.n_pages * self.mover.page_bytes
        t["state", direction] += len(img.checkpoint_positions) * self.mover.slot_bytes

    def _demote(self, img: SessionImage) -> None:
        spill = self.host.put(img) if self.host is not None else [img]
        if self.disk is not None:
            for old in spill:
                self.disk.put(old)

    def install(self, img: SessionImage, slot: int | None = None) -> CacheEntry | None:
        """Copy an image into the device cache as an ordinary entry (in cell `slot` when given),
        evicting least recently used entries for room. None when the pools cannot hold it."""
        assert self.cache is not None and self.mover is not None
        pool, state = self.pool, self.state_pool
        n, k = img.n_pages, len(img.checkpoint_positions)
        if n != pages_for_tokens(len(img.token_ids), pool.page_size) or img.frontier_state != self.hybrid:
            return None
        need = n + self.reserved_pages()
        if need > pool.num_pages or (state is not None and k > state.num_slots):
            return None
        if pool.num_free < need or (state is not None and state.num_free < k):
            self.cache.evict(need, k)
        if pool.num_free < need or (state is not None and state.num_free < k):
            return None
        pages = pool.allocate(n)
        slots = state.allocate(k) if state is not None else []
        self.mover.write(pages, slots, img.tensors)
        self._count_transfer(img, "h2d")
        page_checkpoints = list(zip(img.page_checkpoints, slots))
        frontier = slots[-1] if img.frontier_state else -1
        self.cache.insert(img.token_ids, pages, img.session, frontier, page_checkpoints, slot=slot)
        return self.cache.newest()

    # ---- promotion before admission --------------------------------------------------------

    def promote(self, scheduler: Any) -> None:
        """Serve the queue's head from a lower tier when one reuses more of its prompt than the
        device cache does and admission could then run it."""
        cache = self.cache
        lower = self.host is not None or (self.disk is not None and self.config.disk_restore)
        if cache is None or not lower or not scheduler.waiting:
            return
        seq = scheduler.waiting[0]
        if not seq.cache_prompt or self._looked == seq.seq_id:
            return
        if len(scheduler.running) >= scheduler.config.max_concurrency:
            return  # no lane: look again when one frees
        prompt, limit, P = seq.prompt_token_ids, seq.prompt_len - 1, self.pool.page_size
        find = cache.match_checkpoint if self.hybrid else cache.match
        match = find(prompt, limit)
        on_device = match.num_tokens if match else 0
        candidates: list[tuple[int, str, Any]] = []
        if self.host is not None:
            found = self.host.best(prompt, limit, self.hybrid, P)
            if found is not None and found[1] > on_device:
                candidates.append((found[1], "host", found[0]))
            elif on_device == 0:
                self.counters.misses["host"] += 1
        if self.disk is not None and self.config.disk_restore:
            found = self.disk.best(prompt, limit, self.hybrid, P)
            if found is not None and found[1] > on_device:
                candidates.append((found[1], "disk", found[0]))
            elif on_device == 0:
                self.counters.misses["disk"] += 1
        self._looked = seq.seq_id
        if not candidates:
            return
        _, tier, key = max(candidates, key=lambda c: (c[0], c[1] == "host"))
        lower_tier = self.host if tier == "host" else self.disk
        img_pages = pages_for_tokens(len(lower_tier.tokens_of(key)), P)
        entitlement = pages_for_tokens(seq.prompt_len + seq.max_output_tokens, P)
        if self.pool.num_free + cache.freeable_pages() < entitlement + scheduler.outstanding_pages() + img_pages:
            self._looked = None  # not now: the pool is busy; look again at the next step
            return
        img = self.host.take(key) if tier == "host" else self.disk.load(key)
        if img is None:
            self.counters.misses["disk"] += 1
            return
        entry = self.install(img)
        if entry is None:
            if tier == "host":
                self.host.put(img)
            return
        self._promoted[entry.entry_id] = tier

    def admitted(self, entry_id: int, reused_tokens: int, cache_prompt: bool) -> str | None:
        """Count an admission; returns the tier its reused prefix came from (None: nothing reused)."""
        if not cache_prompt:
            return None
        if reused_tokens <= 0:
            self.counters.misses["device"] += 1
            return None
        tier = self._promoted.pop(entry_id, "device")
        self.counters.hits[tier] += 1
        if tier != "device":
            self.counters.misses["device"] += 1
        return tier

    # ---- slot actions (the server's POST /slots/{id}) ---------------------------------------

    def _slot_entry(self, slot: int, if_digest: str | None) -> CacheEntry | None:
        entry = self.cache.entry_in_slot(slot) if self.cache is not None else None
        if if_digest is not None and (entry is None or session_digest(entry.session) != if_digest):
            raise SlotError(f"slot {slot} no longer holds session {if_digest}", "mismatch")
        return entry

    def save_slot(self, slot: int, if_digest: str | None) -> SessionImage:
        """A host copy of the session in `slot`. Raises SlotError (empty, mismatch)."""
        entry = self._slot_entry(slot, if_digest)
        if entry is None:
            raise SlotError(f"slot {slot} holds no session to save", "empty")
        if self.mover is None:
            raise SlotError("this runner cannot copy its KV cache off the device", "empty")
        return self.capture(entry)

    def bind(self, slot: int, filename: str, digest: str) -> None:
        """Bind the session in `slot` (if still `digest`) to its slot file for --auto-save-evicted."""
        entry = self.cache.entry_in_slot(slot) if self.cache is not None else None
        if entry is not None and session_digest(entry.session) == digest:
            for entry_id, b in list(self._bindings.items()):
                if b.filename == filename:
                    del self._bindings[entry_id]
            self._bindings[entry.entry_id] = _Binding(filename, len(entry.session))
        if self.writer is not None:
            self.writer.supersede(filename)

    def erase_slot(self, slot: int, if_digest: str | None) -> int:
        """Evict the session in `slot` (never written anywhere); returns its tokens (0: empty)."""
        entry = self._slot_entry(slot, if_digest)
        if entry is None:
            return 0
        binding = self._bindings.get(entry.entry_id)
        if binding is not None and self.writer is not None:
            self.writer.supersede(binding.filename)
        self._drop_slot(slot)
        return len(entry.session)

    def _drop_slot(self, slot: int) -> None:
        entry = self.cache.entry_in_slot(slot) if self.cache is not None else None
        if entry is not None:
            self._bindings.pop(entry.entry_id, None)
            self._promoted.pop(entry.entry_id, None)
            self.cache.drop(entry.entry_id)

    def restore_slot(self, slot: int, img: SessionImage, filename: str) -> CacheEntry:
        """Replace whatever `slot` held with `img`. Raises SlotError (the slot is left empty)."""
        self._drop_slot(slot)
        entry = self.install(img, slot=slot) if self.cache is not None and self.mover is not None else None
        if entry is None:
            raise SlotError(f"the KV pool cannot hold the {len(img.token_ids)}-token session of {filename}", "restore")
        self._bindings[entry.entry_id] = _Binding(filename, len(img.session))
        return entry

    def _auto_save(self, img: SessionImage, binding: _Binding) -> None:
        assert self.slot_dir is not None and self.writer is not None
        if len(img.session) < binding.depth:
            log.info("auto-save: skipped %s (a %d-token copy would replace %d tokens)", binding.filename,
                     len(img.session), binding.depth)
            return
        path = self.slot_dir / binding.filename

        def job() -> None:
            write_session_file(path, self.compat, [img], kind="slot", model=self.model)
            self.counters.auto_saves += 1
            log.info("auto-save: wrote %d tokens to %s", len(img.session), binding.filename)

        if not self.writer.submit(binding.filename, "auto_save", job, limit=MAX_WAITING_SPILLS):
            log.warning("auto-save: skipped %s (%d spills already wait for the writer)", binding.filename,
                        MAX_WAITING_SPILLS)

    def flush_writes(self, filename: str | None = None) -> None:
        """Wait for queued writes (a restore reads the newest state of its file)."""
        if self.writer is not None:
            self.writer.flush()

    # ---- the prefix-cache file ---------------------------------------------------------------

    def load_prefix_cache_file(self, path: Path) -> int:
        """At start: fill the host tier from `path`. A missing file restores nothing; a file for
        another profile, or a corrupt one, is ignored (and replaced at the next stop). Returns
        the sessions restored."""
        if self.host is None or not path.exists():
            return 0
        try:
            _, images, _ = read_session_file(path, self.compat)
        except SessionFileError as e:
            log.warning("prefix cache file ignored: %s", e)
            return 0
        for img in images:  # least recent first, so the newest end most recently used
            self.host.put(img)
        log.info("prefix cache file: restored %d sessions (%d bytes) from %s", len(images), self.host.nbytes, path)
        return len(images)

    def save_prefix_cache_file(self, path: Path, cancel: threading.Event | None = None,
                               include_device: bool = True) -> int:
        """At stop: write the device entries (unless `include_device` is False: a suspended model's
        pools are gone) and the host tier (newest first, up to the host budget) to `path`.
        Returns the sessions written; raises SaveCancelled or OSError."""
        if self.host is None:
            return 0
        images: list[SessionImage] = []
        budget = self.host.budget
        device = ([self.capture(e) for e in reversed(self.cache.entries())]
                  if self.cache is not None and include_device else [])
        for img in device + list(reversed(self.host.images())):
            if img.nbytes <= budget and all(img.token_ids != o.token_ids for o in images):
                images.append(img)
                budget -= img.nbytes
        images.reverse()
        write_session_file(path, self.compat, images, kind="prefix_cache", model=self.model, cancel=cancel)
        return len(images)

    # ---- gauges ------------------------------------------------------------------------------

    def gauges(self) -> TierGauges:
        page_bytes = self.mover.page_bytes if self.mover is not None else 0
        slot_bytes = self.mover.slot_bytes if self.mover is not None else 0
        state_used = self.state_pool.num_used if self.state_pool is not None else 0
        pages = {"device": self.pool.num_used, "host": self.host.n_pages if self.host else 0,
                 "disk": self.disk.n_pages if self.disk else 0}
        nbytes = {"device": self.pool.num_used * page_bytes + state_used * slot_bytes,
                  "host": self.host.nbytes if self.host else 0, "disk": self.disk.nbytes if self.disk else 0}
        entries = {"device": len(self.cache) if self.cache is not None else 0,
                   "host": len(self.host) if self.host else 0, "disk": len(self.disk) if self.disk else 0}
        c = self.counters
        return TierGauges(pages, nbytes, entries, dict(c.hits), dict(c.misses), dict(c.transfer_bytes),
                          self.disk.spills if self.disk else 0, c.auto_saves,
                          self.host.budget if self.host else 0, self.disk.budget if self.disk else 0)

    def clear_retained(self) -> None:
        """Drop every retained session on the device and in the host tier (files stay)."""
        if self.cache is not None:
            for e in self.cache.entries():
                self._drop_slot(e.slot)
        if self.host is not None:
            self.host.clear()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
