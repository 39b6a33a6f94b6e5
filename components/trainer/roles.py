"""Ranks and roles of one run: T learner ranks + G generator processes, placed by rank.

One run is `world_size = T + G` processes. Global rank r < T is learner rank r; rank T + i is
generator i. The same numbering holds whether `scalerl train` spawned the processes on one
machine or Slurm started them as the tasks of one job (`srun`, block distribution, so the
ranks of a node are consecutive)::

    rank:   0          1 .. T-1          T .. T+G-1
    role:   learner-0  learner-1..T-1    generator-0..G-1
            (the hub: curriculum, run directory, weight broadcast root)

Learner rank 0 listens on four ports (``Endpoints``): the learner group's torch.distributed
rendezvous, the weight group's TCPStore, and the transport's sockets (hub_port and up).

On GPU every process is given its own device(s) before CUDA is initialised, through
CUDA_VISIBLE_DEVICES: a learner rank one GPU, a generator `gpus_per_generator` (its engine's
tensor parallelism). When a node has fewer GPUs than its processes need, they share (one GPU
for a learner and a generator is the smallest GPU setup), with a warning.
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

log = logging.getLogger(__name__)

__all__ = ["Role", "Layout", "Endpoints", "ProcessEnv", "process_env", "free_port_base", "assign_gpus", "slurm_task_gpus",
           "gpus_bound_per_task", "available_gpus", "settle_heap", "PORTS_PER_RUN"]

PORTS_PER_RUN = 10  # base: learner group, base+1: weight group store, base+2..: transport


@dataclass(frozen=True)
class Role:
    """What one process of a run does."""

    kind: str  # "learner" | "generator"
    index: int  # learner rank or generator index
    rank: int  # global rank in the run

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    @property
    def is_learner(self) -> bool:
        return self.kind == "learner"

    @property
    def is_hub(self) -> bool:
        """Learner rank 0: orders prompts, receives rollouts, owns the run directory."""
        return self.kind == "learner" and self.index == 0


@dataclass(frozen=True)
class Layout:
    """How many processes of each kind a run has (from train.learner_ranks / train.num_generators)."""

    learner_ranks: int
    num_generators: int
    gpus_per_generator: int = 1

    def __post_init__(self) -> None:
        if self.learner_ranks < 1 or self.num_generators < 1 or self.gpus_per_generator < 1:
            raise ValueError(
                f"a run needs >= 1 learner rank, >= 1 generator and >= 1 GPU per generator; got "
                f"learner_ranks={self.learner_ranks}, num_generators={self.num_generators}, "
                f"gpus_per_generator={self.gpus_per_generator}"
            )

    @property
    def world_size(self) -> int:
        return self.learner_ranks + self.num_generators

    def role(self, rank: int) -> Role:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this run's {self.world_size} processes "
                             f"({self.learner_ranks} learner ranks + {self.num_generators} generators)")
        if rank < self.learner_ranks:
            return Role("learner", rank, rank)
        return Role("generator", rank - self.learner_ranks, rank)

    def roles(self) -> list[Role]:
        return [self.role(r) for r in range(self.world_size)]

    def generator_names(self) -> list[str]:
        return [f"generator-{i}" for i in range(self.num_generators)]

    def peer_names(self) -> list[str]:
        """Every process but the hub (learner-0)."""
        return [r.name for r in self.roles() if not r.is_hub]

    def gpus_needed(self, role: Role) -> int:
        return 1 if role.is_learner else self.gpus_per_generator

    def devices_reserved(self, on_gpu: bool, available: Optional[int] = None) -> int:
        """Devices the run holds: on CPU one core per process; on GPU one per learner rank + TP per
        generator, or the `available` GPUs when the processes share fewer (counted once each)."""
        if on_gpu:
            need = self.learner_ranks + self.num_generators * self.gpus_per_generator
            return min(need, available) if available else need
        return self.world_size


@dataclass(frozen=True)
class Endpoints:
    """Where learner rank 0 listens (host + a block of PORTS_PER_RUN ports)."""

    host: str
    port_base: int
    token: str = ""  # the run's token (transport.routing_id): the same in every process of one launch

    @property
    def learner_port(self) -> int:
        return self.port_base

    @property
    def weight_port(self) -> int:
        return self.port_base + 1

    @property
    def hub_port(self) -> int:
        return self.port_base + 2

    def to_env(self) -> dict:
        return {"SCALERL_HUB_HOST": self.host, "SCALERL_PORT_BASE": str(self.port_base), "SCALERL_RUN_TOKEN": self.token}


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the run, read from the environment."""

    rank: int
    world_size: int
    local_rank: int
    endpoints: Endpoints
    source: str  # "scalerl" (spawned by `scalerl train`) or "slurm" (a task of a Slurm job)


def _slurm_hostnames(nodelist: str) -> list[str]:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        names = out.stdout.split()
        if names:
            return names
    except (OSError, subprocess.SubprocessError):
        pass
    # no scontrol in the task (a container without Slurm's tools): submitit's parser of the same syntax
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    try:
        from submitit.slurm.slurm import _parse_node_list

        names = _parse_node_list(nodelist)
    except Exception:  # noqa: BLE001 - an older or newer submitit, or a list it cannot read
        names = []
    if names:
        return names
    raise RuntimeError(f"cannot expand the Slurm node list {nodelist!r}: `scontrol show hostnames` failed; "
                       "set SCALERL_HUB_HOST to the first node's address")


PORT_FLOOR = 20000  # run port blocks lie in [PORT_FLOOR, the kernel's ephemeral range)


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for outgoing (ephemeral) ports; Linux's default when it cannot be read."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _port_blocks(n: int = PORTS_PER_RUN) -> tuple[int, int]:
    """(first port, number of n-port blocks) BELOW the ephemeral range: a port probed free there
    cannot be taken a moment later by an outgoing connection (gloo's pairs, ZeroMQ, HTTP) of this
    or another run, which is how a block probed free in 20000-60000 once failed to bind."""
    lo = ephemeral_port_range()[0]
    if lo - PORT_FLOOR >= 10 * n:
        return PORT_FLOOR, (lo - PORT_FLOOR) // n
    return 1024, max((lo - 1024) // n, 1)  # an unusually low ephemeral range: privileged ports excluded


def slurm_port_base(job_id: str) -> int:
    """A port block derived from the Slurm job id, so every task of the job computes the same one."""
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    first, blocks = _port_blocks()
    return first + (int(digits) % blocks) * PORTS_PER_RUN


def process_env(environ: Optional[dict] = None) -> Optional[ProcessEnv]:
    """Rank, world size and hub address of this process; None when it is a plain single process.

    Read, in order: SCALERL_RANK / SCALERL_WORLD_SIZE (set by `scalerl train` for the processes
    it spawns), then SLURM_PROCID / SLURM_STEP_NUM_TASKS when the job step has more than one task
    (`srun`). SCALERL_HUB_HOST / SCALERL_PORT_BASE override the hub address under Slurm;
    "{node}" in SCALERL_HUB_HOST stands for the step's first node (e.g. "{node}-ib"), so one
    setting serves every job of a sweep.
    """
    env = os.environ if environ is None else environ
    if "SCALERL_RANK" in env:
        return ProcessEnv(
            rank=int(env["SCALERL_RANK"]),
            world_size=int(env["SCALERL_WORLD_SIZE"]),
            local_rank=int(env.get("SCALERL_LOCAL_RANK", env["SCALERL_RANK"])),
            endpoints=Endpoints(env.get("SCALERL_HUB_HOST", "127.0.0.1"), int(env["SCALERL_PORT_BASE"]),
                                env.get("SCALERL_RUN_TOKEN", "")),
            source="scalerl",
        )
    ntasks = slurm_step_tasks(env)
    if ntasks > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
        host = env.get("SCALERL_HUB_HOST") or "{node}"
        if "{node}" in host:  # a template of the first node's name, e.g. "{node}-ib" for its fast network
            host = host.replace("{node}", _slurm_hostnames(nodelist)[0])
        job = env.get("SLURM_JOB_ID", "0")
        base = int(env["SCALERL_PORT_BASE"]) if "SCALERL_PORT_BASE" in env else slurm_port_base(job)
        return ProcessEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=ntasks,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            endpoints=Endpoints(host, base, slurm_run_token(env)),
            source="slurm",
        )
    return None


def slurm_run_token(environ: Mapping[str, str]) -> str:
    """One token for every task of a Slurm step and no other: job id, step id and the job's
    restart count (a requeued job's new tasks never meet its old ones)."""
    parts = [environ.get("SLURM_JOB_ID", "0"), environ.get("SLURM_STEP_ID", "0"), environ.get("SLURM_RESTART_COUNT", "0")]
    return "s" + ".".join(p.replace("#", "") for p in parts)


def slurm_step_tasks(environ: Optional[Mapping[str, str]] = None) -> int:
    """The task count of this process's Slurm step; 1 outside a step. Only srun sets
    SLURM_STEP_NUM_TASKS: a batch script also has SLURM_PROCID=0 and the job's SLURM_NTASKS, but
    it is one process (`scalerl train` there starts the run's processes itself)."""
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env:
        return 1
    return int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1)


def is_loopback(addr: str) -> bool:
    """A loopback address or name (127.x, ::1, localhost): reachable from this machine only."""
    return addr == "localhost" or addr.startswith("127.") or addr == "::1"


def step_nodes(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many nodes this process's run spans: its Slurm step's node count (`srun`); 1 for a
    process `scalerl train` started (SCALERL_RANK: all on its machine) or outside any step (a
    batch script runs on one node, whatever SLURM_NNODES says)."""
    env = os.environ if environ is None else environ
    if "SCALERL_RANK" in env:
        return 1
    try:
        return max(int(env.get("SLURM_STEP_NUM_NODES") or 1), 1)
    except ValueError:
        return 1


def gloo_interface_problem(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why gloo cannot connect this node to the run's other nodes, or None.

    Without GLOO_SOCKET_IFNAME, gloo takes the address this node's own name resolves to. Where
    that is a loopback address (Debian's "127.0.1.1 <hostname>" line in /etc/hosts), ranks on
    other nodes are told to connect to it and wait until the group's timeout (minutes) instead."""
    env = os.environ if environ is None else environ
    if step_nodes(env) <= 1 or env.get("GLOO_SOCKET_IFNAME"):
        return None
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return None  # gloo names an unresolvable host itself
    if not is_loopback(addr):
        return None
    try:
        names = [n for _, n in socket.if_nameindex() if n != "lo"]
    except OSError:
        names = []
    return (f"this node's name {host!r} resolves to the loopback address {addr}, which gloo would give the "
            f"ranks on the run's {step_nodes(env)} nodes; set GLOO_SOCKET_IFNAME to the network interface the "
            f"nodes share (this node has: {', '.join(names) or 'none but lo'}), e.g. in the job's environment")


def _ports_free(base: int, n: int) -> bool:
    for port in range(base, base + n):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


def available_gpus(environ: Optional[dict] = None) -> Optional[int]:
    """GPUs this run may use: Slurm's allocation (GPUs per node x nodes), else CUDA_VISIBLE_DEVICES, else None."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"]) * int(env.get("SLURM_NNODES", "1") or 1)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return None


def free_port_base(n: int = PORTS_PER_RUN, attempts: int = 200) -> int:
    """A block of n consecutive free TCP ports on this machine (for a locally spawned run)."""
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    first, blocks = _port_blocks(n)
    for _ in range(attempts):
        base = first + rng.randrange(blocks) * n
        if _ports_free(base, n):
            return base
    raise RuntimeError(f"no block of {n} free TCP ports found between {first} and {first + blocks * n} "
                       "(below the kernel's ephemeral port range)")


def pin_cpu(slot: int, world_size: int, environ: Optional[dict] = None) -> Optional[int]:
    """Pin this process to one CPU of its affinity set (the `slot`-th: the process's global rank)
    when every process of the run can have its own (a local run on a machine with at least
    `world_size` CPUs); returns the CPU, or None when it leaves the process alone: under Slurm
    (its task binding decides), when the run's processes outnumber the CPUs, or when
    SCALERL_PIN_CPUS=0. Unpinned, the run's processes hop between the cores as they wake, and a
    run's CPU time then depends on whether other work holds the other cores (BENCHMARKS.md
    "Compute axis beside a CPU hog")."""
    env = os.environ if environ is None else environ
    if env.get("SCALERL_PIN_CPUS", "1") == "0" or env.get("SLURM_JOB_ID"):
        return None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return None
    if len(cpus) < world_size:
        return None
    cpu = cpus[slot % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def settle_heap() -> int:
    """Move everything start-up built (modules, the model, the task's problems, the tokenizer)
    out of the cyclic garbage collector's reach, once a process is ready to train or generate;
    returns the number of objects frozen.

    Python's full (generation-2) collection walks every tracked object. A learner or generator
    holds about 400,000 of them after start-up, and one full pass over them took 0.2-0.4 s on
    this 2-core CPU: a stall at an arbitrary step (a generator late with its batch, a learner
    late for a collective). After a full collection, `gc.freeze` parks the survivors in the
    permanent generation, so later passes walk only what training allocates. Collection itself
    stays on: cycles created while training are still freed (BENCHMARKS.md "The redesign's step
    time")."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


# "1" in every process of a run whose processes share GPUs (`gpus_shared`), set by whoever binds
# the GPUs (the local launcher, or each Slurm task); the weight group's "auto" backend reads it.
GPUS_SHARED_ENV = "SCALERL_GPUS_SHARED"


def gpus_shared(layout: Layout, ranks_per_node: Union[int, Sequence[int]], gpus_on_node: int) -> bool:
    """True when the processes of some node need more GPUs than it has, so that `assign_gpus`
    makes them share (e.g. a learner and a generator on one GPU). Nodes hold consecutive ranks:
    `ranks_per_node` each (the last one the rest), or the given count on each node in node order,
    and `gpus_on_node` GPUs each, so every process of the run computes the same answer."""
    if isinstance(ranks_per_node, int):
        per = max(int(ranks_per_node), 1)
        counts = [per] * -(-layout.world_size // per)
    else:
        counts = [max(int(c), 0) for c in ranks_per_node]
    first = 0
    for count in counts:
        need = sum(layout.gpus_needed(layout.role(r)) for r in range(first, min(first + count, layout.world_size)))
        if need > gpus_on_node:
            return True
        first += count
    return False


def slurm_tasks_per_node(environ: Mapping[str, str]) -> Optional[list[int]]:
    """The job step's task count on each of its nodes, in node order, from SLURM_STEP_TASKS_PER_NODE
    (else SLURM_TASKS_PER_NODE): "2(x3),1" is [2, 2, 2, 1]. None when neither is set or readable.
    Unlike SLURM_NTASKS_PER_NODE this is set however the tasks were asked for (`--ntasks` with
    `--overcommit` too) and tells uneven nodes apart."""
    text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts or None


def slurm_task_gpus(layout: Layout, penv: "ProcessEnv", visible: Sequence[str], environ: Optional[dict] = None) -> tuple[list[str], bool]:
    """(this Slurm task's devices, whether the run's processes share GPUs), from what Slurm shows it.

    Two ways a job can hold its GPUs:
    - per node (`scalerl`'s own jobs: `--gpus-per-node`): every task sees all of its node's GPUs and
      takes its own by rank (`assign_gpus`); they are shared when the node has too few (`gpus_shared`);
    - per task (`--gpus-per-task` or `--tres-per-task=gres/gpu:N`, which imply `--gpu-bind=per_task`):
      each task sees only the GPUs bound to it, so it takes the first ones its role needs, and no
      two processes share one. This is trusted only when the task sees no more GPUs than were
      bound to it (an explicit `--gpu-bind=none` shows every task the whole node: then per node).
    Every task has the same answer, so the weight group agrees.
    """
    env = os.environ if environ is None else environ
    role = layout.role(penv.rank)
    bound = gpus_bound_per_task(env)
    if bound is not None and len(visible) <= bound:
        need = layout.gpus_needed(role)
        if len(visible) < need:
            knob = " (vllm.tensor_parallel_size)" if not role.is_learner else ""
            raise RuntimeError(
                f"{role.name} needs {need} GPU(s){knob} but Slurm bound {len(visible)} to its task "
                f"({bound} per task, CUDA_VISIBLE_DEVICES={','.join(visible) or '(none)'}): "
                f"submit with --gpus-per-task={need}, or with --gpus-per-node and no --gpus-per-task")
        return list(visible[:need]), False
    first = penv.rank - penv.local_rank
    counts = slurm_tasks_per_node(env)
    if counts is not None and sum(counts) == penv.world_size:  # each node's own count
        gtids = sorted(int(t) for t in env.get("SLURM_GTIDS", "").split(",") if t.strip().isdigit())
        if gtids and gtids != list(range(gtids[0], gtids[0] + len(gtids))):
            raise RuntimeError(
                f"rank {penv.rank}: this node holds ranks {gtids} (SLURM_GTIDS), not a block of consecutive ranks; the "
                "run's GPU layout places ranks on nodes in blocks: submit with --distribution=block (Slurm's default)")
        node = int(env.get("SLURM_NODEID", "0") or 0)
        node_ranks = gtids if penv.rank in gtids else list(range(first, first + counts[min(node, len(counts) - 1)]))
        per_node: Union[int, list[int]] = counts
    else:  # the same count on every node
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0") or 0) or (penv.world_size // max(int(env.get("SLURM_NNODES", "1")), 1))
        node_ranks = list(range(first, min(first + per_node, penv.world_size)))
    mine = assign_gpus(layout, penv.rank, node_ranks, len(visible))
    return [visible[i] for i in mine], gpus_shared(layout, per_node, len(visible))


def gpus_bound_per_task(environ: dict) -> Optional[int]:
    """GPUs Slurm binds to each task, or None when the job holds them per node: SLURM_GPUS_PER_TASK
    ("2" or "a100:2"), else the gres/gpu entry of SLURM_TRES_PER_TASK ("cpu=4,gres/gpu=2",
    "gres/gpu:a100:2"; newer Slurm reports --gpus-per-task there)."""
    value = environ.get("SLURM_GPUS_PER_TASK") or ""
    if not value:
        entries = [e for e in (environ.get("SLURM_TRES_PER_TASK") or "").split(",") if e.startswith("gres/gpu")]
        value = entries[0] if entries else ""
    count = value.replace("=", ":").rsplit(":", 1)[-1].strip()
    return int(count) if count.isdigit() and int(count) > 0 else None


def assign_gpus(layout: Layout, rank: int, node_ranks: Sequence[int], gpus_on_node: int) -> list[int]:
    """Local GPU indices of `rank` among the processes of its node (consecutive, in rank order).

    Exclusive when the node has enough GPUs; otherwise the processes share them round-robin
    (e.g. a learner and a generator on one GPU), which is logged.
    """
    if gpus_on_node < 1:
        raise RuntimeError(f"{layout.role(rank).name} should run on GPU but its node has no visible GPU")
    ranks = sorted(node_ranks)
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not among its node's ranks {ranks}")
    need = [layout.gpus_needed(layout.role(r)) for r in ranks]
    start = sum(need[: ranks.index(rank)])
    mine = need[ranks.index(rank)]
    if sum(need) <= gpus_on_node:
        return list(range(start, start + mine))
    if mine > gpus_on_node:
        raise RuntimeError(f"{layout.role(rank).name} needs {mine} GPUs (tensor parallelism) but its node has {gpus_on_node}")
    log.warning("the %d processes on this node need %d GPUs but %d are visible: they share GPUs (NCCL refuses two "
                "ranks on one GPU, so the weight sync's \"auto\" backend is gloo; train.weight_sync_backend = \"ipc\" "
                "passes CUDA IPC handles instead)", len(ranks), sum(need), gpus_on_node)
    first = start % gpus_on_node
    if first + mine > gpus_on_node:
        first = 0
    return list(range(first, first + mine))
