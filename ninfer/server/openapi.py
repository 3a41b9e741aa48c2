"""GET /openapi.json: an OpenAPI 3.1 description of every route the server answers, with the
request fields, types and ranges the protocol adapters enforce, so that a schema-driven fuzzer
(schemathesis) can exercise them. It describes the contract, it does not drive validation: the
adapters stay the one place that checks a body, and tests/test_reliability_http.py keeps the two in
step by sending what this document allows."""
from __future__ import annotations

from typing import Any

from ninfer.server.http import Call
from ninfer.version import version_string

NUM = {"type": "number"}
INT = {"type": "integer"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
STOP4 = {"oneOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}]}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": STR}}

SAMPLING = {
    "temperature": {"type": "number", "maximum": 100},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer", "minimum": -2**63, "maximum": 2**64 - 1},  # unsigned seeds fold into range
}
NAME = {"type": "string", "minLength": 1}
FUNCTION_TOOL = {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"const": "function"},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": NAME, "description": STR,
                                                            "parameters": {"type": "object",
                                                                           "properties": {"type": {"const": "object"}}},
                                                            "strict": BOOL}}}}
CUSTOM_TOOL = {"type": "object", "required": ["type", "custom"],
               "properties": {"type": {"const": "custom"},
                              "custom": {"type": "object", "required": ["name"],
                                         "properties": {"name": NAME, "description": STR,
                                                        "format": {"type": "object", "required": ["type"],
                                                                   "properties": {"type": {"const": "text"}}}}}}}
CHAT_TOOL_CHOICE = {"oneOf": [{"enum": ["none", "auto", "required"]},
                              {"type": "object", "required": ["type", "function"],
                               "properties": {"type": {"const": "function"},
                                              "function": {"type": "object", "required": ["name"],
                                                           "properties": {"name": NAME}}}}]}

CHAT_MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [STR, {"type": "array", "items": TEXT_PART}]},
        "tool_call_id": STR,
        "reasoning_content": STR,
    },
}

RESPONSE_FORMAT = {
    "type": "object", "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "schema": {"type": "object"},  # llama.cpp: json_object with a schema
        "json_schema": {"type": "object", "required": ["schema"],
                        "properties": {"name": STR, "schema": {"type": "object"}, "strict": BOOL}},
    },
}

CHAT = {
    "type": "object", "required": ["messages"],
    "properties": {
        "model": STR,
        "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
        "max_tokens": {"type": "integer", "minimum": -1},
        "max_completion_tokens": {"type": "integer", "minimum": -1},
        **SAMPLING,
        "top_k": {"type": "integer", "minimum": 0},
        "stop": STOP4,
        "stream": BOOL,
        "stream_options": {"type": "object", "properties": {"include_usage": BOOL}},
        "logprobs": BOOL,
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "n": {"const": 1},
        "ignore_eos": BOOL,
        "response_format": RESPONSE_FORMAT,
        "json_schema": {"type": "object"},  # llama.cpp's top-level schema
        "grammar": STR,  # llama.cpp's GBNF grammar
        "continue_final_message": BOOL,
        "enable_thinking": BOOL,
        "preserve_thinking": BOOL,
        "chat_template_kwargs": {"type": "object"},
        "reasoning_effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh", "max", "default", "auto"]},
        "timings_per_token": BOOL,
        "return_progress": BOOL,
        "id_slot": {"type": "integer", "minimum": -1},
        "tools": {"type": "array", "items": {"oneOf": [FUNCTION_TOOL, CUSTOM_TOOL]}},
        "tool_choice": CHAT_TOOL_CHOICE,
        "parallel_tool_calls": BOOL,
        "logit_bias": {"type": "object", "additionalProperties": {"const": 0}},  # only neutral biases
        "modalities": {"type": "array", "items": {"const": "text"}},
        "verbosity": {"const": "medium"},
        "user": STR,
    },
}

PROMPT = {"oneOf": [STR, {"type": "array", "minItems": 1, "maxItems": 1, "items": STR},
                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}
RAW_COMMON = {
    "prompt": PROMPT,
    "temperature": NUM,
    "top_k": INT,
    **{k: v for k, v in SAMPLING.items() if k != "temperature"},
    "stop": {"oneOf": [STR, {"type": "array", "items": STR, "maxItems": 32}]},
    "stream": BOOL,
    "ignore_eos": BOOL,
    "cache_prompt": BOOL,
    "timings_per_token": BOOL,
    "json_schema": {"type": "object"},
    "grammar": STR,
}
LLAMACPP_COMPLETION = {"type": "object", "required": ["prompt"],
                       "properties": {**RAW_COMMON, "n_predict": INT, "max_tokens": INT}}
INFILL = {"type": "object",
          "properties": {**{k: v for k, v in RAW_COMMON.items() if k != "prompt"}, "prompt": STR,
                         "input_prefix": STR, "input_suffix": STR, "n_predict": INT}}
EMBEDDINGS = {"type": "object", "required": ["input"],
              "properties": {"model": STR,
                             "input": {"oneOf": [{"type": "string", "minLength": 1},
                                                 {"type": "array", "minItems": 1, "maxItems": 2048,
                                                  "items": {"type": "string", "minLength": 1}},
                                                 {"type": "array", "minItems": 1,
                                                  "items": {"type": "integer", "minimum": 0}},
                                                 {"type": "array", "minItems": 1, "maxItems": 2048,
                                                  "items": {"type": "array", "minItems": 1,
                                                            "items": {"type": "integer", "minimum": 0}}}]},
                             "dimensions": {"type": "integer", "minimum": 1},
                             "encoding_format": {"enum": ["float", "base64"]},
                             "pooling": {"enum": ["mean", "last", "cls"]},
                             "normalize": BOOL, "embd_normalize": {"type": "integer", "minimum": -1}}}
RERANK_DOC = {"oneOf": [STR, {"type": "object", "required": ["text"], "properties": {"text": STR}}]}
RERANK = {"type": "object", "required": ["query", "documents"],
          "properties": {"model": STR, "query": {"type": "string", "minLength": 1},
                         "documents": {"type": "array", "minItems": 1, "maxItems": 1000, "items": RERANK_DOC},
                         "top_n": {"type": "integer", "minimum": 1}, "return_documents": BOOL, "return_text": BOOL,
                         "instruction": {"type": "string", "minLength": 1}}}
OPENAI_COMPLETION = {"type": "object", "required": ["prompt"],
                     "properties": {**RAW_COMMON, "model": STR, "max_tokens": {"type": "integer", "minimum": -1},
                                    "echo": BOOL, "n": {"const": 1}, "best_of": {"const": 1}}}

ANTHROPIC_MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["user", "assistant"]},
                   "content": {"oneOf": [STR, {"type": "array", "items": TEXT_PART}]}},
}
MESSAGES = {
    "type": "object", "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "minItems": 1, "items": ANTHROPIC_MESSAGE},
        "system": {"oneOf": [STR, {"type": "array", "items": TEXT_PART}]},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        "stream": BOOL,
        "thinking": {"type": "object", "required": ["type"],
                     "properties": {"type": {"enum": ["enabled", "disabled", "adaptive"]},
                                    "budget_tokens": {"type": "integer", "minimum": 1024},
                                    "display": {"enum": ["summarized", "omitted"]}}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["name"],
                                             "properties": {"name": NAME, "description": STR,
                                                            "input_schema": {"type": "object"}}}},
        "tool_choice": {"type": "object", "required": ["type"],
                        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": NAME,
                                       "disable_parallel_tool_use": BOOL}},
        "output_config": {"type": "object",
                          "properties": {"effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh",
                                                             "max"]}}},
        "metadata": {"type": "object"},
    },
}
COUNT_TOKENS = {"type": "object", "required": ["model", "messages"],
                "properties": {k: MESSAGES["properties"][k] for k in ("model", "messages", "system")}}

RESPONSES_INPUT = {"oneOf": [STR, {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
                   "content": {"oneOf": [STR, {"type": "array", "items": {
                       "type": "object", "required": ["type", "text"],
                       "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": STR}}}]}}}}]}
RESPONSES = {
    "type": "object", "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": RESPONSES_INPUT,
        "instructions": STR,
        "previous_response_id": {"type": "string", "minLength": 1},
        "max_output_tokens": {"type": "integer", "minimum": 0},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "stream": BOOL,
        "store": BOOL,
        "metadata": {"type": "object", "maxProperties": 16,
                     "additionalProperties": {"type": "string", "maxLength": 512}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"],
                                             "properties": {"type": {"const": "function"}, "name": NAME,
                                                            "description": STR, "parameters": {"type": "object"},
                                                            "strict": BOOL}}},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]},
                                  {"type": "object", "required": ["type", "name"],
                                   "properties": {"type": {"const": "function"}, "name": NAME}}]},
        "parallel_tool_calls": BOOL,
        "reasoning": {"type": "object", "properties": {"effort": {"enum": ["none", "minimal", "low", "medium",
                                                                          "high", "xhigh"]}}},
        "include": {"type": "array", "items": {"enum": ["reasoning.encrypted_content",
                                                        "message.output_text.logprobs"]}},
        "truncation": {"const": "disabled"},
        "service_tier": {"enum": ["auto", "default"]},
        "background": {"const": False},
        "text": {"type": "object", "properties": {
            "format": {"type": "object", "required": ["type"],
                       "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "name": STR,
                                      "schema": {"type": "object"}, "strict": BOOL}},
            "verbosity": {"const": "medium"}}},
        "user": STR,
    },
}
INPUT_TOKENS = {"type": "object", "required": ["model", "input"],
                "properties": {k: RESPONSES["properties"][k] for k in ("model", "input", "instructions")}}
TOKENIZE = {"type": "object", "required": ["content"],
            "properties": {"content": STR, "add_special": BOOL, "parse_special": BOOL, "with_pieces": BOOL}}
DETOKENIZE = {"type": "object", "required": ["tokens"],
              "properties": {"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}
SLOT_ACTION = {"type": "object",
               "properties": {"filename": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$"},
                              "if_digest": {"type": "string", "pattern": "^[0-9a-fA-F]{16}$"}}}
APPLY_TEMPLATE = {"type": "object", "required": ["messages"],
                  "properties": {"messages": CHAT["properties"]["messages"], "add_generation_prompt": BOOL,
                                 "continue_final_message": BOOL}}

MODEL_NAME = {"type": "object", "required": ["model"], "properties": {"model": {"type": "string", "minLength": 1}}}
SUSPEND = {"type": "object", "properties": {"auto_resume": BOOL}}

JSON_OK = {"description": "OK", "content": {"application/json": {"schema": {"type": ["object", "array"]}}}}
ERROR = {"description": "an error in the protocol's envelope",
         "content": {"application/json": {"schema": {"type": "object"}}}}
SSE_OR_JSON = {"description": "OK: JSON, or server-sent events with stream: true",
               "content": {"application/json": {"schema": {"type": "object"}},
                           "text/event-stream": {"schema": {"type": "string"}}}}


def _op(summary: str, body: dict[str, Any] | None = None, ok: dict[str, Any] = JSON_OK,
        params: list[dict[str, Any]] | None = None, security: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary,
                          "responses": {"200": ok, "400": ERROR, "401": ERROR, "404": ERROR, "409": ERROR, "413": ERROR,
                                        "429": ERROR, "503": ERROR, "504": ERROR, "529": ERROR}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    if not security:
        op["security"] = []
    return op


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}


def _slot_op() -> dict[str, Any]:
    """POST /slots/{id}?action=save|restore|erase (filename for save and restore; 501 without
    --slot-save-path, 409 slot_busy / slot_session_mismatch)."""
    op = _op("save, restore or erase a slot's session (a file in --slot-save-path)", SLOT_ACTION, params=[
        _path_param("id_slot"),
        {"name": "action", "in": "query", "required": True, "schema": {"enum": ["save", "restore", "erase"]}}])
    op["requestBody"]["required"] = False  # erase takes none
    op["responses"].update({"409": ERROR, "501": ERROR})
    return op


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (the same for every server; the model id is a request field)."""
    text_ok = {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths: dict[str, Any] = {
        "/health": {"get": _op("process health and build version", security=False)},
        "/openapi.json": {"get": _op("this document")},
        "/v1": {"get": _op("endpoint index")},
        "/v1/models": {"get": _op("the served model alias, context limit, modalities and meta")},
        "/v1/models/{model_id}": {"get": _op("lookup of the served alias", params=[_path_param("model_id")])},
        "/props": {"get": _op("llama.cpp-shaped server properties")},
        "/v1/load": {"get": _op("serving capacity, current load and monotonic counters")},
        "/stats": {"get": _op("the /v1/load snapshot plus the engine counters")},
        "/metrics": {"get": _op("Prometheus text", ok=text_ok)},
        "/slots": {"get": _op("per-cell occupancy of the private context cache")},
        "/slots/{id_slot}": {"post": _slot_op()},
        "/v1/chat/completions": {"post": _op("OpenAI Chat Completions", CHAT, SSE_OR_JSON)},
        "/chat/completions": {"post": _op("OpenAI Chat Completions (llama-server's un-prefixed alias)", CHAT,
                                          SSE_OR_JSON)},
        "/v1/completions": {"post": _op("OpenAI legacy completion of a raw prompt", OPENAI_COMPLETION, SSE_OR_JSON)},
        "/completion": {"post": _op("llama.cpp completion of a raw prompt", LLAMACPP_COMPLETION, SSE_OR_JSON)},
        "/completions": {"post": _op("llama.cpp completion (alias)", LLAMACPP_COMPLETION, SSE_OR_JSON)},
        "/infill": {"post": _op("llama.cpp fill-in-the-middle (models with FIM tokens)", INFILL, SSE_OR_JSON)},
        "/v1/embeddings": {"post": _op("OpenAI embeddings: the served model's pooled hidden states", EMBEDDINGS)},
        "/embeddings": {"post": _op("OpenAI embeddings (un-prefixed alias)", EMBEDDINGS)},
        **{path: {"post": _op("documents ranked by relevance to a query, judged by the model", RERANK)}
           for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")},
        "/tokenize": {"post": _op("the model's tokenizer", TOKENIZE)},
        "/detokenize": {"post": _op("token ids to text", DETOKENIZE)},
        "/apply-template": {"post": _op("the prompt a chat request renders to", APPLY_TEMPLATE)},
        "/v1/messages": {"post": _op("Anthropic Messages", MESSAGES, SSE_OR_JSON)},
        "/v1/messages/count_tokens": {"post": _op("Anthropic token count", COUNT_TOKENS)},
        "/v1/responses": {"post": _op("OpenAI Responses create", RESPONSES, SSE_OR_JSON)},
        "/responses": {"post": _op("OpenAI Responses create (un-prefixed alias)", RESPONSES, SSE_OR_JSON)},
        "/v1/responses/input_tokens": {"post": _op("Responses prompt-token count", INPUT_TOKENS)},
        "/v1/responses/compact": {"post": _op("refused: compaction is not supported", {"type": "object"})},
        "/v1/messages/batches": {"post": _op("refused: Message Batches are not supported", {"type": "object"})},
        "/v1/responses/{response_id}": {
            "get": _op("a stored Response", params=[_path_param("response_id")]),
            "delete": _op("delete a stored Response", params=[_path_param("response_id")]),
        },
        "/v1/responses/{response_id}/input_items": {"get": _op(
            "a stored Response's input Items", params=[
                _path_param("response_id"),
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                {"name": "after", "in": "query", "schema": STR}])},
        "/models": {"get": _op("every catalog model with its status (llama.cpp's router API)")},
        "/models/load": {"post": _op("load a model, or wake it", MODEL_NAME)},
        "/models/unload": {"post": _op("unload a model once its requests have finished", MODEL_NAME)},
        "/models/sleep": {"post": _op("put an idle model to sleep (--model-suspend)", MODEL_NAME)},
        "/models/sse": {"get": _op("one server-sent event per model status change",
                                   ok={"description": "OK", "content": {"text/event-stream": {"schema": STR}}})},
        "/v1/models/{model_id}/suspend": {"post": _op("give an idle model's memory back (--model-suspend)",
                                                      SUSPEND, params=[_path_param("model_id")])},
        "/v1/models/{model_id}/resume": {"post": _op("take the memory again and restore the retained state",
                                                     params=[_path_param("model_id")])},
        "/v1/models/{model_id}/residency": {"get": _op("resident or suspended, and what a suspend moves",
                                                       params=[_path_param("model_id")])},
        "/v1/responses/{response_id}/cancel": {"post": _op("refused: background execution is not supported",
                                                           params=[_path_param("response_id")])},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "ninfer", "version": version_string(),
                 "description": "OpenAI-, Anthropic- and llama.cpp-compatible serving over one resident engine"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}, {"x-api-key": []}],
        "paths": paths,
    }


async def handle_openapi(call: Call) -> None:
    await call.respond(200, document())
