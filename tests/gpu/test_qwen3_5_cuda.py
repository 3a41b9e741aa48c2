"""The qwen3_5 hybrid (Gated DeltaNet + gated attention) on the cuda backend, and the one sampler.

A tiny random-weight Qwen3_5ForCausalLM (shapes the kernels take: head_dim 64, delta-rule heads of
64) in fp32: logits against transformers, 32 greedy tokens identical, chunked prefill across chunk
boundaries and batches of 1..8 sequences of different lengths (prompt and decode rows) equal to each
sequence alone. Then the sampler: a seeded request draws the same tokens with and without logprobs,
and with a grammar mask that allows those tokens (masks applied before the draw, not by redrawing).
"""
from __future__ import annotations

import types

import pytest
import torch

from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.config import ModelConfig
from ninfer.engine.request import SamplingParams
from ninfer.engine.sampler import mask_words
from ninfer.engine.synthetic import SyntheticArtifact
from ninfer.formats import TensorFormat

transformers = pytest.importorskip("transformers")
PAGE = 16
GREEDY = SamplingParams(temperature=0.0)


def tiny_hf():
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=1024)
    hf = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # move the parameters HF initializes to constants, so a missing transform shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.3, 0.3)
            if "A_log" in name or "dt_bias" in name:
                p.uniform_(-1.0, 1.0)
    sd = {k: v.detach().clone().cuda() for k, v in hf.state_dict().items()}
    config = ModelConfig.from_hf(cfg.to_dict() | {"architectures": ["Qwen3_5ForCausalLM"]})
    meta = types.SimpleNamespace(config=config, tensor_formats={k: TensorFormat("f32") for k in sd})
    artifact = types.SimpleNamespace(meta=meta, path="tiny-qwen3_5",
                                     load_parts=lambda device: {k: {"": v.to(device)} for k, v in sd.items()})
    return hf.cuda(), artifact


@pytest.fixture(scope="module")
def tiny():
    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    hf, artifact = tiny_hf()
    runner = CudaModelRunner(artifact, num_pages=128, page_size=PAGE, device="cuda", dtype=torch.float32,
                             num_state_slots=10)
    return hf, runner


def work(tokens: list[int], start: int, pages: list[int], slot: int, generated: list[int] | None = None,
         seq_id: int = 1, sampling: SamplingParams = GREEDY, seed: int = 0, sample: bool = True) -> SequenceWork:
    return SequenceWork(seq_id=seq_id, token_ids=tokens, start_pos=start, block_table=pages, sample=sample,
                        sampling=sampling, output_token_ids=list(generated or []), seed=seed, state_slot=slot)


def test_logits_and_greedy_match_transformers(tiny) -> None:
    hf, runner = tiny
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 512, (100,), generator=g).tolist()
    ours = runner.forward_logits(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0]
    err = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"\nqwen3_5 tiny fp32 prompt: max rel err {err:.2e}")
    assert err < 1e-4
    # 32 greedy tokens: prefill, then decode rows (CUDA graphs) carrying the recurrent state
    with torch.no_grad():
        ref_ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False,
                              min_new_tokens=32)[0, len(prompt):].tolist()
    pages = list(range(-(-(len(prompt) + 32) // PAGE)))
    out = runner.run(ScheduledBatch([work(prompt, 0, pages, 3)]))
    generated = [out.sampled[1]]
    while len(generated) < 32:
        out = runner.run(ScheduledBatch([work([generated[-1]], len(prompt) + len(generated) - 1, pages, 3,
                                              generated)]))
        generated.append(out.sampled[1])
    assert generated == ref_ids
    assert runner.graphs.captures >= 1


def test_chunks_and_batches_equal_one_shot(tiny) -> None:
    _, runner = tiny
    g = torch.Generator().manual_seed(2)
    lens = [150, 1, 7, 64, 65, 33, 2, 90]
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    alone = [runner.forward_logits(p)[-1] for p in prompts]
    # chunked prefill of the 150-token prompt: 64 + 64 + 22, state carried in its slot
    pages = list(range(10))
    for start, end in ((0, 64), (64, 128), (128, 150)):
        logits = runner.batch_logits(ScheduledBatch([work(prompts[0][start:end], start, pages, 0)]))
    assert torch.allclose(logits[0], alone[0], atol=2e-4, rtol=0), (logits[0] - alone[0]).abs().max()
    # every batch size 1..8 of prompts in one step; each row equals the sequence alone
    for n in range(1, 9):
        seqs = [work(p, 0, list(range(10 * i + 10, 10 * i + 20)), i, seq_id=i) for i, p in enumerate(prompts[:n])]
        logits = runner.batch_logits(ScheduledBatch(seqs))
        for i in range(n):
            assert torch.allclose(logits[i], alone[i], atol=2e-4, rtol=0), (n, i, (logits[i] - alone[i]).abs().max())
    # then one decode row per sequence, all 8 at once, against each sequence's own next-position logits
    nxt = [int(a.argmax()) for a in alone]
    seqs = [work([nxt[i]], len(p), list(range(10 * i + 10, 10 * i + 20)), i, generated=[nxt[i]], seq_id=i)
            for i, p in enumerate(prompts)]
    logits = runner.batch_logits(ScheduledBatch(seqs))
    for i, p in enumerate(prompts):
        ref = runner.forward_logits(p + [nxt[i]])[-1]
        assert torch.allclose(logits[i], ref, atol=2e-4, rtol=0), (i, (logits[i] - ref).abs().max())


def _generate(runner, prompt: list[int], steps: int, sampling: SamplingParams, seed: int,
              masks: list[torch.Tensor] | None = None) -> tuple[list[int], list, list[torch.Tensor]]:
    pages = list(range(-(-(len(prompt) + steps) // PAGE)))
    tokens: list[int] = []
    records, logits = [], []
    for step in range(steps):
        w = work(prompt if step == 0 else [tokens[-1]], 0 if step == 0 else len(prompt) + step - 1, pages, -1,
                 generated=tokens, sampling=sampling, seed=seed)
        w.token_mask = masks[step] if masks else None
        out, lg = runner.run_with_logits(ScheduledBatch([w]))
        tokens.append(out.sampled[1])
        records.append(out.logprobs.get(1))
        logits.append(lg[0])
    return tokens, records, logits


def test_seeded_tokens_same_with_logprobs_and_grammar() -> None:
    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    runner = CudaModelRunner(SyntheticArtifact("smollm2-135m", "int4", seed=3), num_pages=8, page_size=64,
                             device="cuda")
    vocab = runner.vocab_size
    prompt = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = SamplingParams(temperature=1.5, top_k=20, top_p=1.0, min_p=0.0)
    base, _, logits = _generate(runner, prompt, 24, plain, seed=11)
    assert len(set(base)) > 3, "high temperature over random logits should not repeat one token"
    with_lp, records, _ = _generate(runner, prompt, 24, SamplingParams(temperature=1.5, top_k=20, top_p=1.0,
                                                                        min_p=0.0, logprobs=True, top_logprobs=3),
                                    seed=11)
    assert with_lp == base
    assert all(r is not None and r.token_id == t for r, t in zip(records, base))
    # a grammar that allows every candidate the draw could take (each step's top 20) and forbids half
    # of the rest: the same tokens; one that forbids the drawn token: never that token
    g = torch.Generator().manual_seed(5)
    masks, forbid = [], []
    for step, row in enumerate(logits):
        allowed = torch.rand(vocab, generator=g) < 0.5
        allowed[row.topk(20).indices.cpu()] = True
        masks.append(_pack(allowed))
        no_base = allowed.clone()
        no_base[base[step]] = False
        forbid.append(_pack(no_base))
    assert _generate(runner, prompt, 24, plain, seed=11, masks=masks)[0] == base
    first = _generate(runner, prompt, 1, plain, seed=11, masks=forbid[:1])[0][0]
    assert first != base[0] and bool(_unpack(forbid[0], vocab)[first])


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    words = mask_words(allowed.numel())
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:allowed.numel()] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(-1)
    return packed.to(torch.uint32).view(torch.int32).view(1, words) if hasattr(torch, "uint32") else \
        torch.tensor([(w if w < 2 ** 31 else w - 2 ** 32) for w in packed.tolist()], dtype=torch.int32).view(1, words)


def _unpack(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    words = mask.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    return ((words.unsqueeze(-1) >> torch.arange(32)) & 1).reshape(-1)[:vocab].bool()


def test_resume_from_a_copied_checkpoint(tiny) -> None:
    """A prompt's state copied into another slot (ScheduledBatch.state_copies) continues exactly as the
    whole sequence computed in one go; the source slot is left as it was."""
    _, runner = tiny
    g = torch.Generator().manual_seed(6)
    head, tail = torch.randint(0, 512, (80,), generator=g).tolist(), torch.randint(0, 512, (30,), generator=g).tolist()
    pages = list(range(100, 108))
    runner.batch_logits(ScheduledBatch([work(head, 0, pages, 7, sample=False)]))
    before = [t[7].clone() for t in (*runner.conv, *runner.ssm)]
    logits = runner.batch_logits(ScheduledBatch([work(tail, len(head), pages, 8)], state_copies=[(7, 8)]))
    ref = runner.forward_logits(head + tail)[-1]
    assert torch.allclose(logits[0], ref, atol=2e-4, rtol=0), (logits[0] - ref).abs().max()
    assert all(torch.equal(t[7], b) for t, b in zip((*runner.conv, *runner.ssm), before))
