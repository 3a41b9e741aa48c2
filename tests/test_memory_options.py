"""The memory-hierarchy options of `ninfer serve`, checked against each other before start-up."""
from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.cli.memory_options import host_budget, memory_config
from ninfer.errors import ConfigError

BASE = dict(host_kv_mib=None, host_cache_mib=None, prefix_cache_file=None, slot_save_path=None,
            auto_save_evicted=False, disk_kv_path=None, disk_kv_gib=64.0, disk_kv_restore=False, prefix_reuse=True)


def test_defaults_and_budgets(tmp_path: Path) -> None:
    m = memory_config(**BASE)
    assert m.host_kv_bytes == 8192 << 20 and m.slot_save_path is None and m.disk_path is None
    assert host_budget(16, None) == 16 << 20 and host_budget(None, "32") == 32 << 20 and host_budget(0, None) == 0
    assert host_budget(None, "auto") >= 0
    m = memory_config(**{**BASE, "slot_save_path": str(tmp_path / "new" / "slots"), "auto_save_evicted": True,
                         "disk_kv_path": str(tmp_path / "kv"), "disk_kv_gib": 0.5, "disk_kv_restore": True,
                         "prefix_cache_file": str(tmp_path / "p.cache")})
    assert Path(m.slot_save_path).is_dir() and Path(m.disk_path).is_dir() and m.disk_bytes == 1 << 29
    assert m.prefix_cache_file == str(tmp_path / "p.cache")


@pytest.mark.parametrize("change, message", [
    ({"host_kv_mib": 8, "host_cache_mib": "8"}, "--host-cache-mib replaces --host-kv-mib"),
    ({"host_cache_mib": "lots"}, "--host-cache-mib must be"),
    ({"host_kv_mib": -1}, "--host-kv-mib must be >= 0"),
    ({"auto_save_evicted": True}, "--auto-save-evicted requires --slot-save-path"),
    ({"disk_kv_restore": True}, "--disk-kv-restore requires --disk-kv-path"),
    ({"prefix_cache_file": "/nonexistent-folder/p.cache"}, "does not exist"),
    ({"prefix_cache_file": "PLACEHOLDER", "host_cache_mib": "0"}, "needs a host tier"),
    ({"slot_save_path": "PLACEHOLDER", "prefix_reuse": False}, "--no-prefix-reuse"),
    ({"disk_kv_gib": 0}, "--disk-kv-gib"),
])
def test_bad_combinations_name_the_option(change: dict, message: str, tmp_path: Path) -> None:
    change = {k: (str(tmp_path / "x") if v == "PLACEHOLDER" else v) for k, v in change.items()}
    with pytest.raises(ConfigError, match=message):
        memory_config(**{**BASE, **change})
