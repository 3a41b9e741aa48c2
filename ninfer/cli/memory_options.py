"""The memory-hierarchy options of `ninfer serve` (spec: Slots, Disk tier, --host-kv-mib,
--host-cache-mib, --prefix-cache-file): parsed and checked here, handed down as a MemoryConfig."""
from __future__ import annotations

import os
from pathlib import Path

from ninfer.engine.config import MemoryConfig
from ninfer.errors import ConfigError

MIB = 1 << 20
DEFAULT_HOST_KV_MIB = 8192  # spec default
HOST_CACHE_RESERVE_MIB = 3072  # --host-cache-mib auto leaves this much host memory free (spec default)


def available_host_bytes() -> int:
    """Host memory still available: the smaller of the system's and the memory cgroup's."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        usage = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, int(limit) - usage)
    except (OSError, ValueError):
        pass
    return max(0, avail)


def host_budget(host_kv_mib: int | None, host_cache_mib: str | None) -> int:
    """The host tier's byte budget from --host-kv-mib / --host-cache-mib N|auto (not both)."""
    if host_cache_mib is not None and host_kv_mib is not None:
        raise ConfigError("--host-cache-mib replaces --host-kv-mib; give one of them")
    if host_cache_mib is None:
        mib = DEFAULT_HOST_KV_MIB if host_kv_mib is None else host_kv_mib
        if mib < 0:
            raise ConfigError("--host-kv-mib must be >= 0")
        return mib * MIB
    if host_cache_mib == "auto":
        return max(0, available_host_bytes() - HOST_CACHE_RESERVE_MIB * MIB)
    try:
        mib = int(host_cache_mib)
    except ValueError:
        raise ConfigError(f"--host-cache-mib must be a number of MiB or auto, got {host_cache_mib!r}") from None
    if mib < 0:
        raise ConfigError("--host-cache-mib must be >= 0")
    return mib * MIB


def memory_config(*, host_kv_mib: int | None, host_cache_mib: str | None, prefix_cache_file: str | None,
                  slot_save_path: str | None, auto_save_evicted: bool, disk_kv_path: str | None,
                  disk_kv_gib: float, disk_kv_restore: bool, prefix_reuse: bool) -> MemoryConfig:
    """Check the options against each other and the file system; create --slot-save-path."""
    if not prefix_reuse:
        for flag, value in (("--slot-save-path", slot_save_path), ("--auto-save-evicted", auto_save_evicted),
                            ("--prefix-cache-file", prefix_cache_file), ("--disk-kv-path", disk_kv_path)):
            if value:
                raise ConfigError(f"{flag} needs the context cache; it cannot be combined with --no-prefix-reuse")
    if disk_kv_gib <= 0:
        raise ConfigError("--disk-kv-gib must be positive")
    slot_dir = None
    if slot_save_path is not None:
        path = Path(slot_save_path).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--slot-save-path {slot_save_path}: cannot create it ({e.strerror})") from None
        slot_dir = str(path)
    cache_file = None
    if prefix_cache_file is not None:
        path = Path(prefix_cache_file).expanduser().resolve()
        if not path.parent.is_dir():
            raise ConfigError(f"--prefix-cache-file {prefix_cache_file}: the folder {path.parent} does not exist")
        cache_file = str(path)
    disk_dir = None
    if disk_kv_path is not None:
        path = Path(disk_kv_path).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--disk-kv-path {disk_kv_path}: cannot create it ({e.strerror})") from None
        disk_dir = str(path)
    return MemoryConfig(host_kv_bytes=host_budget(host_kv_mib, host_cache_mib), disk_path=disk_dir,
                        disk_bytes=int(disk_kv_gib * (1 << 30)), disk_restore=disk_kv_restore,
                        slot_save_path=slot_dir, auto_save_evicted=auto_save_evicted, prefix_cache_file=cache_file)
