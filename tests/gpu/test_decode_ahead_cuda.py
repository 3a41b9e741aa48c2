"""Decode-ahead on the cuda runner: the engine launches the step after a decode step before reading
that step's tokens (each row's input taken on the device), and gets the same tokens as when every
step is read before the next is built: greedy and seeded sampling, lanes that start and end at
different times, a stop token that ends one lane with its next step already launched; and after a
resume that built the runner again (a suspend without fixed addresses)."""
from __future__ import annotations

import gc

import pytest
import torch

from ninfer.engine.config import SchedulerConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedRequest, SamplingParams
from ninfer.engine.suspend import SuspendOptions
from ninfer.engine.synthetic import SyntheticArtifact

pytestmark = pytest.mark.gpu


class IdTokens:
    """token t <-> the text "<t>"; `stop` is the end of sequence."""

    special_token_ids = frozenset()

    def __init__(self, vocab: int, stop: int) -> None:
        self.vocab_size = vocab
        self.stop_token_ids = frozenset({stop})

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()


def run_requests(artifact, ahead: bool, stop: int, again: str | None = None) -> tuple[dict[str, list[int]], int]:
    """The four requests at once -> (their tokens, launches). again "prefix": the requests once, then
    the same requests again, their prompts found in the prefix cache, the second round's tokens;
    "resume": a suspend and resume between the rounds (the caller turns fixed addresses off: the
    resume builds the runner again, and launches count from there)."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    runner = CudaModelRunner(artifact, num_pages=64, page_size=64, device="cuda")
    engine = Engine(runner, IdTokens(runner.vocab_size, stop),
                    SchedulerConfig(max_concurrency=4, prefix_reuse=again is not None, decode_ahead=ahead),
                    model_max_context=4096)
    engine.start()
    try:
        if again == "resume":
            engine.configure_suspend(SuspendOptions()).result(300)
            assert not runner.fixed_addresses
        if again is not None:
            submit_all(engine, "first-")
        if again == "resume":
            engine.suspend().result(120)
            engine.resume().result(300)
        return submit_all(engine), runner._launches
    finally:
        engine.shutdown()
        del engine, runner
        gc.collect()
        torch.cuda.empty_cache()


def submit_all(engine: Engine, prefix: str = "") -> dict[str, list[int]]:
    """Submit the four requests at once (ids prefixed) -> their tokens by name."""
    requests = {
        "greedy": PreparedRequest(request_id=prefix + "greedy", prompt_token_ids=list(range(100, 140)), max_tokens=70,
                                  sampling=SamplingParams(temperature=0.0), ignore_eos=True),
        "sampled": PreparedRequest(request_id=prefix + "sampled", prompt_token_ids=list(range(7, 30)), max_tokens=90,
                                   sampling=SamplingParams(temperature=0.9, top_k=20, seed=11), ignore_eos=True),
        "short": PreparedRequest(request_id=prefix + "short", prompt_token_ids=[5, 6, 7], max_tokens=9,
                                 sampling=SamplingParams(temperature=0.0), ignore_eos=True),
        "stops": PreparedRequest(request_id=prefix + "stops", prompt_token_ids=list(range(300, 310)), max_tokens=60,
                                 sampling=SamplingParams(temperature=0.0)),
    }
    handles = {rid: engine.submit(r) for rid, r in requests.items()}
    out = {}
    for rid, h in handles.items():
        ids, final = [], None
        for ev in h:
            ids += ev.token_ids
            final = ev
        assert final.finish_reason in ("length", "stop"), (rid, final.error)
        out[rid] = ids
    return out


@pytest.mark.parametrize("weights", ["int4", "q4_k_m"])
def test_decode_ahead_gives_the_tokens_of_step_by_step_decoding(weights: str) -> None:
    artifact = SyntheticArtifact("smollm2-135m", weights=weights)
    reference, _ = run_requests(artifact, ahead=False, stop=-1)
    stop = reference["stops"][20]  # greedy: "stops" ends at its 21st token when this is its stop token
    reference, launches_off = run_requests(artifact, ahead=False, stop=stop)
    ahead, launches = run_requests(artifact, ahead=True, stop=stop)
    assert launches_off == 0 and launches > 0
    assert len(reference["stops"]) <= 21 and reference["stops"][-1] == stop
    for rid in reference:
        assert ahead[rid] == reference[rid], rid


@pytest.mark.parametrize("again", ["prefix", "resume"])
def test_decode_ahead_on_prompts_found_in_the_prefix_cache(again: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 run of 2026-12-04 with decode-ahead on found test_suspend_fixed_cuda's fallback
    ending a request after its first token: the prompt found in the prefix cache after a resume
    that built the runner again. Both parts apart, on a synthetic model."""
    from ninfer.engine.backends import vmm

    monkeypatch.setattr(vmm, "supported", lambda device: False)
    artifact = SyntheticArtifact("smollm2-135m", weights="int4")
    reference, _ = run_requests(artifact, ahead=False, stop=-1, again=again)
    ahead, launches = run_requests(artifact, ahead=True, stop=-1, again=again)
    assert launches > 0
    for rid in reference:
        assert ahead[rid] == reference[rid], rid
