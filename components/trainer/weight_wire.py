"""What the weight-sync protocol (weight_sync.py), its backends (weight_sync_backends.py) and vLLM's
side of it (weight_sync_vllm.py) share: the group (`WeightGroup`), the announced update
(`WeightUpdate`, `ParamSpec`), the stats of a send, the error; the group's TCPStore, its timeout
and the ranks missing from it; shared-buffer handles (ipc); bucket views and vLLM's packed chunks.

It imports none of them, so the three import it and not each other's private names.
"""

from __future__ import annotations

import datetime
import math
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from components.registry import WEIGHT_SYNC_BACKENDS, UnknownComponentError

__all__ = ["WeightGroup", "ParamSpec", "WeightUpdate", "SyncStats", "WeightSyncError", "STORE_PREFIX", "run_store",
           "NCCL_NUM_BUFFERS", "mb_to_bytes", "dtype_name", "group_timeout", "join_store", "missing_ranks", "rank_names", "ipc_key",
           "gpu_uuid", "share_buffer", "open_buffer", "bucket_views", "vllm_packed_chunks"]

STORE_PREFIX = "scalerl_weights"
NCCL_NUM_BUFFERS = 2  # vLLM's packed broadcast: both sides must agree


class WeightSyncError(RuntimeError):
    """A weight update could not complete (a peer died, hung, or the data disagreed)."""


# ----------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class WeightGroup:
    """How to reach the weight group (picklable; the same object goes to every member).

    Args:
        master_addr: host of learner rank 0, which hosts the TCPStore (reachable from every generator).
        master_port: the TCPStore's port.
        num_generators: G.
        workers_per_generator: W, the processes of one generator that receive weights: vLLM's
            tensor-parallel workers (``vllm.tensor_parallel_size``; each receives every full tensor
            and its ``load_weights`` keeps its shard), 1 for a torch engine. The group has
            1 + G x W ranks; generator i's worker w is rank 1 + i x W + w (`generator_rank`).
        backend: "gloo" (CPU), "nccl" (GPU, vLLM's PyNccl) or "ipc" (one node, shared memory / CUDA IPC).
        timeout_s: rendezvous and per-collective timeout (gloo, ipc).
        bucket_mb: size of the broadcast buffers (nccl: both sides must agree, so it is fixed here).
        token: the run's token (`roles.Endpoints.token`): every store key lives under it, so a process
            of another run (or of an earlier attempt of this Slurm job) that reaches the same port
            never takes a rank of this group ("" : no prefix).
    """

    master_addr: str
    master_port: int
    num_generators: int
    backend: str = "gloo"
    timeout_s: float = 300.0
    bucket_mb: float = 64.0
    workers_per_generator: int = 1
    token: str = ""

    def __post_init__(self) -> None:
        try:
            WEIGHT_SYNC_BACKENDS.get(self.backend)
        except UnknownComponentError as err:
            raise ValueError(f"weight group: {err}") from None
        if int(self.num_generators) < 1:
            raise ValueError(f"weight group needs num_generators >= 1, got {self.num_generators!r}")
        if isinstance(self.workers_per_generator, bool) or not isinstance(self.workers_per_generator, int) \
                or self.workers_per_generator < 1:
            raise ValueError(f"weight group workers_per_generator must be an int >= 1 (vLLM's tensor_parallel_size), "
                             f"got {self.workers_per_generator!r}")
        if not 0 < int(self.master_port) < 65536:
            raise ValueError(f"weight group master_port must be in 1..65535, got {self.master_port!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"weight group timeout_s must be > 0, got {self.timeout_s!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"weight group bucket_mb must be > 0, got {self.bucket_mb!r}")

    @property
    def world_size(self) -> int:
        return 1 + int(self.num_generators) * self.workers_per_generator

    def generator_rank(self, generator: int, worker: int = 0) -> int:
        """The weight-group rank of `generator`'s `worker` (its tensor-parallel rank)."""
        if not 0 <= int(generator) < int(self.num_generators):
            raise ValueError(f"generator index must be in 0..{int(self.num_generators) - 1}, got {generator!r}")
        if not 0 <= int(worker) < self.workers_per_generator:
            raise ValueError(f"a generator's worker must be in 0..{self.workers_per_generator - 1} "
                             f"(workers_per_generator = {self.workers_per_generator}), got {worker!r}")
        return 1 + int(generator) * self.workers_per_generator + int(worker)

    def rank_name(self, rank: int) -> str:
        """Who holds weight-group `rank`: "learner rank 0", "generator 1 (rank 2)", or with
        tensor-parallel workers "generator 1 worker 0 (rank 3)"."""
        if int(rank) == 0:
            return "learner rank 0"
        generator, worker = divmod(int(rank) - 1, self.workers_per_generator)
        if self.workers_per_generator == 1:
            return f"generator {generator} (rank {rank})"
        return f"generator {generator} worker {worker} (rank {rank})"

    @property
    def bucket_bytes(self) -> int:
        return mb_to_bytes(self.bucket_mb)

    @property
    def endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @classmethod
    def local(cls, num_generators: int, **kwargs: Any) -> "WeightGroup":
        """A group on this machine (127.0.0.1) with a port that is free right now, BELOW the
        ephemeral range (`roles.free_port_base`, as a run's own ports): a port the kernel hands
        out for bind(0) could be handed out again, once released, to whoever binds next (seen:
        vLLM's tensor-parallel workers, started after the group was made, took its port for
        their own store, and the generator's workers joined vLLM's store instead of ours)."""
        from components.trainer.roles import free_port_base

        host = kwargs.pop("master_addr", "127.0.0.1")
        return cls(master_addr=host, master_port=free_port_base(1), num_generators=num_generators, **kwargs)


def mb_to_bytes(mb: float) -> int:
    return max(1, int(float(mb) * 2**20))


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} (expected e.g. 'float32', 'bfloat16')")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


@dataclass(frozen=True)
class ParamSpec:
    """One tensor the generators receive: HF name, full shape, dtype name ("float32", "bfloat16")."""

    name: str
    shape: tuple
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class WeightUpdate:
    """What an announcement carries (picklable): the version and the tensors, in order.

    ``buckets`` is the gloo layout: [start, end) index ranges into ``params``, consecutive,
    covering all of them, each of one dtype and at most ``bucket_bytes`` unless it holds a single
    tensor. (The nccl backend packs with vLLM's rule at the group's ``bucket_mb`` instead.)
    """

    version: int
    params: tuple
    bucket_bytes: int
    buckets: tuple

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError("WeightUpdate needs at least one parameter")
        end = 0
        for start, stop in self.buckets:
            if start != end or stop <= start:
                raise ValueError(f"WeightUpdate buckets must be consecutive non-empty ranges, got {self.buckets!r}")
            if len({self.params[i].dtype for i in range(start, stop)}) != 1:
                raise ValueError(f"WeightUpdate bucket [{start}, {stop}) mixes dtypes")
            end = stop
        if end != len(self.params):
            raise ValueError(f"WeightUpdate buckets cover {end} of {len(self.params)} parameters")

    @classmethod
    def plan(cls, version: int, params: Sequence[ParamSpec], bucket_mb: float) -> "WeightUpdate":
        """Bucket `params` (in order) into same-dtype runs of at most `bucket_mb` MiB."""
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        params = tuple(params)
        cap = mb_to_bytes(bucket_mb)
        buckets: list[tuple[int, int]] = []
        start, size = 0, 0
        for i, spec in enumerate(params):
            if i > start and (spec.dtype != params[start].dtype or size + spec.nbytes > cap):
                buckets.append((start, i))
                start, size = i, 0
            size += spec.nbytes
        if params:
            buckets.append((start, len(params)))
        return cls(version=int(version), params=params, bucket_bytes=cap, buckets=tuple(buckets))

    def with_version(self, version: int) -> "WeightUpdate":
        """The same layout for another version (the layout does not change between steps)."""
        return WeightUpdate(version=int(version), params=self.params, bucket_bytes=self.bucket_bytes, buckets=self.buckets)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def to_dict(self) -> dict:
        """Plain python (the update_info of the vLLM gloo engine)."""
        return {
            "version": self.version,
            "params": [[p.name, list(p.shape), p.dtype] for p in self.params],
            "bucket_bytes": self.bucket_bytes,
            "buckets": [list(b) for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "WeightUpdate":
        return cls(
            version=int(d["version"]),
            params=tuple(ParamSpec(str(n), tuple(int(s) for s in shape), str(dt)) for n, shape, dt in d["params"]),
            bucket_bytes=int(d["bucket_bytes"]),
            buckets=tuple((int(a), int(b)) for a, b in d["buckets"]),
        )

    def vllm_nccl_update_info(self) -> dict:
        """The update_info of vLLM's NCCL weight-transfer engine (names, dtype_names, shapes)."""
        return {
            "names": self.names,
            "dtype_names": [p.dtype for p in self.params],
            "shapes": [list(p.shape) for p in self.params],
        }


@dataclass(frozen=True)
class SyncStats:
    """What one `WeightSender.send` did."""

    version: int
    bytes: int
    num_buckets: int
    seconds: float  # the whole send: gather + cast + pack + broadcast
    source_seconds: float  # time spent pulling tensors from `named_tensors` (full_tensor gathers, casts)


# ----------------------------------------------------------------------------- the store
def group_timeout(group: WeightGroup) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(group.timeout_s))


def join_store(group: WeightGroup, rank: int):
    """The group's TCPStore (rank 0 hosts it), with this rank marked as joined."""
    import torch.distributed as dist

    is_master = rank == 0
    try:
        store = dist.TCPStore(group.master_addr, int(group.master_port), None, is_master, group_timeout(group), wait_for_workers=False)
    except Exception as err:  # noqa: BLE001
        who = "host" if is_master else "reach"
        raise WeightSyncError(
            f"weight group rank {rank}: cannot {who} the weight group's TCPStore at {group.endpoint} "
            f"(learner rank 0 hosts it) within {group.timeout_s:g} s: {err}"
        ) from err
    store = run_store(store, group.token)
    store.set(f"{STORE_PREFIX}/joined/{rank}", "1")
    return store


def run_store(store, token: str):
    """`store` with every key under this run's `token` (the store itself when there is none)."""
    import torch.distributed as dist

    return dist.PrefixStore(f"scalerl-run/{token}", store) if token else store


def missing_ranks(store, keys: dict) -> list[int]:
    """The ranks whose store key (keys: {rank: key}) is not set; stops at the first store error."""
    missing = []
    for r, key in keys.items():
        try:
            if not store.check([key]):
                missing.append(r)
        except Exception:  # noqa: BLE001
            break
    return missing


def rank_names(group: WeightGroup, ranks: Sequence[int]) -> str:
    return ", ".join(group.rank_name(r) for r in ranks) or "unknown"


# ----------------------------------------------------------------------------- ipc: handles to shared buffers
def ipc_key(round_: int, bucket: int, what: str, rank: int) -> str:
    """Store key of one round's bucket: the handle for (`what`="h") or the ack of (`what`="ack") generator rank."""
    return f"{STORE_PREFIX}/ipc/{round_}/{bucket}/{what}/{rank}"


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share_buffer(flat: torch.Tensor) -> bytes:
    """A handle (bytes) that another process on this node opens with `open_buffer`; one handle per opener.

    CUDA: reduce_tensor's CUDA IPC arguments plus the GPU's UUID. CPU: the tensor pickled by
    torch's ForkingPickler under the ``file_system`` sharing strategy (the storage moves into
    torch's shared-memory manager on first use; each handle holds one reference, which `open_buffer`
    releases, so every opener needs its own handle).
    """
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(("cuda", gpu_uuid(flat.device), tuple(reduce_tensor(flat)[1])))
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # the fd strategy hands fds to children only
    try:
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(flat)
    finally:
        tmp.set_sharing_strategy(previous)
    return pickle.dumps(("cpu", None, buf.getvalue()))


def open_buffer(handle: bytes, device: torch.device) -> torch.Tensor:
    """The sender's buffer (no copy) from a `share_buffer` handle; raises WeightSyncError if it is on another GPU."""
    kind, uuid, payload = pickle.loads(handle)
    if kind == "cpu":
        return pickle.loads(payload)
    if device.type != "cuda":
        raise WeightSyncError("weight group ipc: the learner shares a CUDA buffer but this generator is on the CPU")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = device.index if device.index is not None else torch.cuda.current_device()
    if gpu_uuid(torch.device("cuda", index)) != uuid:
        raise WeightSyncError(
            f"weight group ipc: the learner's buffer is on GPU {uuid} and this generator on "
            f"{gpu_uuid(torch.device('cuda', index))}; ipc needs them on the same GPU (use nccl across GPUs)"
        )
    args = list(payload)
    args[6] = index  # reduce_tensor's device index is the sender's numbering; the GPU is the same (UUID)
    return rebuild_cuda_tensor(*args)


# ----------------------------------------------------------------------------- bucket layouts
def bucket_views(flat: torch.Tensor, specs: Sequence[ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    """(name, view) per spec of one bucket's flat buffer [numel], in order."""
    out, offset = [], 0
    for spec in specs:
        out.append((spec.name, flat[offset : offset + spec.numel].view(spec.shape)))
        offset += spec.numel
    return out


def vllm_packed_chunks(params: Sequence[ParamSpec], buffer_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges of vLLM's packed broadcast: a chunk closes once its size EXCEEDS the buffer."""
    chunks, start, size = [], 0, 0
    for i, spec in enumerate(params):
        size += spec.nbytes
        if size > buffer_bytes:
            chunks.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(params):
        chunks.append((start, len(params)))
    return chunks
