"""`ninfer calibrate` on the GPU: a quick calibration of a small synthetic model writes a valid
device profile for this GPU, prints the route table, and bench runs with it, naming it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from ninfer.kernels.launchers import GEMV_FORMATS, GEMV_ROUTES, MAX_GEMV_ROWS, MMA_PIPES
from ninfer.kernels.profile import DeviceProfile, device_key


def ninfer(*args: str, cache: Path) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "ninfer.cli.main", *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, NINFER_CACHE=str(cache)))


def test_calibrate_writes_a_profile_bench_uses(tmp_path: Path) -> None:
    out = ninfer("calibrate", "--synthetic", "smollm2-135m", "--quick", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    key = device_key(0)
    path = tmp_path / "device-profiles" / f"{key.slug()}.yaml"
    assert f"wrote {path}" in out.stderr
    assert "decode matmuls" in out.stdout and "graph rows" in out.stdout

    data = yaml.safe_load(path.read_text())
    assert data["device"] == key.to_dict() and data["device"]["gpu"] == torch.cuda.get_device_name(0)
    assert "smollm2-135m" in data["calibrated_on"]
    profile = DeviceProfile.load(path)
    assert set(profile.gemv) == set(GEMV_FORMATS)
    assert all(r in GEMV_ROUTES or (r == "cublas" and k in ("bf16", "f32")) for k, r in profile.gemv.items())
    assert profile.attention_partition in (64, 256, 512) and profile.prompt_rows in (64, 128)
    assert profile.graph_rows[-1] == MAX_GEMV_ROWS
    m = data["measured"]
    for fmt in ("bf16", "int8", "int4_sym", "int4_asym"):
        assert "warp" in m["gemv"][fmt] and set(m["gemv"][fmt]) <= set(GEMV_ROUTES)
        assert profile.gemv[fmt] in set(m["gemv"][fmt]) | ({"cublas"} if fmt == "bf16" else set())
        for times in m["gemv"][fmt].values():
            assert set(times) == {1, 2, 8} and all(0 < t < 1 for t in times.values())
    assert all(0 < t < 1 for t in m["cublas"].values())
    assert set(m["mma_pipe"]) == {"rule", *MMA_PIPES} and all(set(t) == {1, 2, 8} for t in m["mma_pipe"].values())
    assert profile.mma_pipe is None or profile.mma_pipe in MMA_PIPES
    assert "pipe" in out.stdout  # its table
    assert {tuple(s) for s in map(tuple, m["shapes"])} >= {(49152, 576, 1)}  # the tied lm_head, once
    assert set(m["decode_step"]) == {1, 2, 8}

    bench = ninfer("bench", "--synthetic", "smollm2-135m", "--backend", "cuda", "-p", "64", "-n", "16", "-r", "1",
                   "-o", "json", cache=tmp_path)
    assert bench.returncode == 0, bench.stderr
    assert f"device profile {path}" in bench.stderr  # auto found the stored one, and the log names it
    rows = json.loads(bench.stdout)
    assert all(r["device_profile"] == str(path) for r in rows)
    assert all(r["ceilings"]["read_gbs"] > 100 and r["ceilings"]["matmul_tflops"] > 10 for r in rows)
    tg = next(r for r in rows if r["n_gen"])
    assert 0 < tg["bandwidth_ratio"] < 1.2

    off = ninfer("bench", "--synthetic", "smollm2-135m", "--backend", "cuda", "-p", "0", "-n", "8", "-r", "1",
                 "--device-profile", "off", "--ceilings", "off", "-o", "json", cache=tmp_path)
    assert off.returncode == 0, off.stderr
    assert "device profile off (built-in defaults)" in off.stderr
