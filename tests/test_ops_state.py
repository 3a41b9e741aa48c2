"""The ops reports of the recurrent-state pool (hybrid models), from a hand-built snapshot:
/v1/load capacity and occupancy, /metrics gauges, /slots checkpoints."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ninfer.engine.counters import ContinuationInfo, EngineSnapshot
from ninfer.engine.request import SamplingParams
from ninfer.server.config import ServerConfig
from ninfer.server.generate import session_digest
from ninfer.server.ops import handle_slots, load_report, metrics_text


def fake_call(snap: EngineSnapshot) -> Any:
    engine = SimpleNamespace(snapshot=lambda: snap)
    state = SimpleNamespace(loaded=SimpleNamespace(engine=engine), model_id="m", uptime=lambda: 1.0,
                            admitted=0, requests_total=0, requests_failed=0, requests_rejected=0,
                            slot_digests={}, base_sampling=SamplingParams(), config=ServerConfig(),
                            slot_params={}, running_params={})
    call = SimpleNamespace(state=state, sent=None)

    async def respond(status: int, body: Any) -> None:
        call.sent = (status, body)

    call.respond = respond
    return call


def snapshot(state_total: int, state_used: int, continuations: tuple[ContinuationInfo, ...] = ()) -> EngineSnapshot:
    return EngineSnapshot(published_at=0.0, max_concurrency=2, max_pending_requests=4, max_context=256,
                          kv_capacity_tokens=256, kv_capacity_pages=4, kv_page_tokens=64,
                          max_private_continuations=4, admitted=0, peak_admitted=0, running=0, prefilling=0,
                          decode_ready=0, waiting=0, kv_pages_used=1, kv_tokens_used=64,
                          retained_continuations=len(continuations), state_slots_total=state_total,
                          state_slots_used=state_used, continuations=continuations)


def test_state_pool_in_load_metrics_and_slots() -> None:
    entry = ContinuationInfo(entry_id=7, n_tokens=5, n_pages=1, slot=0, session=(1, 2, 3, 4, 5, 6), state_slot=2,
                             page_checkpoints=((4, 3),))
    call = fake_call(snapshot(6, 1, (entry,)))
    report = load_report(call, "ninfer.load")
    assert report["capacity"]["device_state_slots"] == 6 and report["occupancy"]["device_state_slots"] == 1
    lines = metrics_text(call).splitlines()
    assert 'ninfer:context_occupancy{pool="device_state_slots"} 1' in lines
    assert "ninfer:state_slots_total 6" in lines and "ninfer:state_slots_used 1" in lines
    asyncio.run(handle_slots(call))
    status, (cell, *idle) = call.sent  # one entry per cell: the retained one, then 3 idle
    assert [c["id"] for c in idle] == [1, 2, 3] and not any(c["retained"] for c in idle)
    assert status == 200 and [(c["frontier"], c["state_slot"]) for c in cell["checkpoints"]] == [(4, 3), (5, 2)]
    assert [c["session_digest"] for c in cell["checkpoints"]] == [session_digest([1, 2, 3, 4]),
                                                                  session_digest([1, 2, 3, 4, 5])]


def test_pure_attention_reports_no_state() -> None:
    entry = ContinuationInfo(entry_id=7, n_tokens=5, n_pages=1, slot=0, session=(1, 2, 3, 4, 5, 6))
    call = fake_call(snapshot(0, 0, (entry,)))
    assert load_report(call, "ninfer.load")["capacity"]["device_state_slots"] == 0
    assert "ninfer:state_slots_total 0" in metrics_text(call).splitlines()
    asyncio.run(handle_slots(call))
    assert "state_slot" not in call.sent[1][0]["checkpoints"][0]
