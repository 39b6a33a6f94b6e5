"""The run's weight group: which backend carries the weights from learner-0 to the generators
(`train.weight_sync_backend` resolved, the same on every member) and the group every member
builds (learner-0 in loop.py, each generator in generator.py)."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

from components.trainer.roles import GPUS_SHARED_ENV, step_nodes
from components.trainer.weight_sync import WeightGroup

__all__ = ["weight_sync_backend", "weight_group_of"]

log = logging.getLogger(__name__)


def weight_sync_backend(choice: str, device: str, gpus_shared: Optional[bool] = None, workers_per_generator: int = 1) -> str:
    """`train.weight_sync_backend` resolved (the same on every member of the group): "auto" is
    nccl on GPU when vLLM (whose weight-transfer engine the nccl path uses) is installed and no
    two processes share a GPU, else gloo. `gpus_shared` (default: SCALERL_GPUS_SHARED, set where
    the GPUs were bound, `roles.gpus_shared`): NCCL refuses two ranks on one GPU, so "nccl"
    there is refused with the choices that work. "ipc" on GPU needs every receiver on the
    learner's GPU, so it is refused for tensor-parallel generators (`workers_per_generator` > 1:
    each worker has its own GPU)."""
    on_gpu = str(device).startswith("cuda")
    if gpus_shared is None:
        gpus_shared = os.environ.get(GPUS_SHARED_ENV) == "1"
    tensor_parallel = int(workers_per_generator) > 1
    ipc_hint = "" if tensor_parallel else "'ipc' (CUDA IPC, one node), "  # ipc needs every receiver on the learner's GPU
    if choice == "nccl" and on_gpu and gpus_shared:
        raise ValueError("train.weight_sync_backend = 'nccl' but this run's processes share GPUs (NCCL refuses two ranks "
                         f"on one GPU); use {ipc_hint}'gloo' or 'auto'")
    nodes = step_nodes()
    if choice == "ipc" and nodes > 1:
        raise ValueError(f"train.weight_sync_backend = 'ipc' hands the generators handles to learner-0's memory, which "
                         f"exist on its node only, but this run spans {nodes} nodes; use 'auto', 'nccl' or 'gloo'")
    if choice == "ipc" and on_gpu and tensor_parallel:
        raise ValueError(f"train.weight_sync_backend = 'ipc' shares the learner's GPU buffers, but each generator's "
                         f"{int(workers_per_generator)} tensor-parallel workers (vllm.tensor_parallel_size) sit on GPUs of their "
                         f"own; use 'nccl', 'gloo' or 'auto'")
    if choice != "auto":
        return choice
    if not on_gpu:
        return "gloo"
    if gpus_shared:
        log.warning("the run's processes share GPUs: weights go to the generators over gloo, staged through host memory%s",
                    " (train.weight_sync_backend = 'ipc' passes CUDA IPC handles instead)" if ipc_hint else "")
        return "gloo"
    if importlib.util.find_spec("vllm") is None:
        log.warning("vLLM is not installed: weights go to the generators over gloo, staged through host memory")
        return "gloo"
    return "nccl"


def weight_group_of(cfg, endpoints, layout, device: str):
    """The run's weight group (learner-0 + every generator's receiving workers: vLLM's tensor-parallel
    workers each join it); every member builds the same one."""
    host = endpoints.host if endpoints.host not in ("", "0.0.0.0") else "127.0.0.1"
    return WeightGroup(master_addr=host, master_port=endpoints.weight_port, num_generators=layout.num_generators,
                       backend=weight_sync_backend(cfg.weight_sync_backend, device,
                                                   workers_per_generator=layout.gpus_per_generator),
                       timeout_s=max(cfg.queue_timeout_s, 300.0), bucket_mb=cfg.weight_sync_bucket_mb,
                       workers_per_generator=layout.gpus_per_generator, token=getattr(endpoints, "token", "") or "")
