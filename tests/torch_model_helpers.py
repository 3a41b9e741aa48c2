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
    out = model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def ours_greedy(runner: TorchModelRunner, ids: list[int], steps: int, page_ids: list[int] | None = None) -> list[int]:
    """Prefill then one-token decode steps through run(), on the given pages (default 0..)."""
    pages = page_ids if page_ids is not None else list(range(-(-(len(ids) + steps) // runner.page_size)))
    out: list[int] = []
    tokens, start = list(ids), 0
    for _ in range(steps):
        seq = SequenceWork(seq_id=7, token_ids=tokens, start_pos=start, block_table=pages, sample=True,
                           sampling=GREEDY, output_token_ids=list(out))
        out.append(runner.run(ScheduledBatch([seq])).sampled[7])
        start += len(tokens)
        tokens = [out[-1]]
    return out


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
