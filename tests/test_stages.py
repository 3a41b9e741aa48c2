"""Pipeline stages (--devices, --stage-layers) on CPU: the option checks, the default split, and two
or three CPU stages giving the logits (bit for bit) and greedy tokens of one device for llama, qwen3
and the hybrid qwen3_5 (tiny random-weight fixtures converted through the real converter)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_qwen3_5 import greedy_lanes as lanes_of

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.stages import balanced_split, check_split, parse_devices, parse_stage_layers, plan_stages
from ninfer.errors import ConfigError

PROMPTS = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183],
           [17, 923, 40211, 5, 5, 5, 880, 12, 31999, 7, 64, 1024, 2048, 4096, 77, 301, 19, 2, 48000, 3, 9, 10]]


# ---- options -------------------------------------------------------------------------------------

def test_parse_devices() -> None:
    assert parse_devices(None, "torch") is None
    assert parse_devices("cpu,cpu", "torch") == ["cpu", "cpu"]
    assert parse_devices("0,cuda:1,0", "cuda") == ["cuda:0", "cuda:1", "cuda:0"]
    for bad, word in [("cpu", "2 to 8"), (",".join(["cpu"] * 9), "2 to 8"), ("cpu,gpu", "'gpu'"),
                      ("cpu,0", "not both")]:
        with pytest.raises(ConfigError, match=word):
            parse_devices(bad, "torch")
    with pytest.raises(ConfigError, match="cuda backend"):
        parse_devices("cpu,cpu", "cuda")


def test_stage_layers_checked_against_the_model() -> None:
    assert parse_stage_layers("3,5") == [3, 5]
    with pytest.raises(ConfigError, match="layer counts"):
        parse_stage_layers("3,x")
    check_split([3, 5], ["cpu", "cpu"], 8)
    with pytest.raises(ConfigError, match="sums to 7, but the model has 8 layers"):
        check_split([3, 4], ["cpu", "cpu"], 8)
    with pytest.raises(ConfigError, match="at least one layer"):
        check_split([0, 8], ["cpu", "cpu"], 8)
    with pytest.raises(ConfigError, match="3 stages for 2 --devices"):
        check_split([2, 3, 3], ["cpu", "cpu"], 8)


def test_balanced_split() -> None:
    assert balanced_split(8, [1, 1]) == [4, 4]
    assert balanced_split(9, [1, 1]) == [5, 4]
    assert balanced_split(30, [3, 1]) == [22, 8] or balanced_split(30, [3, 1]) == [23, 7]
    assert balanced_split(4, [100, 0, 0]) == [2, 1, 1]  # every stage gets a layer
    assert sum(balanced_split(61, [5, 7, 11])) == 61
    with pytest.raises(ConfigError, match="fewer than"):
        balanced_split(2, [1, 1, 1])


def test_plan_numbers_each_kind_apart() -> None:
    kinds = ("linear_attention",) * 3 + ("attention",) + ("linear_attention",) * 3 + ("attention",)
    a, b = plan_stages(kinds, ["cpu", "cpu"], [3, 5])
    assert (a.first, a.count, a.attention, a.recurrent, a.last) == (0, 3, (0, 0), (0, 3), False)
    assert (b.first, b.count, b.attention, b.recurrent, b.last) == (3, 5, (0, 2), (3, 6), True)


# ---- two CPU stages against one device -----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs: dict[str, Path], tiny_qwen3_5_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    from ninfer.engine.convert import convert

    root = tmp_path_factory.mktemp("stages_tiny")
    folders = {"llama": tiny_hf_dirs["llama"], "qwen3": tiny_hf_dirs["qwen3"],
               "qwen3_5": tiny_qwen3_5_dirs["causal"], "qwen3_5-tied": tiny_qwen3_5_dirs["multimodal"]}
    return {k: Artifact.open(convert(v, root / f"{k}.ninfer", weights="keep", progress=False))
            for k, v in folders.items()}


def runner(artifact: Artifact, **kw) -> TorchModelRunner:
    return TorchModelRunner(artifact, num_pages=16, page_size=16, dtype=torch.float32, num_state_slots=4, **kw)


def greedy_lanes(r: TorchModelRunner, steps: int) -> list[list[int]]:
    """Both prompts as lanes of one batch on interleaved pages: one prefill step, then decode."""
    return lanes_of(r, [list(p) for p in PROMPTS], steps)


@pytest.mark.parametrize("name,split", [("llama", [1, 1]), ("qwen3", [1, 1]), ("qwen3_5", [3, 5]),
                                        ("qwen3_5", [4, 4]), ("qwen3_5-tied", [2, 3, 3])])
def test_cpu_stages_match_one_device(tiny, name: str, split: list[int]) -> None:
    one = runner(tiny[name])
    staged = runner(tiny[name], devices=["cpu"] * len(split), stage_layers=split)
    assert len(staged.stages) == len(split)
    assert [s.plan.count for s in staged.stages] == split
    ids = PROMPTS[1] + PROMPTS[0]
    ref, ours = one.forward_logits(ids), staged.forward_logits(ids)
    # the hand-off carries the residual and the normed rows: stages compute the bits of one device
    assert torch.equal(ours, ref)
    assert greedy_lanes(staged, 12) == greedy_lanes(one, 12)


def test_bf16_cpu_stages_match_one_device(tiny) -> None:
    """The default dtype (bf16 weights and packed CPU kernels): still the bits of one device."""
    kw = dict(num_pages=16, page_size=16, num_state_slots=4)
    one = TorchModelRunner(tiny["qwen3_5"], **kw)
    two = TorchModelRunner(tiny["qwen3_5"], devices=["cpu", "cpu"], stage_layers=[5, 3], **kw)
    ids = PROMPTS[0] + PROMPTS[1]
    assert torch.equal(two.forward_logits(ids), one.forward_logits(ids))
    assert greedy_lanes(two, 8) == greedy_lanes(one, 8)


def test_stage_holds_only_its_layers(tiny) -> None:
    r = runner(tiny["qwen3_5"], devices=["cpu", "cpu"], stage_layers=[3, 5])
    first, last = r.stages
    assert first.model.lm_head is None and last.model.embed is None  # untied: each held once
    assert len(first.model.layers) == 3 and len(last.model.layers) == 5
    assert len(r.kv.k) == 2 and len(r.states.conv) == 6  # the whole model's pools, stage by stage
    memory = r.device_memory()
    assert [m["layers"] for m in memory] == [[0, 2], [3, 7]]
    assert memory[0]["kv_bytes"] == 0 and memory[1]["kv_bytes"] > 0  # stage 0 has no attention layer
    assert memory[0]["state_bytes"] == memory[1]["state_bytes"] > 0  # three linear-attention layers each
    assert sum(m["weights_bytes"] for m in memory) > 0


def test_stage_layers_must_cover_the_model(tiny) -> None:
    with pytest.raises(ConfigError, match="sums to 3, but the model has 8 layers"):
        runner(tiny["qwen3_5"], devices=["cpu", "cpu"], stage_layers=[1, 2])
