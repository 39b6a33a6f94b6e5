"""vLLM's side of the gloo and ipc weight sync: a weight-transfer engine inside each vLLM worker.

vLLM loads new weights through its weight-transfer API (``LLM.init_weight_transfer_engine``,
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``). For nccl it has its own
engine; for gloo and ipc (CPU, or GPUs shared on one node) this module registers one in vLLM's
``WeightTransferEngineFactory`` under ``VLLM_GLOO_BACKEND``:

    register_vllm_gloo_engine(WeightReceiver)                # in each vLLM worker, before its engine is made
    llm.init_weight_transfer_engine({"backend": VLLM_GLOO_BACKEND, "init_info": receiver.vllm_init_info()})
    llm.update_weights(receiver.vllm_update_info(update))    # each worker: receive, model.load_weights

Each worker joins the weight group as its own receiving rank (`engine_worker_rank`: every
tensor-parallel worker receives every full tensor, `load_weights` keeps its shard) and loads
bucket by bucket inside vLLM's layerwise reload (checkpoint format).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from components.trainer.weight_wire import WeightGroup, WeightSyncError, WeightUpdate

__all__ = ["VLLM_GLOO_BACKEND", "register_vllm_gloo_engine", "engine_worker_rank"]

VLLM_GLOO_BACKEND = "scalerl_gloo"  # the name of this module's engine in vLLM's WeightTransferEngineFactory

_VLLM_GLOO_CLASS = None


def register_vllm_gloo_engine(receiver_cls: type) -> type:
    """Register (once per process) the gloo engine in vLLM's WeightTransferEngineFactory; returns its class.

    It speaks the gloo and ipc protocols of weight_sync.py through `receiver_cls` (weight_sync's
    `WeightReceiver`, handed in so that this module imports only weight_wire.py):
    `init_transfer_engine` joins the weight group as the receiver's rank, `update_weights` receives
    bucket by bucket into `model.load_weights`, inside vLLM's layerwise reload
    (`start_weight_update` / `finish_weight_update`, checkpoint format).
    """
    global _VLLM_GLOO_CLASS
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if _VLLM_GLOO_CLASS is None:
        _VLLM_GLOO_CLASS = _make_vllm_gloo_engine_class(receiver_cls)
    if VLLM_GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(VLLM_GLOO_BACKEND, _VLLM_GLOO_CLASS)
    return _VLLM_GLOO_CLASS


def engine_worker_rank(parallel_config, group: WeightGroup) -> int:
    """This vLLM worker's place among its generator's `group.workers_per_generator` receivers: its
    rank within the engine, counted as vLLM's NCCL engine counts it (data-parallel index x the
    engine's world size + rank). Every tensor-parallel worker receives every full tensor;
    `load_weights` keeps its shard."""
    worker = int(getattr(parallel_config, "data_parallel_index", 0) or 0) * int(parallel_config.world_size) \
        + int(parallel_config.rank)
    if not 0 <= worker < group.workers_per_generator:
        raise WeightSyncError(
            f"vLLM worker {worker} of a generator (the engine's world size: {parallel_config.world_size}) has no place "
            f"in the weight group, which counts {group.workers_per_generator} "
            f"receiving worker(s) per generator: the run's layout and vllm.tensor_parallel_size disagree"
        )
    return worker


def _make_vllm_gloo_engine_class(receiver_cls: type) -> type:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        group: dict = field(default_factory=dict)  # WeightGroup fields
        rank: int = 1

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        version: int = 0
        params: list = field(default_factory=list)  # [[name, shape, dtype name], ...]
        bucket_bytes: int = 1
        buckets: list = field(default_factory=list)

    class ScalerlGlooWeightTransferEngine(WeightTransferEngine):
        """vLLM worker side of the scalerl gloo weight group (see register_vllm_gloo_engine)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.receiver: Optional[Any] = None  # a receiver_cls (weight_sync.WeightReceiver)

        def init_transfer_engine(self, init_info) -> None:
            group = WeightGroup(**init_info.group)
            rank = init_info.rank + engine_worker_rank(self.parallel_config, group)
            self.receiver = receiver_cls(group, rank, device=str(self.device))
            self.receiver.connect()

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only
            # torch; gloo is synchronous, so only a CUDA model needs the sync.
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def receive_weights(self, update_info) -> None:
            if self.receiver is None:
                raise RuntimeError("scalerl gloo weight transfer: init_weight_transfer_engine() was not called")
            update = WeightUpdate.from_dict(asdict(update_info))
            shared = self.receiver.shares_buffers
            for bucket in self.receiver.receive_buckets(update):
                if shared:  # views of the learner's buffer, refilled after this bucket; vLLM's layerwise
                    # reload keeps the tensors of a fused layer (qkv, gate_up) until all its parts came
                    bucket = [(name, t.to(self.device, copy=True)) for name, t in bucket]
                elif self.device.type != "cpu":
                    bucket = [(name, t.to(self.device)) for name, t in bucket]
                self.model.load_weights(bucket)

        def shutdown(self) -> None:
            if self.receiver is not None:
                self.receiver.close()
                self.receiver = None

    return ScalerlGlooWeightTransferEngine
