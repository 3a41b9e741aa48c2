"""The local store of OpenAI Responses: what GET /v1/responses/{id}, its input_items and
previous_response_id read. Process memory only, least recently used evicted past a byte budget."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from ninfer.errors import RequestError

if TYPE_CHECKING:
    from ninfer.server.http import Call

STORE_BYTES = 64 << 20  # the budget, counted as the serialized size of what an entry keeps


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]  # the terminal Response object
    input_items: list[dict[str, Any]]  # this request's canonical input Items
    history: list[dict[str, Any]]  # every Item of the chain up to and including this output
    size: int


class ResponseStore:
    """Stored Responses of this process, least recently used evicted past `budget` bytes."""

    def __init__(self, budget: int = STORE_BYTES) -> None:
        self.budget = budget
        self.used = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        entry = self._items.get(response_id)
        if entry is not None:
            self._items.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            history: list[dict[str, Any]]) -> None:
        size = len(orjson.dumps([response, input_items, history]))
        if size > self.budget:
            raise RequestError(f"this Response ({size} bytes with its history) exceeds the response store "
                               f"({self.budget} bytes); send it with store: false", param="store",
                               code="response_store_capacity_exceeded")
        while self.used + size > self.budget:
            _, old = self._items.popitem(last=False)
            self.used -= old.size
        self._items[response["id"]] = Stored(response, input_items, history, size)
        self.used += size

    def delete(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.used -= entry.size
        return entry is not None


def _store(call: Call) -> ResponseStore:
    store = call.state.extensions.get("responses")
    if store is None:
        store = call.state.extensions["responses"] = ResponseStore()
    return store
