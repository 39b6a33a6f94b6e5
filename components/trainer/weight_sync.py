"""Weight sync by broadcast: learner rank 0 -> every generator.

The WEIGHT GROUP is learner rank 0 (rank 0) plus every generator's receiving workers: generator
i is rank 1 + i, or with vLLM tensor parallelism of W its worker w is rank 1 + i x W + w (each TP
worker receives every full tensor; its `load_weights` keeps its shard). It is never
the default process group (the learner ranks own theirs, and vLLM sets up its own
torch.distributed world inside a generator), so it is built statelessly:

- ``gloo`` (CPU): a ``TCPStore`` hosted by learner rank 0 + ``torch.distributed.ProcessGroupGloo``
  on it. Every collective has the group's timeout, so a dead or silent peer is an error, never a
  hang. Tensors travel in BUCKETS: runs of consecutive same-dtype tensors of at most
  ``bucket_mb`` (a larger tensor is a bucket on its own), packed into one flat buffer and sent
  with one broadcast; the sender packs bucket b+1 while bucket b is on the wire.
- ``nccl`` (GPU): vLLM's own weight-transfer API. The learner uses vLLM's
  ``NCCLTrainerWeightTransferEngine`` (``PyNcclCommunicator`` on a ``StatelessProcessGroup``,
  vLLM's packed broadcast with ``bucket_mb`` buffers); a vLLM generator uses vLLM's
  ``NCCLWeightTransferEngine`` (``init_weight_transfer_engine`` / ``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update``); a torch-engine generator reads the same packed
  wire format. Tested on CPU with gloo in NCCL's place and no-op CUDA streams (vLLM's packing,
  both vLLM engines and this glue run as they are; tests/test_weight_sync.py); NCCL itself has
  not run here (no GPU). NCCL has no timeout:
  a dead peer is caught by the run's heartbeats, not here.
- ``ipc`` (one node; on GPU the learner and its generators SHARE the GPU, where NCCL refuses two
  ranks): no collective at all. Learner rank 0 packs each bucket into one of two buffers it
  owns and publishes a handle to it in the TCPStore; each generator opens the handle, copies
  the bucket into its model and acknowledges; a buffer is refilled only once every generator
  has acknowledged it (so packing bucket b+1 overlaps the generators' copy of bucket b). GPU
  buffers are shared by CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``, the
  mechanism of vLLM's IPC engine; the receiver must be on the same physical GPU, checked by
  UUID), CPU buffers through torch's shared-memory manager (its ``file_system`` strategy, so
  no file is left behind by a killed process). Every wait has the group's timeout and names
  the generator that did not acknowledge. The CUDA half is UNTESTED here (no GPU); the
  protocol is the same and is tested on CPU.

One update, step by step (the control message travels on the run's transport, not here)::

    # learner, every rank (FSDP2: full_tensor() is a collective over the learner group)
    update = WeightUpdate.plan(version, generator_state_meta(model, precision), cfg.weight_sync_bucket_mb)
    announce(update)                                        # rank 0, over the control transport
    stats = push_weights(model, precision, update, sender)  # sender on rank 0, None elsewhere
    # generator, between two decode steps, on the announcement
    engine.receive_weights(receiver, update)                # torch: in place, KV cache kept

Joining: the group forms when all its ranks have called `connect()` (learner:
`WeightSender.connect`; generator: `engine.connect_weights(receiver)`). Call it on every rank at
startup, or on none (then the first `send` / `receive_weights` joins): a rank that connects
while the others wait for an update blocks until the group timeout, then raises naming the
missing ranks.

Modules: weight_wire.py holds what they all share (the group, the announced update, the store,
shared-buffer handles); this one the protocol (the learner-side tensors, `WeightSender` /
`WeightReceiver`); weight_sync_backends.py the backends they dispatch to by
``group.backend`` (registered in ``WEIGHT_SYNC_BACKENDS``) and what moves the bytes (the gloo
group, shared-buffer handles, vLLM's NCCL trainer engine); weight_sync_vllm.py the vLLM side of
gloo and ipc: on CPU a vLLM generator also goes through vLLM's weight-transfer API, with a gloo
engine (``VLLM_GLOO_BACKEND``) registered in vLLM's ``WeightTransferEngineFactory``.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterable, Iterator, Optional

import torch

from components.precision import get_precision
from components.registry import WEIGHT_SYNC_BACKENDS
from components.trainer import weight_sync_backends  # noqa: F401  (registers gloo, ipc, nccl)
from components.trainer.weight_sync_vllm import VLLM_GLOO_BACKEND, register_vllm_gloo_engine
from components.trainer.weight_wire import (
    NCCL_NUM_BUFFERS,
    STORE_PREFIX,
    ParamSpec,
    SyncStats,
    WeightGroup,
    WeightSyncError,
    WeightUpdate,
    bucket_views,
    dtype_name,
    group_timeout,
    ipc_key,
    join_store,
    missing_ranks,
    open_buffer,
    rank_names,
    share_buffer,
    vllm_packed_chunks,
)

__all__ = [
    "WeightGroup",
    "ParamSpec",
    "WeightUpdate",
    "SyncStats",
    "WeightSyncError",  # weight_wire.py's, raised by the sender and receiver too
    "hf_name",
    "generator_state_meta",
    "generator_state_names",
    "iter_full_parameters",
    "push_weights",
    "same_device",
    "WeightSender",
    "WeightReceiver",
]

# Path components that wrappers insert into parameter names (torch.compile, FSDP1, activation
# checkpointing); a leading "module." comes from DDP-style wrappers.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


# ----------------------------------------------------------------------------- learner side: names and tensors
def hf_name(name: str) -> str:
    """A parameter name without wrapper components (`_orig_mod.`, `_checkpoint_wrapped_module.`, leading `module.`)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _head_param_ids(model: torch.nn.Module, fp32_head: bool) -> set[int]:
    """ids of the LM head's parameters (the ones kept in fp32 under bf16_fp32_head)."""
    if not fp32_head:
        return set()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding; bf16_fp32_head needs an LM head")
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    if emb is not None and head.weight is emb.weight:
        raise ValueError(
            "precision bf16_fp32_head sends an fp32 LM head and a bf16 embedding, but the learner's model ties "
            "them; untie it first (components.precision.untie_lm_head), as the learner does for this policy"
        )
    return {id(p) for p in head.parameters()}


def _wire_dtype(param: torch.Tensor, is_head: bool, policy) -> torch.dtype:
    if not param.dtype.is_floating_point:
        return param.dtype
    return torch.float32 if is_head else policy.param_dtype


def generator_state_meta(model: torch.nn.Module, precision) -> list[ParamSpec]:
    """What the generators receive, in order: HF name, FULL shape (also under FSDP2), dtype.

    The precision policy decides the dtype: fp32 -> float32; bf16 -> bfloat16 everywhere;
    bf16_fp32_head -> bfloat16 body, float32 LM head (the learner's model must be untied).
    Tied parameters appear once (as `named_parameters` lists them). A LoRA learner's model
    (train.lora_rank > 0) is listed as its base model: base names, no adapter tensors
    (`components.trainer.lora.generator_parameters`).
    """
    from components.trainer.lora import generator_parameters

    policy = get_precision(precision)
    head_ids = _head_param_ids(model, policy.fp32_head)
    return [
        ParamSpec(hf_name(name), tuple(int(s) for s in p.shape), dtype_name(_wire_dtype(p, id(p) in head_ids, policy)))
        for name, p, _ in generator_parameters(model)
    ]


def generator_state_names(model: torch.nn.Module, precision) -> list[str]:
    """The HF parameter names the generators receive, in order."""
    return [spec.name for spec in generator_state_meta(model, precision)]


def iter_full_parameters(model: torch.nn.Module, precision) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor in the generator dtype), one parameter at a time.

    Call it on EVERY learner rank, in step: under FSDP2 each parameter is a DTensor and
    `full_tensor()` is an all-gather over the learner group (only one full parameter exists at a
    time, never the whole model). A plain model yields its parameters cast (or, when the dtype
    already matches, the parameter's own detached storage: copy it before the next optimizer
    step if you keep it). Ranks other than 0 discard what they get.

    A LoRA learner's model yields the base model's names with each adapted weight MERGED,
    W + (lora_alpha / r) x B @ A, computed on the fly from the full fp32 tensors (its A and B
    gathered right after W, on every rank) and then cast; the trained tensors are not modified
    (`components.trainer.lora.merged_weight`).
    """
    from torch.distributed.tensor import DTensor

    from components.trainer.lora import generator_parameters, merged_weight

    policy = get_precision(precision)
    head_ids = _head_param_ids(model, policy.fp32_head)
    for name, p, lora_layer in generator_parameters(model):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if lora_layer is not None:
            full = merged_weight(full, lora_layer)
        yield hf_name(name), full.detach().to(_wire_dtype(p, id(p) in head_ids, policy))


def push_weights(model: torch.nn.Module, precision, update: WeightUpdate, sender: Optional["WeightSender"]) -> Optional[SyncStats]:
    """One update from the learner side: every rank gathers, rank 0 (the one with a sender) broadcasts."""
    tensors = iter_full_parameters(model, precision)
    if sender is not None:
        return sender.send(update, tensors)
    for _ in tensors:  # join the all-gathers; the tensors are rank 0's business
        pass
    return None


# ----------------------------------------------------------------------------- the two ends: learner rank 0, generators
def same_device(have: torch.device, want: torch.device) -> bool:
    """Whether a tensor on `have` is on `want`, where an index-less `want` ("cuda") means the current
    device: torch.device("cuda") != torch.device("cuda:0"), and a buffer reallocated (and re-exported
    over CUDA IPC) for every bucket on that inequality is what this avoids."""
    if have.type != want.type:
        return False
    if want.index is None and want.type == "cuda":
        return have.index == torch.cuda.current_device()
    return want.index is None or have.index == want.index


class WeightSender:
    """Learner rank 0's end of the weight group.

    `connect()` joins the group (it waits for every generator, up to the group's timeout); `send`
    connects first if needed. One `send` at a time.
    """

    def __init__(self, group: WeightGroup, *, device: Optional[str] = None):
        self.group = group
        self.device = torch.device(device) if device is not None else None
        self._store = None
        self._pg = None
        self._nccl = None  # (vLLM trainer engine, round source)
        self._buffers: list[Optional[torch.Tensor]] = [None, None]  # two reusable uint8 buffers (gloo: CPU; ipc: shared)
        self._broken: Optional[str] = None
        self._ipc_ready = False
        self._round = 0  # ipc: updates sent so far (the generators count the same)

    @property
    def connected(self) -> bool:
        return self._pg is not None or self._nccl is not None or self._ipc_ready

    def connect(self) -> None:
        if self.connected:
            return
        WEIGHT_SYNC_BACKENDS.get(self.group.backend).connect_sender(self)

    def send(self, update: WeightUpdate, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Broadcast `named_tensors` (they must match `update.params` in order, shape and dtype)."""
        if self._broken:
            raise WeightSyncError(f"weight sender is unusable after an earlier failure: {self._broken}")
        self.connect()
        t0 = time.perf_counter()
        clock = [0.0]
        backend = WEIGHT_SYNC_BACKENDS.get(self.group.backend)
        try:
            backend.send(self, update, named_tensors, clock)
        except BaseException as err:
            self._broken = f"{type(err).__name__}: {err}"
            raise
        return SyncStats(
            version=update.version,
            bytes=update.total_bytes,
            num_buckets=backend.wire_buckets(update, self.group),  # what went on the wire
            seconds=time.perf_counter() - t0,
            source_seconds=clock[0],
        )

    def _buffer(self, slot: int, nbytes: int, device: Optional[torch.device] = None) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes or (device is not None and not same_device(buf.device, device)):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._buffers[slot] = buf
        return buf

    def _join_ipc(self):
        """Host the store and wait until every generator has joined (a missing one is named)."""
        store = join_store(self.group, 0)
        keys = {r: f"{STORE_PREFIX}/joined/{r}" for r in range(1, self.group.world_size)}
        try:
            store.wait(list(keys.values()), group_timeout(self.group))
        except Exception as err:  # noqa: BLE001
            raise WeightSyncError(
                f"weight group at {self.group.endpoint}: {rank_names(self.group, missing_ranks(store, keys))} did not join "
                f"within {self.group.timeout_s:g} s: {err}"
            ) from err
        self._ipc_ready = True
        return store

    def _send_ipc(self, update: WeightUpdate, pairs: Iterator[tuple[ParamSpec, torch.Tensor]]) -> None:
        """Pack bucket b into buffer b % 2, publish one handle per generator, and refill a buffer only
        once every generator has acknowledged the bucket in it."""
        self._round += 1
        rnd, n, gens = self._round, len(update.buckets), range(1, self.group.world_size)
        unacked: list[int] = []
        for b, (start, stop) in enumerate(update.buckets):
            specs = update.params[start:stop]
            dtype = specs[0].torch_dtype
            numel = sum(s.numel for s in specs)
            if len(unacked) == 2:  # both buffers in use: wait for the older bucket
                self._wait_acks(update, rnd, unacked.pop(0), n)
            flat = None
            offset = 0
            for _ in specs:
                spec, tensor = next(pairs)
                if flat is None:  # the bucket's buffer lives where the tensors are (CUDA IPC or CPU shared memory)
                    device = self.device if self.device is not None else tensor.device
                    flat = self._buffer(b % 2, numel * dtype.itemsize, device)[: numel * dtype.itemsize].view(dtype)  # [numel]
                flat[offset : offset + spec.numel].copy_(tensor.reshape(-1))
                offset += spec.numel
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()  # the bytes are there before anyone opens them
            for r in gens:
                self._store.set(ipc_key(rnd, b, "h", r), share_buffer(flat))
            unacked.append(b)
        for b in unacked:
            self._wait_acks(update, rnd, b, n)
        for _ in pairs:  # checks that nothing is left over
            pass

    def _wait_acks(self, update: WeightUpdate, rnd: int, b: int, n: int) -> None:
        keys = {r: ipc_key(rnd, b, "ack", r) for r in range(1, self.group.world_size)}
        try:
            self._store.wait(list(keys.values()), group_timeout(self.group))
        except Exception as err:  # noqa: BLE001
            raise WeightSyncError(
                f"weight update v{update.version}: {rank_names(self.group, missing_ranks(self._store, keys))} did not take bucket "
                f"{b + 1}/{n} from learner rank 0's shared buffer within {self.group.timeout_s:g} s (it died or hung): {err}"
            ) from err
        for r in keys:
            self._store.delete_key(ipc_key(rnd, b, "h", r))
            self._store.delete_key(keys[r])

    def _send_gloo(self, update: WeightUpdate, pairs: Iterator[tuple[ParamSpec, torch.Tensor]]) -> None:
        pending = None  # (work, bucket index) of the broadcast on the wire
        n = len(update.buckets)
        for b, (start, stop) in enumerate(update.buckets):
            specs = update.params[start:stop]
            dtype = specs[0].torch_dtype
            numel = sum(s.numel for s in specs)
            flat = self._buffer(b % 2, numel * dtype.itemsize)[: numel * dtype.itemsize].view(dtype)  # [numel]
            offset = 0
            for _ in specs:  # pack while the previous bucket is on the wire
                spec, tensor = next(pairs)
                flat[offset : offset + spec.numel].copy_(tensor.reshape(-1))
                offset += spec.numel
            if pending is not None:
                self._wait(pending, update, n)
            pending = (self._pg.broadcast(flat, 0), b)
        if pending is not None:
            self._wait(pending, update, n)
        for _ in pairs:  # checks that nothing is left over
            pass

    def _wait(self, pending, update: WeightUpdate, n: int) -> None:
        work, b = pending
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001
            raise WeightSyncError(
                f"weight update v{update.version}: broadcast of bucket {b + 1}/{n} from learner rank 0 to the "
                f"{self.group.num_generators} generator(s) at {self.group.endpoint} failed (a generator died or did not "
                f"receive within {self.group.timeout_s:g} s): {err}"
            ) from err

    def _send_nccl(self, update: WeightUpdate, named_tensors, clock: list) -> None:
        engine, source = self._nccl
        if update.bucket_bytes != self.group.bucket_bytes:
            raise WeightSyncError(
                f"weight update v{update.version}: planned with {update.bucket_bytes} B buckets but the nccl group packs "
                f"{self.group.bucket_bytes} B buffers; plan with the group's bucket_mb ({self.group.bucket_mb})"
            )
        # vLLM's packed producer pulls our tensors (and, with FSDP2, starts their all-gathers) on its own
        # CUDA streams, which do not wait for the default stream where the optimizer step was queued: wait
        # for that step here, or the generators could get a mix of old and new weights.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        source.set_round(update, named_tensors, clock)
        try:
            engine.send_weights()
        finally:
            source.set_round(None, None, None)

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl[0].shutdown()
        self._pg = self._store = self._nccl = None
        self._ipc_ready = False
        cuda = any(b is not None and b.is_cuda for b in self._buffers)
        self._buffers = [None, None]
        if cuda:
            torch.cuda.ipc_collect()  # frees the shared blocks the generators have released


class WeightReceiver:
    """A generator's end of the weight group (rank: `WeightGroup.generator_rank`).

    Torch engines receive through it directly. A vLLM engine hands its connection parameters
    (`vllm_init_info`) to vLLM, whose worker-side weight-transfer engine then owns the connection.
    """

    def __init__(self, group: WeightGroup, rank: int, *, device: str = "cpu"):
        if not 1 <= int(rank) < group.world_size:
            raise ValueError(f"a generator's weight-group rank must be in 1..{group.world_size - 1}, got {rank!r}")
        self.group = group
        self.rank = int(rank)
        self.device = torch.device(device)
        self._store = None
        self._pg = None
        self._comm = None  # vLLM PyNcclCommunicator (nccl)
        self._broken: Optional[str] = None
        self._round = 0  # ipc: updates received so far (the sender counts the same)

    @property
    def connected(self) -> bool:
        return self._pg is not None or self._comm is not None or (self._store is not None and self.shares_buffers)

    @property
    def shares_buffers(self) -> bool:
        """The received tensors are views of the sender's buffers, refilled after each bucket (ipc)."""
        return WEIGHT_SYNC_BACKENDS.get(self.group.backend).shares_buffers

    def connect(self) -> None:
        if self.connected:
            return
        WEIGHT_SYNC_BACKENDS.get(self.group.backend).connect_receiver(self)

    def receive_buckets(self, update: WeightUpdate) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket as a list of (name, tensor); tensors are views of that bucket's buffer.

        Consume it to the end: the sender and the other generators are in the same broadcasts.
        """
        if self._broken:
            raise WeightSyncError(f"weight receiver of {self.group.rank_name(self.rank)} is unusable after an earlier failure: "
                                  f"{self._broken}")
        self.connect()
        yield from WEIGHT_SYNC_BACKENDS.get(self.group.backend).receive_buckets(self, update)

    def receive(self, update: WeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in `update.params` order; holds one bucket at a time."""
        for bucket in self.receive_buckets(update):
            yield from bucket

    def discard(self, update: WeightUpdate) -> None:
        """Take part in an update without keeping anything (keeps the group in step)."""
        for _ in self.receive_buckets(update):
            pass

    def _receive_gloo(self, update: WeightUpdate) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for b, (start, stop) in enumerate(update.buckets):
            specs = update.params[start:stop]
            flat = torch.empty(sum(s.numel for s in specs), dtype=specs[0].torch_dtype)  # [numel]
            try:
                self._pg.broadcast(flat, 0).wait()
            except Exception as err:  # noqa: BLE001
                raise self._lost_sender(update, b, specs, "receiving", "sent", err) from err
            yield bucket_views(flat, specs)

    def _lost_sender(self, update: WeightUpdate, b: int, specs, doing: str, did: str, err: BaseException) -> WeightSyncError:
        """Mark this receiver broken; the error naming learner rank 0 and the bucket it was `doing`."""
        self._broken = f"{type(err).__name__}: {err}"
        return WeightSyncError(
            f"weight update v{update.version}: {self.group.rank_name(self.rank)} lost the sender (learner rank 0 at "
            f"{self.group.endpoint}) while {doing} bucket {b + 1}/{len(update.buckets)} ({specs[0].name} ...): it died, or "
            f"{did} nothing within the group timeout of {self.group.timeout_s:g} s: {err}"
        )

    def _receive_ipc(self, update: WeightUpdate) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket as views of learner rank 0's shared buffer; acknowledged once the consumer asks
        for the next one (so copy out of the views before that: the buffer is refilled after the ack)."""
        self._round += 1
        n = len(update.buckets)
        for b, (start, stop) in enumerate(update.buckets):
            specs = update.params[start:stop]
            try:
                flat = open_buffer(self._store.get(ipc_key(self._round, b, "h", self.rank)), self.device)  # [numel]
            except WeightSyncError:
                raise
            except Exception as err:  # noqa: BLE001
                raise self._lost_sender(update, b, specs, "waiting for", "shared", err) from err
            if flat.dtype != specs[0].torch_dtype or flat.numel() != sum(s.numel for s in specs):
                self._broken = "bucket layout mismatch"
                raise WeightSyncError(f"weight update v{update.version}: bucket {b + 1}/{n} arrived as {flat.numel()} "
                                      f"{flat.dtype}, the announcement says {sum(s.numel for s in specs)} {specs[0].torch_dtype}")
            out = bucket_views(flat, specs)
            yield out
            if flat.is_cuda:
                torch.cuda.synchronize(flat.device)  # the consumer's (non-blocking) copies are done
            del out, flat
            self._store.set(ipc_key(self._round, b, "ack", self.rank), "1")

    def _receive_nccl(self, update: WeightUpdate) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """vLLM's packed wire format (vllm.distributed.weight_transfer.packed_tensor): uint8 chunks."""
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        specs = update.params
        for start, stop in vllm_packed_chunks(specs, self.group.bucket_bytes):
            chunk = specs[start:stop]
            sizes = [s.nbytes for s in chunk]
            packed = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)  # [bytes]
            self._comm.broadcast(packed, src=0, stream=torch.cuda.current_stream())
            yield unpack_tensor(packed, [s.name for s in chunk], [list(s.shape) for s in chunk],
                                [s.torch_dtype for s in chunk], sizes)

    def vllm_transfer(self) -> tuple[str, Optional[Callable[[], type]]]:
        """How a vLLM engine loads this group's updates: the backend's name in vLLM's
        WeightTransferEngineFactory, and a picklable function that registers it there, to call in
        each vLLM worker (None: vLLM's own engine, nccl). gloo and ipc: this repository's engine
        (weight_sync_vllm.py). The engine asks the receiver, so engines/ never imports trainer/."""
        if self.group.backend == "nccl":
            return "nccl", None
        return VLLM_GLOO_BACKEND, functools.partial(register_vllm_gloo_engine, WeightReceiver)

    def vllm_init_info(self) -> dict:
        """`LLM.init_weight_transfer_engine` init_info for this receiver (gloo, ipc: our engine; nccl: vLLM's)."""
        return WEIGHT_SYNC_BACKENDS.get(self.group.backend).vllm_init_info(self)

    def _vllm_nccl_init_info(self) -> dict:
        return {
            "master_address": self.group.master_addr,
            "master_port": int(self.group.master_port),
            "rank_offset": self.rank,  # this generator's first rank; vLLM adds each worker's tensor-parallel rank
            "world_size": self.group.world_size,
            "packed": True,
            "packed_buffer_size_bytes": self.group.bucket_bytes,
            "packed_num_buffers": NCCL_NUM_BUFFERS,
        }

    def vllm_update_info(self, update: WeightUpdate) -> dict:
        """`LLM.update_weights` update_info for `update` on this receiver's backend."""
        return WEIGHT_SYNC_BACKENDS.get(self.group.backend).vllm_update_info(update)

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
        self._pg = self._store = self._comm = None
