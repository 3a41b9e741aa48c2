"""The `ninfer` command as a user runs it: version, run, tokenize, convert, bench, and one-line errors."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.version import version_string


def ninfer(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = None
    if cache is not None:
        import os
        env = dict(os.environ, NINFER_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "ninfer.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_version_prints_version_and_build_id() -> None:
    out = ninfer("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == version_string()
    assert re.fullmatch(r"\d+\.\d+\.\d+\+\S+", out.stdout.strip())


@pytest.mark.parametrize("args, message", [
    (("run", "/no/such/model.gguf", "hi"), "no such file"),
    (("run", "--top-p", "3", "hi"), "--top-p"),
    (("run", "--max-tokens", "0", "hi"), "--max-tokens"),
    (("convert", "/no/such.gguf", "-o", "x.ninfer"), "/no/such.gguf"),
    (("bench", "--synthetic", "nope"), "known shapes"),
    (("bench", "--synthetic", "smollm2-135m", "-ub", "0"), "-ub must be >= 1"),
    (("serve", "--port", "abc"), "--port"),
    (("serve", "--max-concurrency", "9"), "--max-concurrency"),
    (("serve", "--rope-yarn-factor", "5"), "--rope-yarn-factor"),
    (("serve", "--rope-yarn", "--rope-scaling-factor", "2"), "excludes --rope-yarn"),
    (("run", "--threads", "-1", "hi"), "--threads"),
    (("run", "--reasoning-effort", "extreme", "hi"), "--reasoning-effort must be one of"),
    (("run", "--raw", "--reasoning-effort", "low", "hi"), "cannot be combined with --raw"),
    (("serve", "--default-reasoning-effort", "extreme"), "--default-reasoning-effort must be one of"),
    (("serve", "--default-reasoning-effort", "high", "--no-thinking"), "conflicts with --no-thinking"),
])
def test_errors_are_one_line_without_traceback(args: tuple[str, ...], message: str) -> None:
    out = ninfer(*args)
    assert out.returncode == 1
    assert message in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_serve_start_up_failures_exit_1(tmp_path: Path) -> None:
    """The real process: a missing model and a port in use end start-up with status 1 (a supervisor
    tells a dead server from a clean stop), the cause in one line."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = ninfer("serve", str(tmp_path / "missing.gguf"), "--port", str(port))
    assert out.returncode == 1 and "no such file" in out.stderr and "Traceback" not in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = ninfer("serve", str(tmp_path / "missing.gguf"), "--port", str(port))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr


def test_bad_artifact_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"not a safetensors file at all")
    out = ninfer("run", str(bad), "hi")
    assert out.returncode == 1 and str(bad) in out.stderr and "Traceback" not in out.stderr
    debug = ninfer("--debug", "run", str(bad), "hi")
    assert "Traceback" in debug.stderr  # --debug shows it


def test_empty_prompt_is_refused(smollm2_artifact: Path) -> None:
    out = ninfer("run", str(smollm2_artifact), "   ")
    assert out.returncode == 1 and "prompt is empty" in out.stderr


@pytest.mark.slow
def test_run_json_is_one_object_and_seeded(smollm2_artifact: Path) -> None:
    args = ("run", str(smollm2_artifact), "--json", "--seed", "7", "--temperature", "0.8", "--max-tokens", "8",
            "Tell me a story")
    first, second = ninfer(*args), ninfer(*args)
    assert first.returncode == 0, first.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"]  # same seed, same output
    assert 1 <= len(a["token_ids"]) <= 8
    assert a["finish_reason"] in ("stop", "length")
    assert a["timings"]["predicted_n"] == len(a["token_ids"])


def test_run_json_schema(smollm2_artifact: Path, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    out = ninfer("run", str(smollm2_artifact), "--json", "--temperature", "0", "--max-tokens", "60",
                 "--json-schema", str(tmp_path / "s.json"), "What is the capital of France? Answer in JSON.")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "stop" and set(json.loads(result["text"])) == {"capital"}
    bad = ninfer("run", str(smollm2_artifact), "--json-schema", '{"type": "strin"}', "hi")
    assert bad.returncode == 1 and "--json-schema cannot be enforced" in bad.stderr


def test_run_dtype(smollm2_artifact: Path) -> None:
    out = ninfer("run", str(smollm2_artifact), "--json", "--dtype", "float32", "--temperature", "0",
                 "--max-tokens", "6", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in json.loads(out.stdout)["text"]
    bad = ninfer("run", str(smollm2_artifact), "--dtype", "float16", "hi")
    assert bad.returncode == 1 and "--dtype must be one of auto, bfloat16, float32" in bad.stderr


@pytest.mark.slow
def test_run_streams_text_then_rates(smollm2_artifact: Path) -> None:
    out = ninfer("run", str(smollm2_artifact), "--temperature", "0", "--max-tokens", "12",
                 "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert re.search(r"prompt: \d+ tokens, [\d.]+ tok/s \| decode: \d+ tokens, [\d.]+ tok/s", out.stderr)


def test_tokenize_json_with_pieces(smollm2_artifact: Path) -> None:
    out = ninfer("tokenize", str(smollm2_artifact), "--json", "--with-pieces", "<|im_start|>Hello world")
    assert out.returncode == 0, out.stderr
    tokens = json.loads(out.stdout)["tokens"]
    assert tokens[0] == {"id": 1, "piece": "<|im_start|>"}
    assert [t["piece"] for t in tokens[1:]] == ["Hello", "Ġworld"]


def test_convert_writes_a_valid_artifact(tiny_hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    out_path = tmp_path / "tiny.ninfer"
    out = ninfer("convert", str(tiny_hf_dirs["qwen3"]), "-o", str(out_path), "--weights", "int8", "-q")
    assert out.returncode == 0, out.stderr
    from ninfer.engine.artifact import Artifact
    meta = Artifact.open(out_path).meta
    assert meta.architecture == "qwen3"
    assert meta.source["kind"] == "hf" and len(meta.source["sha256"]) == 64
    assert {f.format for f in meta.tensor_formats.values()} >= {"int8", "f32"}


@pytest.mark.slow
def test_bench_json_has_llama_bench_fields(tmp_path: Path) -> None:
    out = ninfer("bench", "--synthetic", "smollm2-135m", "--backend", "torch", "-p", "16", "-n", "4", "-r", "2",
                 "--concurrency", "1,2", "-ub", "8", "-o", "jsonl")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["n_prompt"], r["n_gen"], r["n_concurrency"]) for r in rows] == [(16, 0, 1), (0, 4, 1), (0, 4, 2)]
    for r in rows:
        assert len(r["samples_ts"]) == 2 and r["avg_ts"] > 0 and r["stddev_ts"] >= 0
        assert {"avg_ns", "stddev_ns", "model_size", "model_n_params", "build_commit", "n_depth"} <= set(r)
        assert r["n_ubatch"] == 8
        # the roofline, against ceilings probed in this run (--ceilings on is the default)
        limits = r["ceilings"]
        assert limits["device"] == "cpu" and limits["read_gbs"] > 0 and limits["matmul_tflops"] > 0
        assert limits["matmul_dtype"] == "bfloat16" and set(limits["probes"]) == {"read", "copy", "matmul"}
        assert r["achieved_gbs"] == pytest.approx(r["bytes_per_token"] * r["avg_ts"] / 1e9, rel=1e-3)
        assert r["achieved_tflops"] == pytest.approx(r["flops_per_token"] * r["avg_ts"] / 1e12, rel=1e-3)
        assert r["bandwidth_ratio"] == pytest.approx(r["achieved_gbs"] / limits["read_gbs"])
        assert r["matmul_ratio"] == pytest.approx(r["achieved_tflops"] / limits["matmul_tflops"])
    assert len({json.dumps(r["ceilings"]) for r in rows}) == 1  # probed once per run
    pp, tg1, tg2 = rows
    # smollm2-135m bf16, tied: the weights (~269 MB) are read once per decode step, shared by 2 streams
    assert 2.6e8 < tg1["bytes_per_token"] < 2.8e8
    assert tg2["bytes_per_token"] == pytest.approx(tg1["bytes_per_token"] / 2, rel=0.01)
    assert pp["flops_per_token"] > tg1["flops_per_token"] / 2


@pytest.mark.slow
def test_bench_md_on_the_default_model_without_ceilings(smollm2_artifact: Path) -> None:
    out = ninfer("bench", str(smollm2_artifact), "--backend", "torch", "-p", "8", "-n", "3", "-d", "16", "-r", "1",
                 "--ceilings", "off")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[-6:] == ["test", "t/s", "MB/tok", "GB/s", "GFLOP/tok", "TFLOP/s"]
    pp, tg = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    assert pp[-6] == "pp8" and pp[-4:-2] == ["", ""] and float(pp[-1]) > 0
    assert tg[-6] == "tg3 @ d16" and float(tg[-4]) > 50 and tg[-2:] == ["", ""]  # Q4_1: ~80 MB a token
    assert "ceilings" not in out.stdout
    bad = ninfer("bench", str(smollm2_artifact), "--ceilings", "maybe")
    assert bad.returncode == 1 and "--ceilings" in bad.stderr
