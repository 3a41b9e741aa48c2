"""Helpers for the torch model tests: transformers references on the same weights, greedy decode
through our runner's paged path, and the near-tie check for greedy divergence."""
from __future__ import annotations

from pathlib import Path

import torch

from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def hf_from_gguf(gguf: Path):
    """transformers' own GGUF loading (its dequantize + Q/K un-permute) into an f32 model.

    `from_pretrained(gguf_file=...)` insists on `accelerate`, which ninfer does not depend on; this is
    the same loader without it: build on the meta device, then assign the dequantized tensors."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # its buffer was on meta
    return model.eval()


def hf_with_weights(folder: Path, weights: dict[str, torch.Tensor]):
    """The HF folder's model in f32 with `weights` (HF names, e.g. Artifact.load_dequantized()) loaded."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing  # tied: lm_head shares embed_tokens
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, vocab] float32 logits of one sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens from transformers' generate, EOS treated as an ordinary token (not
    suppressed, as min_new_tokens would do, and not stopping)."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(ids) + steps
    return out[0, len(ids):].tolist()


def ours_greedy(runner: TorchModelRunner, prompts: list[list[int]], steps: int,
                page_tables: list[list[int]]) -> list[list[int]]:
    """Greedy decode of several sequences as lanes of one batch through run(): one step prefills
    them all, then each step decodes one token per lane. -> generated ids per prompt."""
    outs: list[list[int]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]
    starts = [0] * len(prompts)
    for _ in range(steps):
        seqs = [SequenceWork(seq_id=i, token_ids=pending[i], start_pos=starts[i], block_table=page_tables[i],
                             sample=True, sampling=GREEDY, output_token_ids=list(outs[i]))
                for i in range(len(prompts))]
        sampled = runner.run(ScheduledBatch(seqs)).sampled
        for i in range(len(prompts)):
            outs[i].append(sampled[i])
            starts[i] += len(pending[i])
            pending[i] = [sampled[i]]
    return outs


def assert_greedy_agrees(ours: list[int], ref: list[int], ref_model, prompt: list[int], tol: float) -> None:
    """Identical greedy tokens, or a first divergence only where the reference's top-2 logits are
    within `tol` of each other and ours picked the reference's runner-up."""
    assert len(ours) == len(ref)
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if first is None:
        return
    logits = hf_logits(ref_model, prompt + ref[:first])[-1]
    top2 = logits.topk(2)
    margin = float(top2.values[0] - top2.values[1])
    assert ours[first] == int(top2.indices[1]) and margin < tol, (
        f"greedy tokens diverge at step {first}: ours {ours[first]}, reference {ref[first]}, reference top-2 "
        f"margin {margin:.4g} (near-tie tolerance {tol})")
