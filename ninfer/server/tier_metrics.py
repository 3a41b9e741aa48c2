"""The /metrics series and /v1/load fields of the context tiers (device, host, disk), from the
TierGauges the engine publishes with its snapshot."""
from __future__ import annotations

from typing import Any


def tier_series(lines: list[str], gauges: Any) -> None:
    """Append the per-tier series (Prometheus text) for a snapshot's `tiers` gauges."""
    if gauges is None:
        return

    def series(name: str, kind: str, help_text: str, values: dict, labels: tuple[str, ...]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for key, v in sorted(values.items()):
            key = key if isinstance(key, tuple) else (key,)
            lines.append(name + "{" + ",".join(f'{label}="{k}"' for label, k in zip(labels, key)) + "} " + str(v))

    series("ninfer:context_tier_pages", "gauge", "KV pages each tier holds (device: the pool's pages in use)",
           gauges.pages, ("tier",))
    series("ninfer:context_tier_bytes", "gauge", "bytes each tier holds (KV pages and recurrent-state checkpoints)",
           gauges.bytes, ("tier",))
    series("ninfer:context_tier_sessions", "gauge", "retained sessions each tier holds", gauges.entries, ("tier",))
    series("ninfer:context_tier_hits_total", "counter", "admissions that reused a prefix the tier supplied",
           gauges.hits, ("tier",))
    series("ninfer:context_tier_misses_total", "counter", "prefix lookups the tier could not serve",
           gauges.misses, ("tier",))
    series("ninfer:context_transfer_bytes_total", "counter",
           "context-cache bytes moved between Device and Host: object state or main_kv, direction d2h or h2d",
           gauges.transfer_bytes, ("object", "direction"))
    series("ninfer:context_tier_writes_total", "counter", "sessions written to the disk tier (spill) and back to "
           "their slot file on eviction (auto_save)", {"spill": gauges.spills, "auto_save": gauges.auto_saves},
           ("kind",))


def host_kv_bytes(gauges: Any) -> int:
    return gauges.bytes.get("host", 0) if gauges is not None else 0
