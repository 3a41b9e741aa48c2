"""ModelRunner implementations: `torch` (the readable reference, CPU and CUDA) and `cuda`."""
from __future__ import annotations

import importlib.util


def cuda_available() -> bool:
    """True when this build has the cuda backend's runner and cuda-python is importable."""
    return (importlib.util.find_spec("ninfer.engine.backends.cuda_runner") is not None
            and importlib.util.find_spec("cuda") is not None)
