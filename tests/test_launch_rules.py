"""The kernel launchers' pure rules (no GPU): where the tiled gemv stages its activations in shared
memory (launchers.xsmem_bytes)."""
from __future__ import annotations

import pytest

from ninfer.kernels import launchers as L


@pytest.mark.parametrize("M,N,K,int8,force,expect", [
    (1, 128256, 4096, False, None, 4104 * 2),  # int4 lm_head: the rule takes it
    (1, 28672, 4096, False, None, 4104 * 2),  # gate_up
    (1, 6144, 4096, False, None, 0),  # qkv: too few outputs
    (1, 28672, 4096, True, None, 0),  # int8: never by the rule
    (2, 28672, 4096, False, None, 0),  # two rows lose
    (1, 6144, 4096, True, 1, 4104 * 2),  # forced where it fits
    (2, 4096, 14336, False, 1, 0),  # ... but not past TILED_XSMEM_BYTES
    (1, 28672, 4096, False, 0, 0),  # forced off
])
def test_xsmem_rule(M: int, N: int, K: int, int8: bool, force: int | None, expect: int) -> None:
    assert L.xsmem_bytes(M, N, K, int8, force) == expect


def test_xsmem_switch_off(monkeypatch) -> None:
    monkeypatch.setattr(L, "TILED_XSMEM", False)
    assert L.xsmem_bytes(1, 128256, 4096, False) == 0
    assert L.xsmem_bytes(1, 128256, 4096, False, force=1) == 4104 * 2
