"""POST /v1/rerank (also /rerank, /v1/reranking, /reranking): documents ranked by relevance to a
query, in Jina's and llama.cpp's shape, with the served chat model as the judge.

Each document is one chat prompt in Qwen3-Reranker's formulation (a system turn asking whether the
document meets the instruction and the query, answered only "yes" or "no"; thinking off), rendered
through the one chat path. Its first answer token is drawn under a mask of the yes/no tokens
("yes", "Yes", "no", "No") with their log probabilities, and relevance_score is P(yes) /
(P(yes) + P(no)): the mask renormalizes over those tokens, which leaves the ratio unchanged. The
judging prefix common to every document is prefilled and retained once first, so each judgement
reuses it; the judgements themselves leave nothing in the context cache. A body with `texts`
instead of `documents` follows TEI, as llama.cpp's /rerank does: a bare array of {index, score}.
"""
from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from ninfer.engine.chat import Message
from ninfer.engine.request import PreparedRequest, SamplingParams
from ninfer.errors import RequestError
from ninfer.server.chat_request import ChatRequest
from ninfer.server.chat_run import prepare
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.fanout import run_each
from ninfer.server.generate import new_request_id
from ninfer.server.http import Call
from ninfer.server.params import bad, check_model, opt_bool, opt_int
from ninfer.server.state import ServerState

if TYPE_CHECKING:  # token_choice needs torch, which loads with the model, after the server starts
    from ninfer.engine.token_choice import TokenChoice

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
MAX_DOCUMENTS = 1000
MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth its own prefill


def answer_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The single-token spellings of yes and no ("yes"/"Yes", "no"/"No") in this vocabulary."""
    def single(words: tuple[str, ...]) -> list[int]:
        ids = [tokenizer.encode(w, parse_special=False) for w in words]
        return sorted({i[0] for i in ids if len(i) == 1})

    yes, no = single(("yes", "Yes")), single(("no", "No"))
    if not yes or not no:
        raise RequestError("rerank needs yes and no to be single tokens of the model's vocabulary",
                           code="rerank_not_supported")
    return yes, no


def _text(value: Any, where: str) -> str:
    if isinstance(value, dict):
        value = value.get("text")
        where += ".text"
    if not isinstance(value, str):
        raise bad(where, f"{where} must be a string or an object with a text string")
    return value


def score(top: tuple[tuple[int, float], ...], yes: list[int], no: list[int]) -> float:
    """P(yes) / (P(yes) + P(no)) from the answer position's log probabilities."""
    probs = {token: math.exp(lp) for token, lp in top}
    p_yes = sum(probs.get(t, 0.0) for t in yes)
    p_no = sum(probs.get(t, 0.0) for t in no)
    return p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.0


def judgement(state: ServerState, rid: str, instruction: str, query: str, document: str,
              answer: TokenChoice) -> PreparedRequest:
    """One document's prompt through the chat path, its answer masked to the yes/no tokens."""
    content = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    k = len(answer.token_ids)
    chat = ChatRequest(protocol="rerank", messages=[Message("system", SYSTEM), Message("user", content)],
                       sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=k),
                       template_kwargs={"enable_thinking": False}, max_tokens=1, logprobs=True, top_logprobs=k)
    req = prepare(state, chat, rid)
    req.grammar = answer
    req.retain = False  # reuse the shared judging prefix; keep no cell per document
    req.hints["speculative"] = False  # one token: nothing to draft
    req.batch_prefill = True  # a lane's worth of judgements share prefill units
    return req


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        n = min(n, len(p))
        while n and p[:n] != first[:n]:
            n -= 1
    return first[:n]


async def handle_rerank(call: Call) -> None:
    body = call.json()
    state = call.state
    rid = new_request_id()
    try:
        check_model(body, state)
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise bad("query", "query must be a non-empty string", code="missing_required_parameter"
                      if query is None else "invalid_value")
        tei = "texts" in body and "documents" not in body
        name = "texts" if tei else "documents"
        docs = body.get(name)
        if not isinstance(docs, list) or not docs:
            raise bad(name, f"{name} must be a non-empty array", code="missing_required_parameter"
                      if docs is None else "invalid_value")
        if len(docs) > MAX_DOCUMENTS:
            raise bad(name, f"{name} holds at most {MAX_DOCUMENTS} documents")
        texts = [_text(d, f"{name}[{i}]") for i, d in enumerate(docs)]
        top_n = opt_int(body, "top_n", lo=1)
        return_documents = opt_bool(body, "return_documents")
        return_text = bool(opt_bool(body, "return_text"))
        instruction = body.get("instruction", DEFAULT_INSTRUCTION)
        if not isinstance(instruction, str) or not instruction:
            raise bad("instruction", "instruction must be a non-empty string")
        from ninfer.engine.token_choice import TokenChoice

        yes, no = answer_ids(state.loaded.tokenizer)
        answer = TokenChoice(yes + no, state.loaded.facts.logits_size)
        reqs = await asyncio.to_thread(lambda: [judgement(state, f"{rid}-{i}", instruction, query, t, answer)
                                                for i, t in enumerate(texts)])
    except CLIENT_ERRORS as e:
        err = http_error(e)
        state.reject("rerank", err)
        raise err
    prefix = shared_prefix([r.prompt_token_ids for r in reqs]) if len(reqs) > 1 else []
    if len(prefix) >= MIN_SHARED_PREFIX:  # prefill the judging prefix once, retained for the judgements
        warm = PreparedRequest(request_id=f"{rid}-prefix", prompt_token_ids=prefix, max_tokens=1,
                               sampling=SamplingParams(temperature=0.0), hints={"protocol": "rerank"})
        await run_each(call, [warm], "rerank")
    outcomes = await run_each(call, reqs, "rerank")
    scores = [score(o.logprobs[0].top if o.logprobs else (), yes, no) for o in outcomes]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:top_n]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    if tei:
        await call.respond(200, [{"index": i, "score": scores[i], **({"text": texts[i]} if return_text else {})}
                                 for i in order])
        return
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents is not False:
            result["document"] = {"text": texts[i]}
        results.append(result)
    await call.respond(200, {"object": "list", "model": state.model_id, "results": results,
                             "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
