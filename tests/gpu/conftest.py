"""tests/gpu: everything here is marked `gpu` and skipped when torch sees no CUDA device."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def kc(kernel_cache: Path):
    from ninfer.kernels.compiler import KernelCompiler

    return KernelCompiler(kernel_cache, device=0)
