"""The GPU tuning scripts' pure parts: decode_variants.py's labels -> compile defines (a trailing 0 turns
a switch off), and pick_variant.py's choice (a candidate must beat the built-in by more than 1 %)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


decode_variants, pick_variant = script("decode_variants"), script("pick_variant")


@pytest.mark.parametrize("label,defines", [
    ("rule", {}),
    ("p2+e+v", {"MMA_PIPE": 2, "MMA_EARLY": 1, "SAMPLE_VEC": 1}),
    ("p0", {"MMA_PIPE": 0}),
    ("h0+a0", {"T4_F16": 0, "ATTN_EARLY": 0}),
    ("e0", {"MMA_EARLY": 0}),
    ("q+t3+x0+b4", {"T4_DQ": 1, "T4_STAGES": 3, "T4_XPRE": 0, "T4_MINB": 4}),
    ("z+b0", {"T4_XSMEM": 1, "T4_MINB": 0}),
    ("r", {"SAMPLE_SPLIT": 1}),
    ("n+z0", {"PRE_NORM": 1, "T4_XSMEM": 0}),
    ("n0", {"PRE_NORM": 0}),
    ("n+m64", {"PRE_NORM": 1, "PRE_NORM_SMALL": 64}),
    ("d0", {"SPLIT_NORM": 0}),
    ("d+n0", {"SPLIT_NORM": 1, "PRE_NORM": 0}),
    ("y", {"RSCALE_PAR": 1}),
    ("u+y0", {"SPLIT_MMA": 1, "RSCALE_PAR": 0}),
    ("l+d", {"HW_EARLY": 1, "SPLIT_NORM": 1}),
    ("r0+s64+f2+w1", {"SAMPLE_SPLIT": 0, "ATTN_MAX_SPLIT": 64, "ATTN_PREFETCH": 2, "MMA_L2PF": 1}),
])
def test_variant_labels(label: str, defines: dict[str, int]) -> None:
    assert decode_variants.defines(label) == defines


@pytest.mark.parametrize("label", ["bogus", "p", "h1", "z2", "p2+", "m"])
def test_unknown_labels_are_refused(label: str) -> None:
    with pytest.raises(SystemExit, match="unknown variant"):
        decode_variants.defines(label)


def test_a_candidate_must_beat_the_built_in_by_one_percent() -> None:
    assert pick_variant.best({"p2": 100.0, "p4": 100.9}, "p2") == "p2"
    assert pick_variant.best({"p2": 100.0, "p4": 101.5}, "p2") == "p4"
    assert pick_variant.best({"p4": 90.0}, "p2") == "p4"  # the built-in not measured: the fastest
    assert pick_variant.best({}, "p2") == "p2"
