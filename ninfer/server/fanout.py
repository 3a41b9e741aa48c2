"""Several engine requests for one HTTP request (the inputs of /v1/embeddings, the judgements of
/v1/rerank): they hold one ingress place together and run a lane's worth (--max-concurrency) at a
time, so the engine batches their decode rows and prefills one after another without one client
filling the pending queue."""
from __future__ import annotations

import asyncio

from ninfer.engine.request import PreparedRequest
from ninfer.server.generate import Generation, Outcome
from ninfer.server.http import Call


async def run_each(call: Call, reqs: list[PreparedRequest], protocol: str) -> list[Outcome]:
    """Every request's outcome (text, tokens, logprobs, final event), in order. The first failure
    cancels the rest and raises."""
    state = call.state
    width = max(1, state.loaded.engine.snapshot().max_concurrency)
    outcomes: list[Outcome | None] = [None] * len(reqs)
    lanes = asyncio.Semaphore(width)

    async def one(i: int, req: PreparedRequest) -> None:
        async with lanes:
            async with Generation(call, req, ingress=False) as gen:
                outcomes[i] = await gen.collect()

    state.enter(protocol)
    try:
        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(reqs)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    finally:
        state.leave()
    assert all(o is not None for o in outcomes)
    return outcomes  # type: ignore[return-value]
