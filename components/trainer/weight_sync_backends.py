"""The weight-sync backends (`train.weight_sync_backend`: gloo, ipc, nccl) and what moves the bytes.

`WeightSender` / `WeightReceiver` (weight_sync.py) look their group's backend up by name in
``WEIGHT_SYNC_BACKENDS`` and call it to join the weight group and to move one `WeightUpdate`:

    backend = WEIGHT_SYNC_BACKENDS.get(group.backend)   # GlooBackend | IpcBackend | NcclBackend
    backend.connect_sender(sender); backend.send(sender, update, named_tensors, clock)
    backend.connect_receiver(receiver); yield from backend.receive_buckets(receiver, update)

- gloo: a ``TCPStore`` hosted by learner rank 0 and a ``ProcessGroupGloo`` on it (`_join_gloo`),
  with the group's timeout on every collective; a missing rank is named.
- ipc: the same store only; buffers travel as handles (`share_buffer` / `open_buffer`: CUDA IPC checked by
  GPU UUID, or torch's ``file_system`` shared memory on CPU), acknowledged per bucket.
- nccl: vLLM's ``NCCLTrainerWeightTransferEngine`` on learner rank 0 (`_nccl_trainer_engine`,
  listening on `listen_address`), in vLLM's packed wire format (`vllm_packed_chunks`).

The protocol itself (announcement, buckets, the order of tensors) is weight_sync.py's; the vLLM
worker-side engine for gloo and ipc is weight_sync_vllm.py's.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from components.registry import WEIGHT_SYNC_BACKENDS
from components.trainer.weight_wire import (
    NCCL_NUM_BUFFERS,
    STORE_PREFIX,
    ParamSpec,
    WeightGroup,
    WeightSyncError,
    WeightUpdate,
    group_timeout,
    join_store,
    missing_ranks,
    rank_names,
    vllm_packed_chunks,
)

if TYPE_CHECKING:  # annotations only: weight_sync.py imports this module
    from components.trainer.weight_sync import WeightReceiver, WeightSender

__all__ = [
    "WeightSyncError",
    "WeightSyncBackend",
    "GlooBackend",
    "IpcBackend",
    "NcclBackend",
    "listen_address",
    "vllm_packed_chunks",
]

# ----------------------------------------------------------------------------- the announced tensors, checked as they go
def _checked(update: WeightUpdate, named_tensors: Iterable[tuple[str, torch.Tensor]], clock: list) -> Iterator[tuple[ParamSpec, torch.Tensor]]:
    """Pair each tensor with its spec, raising on the first disagreement; clock[0] += time spent in the source."""
    it = iter(named_tensors)
    for i, spec in enumerate(update.params):
        t0 = time.perf_counter()
        item = next(it, None)
        clock[0] += time.perf_counter() - t0
        if item is None:
            raise WeightSyncError(f"weight update v{update.version}: the tensors ended after {i} of {len(update.params)} (next: {spec.name!r})")
        name, tensor = item
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.torch_dtype:
            raise WeightSyncError(
                f"weight update v{update.version}: tensor {i} is {name!r} {tuple(tensor.shape)} {tensor.dtype}, but the "
                f"announced update says {spec.name!r} {spec.shape} {spec.torch_dtype}"
            )
        yield spec, tensor
    t0 = time.perf_counter()
    extra = next(it, None)
    clock[0] += time.perf_counter() - t0
    if extra is not None:
        raise WeightSyncError(f"weight update v{update.version}: more tensors than the {len(update.params)} announced (first extra: {extra[0]!r})")


def _join_gloo(group: WeightGroup, rank: int):
    """(store, ProcessGroupGloo) for `rank`; rank 0 hosts the TCPStore. Raises WeightSyncError naming who is missing."""
    import torch.distributed as dist

    from components.trainer.roles import gloo_interface_problem

    problem = gloo_interface_problem()
    if problem:
        raise WeightSyncError(f"weight group rank {rank} (gloo): {problem}")
    is_master = rank == 0
    store = join_store(group, rank)
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, group.world_size, group_timeout(group))
    except Exception as err:  # noqa: BLE001
        missing = []
        if is_master:
            missing = missing_ranks(store, {r: f"{STORE_PREFIX}/joined/{r}" for r in range(group.world_size)})
        names = rank_names(group, missing)
        raise WeightSyncError(
            f"weight group rank {rank}: rendezvous of {group.world_size} ranks at {group.endpoint} failed within "
            f"{group.timeout_s:g} s (missing: {names}): {err}"
        ) from err
    return store, pg


# ---------------------------------------------------------------------------------------------
# the backends (train.weight_sync_backend), registered in WEIGHT_SYNC_BACKENDS
class WeightSyncBackend:
    """One way learner-0's weights reach the generators: how each end joins the weight group and
    moves one `WeightUpdate`. `WeightSender` / `WeightReceiver` call these for their group's backend.

    Defaults: buckets as planned on the wire, and a vLLM generator loads through this repo's
    own weight-transfer engine (weight_sync_vllm.py, `register_vllm_gloo_engine`), which takes the update as a dict.
    """

    shares_buffers = False  # received tensors are views of the sender's (refilled) buffers

    @classmethod
    def connect_sender(cls, sender: "WeightSender") -> None:
        raise NotImplementedError

    @classmethod
    def send(cls, sender: "WeightSender", update: "WeightUpdate", named_tensors, clock: list) -> None:
        raise NotImplementedError

    @classmethod
    def connect_receiver(cls, receiver: "WeightReceiver") -> None:
        raise NotImplementedError

    @classmethod
    def receive_buckets(cls, receiver: "WeightReceiver", update: "WeightUpdate") -> Iterator[list[tuple[str, torch.Tensor]]]:
        raise NotImplementedError

    @classmethod
    def wire_buckets(cls, update: "WeightUpdate", group: WeightGroup) -> int:
        return len(update.buckets)

    @classmethod
    def vllm_init_info(cls, receiver: "WeightReceiver") -> dict:
        return {"group": asdict(receiver.group), "rank": receiver.rank}

    @classmethod
    def vllm_update_info(cls, update: "WeightUpdate") -> dict:
        return update.to_dict()


@WEIGHT_SYNC_BACKENDS.register("gloo", gin_configurable=False)
class GlooBackend(WeightSyncBackend):
    """gloo broadcast of packed buckets (CPU; on GPU staged through host memory)."""

    @classmethod
    def connect_sender(cls, sender):
        sender._store, sender._pg = _join_gloo(sender.group, 0)

    @classmethod
    def send(cls, sender, update, named_tensors, clock):
        sender._send_gloo(update, _checked(update, named_tensors, clock))

    @classmethod
    def connect_receiver(cls, receiver):
        receiver._store, receiver._pg = _join_gloo(receiver.group, receiver.rank)

    @classmethod
    def receive_buckets(cls, receiver, update):
        return receiver._receive_gloo(update)


@WEIGHT_SYNC_BACKENDS.register("ipc", gin_configurable=False)
class IpcBackend(WeightSyncBackend):
    """One node: learner-0 shares two buffers (CUDA IPC / shared memory) through the TCPStore."""

    shares_buffers = True

    @classmethod
    def connect_sender(cls, sender):
        sender._store = sender._join_ipc()

    @classmethod
    def send(cls, sender, update, named_tensors, clock):
        sender._send_ipc(update, _checked(update, named_tensors, clock))

    @classmethod
    def connect_receiver(cls, receiver):
        receiver._store = join_store(receiver.group, receiver.rank)

    @classmethod
    def receive_buckets(cls, receiver, update):
        return receiver._receive_ipc(update)


@WEIGHT_SYNC_BACKENDS.register("nccl", gin_configurable=False)
class NcclBackend(WeightSyncBackend):
    """GPU: vLLM's NCCL weight-transfer engine, in vLLM's packed wire format."""

    @classmethod
    def connect_sender(cls, sender):
        sender._nccl = _nccl_trainer_engine(sender.group)

    @classmethod
    def send(cls, sender, update, named_tensors, clock):
        sender._send_nccl(update, named_tensors, clock)

    @classmethod
    def connect_receiver(cls, receiver):
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        receiver._comm = stateless_init_process_group(
            receiver.group.master_addr, int(receiver.group.master_port), receiver.rank, receiver.group.world_size,
            device=receiver.device.index if receiver.device.index is not None else torch.cuda.current_device(),
        )

    @classmethod
    def receive_buckets(cls, receiver, update):
        return receiver._receive_nccl(update)

    @classmethod
    def wire_buckets(cls, update, group):
        return len(vllm_packed_chunks(update.params, group.bucket_bytes))

    @classmethod
    def vllm_init_info(cls, receiver):
        return receiver._vllm_nccl_init_info()

    @classmethod
    def vllm_update_info(cls, update):
        return update.vllm_nccl_update_info()


# ----------------------------------------------------------------------------- vLLM (GPU): the trainer side
def listen_address(host: str) -> str:
    """The address learner rank 0 gives vLLM's NCCL trainer endpoint, which listens on exactly that
    address (torch's TCPStore, on the gloo and ipc paths, listens on every interface).

    `host` is the node name every process was given. Listening on the address THIS node resolves
    it to could shut out generators on other nodes: where the node resolves its own name to a
    loopback address (Debian's "127.0.1.1 <hostname>" line), or where nodes resolve names
    differently (/etc/hosts against DNS, a management against a fast network). So the endpoint
    listens on every interface ("0.0.0.0"); only a loopback given as such (a one-machine run)
    is kept, and stays private to the machine."""
    from components.trainer.roles import is_loopback

    if is_loopback(host):
        return host
    return "::" if ":" in host else "0.0.0.0"  # an IPv6 address: every IPv6 interface


def _nccl_trainer_engine(group: WeightGroup):
    """vLLM's NCCLTrainerWeightTransferEngine for learner rank 0 (GPU; on CPU only with gloo in NCCL's place)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    class _RoundSource(WeightSource):
        """This round's tensors; the metadata is the announced update."""

        update = tensors = clock = None

        def set_round(self, update, tensors, clock):
            self.update, self.tensors, self.clock = update, tensors, clock

        def metadata(self):
            return [ParamMeta(p.name, p.torch_dtype, tuple(p.shape)) for p in self.update.params]

        def __iter__(self):
            it = iter(self.tensors)
            while True:
                t0 = time.perf_counter()
                item = next(it, None)
                self.clock[0] += time.perf_counter() - t0
                if item is None:
                    return
                yield item

    class _AnnouncedClient:
        """The generators are driven by the run's control transport (the announcement), not by this client."""

        def init_weight_transfer_engine(self, init_info):
            return None

        def start_weight_update(self):
            return None

        def update_weights(self, update_info):
            return None

        def finish_weight_update(self, weight_version=None):
            return None

    source = _RoundSource()
    info = NCCLTrainerInitInfo(
        master_address=listen_address(group.master_addr),
        master_port=int(group.master_port),
        world_size=group.world_size,
        packed=True,
        packed_buffer_size_bytes=group.bucket_bytes,
        packed_num_buffers=NCCL_NUM_BUFFERS,
        rank=0,
    )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=_AnnouncedClient(), source=source)
    return engine, source
