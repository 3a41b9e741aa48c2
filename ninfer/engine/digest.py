"""The session digest: FNV-1a 64 over token ids, the one definition the engine (if_digest checks,
slot files) and the server (/slots, id_slot responses) share."""
from __future__ import annotations

from collections.abc import Iterable

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


def session_digest(token_ids: Iterable[int]) -> str:
    """FNV-1a 64 over the token ids (each as 4 little-endian bytes), 16 hex characters."""
    h = FNV_OFFSET
    for tid in token_ids:
        for b in int(tid).to_bytes(4, "little", signed=False):
            h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"
