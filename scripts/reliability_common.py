"""Shared pieces of the reliability harness (scripts/fuzz.py, soak.py, cancel_leak.py): valid seed
bodies per route, the error-envelope check, and the server's idle resource baseline."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx

def seed_bodies(model: str) -> dict[str, dict[str, Any]]:
    """route -> a valid body (small outputs: the harness measures the server, not the model). Every
    POST route the server answers, aliases included; "{model}" in a path is the served model."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    tool = {"type": "function", "function": {"name": "colour", "description": "Pick a colour.",
                                             "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                            "required": ["name"]}}}
    chat_body = {"model": model, "max_tokens": 4, "temperature": 0, "tools": [tool], "tool_choice": "auto",
                 "messages": [chat[0], {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}
    responses_body = {"model": model, "max_output_tokens": 4, "store": False, "instructions": "Be brief.",
                      "input": [{"type": "message", "role": "user",
                                 "content": [{"type": "input_text", "text": "Name a colour."}]}]}
    embeddings_body = {"model": model, "input": ["Hello world", "The sky is blue"]}
    rerank_body = {"model": model, "query": "What colour is the sky?", "top_n": 1,
                   "documents": ["The sky is blue.", {"text": "Paris is in France."}]}
    return {
        "/v1/chat/completions": chat_body,
        "/chat/completions": chat_body,
        "/v1/completions": {"model": model, "prompt": "The sky is", "max_tokens": 4},
        "/completion": {"prompt": "The sky is", "n_predict": 4, "temperature": 0},
        "/completions": {"prompt": [1, 2, 3], "n_predict": 3},
        "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4},
        "/tokenize": {"content": "Hello world", "with_pieces": True},
        "/detokenize": {"tokens": [1, 2, 3]},
        "/apply-template": {"messages": chat, "add_generation_prompt": True},
        "/v1/messages": {"model": "claude-x", "max_tokens": 4, "system": "Be brief.",
                         "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
        "/v1/messages/count_tokens": {"model": "claude-x", "messages": [{"role": "user", "content": "Hi"}]},
        "/v1/responses": responses_body,
        "/responses": responses_body,
        "/v1/responses/input_tokens": {"model": model, "input": "Count this."},
        "/v1/responses/compact": {"model": model, "input": "x"},
        "/v1/responses/resp_missing/cancel": {},
        "/v1/embeddings": embeddings_body,
        "/embeddings": embeddings_body,
        "/v1/rerank": rerank_body,
        "/rerank": rerank_body,
        "/v1/reranking": rerank_body,
        "/reranking": rerank_body,
        "/models/load": {"model": model},
        "/models/unload": {"model": model},
        "/models/sleep": {"model": model},
        "/v1/models/{model}/suspend": {"auto_resume": True},
        "/v1/models/{model}/resume": {},
        "/v1/messages/batches": {"requests": []},
        "/slots/0?action=save": {"filename": "fuzz-slot.bin"},
        "/slots/0?action=restore": {"filename": "fuzz-slot.bin"},
        "/slots/0?action=erase": {},
    }


# GET routes; /models/sse is a stream that never ends by itself (the fuzzer reads its head and closes)
GET_ROUTES = ("/health", "/v1", "/v1/models", "/props", "/v1/load", "/stats", "/metrics", "/slots",
              "/openapi.json", "/v1/models/{model}", "/v1/models/{model}/residency", "/models", "/models/sse",
              "/v1/responses/resp_missing", "/v1/responses/resp_missing/input_items", "/v1/v1/models")


def served_model(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def envelope_problem(path: str, status: int, body: bytes, content_type: str) -> str | None:
    """Why an error response is not in its protocol's envelope (None when it is)."""
    if status < 400 or path == "/metrics":
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return "error body is not JSON"
    if not isinstance(doc, dict):
        return "error body is not an object"
    if path.startswith("/v1/messages"):
        err = doc.get("error")
        if doc.get("type") != "error" or not isinstance(err, dict) or not isinstance(err.get("message"), str) \
                or not isinstance(err.get("type"), str) or not isinstance(doc.get("request_id"), str):
            return "not Anthropic's {type: error, error: {type, message}, request_id}"
        return None
    err = doc.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str) \
            or "code" not in err or "param" not in err:
        return "not OpenAI's {error: {message, type, param, code}}"
    return None


def resources(client: httpx.Client, pid: int | None = None) -> dict[str, Any]:
    """The engine's held resources as the ops routes publish them, and the process's RSS and open
    files when its pid is known. leaked_pages: pages in use beyond what retained sessions hold."""
    load = client.get("/v1/load").json()
    slots = client.get("/slots").json()
    retained = sum(s.get("n_pages", 0) for s in slots if s.get("retained"))
    out = {
        "admitted": load["requests"]["admitted"], "running": load["requests"]["running"],
        "waiting": load["requests"]["waiting"], "pages_used": load["occupancy"]["device_main_kv_pages"],
        "retained_pages": retained, "processing_slots": sum(1 for s in slots if s.get("is_processing")),
        "state_slots": load["occupancy"].get("device_state_slots", 0),
    }
    out["leaked_pages"] = out["pages_used"] - retained
    if pid is not None:
        out["rss_mib"] = rss_mib(pid)
        out["open_files"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_idle(client: httpx.Client, timeout: float = 120.0) -> dict[str, Any]:
    """Poll until no request is admitted, running or waiting; the last reading."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        r = resources(client)
        if (r["admitted"] == 0 and r["running"] == 0 and r["waiting"] == 0) or time.monotonic() > deadline:
            return r
        time.sleep(0.1)
