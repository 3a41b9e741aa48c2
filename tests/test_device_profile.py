"""Device profiles without a GPU: the pure route selection over measured timings, the profile's
validation and YAML round trip, how --device-profile resolves (calibration stubbed), the decode
shapes calibration times, and `ninfer calibrate` refusing in one line on a machine without a GPU."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer.engine.backends import calibrate as cal
from ninfer.engine.ops.cuda_ops import Weight
from ninfer.errors import ConfigError
from ninfer.formats import TensorFormat
from ninfer.kernels.launchers import GEMV_FORMATS
from ninfer.kernels.profile import DeviceKey, DeviceProfile, ProfileRequest, profile_path
from ninfer.kernels.selection import pick, pick_first_point, pick_graph_rows, scores

KEY = DeviceKey(gpu="NVIDIA H200", compute_capability="9.0", driver="12.8", ninfer="0.1.0")


# -- selection ---------------------------------------------------------------------------------

def test_scores_are_relative_to_each_points_best() -> None:
    s = scores({"a": {1: 1.0, 8: 10.0}, "b": {1: 2.0, 8: 5.0}})
    assert s == {"a": 1.0 + 2.0, "b": 2.0 + 1.0}


def test_pick_keeps_the_default_within_the_margin_and_takes_a_clear_winner() -> None:
    assert pick({"warp": {1: 1.00, 8: 1.00}, "mma": {1: 0.99, 8: 0.99}}, default="warp") == "warp"
    assert pick({"warp": {1: 1.00, 8: 1.00}, "mma": {1: 0.90, 8: 0.80}}, default="warp") == "mma"
    # relative, not absolute: mma is 20 % faster at 7 row counts; warp scores 7 x 1.25 + 1 = 9.75
    warp = {r: 1.0 for r in range(1, 9)}
    mma = {r: 0.8 for r in range(1, 8)} | {8: 2.0}
    assert pick({"warp": warp, "mma": mma}, default="warp") == "mma"  # 7 + 2 = 9 (absolute sums: 7.6 vs 8)
    mma[8] = 3.0
    assert pick({"warp": warp, "mma": mma}, default="warp") == "warp"  # 7 + 3 = 10


def test_weights_and_the_gemv_policies() -> None:
    # int8 as measured on the H200: mma a third slower at one row, twice as fast at eight
    warp = {1: 1.0, 2: 1.0, 4: 1.5, 8: 2.6}
    mma = {1: 1.33, 2: 1.0, 4: 1.0, 8: 1.3}
    table = {"warp": warp, "mma": mma}
    assert scores(table, {1: 3}) == {"warp": 3 + 1 + 1.5 + 2, "mma": 3 * 1.33 + 3}
    assert pick(table, default="warp") == "mma"  # over all row counts: 3.33 vs 4.5
    assert pick_first_point(table, default="warp", first=1) == "warp"  # one row decides
    assert cal.choose({"int8": table}, {}, {}, {}, None)["gemv"]["int8"] == "warp"
    assert cal.choose({"int8": table}, {}, {}, {}, None, "throughput")["gemv"]["int8"] == "mma"
    # a near-tie at one row: the other row counts decide, the default kept when it is among the close
    mma[1] = 1.01
    assert pick_first_point(table, default="warp", first=1) == "mma"
    assert pick_first_point({"warp": {1: 1.0, 8: 1.0}, "mma": {1: 1.01, 8: 1.01}}, default="mma", first=1) == "mma"
    assert pick_first_point({"a": {8: 1.0}, "b": {8: 2.0}}, default="b", first=1) == "a"  # no point 1
    with pytest.raises(ConfigError):
        cal.choose({}, {}, {}, {}, None, "fastest")


def test_pick_skips_candidates_missing_a_point_or_with_bad_times() -> None:
    assert pick({"warp": {1: 1.0, 8: 1.0}, "mma": {1: 0.1}}, default="warp") == "warp"
    assert pick({"warp": {1: 1.0}, "mma": {1: math.nan}}, default="warp") == "warp"
    assert pick({"warp": {1: math.inf}, "mma": {1: 1.0}}, default="warp") == "mma"  # the default failed
    assert pick({}, default=512) == 512


def test_pick_graph_rows() -> None:
    flat = {n: 1.0 + 0.001 * n for n in range(1, 9)}  # bandwidth-bound: padding to 8 costs < 1 %
    assert pick_graph_rows(flat) == (8,)
    steep = {n: float(n) for n in range(1, 9)}  # every row counts: every size gets its graph
    assert pick_graph_rows(steep) == tuple(range(1, 9))
    # 1..4 cost the same, 5..8 the same, twice as much
    two = {n: (1.0 if n <= 4 else 2.0) for n in range(1, 9)}
    assert pick_graph_rows(two) == (4, 8)
    assert pick_graph_rows({1: 1.0, 2: math.nan, 8: 1.0}) == (1, 2, 8)  # no time: its own graph
    with pytest.raises(ValueError):
        pick_graph_rows({})


def test_choose_offers_cublas_to_bf16_only() -> None:
    gemv = {"bf16": {"warp": {1: 2.0, 8: 2.0}}, "int4_asym": {"warp": {1: 2.0, 8: 2.0}}}
    cublas = {1: 1.0, 8: 1.0}
    attention = {256: {"r1/c512": 2.0}, 512: {"r1/c512": 1.0}, 1024: {"r1/c512": 0.5}}
    prompt = {64: {128: 1.0}, 128: {128: 1.0}}
    chosen = cal.choose(gemv, cublas, attention, prompt, step={1: 1.0, 2: 1.0, 8: 1.01})
    assert chosen["gemv"] == {"bf16": "cublas", "int4_asym": "warp"}
    assert chosen["attention_partition"] == 1024 and chosen["prompt_rows"] == 128
    assert chosen["graph_rows"] == (3, 4, 5, 6, 7, 8)  # unmeasured counts keep their own graph
    assert cal.choose(gemv, cublas, attention, prompt, step=None)["graph_rows"] == tuple(range(1, 9))
    DeviceProfile(**chosen)  # a valid profile


def test_choose_the_bf16_mma_pipe() -> None:
    """The rule by shape (None) stays unless a pipe beats it by the margin at one row (latency) or
    over all row counts (throughput); no measurements: the rule."""
    pipes = {None: {1: 1.00, 8: 1.00}, 0: {1: 1.05, 8: 1.00}, 2: {1: 0.99, 8: 0.98}, 4: {1: 0.90, 8: 1.20}}
    assert cal.choose({}, {}, {}, {}, None, mma_pipe=pipes)["mma_pipe"] == 4
    assert cal.choose({}, {}, {}, {}, None, "throughput", pipes)["mma_pipe"] is None  # 4 loses at 8 rows
    pipes[4] = {1: 0.995, 8: 1.0}
    assert cal.choose({}, {}, {}, {}, None, mma_pipe=pipes)["mma_pipe"] is None  # within the margin
    assert cal.choose({}, {}, {}, {}, None)["mma_pipe"] is None
    DeviceProfile(**cal.choose({}, {}, {}, {}, None, mma_pipe={None: {1: 2.0}, 8: {1: 1.0}}))


# -- the profile ---------------------------------------------------------------------------------

def test_defaults_are_the_former_constants() -> None:
    p = DeviceProfile()
    assert p.gemv == {"bf16": "mma", "int8": "tiled", "int4_sym": "tiled", "int4_asym": "tiled", "f32": "warp"}
    assert set(p.gemv) == set(GEMV_FORMATS)
    assert (p.attention_partition, p.prompt_rows, p.graph_rows) == (64, 128, tuple(range(1, 9)))
    assert p.decode_attention == "mma"
    assert p.gemv_route(TensorFormat("int4", 32, symmetric=False)) == "tiled"
    assert [p.graph_size(n) for n in range(1, 9)] == list(range(1, 9))
    assert p.gemv_route(TensorFormat("f16")) == "warp"  # a format no gemv kernel names
    assert [DeviceProfile(graph_rows=(2, 8)).graph_size(n) for n in (1, 2, 3, 8)] == [2, 2, 8, 8]


@pytest.mark.parametrize("fields, message", [
    ({"gemv": {"int4_asym": "cublas"}}, "unquantized"),
    ({"gemv": {"bf16": "tiles"}}, "not one of this build's routes"),
    ({"gemv": {"q5_k": "warp"}}, "unknown gemv formats"),
    ({"attention_partition": 0}, "attention_partition"),
    ({"decode_attention": "tensor"}, "decode_attention"),
    ({"prompt_rows": 100}, "prompt_rows"),
    ({"graph_rows": (1, 4)}, "graph_rows"),
    ({"graph_rows": (4, 2, 8)}, "graph_rows"),
    ({"mma_pipe": 3}, "mma_pipe"),
    ({"mma_pipe": True}, "mma_pipe"),
    ({"mma_pipe": "4"}, "mma_pipe"),
])
def test_profile_validation(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeviceProfile(**fields)


def test_yaml_round_trip(tmp_path: Path) -> None:
    measured = {"gemv": {"bf16": {"warp": {1: 1.234567e-05, 8: 2e-05}}}, "attention": {512: {"r1/c512": 3e-06}}}
    p = DeviceProfile(gemv={"bf16": "cublas"}, mma_pipe=4, attention_partition=1024, decode_attention="warp",
                      prompt_rows=64, graph_rows=(4, 8), device=KEY, calibrated_on="x (llama)", measured=measured)
    path = p.save(profile_path(tmp_path, KEY))
    assert path.parent == tmp_path / "device-profiles" and path.name == "NVIDIA_H200-sm9.0-driver12.8-ninfer0.1.0.yaml"
    back = DeviceProfile.load(path)
    assert back.source == str(path)
    assert dataclasses.replace(back, source="defaults", measured={}) == dataclasses.replace(p, measured={})
    assert back.measured["gemv"]["bf16"]["warp"] == {1: 1.235e-05, 8: 2e-05}
    assert str(path) in back.describe() and "bf16 cublas" in back.describe()
    assert back.decode_attention == "warp" and "decode attention warp" in back.describe()
    assert back.mma_pipe == 4 and "bf16 mma pipe 4" in back.describe()
    assert "bf16 mma pipe by shape" in DeviceProfile().describe()


def test_bad_profile_files(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("version: 99\n")
    with pytest.raises(ConfigError, match="not a version 1 profile"):
        DeviceProfile.load(bad)
    bad.write_text("version: 1\ngemv: {bf16: nope}\n")
    with pytest.raises(ConfigError, match=r"nope.*p\.yaml"):
        DeviceProfile.load(bad)
    bad.write_text(": : [\n")
    with pytest.raises(ConfigError, match="not YAML"):
        DeviceProfile.load(bad)
    with pytest.raises(ConfigError, match="No such file"):
        DeviceProfile.load(tmp_path / "missing.yaml")


def test_profile_request_from_flags(tmp_path: Path) -> None:
    assert ProfileRequest.from_flags("auto") == ProfileRequest("auto", None)
    assert ProfileRequest.from_flags("calibrate", str(tmp_path / "x.yaml")) == ProfileRequest("calibrate", tmp_path / "x.yaml")
    f = tmp_path / "mine.yaml"
    f.write_text("version: 1\n")
    assert ProfileRequest.from_flags(str(f)) == ProfileRequest("auto", f)
    with pytest.raises(ConfigError, match="no such file"):
        ProfileRequest.from_flags(str(tmp_path / "none.yaml"))
    with pytest.raises(ConfigError, match="either"):
        ProfileRequest.from_flags(str(f), str(f))


# -- resolution (calibration stubbed: no GPU here) ------------------------------------------------

class FakeArtifact:
    class meta:
        name = "tiny"
        architecture = "llama"


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    monkeypatch.setattr(cal, "device_key", lambda index: KEY)

    def fake_calibrate(artifact, **kw):
        calls.append(kw["key"])
        return DeviceProfile(attention_partition=1024, device=kw["key"], calibrated_on=artifact.meta.name)
    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    return calls


def resolve(request: ProfileRequest, cache: Path, log: list) -> DeviceProfile:
    return cal.resolve_device_profile(request, FakeArtifact, device="cuda:0", kernel_cache_dir=cache / "k",
                                      cache_dir=cache, log=log.append)


def test_auto_calibrates_once_then_uses_the_stored_profile(tmp_path: Path, stubbed: list) -> None:
    log: list[str] = []
    first = resolve(ProfileRequest("auto"), tmp_path, log)
    stored = profile_path(tmp_path, KEY)
    assert stubbed == [KEY] and stored.is_file() and first.attention_partition == 1024
    second = resolve(ProfileRequest("auto"), tmp_path, log)
    assert stubbed == [KEY] and second.source == str(stored)  # not calibrated again
    assert log[-1].startswith(f"device profile {stored}:")
    resolve(ProfileRequest("calibrate"), tmp_path, log)
    assert stubbed == [KEY, KEY]
    off = resolve(ProfileRequest("off"), tmp_path, log)
    assert off == DeviceProfile(source="off (built-in defaults)") and "off (built-in defaults)" in log[-1]


def test_auto_recalibrates_over_an_unusable_cached_profile(tmp_path: Path, stubbed: list) -> None:
    stored = profile_path(tmp_path, KEY)
    stored.parent.mkdir(parents=True)
    stored.write_text("version: 1\ngemv: {bf16: retired_route}\n")
    log: list[str] = []
    resolve(ProfileRequest("auto"), tmp_path, log)
    assert stubbed == [KEY] and "not usable" in log[0] and DeviceProfile.load(stored).attention_partition == 1024


def test_a_given_profile_file_is_used_and_a_bad_one_refused(tmp_path: Path, stubbed: list) -> None:
    other = dataclasses.replace(KEY, gpu="NVIDIA A100")
    f = DeviceProfile(prompt_rows=256, device=other).save(tmp_path / "mine.yaml")
    log: list[str] = []
    got = resolve(ProfileRequest("auto", f), tmp_path, log)
    assert got.prompt_rows == 256 and stubbed == [] and "measured on NVIDIA A100" in log[0]
    f.write_text("version: 1\nprompt_rows: 3\n")
    with pytest.raises(ConfigError, match="prompt_rows"):
        resolve(ProfileRequest("auto", f), tmp_path, log)


# -- what calibration measures --------------------------------------------------------------------

@dataclasses.dataclass
class Layer:
    qkv: Weight
    o_proj: Weight
    norm: torch.Tensor


class Model:
    def __init__(self, tied: bool) -> None:
        bf16 = TensorFormat("bf16")
        self.embed = Weight(bf16, {"": torch.zeros(100, 16)})
        self.layers = [Layer(Weight(bf16, {"": torch.zeros(48, 16)}), Weight(bf16, {"": torch.zeros(16, 32)}),
                             torch.zeros(16)) for _ in range(3)]
        int4 = TensorFormat("int4", 8, symmetric=False)
        self.lm_head = self.embed if tied else Weight(int4, {"": torch.zeros(100, 8, dtype=torch.uint8)})


@pytest.mark.parametrize("tied", [True, False])
def test_decode_linear_shapes(tied: bool) -> None:
    shapes = cal.decode_linear_shapes(Model(tied), vocab_size=100)
    assert [(s.n, s.k, s.count) for s in shapes] == [(16, 32, 3), (48, 16, 3), (100, 16, 1)]


@pytest.mark.parametrize("fmt", [TensorFormat("bf16"), TensorFormat("int8", 32),
                                 TensorFormat("int4", 32, symmetric=True), TensorFormat("int4", 32, symmetric=False)])
def test_random_parts_follow_the_format(fmt: TensorFormat) -> None:
    parts = cal.random_parts(fmt, 64, 128, torch.device("cpu"))
    assert {k: tuple(v.shape) for k, v in parts.items()} == fmt.stored_shapes((64, 128))
    assert {k: v.dtype for k, v in parts.items()} == fmt.stored_dtypes()
    assert all(v.float().std() > 0 for v in parts.values())


def test_plan_fits_the_model() -> None:
    plan = cal.CalibrationPlan().for_model(4096)
    assert plan.contexts == (512, 2048)
    assert cal.CalibrationPlan(contexts=(8192,)).for_model(1024).contexts == (1024,)
    q = cal.CalibrationPlan.quick()
    assert q.steps(routes=4, graph=True) == 3 * 5 + 3 * 2 * 2 + 2 * 2 + 3


# -- the command -----------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_calibrate_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "calibrate", "--synthetic", "smollm2-135m"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["error: ninfer calibrate times GPU routes, and no CUDA GPU is visible"]
    assert out.stdout == ""


def test_calibrator_loops_on_cpu_with_the_kernels_stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement loops and their bookkeeping (the kernels need a GPU: stubbed with checks of
    what they are given; cuBLAS and the prompt blocks are torch.mm, which runs here)."""
    from ninfer.engine.config import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=1024)
    shapes = [cal.LinearShape(256, 64, 2), cal.LinearShape(64, 128, 2), cal.LinearShape(256, 64, 1)]
    gemv_calls, attention_calls = [], []

    def fake_gemv(kc, x, fmt, parts, out, route="warp", variant=None):
        assert x.is_contiguous() and out.shape == (x.shape[0], parts[""].shape[0])
        assert cal.L.gemv_route_ok(route, fmt, x.shape[1], x.dtype)
        assert variant is None or (fmt.format, route, set(variant)) == ("bf16", "mma", {"MMA_PIPE"})
        gemv_calls.append((fmt.format, fmt.symmetric, route, (variant or {}).get("MMA_PIPE")))

    def fake_attention(kc, q, k_cache, v_cache, tables, lens, max_len, out, scale, partition, ws, route="warp"):
        assert route == "mma"  # the route this model runs: bf16, head_dim 64, 2 query heads per kv head
        parts = -(-max_len // partition)
        assert ws[0].shape == (q.shape[0], 4, parts, 64) and ws[1].shape == (q.shape[0], 4, parts, 2)
        assert tables.shape[0] == q.shape[0] and int(lens[0]) == max_len
        attention_calls.append((q.shape[0], max_len, partition))

    monkeypatch.setattr(cal.L, "gemv", fake_gemv)
    monkeypatch.setattr(cal.L, "paged_attention_decode", fake_attention)
    plan = cal.CalibrationPlan(rows=(1, 8), partitions=(256, 512), contexts=(512,), attention_rows=(1, 2),
                               prompt_rows=(64, 128), prompt_tokens=(100,), reps=1).for_model(1024)
    ticks: list[str] = []
    c = cal.Calibrator(None, shapes, config, torch.device("cpu"), plan, group_size=32, progress=ticks.append)
    gemv, cublas = c.gemv()
    assert set(gemv) == {"bf16", "int8", "int4_sym", "int4_asym"}
    assert all(set(t) == {1, 8} and all(v > 0 for v in t.values()) for r in gemv.values() for t in r.values())
    assert {k: set(r) for k, r in gemv.items()} == {"bf16": {"warp", "mma"}, "int8": {"warp", "mma", "tiled"},
                                                    "int4_sym": {"warp", "mma", "tiled"},
                                                    "int4_asym": {"warp", "mma", "tiled"}}
    assert ("int4", False, "tiled", None) in gemv_calls
    assert ("int8", True, "mma", None) in gemv_calls
    assert set(cublas) == {1, 8} and all(v > 0 for v in cublas.values())
    attention = c.attention()
    assert set(attention) == {256, 512} and set(attention[256]) == {"r1/c512", "r2/c512"}
    assert {(r, p) for r, _, p in attention_calls} == {(1, 256), (1, 512), (2, 256), (2, 512)}
    prompt = c.prompt_rows()
    assert set(prompt) == {64, 128} and all(set(t) == {100} and t[100] > 0 for t in prompt.values())
    pipes = c.mma_pipes()
    assert set(pipes) == {None, *cal.L.MMA_PIPES} and all(set(t) == {1, 8} for t in pipes.values())
    assert {call[3] for call in gemv_calls} == {None, *cal.L.MMA_PIPES}  # None: the rule, no variant given
    routes = sum(len(cal.gemv_routes(f, shapes)) for f in c.formats.values())
    assert len(ticks) == plan.steps(routes=routes, graph=False, pipes=len(pipes))
    measured = {"gemv": gemv, "cublas": cublas, "mma_pipe": {"rule" if p is None else p: t for p, t in pipes.items()},
                "attention": attention, "prompt_rows": prompt, "decode_step": {}}
    profile = DeviceProfile(**cal.choose(gemv, cublas, attention, prompt, None, mma_pipe=pipes), device=KEY,
                            calibrated_on="tiny", measured=measured)
    assert profile.prompt_rows in (64, 128) and profile.attention_partition in (256, 512)

    # the route table `ninfer calibrate` prints
    import io

    from rich.console import Console

    from ninfer.cli.calibrate import print_profile
    buf = io.StringIO()
    print_profile(profile, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "NVIDIA H200" in text and "int4_asym" in text and "r2/c512" in text and "graph rows" in text
    assert "by pipe" in text
    assert text.count(" *") == len(gemv) + 3  # one mark per choice: a route per format, the pipe, partition, rows
