"""Compute accounting: the x axis of every curve (DESIGN.md "Compute accounting").

- `compute_hours` = devices reserved for the run x wall-clock hours of TRAINING. The training
  clock (`TrainingClock`) starts when every generator is ready (engines loaded, weight group
  formed), is paused while an evaluation runs (evaluation has its own fields), and a resumed
  run continues from the wall time its checkpoint recorded, so start-up and restarts are
  never billed. On CPU a device is a core the run reserved (one per process); on GPU a GPU.
- Each process reports its CPU time and its run-queue delay (Linux schedstat: time spent
  runnable but waiting for a CPU), summed over its threads, and the CPUs it may run on.
  `contention` is the share of the run's CPUs that OTHER work used: busy time of those CPUs
  (/proc/stat) minus the run's own CPU time, over CPUs x wall time. About 0 when the run has its
  cores to itself, 0.5 beside one CPU hog on a 2-core machine. (The run's own threads also wait
  for each other: that shows in `runq_frac`, run-queue delay / (CPU + run-queue delay), which
  is 0.1-0.25 for a tiny run alone, so it cannot tell a quiet machine from a shared one.)
- `flops`: 2N per token of a forward pass (N = parameters without the input embedding: a
  lookup, not a matmul) plus causal attention 4 x layers x attention width per (query, key)
  pair; prompt prefill included; training counts 3 forward passes (forward + backward).
"""

from __future__ import annotations

import glob
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

__all__ = [
    "proc_stats",
    "contention",
    "cpu_busy_s",
    "ForeignLoad",
    "TrainingClock",
    "FlopCounter",
    "sequence_forward_flops",
    "step_flop_terms",
]


def proc_stats() -> dict:
    """This process's CPU seconds and run-queue seconds, summed over its live threads.

    Reads /proc/self/task/*/schedstat (on-CPU ns, run-queue wait ns, timeslices). Where
    schedstat is missing (not Linux), the CPU time is os.times() and the delay is 0.
    """
    cpu_ns = wait_ns = 0
    found = False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                fields = f.read().split()
        except OSError:  # the thread exited meanwhile
            continue
        if len(fields) >= 2:
            cpu_ns += int(fields[0])
            wait_ns += int(fields[1])
            found = True
    where = {"host": socket.gethostname(), "cpus": _affinity()}
    if not found:
        t = os.times()
        return {"cpu_s": t.user + t.system, "runq_s": 0.0, "schedstat": False, **where}  # no run-queue delay known
    return {"cpu_s": cpu_ns / 1e9, "runq_s": wait_ns / 1e9, **where}


def _affinity() -> list:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_busy_s(cpus) -> Optional[float]:
    """Seconds the given CPUs spent busy since boot (/proc/stat: everything but idle and iowait); None off Linux."""
    wanted = {f"cpu{int(c)}" for c in cpus}
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            values = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
    return busy / float(ticks)


class ForeignLoad:
    """How much OTHER work ran on this machine's CPUs of the run, between readings.

    `update(procs)` takes {process name: proc_stats()} of the run (processes on other hosts are
    ignored) and returns (share since the last reading, share since the first), each
    (busy time of the run's CPUs - the run's own CPU time) / (number of CPUs x wall time),
    or NaN where /proc/stat cannot be read.
    """

    def __init__(self, host: Optional[str] = None):
        self.host = host or socket.gethostname()
        self.first = None
        self.last = None

    def _reading(self, procs: Mapping[str, Mapping]) -> Optional[tuple]:
        local = [v for v in procs.values() if v.get("host", self.host) == self.host]
        cpus = sorted({int(c) for v in local for c in v.get("cpus", [])}) or _affinity()
        busy = cpu_busy_s(cpus)
        if busy is None:
            return None
        return time.monotonic(), busy, sum(float(v.get("cpu_s", 0.0)) for v in local), len(cpus)

    @staticmethod
    def _share(a: tuple, b: tuple) -> float:
        wall = b[0] - a[0]
        if wall <= 0:
            return float("nan")
        foreign = max((b[1] - a[1]) - (b[2] - a[2]), 0.0)
        return min(foreign / (max(a[3], b[3]) * wall), 1.0)

    def update(self, procs: Mapping[str, Mapping]) -> tuple:
        now = self._reading(procs)
        if now is None:
            return float("nan"), float("nan")
        if self.first is None:
            self.first = self.last = now
            return float("nan"), float("nan")
        step, run = self._share(self.last, now), self._share(self.first, now)
        self.last = now
        return step, run


def contention(now: Mapping[str, Mapping[str, float]], before: Optional[Mapping[str, Mapping[str, float]]] = None) -> float:
    """Run-queue delay / (CPU time + run-queue delay) over the processes, between two readings.

    `now` and `before` map a process name to its proc_stats(); a process missing from
    `before` counts from zero. NaN when nothing ran, or when a process has no schedstat
    (`proc_stats` on a host without it: the delay is unknown, not 0).
    """
    before = before or {}
    if any(stats.get("schedstat") is False for stats in now.values()):  # a process without schedstat: unknown
        return float("nan")
    cpu = wait = 0.0
    for name, stats in now.items():
        prev = before.get(name, {})
        cpu += max(float(stats.get("cpu_s", 0.0)) - float(prev.get("cpu_s", 0.0)), 0.0)
        wait += max(float(stats.get("runq_s", 0.0)) - float(prev.get("runq_s", 0.0)), 0.0)
    total = cpu + wait
    return wait / total if total > 0 else float("nan")


@dataclass
class TrainingClock:
    """Wall-clock seconds of training only: starts on `start()`, paused by `pause()`/`resume()`.

    `base_s` is the training time a resumed run already had (from its checkpoint).
    """

    devices: int
    base_s: float = 0.0
    eval_base_s: float = 0.0
    startup_base_s: float = 0.0
    _started: Optional[float] = None
    _paused_at: Optional[float] = None
    _paused_total: float = 0.0
    _created: float = field(default_factory=time.time)
    _startup_s: float = 0.0

    def start(self) -> None:
        """The generators are ready: training time starts now (start-up before it is not billed)."""
        now = time.time()
        self._started = now
        self._startup_s = now - self._created

    @property
    def running(self) -> bool:
        return self._started is not None

    def pause(self) -> None:
        if self._started is not None and self._paused_at is None:
            self._paused_at = time.time()

    def resume(self) -> float:
        """End a pause; returns its length in seconds."""
        if self._paused_at is None:
            return 0.0
        length = time.time() - self._paused_at
        self._paused_total += length
        self._paused_at = None
        return length

    def wall_s(self, now: Optional[float] = None) -> float:
        """Training seconds so far (this session's, minus pauses, plus the checkpointed base)."""
        if self._started is None:
            return self.base_s
        now = time.time() if now is None else now
        paused = self._paused_total + ((now - self._paused_at) if self._paused_at is not None else 0.0)
        return self.base_s + max(now - self._started - paused, 0.0)

    def compute_hours(self, wall_s: Optional[float] = None) -> float:
        return (self.wall_s() if wall_s is None else wall_s) * self.devices / 3600.0

    def startup_s(self) -> float:
        """Start-up (and restart) seconds across every session of the run, never billed."""
        return self.startup_base_s + (self._startup_s if self._started is not None else time.time() - self._created)


def sequence_forward_flops(n_params: int, layers: int, attn_width: int, prompt_len: int, completion_len: int) -> float:
    """FLOPs of one forward pass over a sequence (prompt prefill + completion), per DESIGN.md.

    Matmuls: 2 x n_params per token. Causal attention: at position t (1-based) a query meets
    t keys, QK^T and AV cost 2 x attn_width flops each per (query, key) pair, per layer:
    4 x layers x attn_width x sum_{t=1..L} t = 2 x layers x attn_width x L (L + 1).
    """
    L = int(prompt_len) + int(completion_len)
    return 2.0 * n_params * L + 2.0 * layers * attn_width * L * (L + 1)


@dataclass
class FlopCounter:
    """Counts generation (1 forward) and training FLOPs of a model's shapes.

    Training is 3 forwards when every weight is trained: the forward, the gradient with respect
    to the activations, the gradient with respect to the weights (2N each per token; causal
    attention, which has no weights, 3 times its forward). With LoRA (`for_lora`) the frozen
    weights get no weight gradient and the adapters run beside them:
    2 (N + Na) forward + 2 (N + Na) activation gradient + 2 Na adapter gradient per token."""

    n_params: int  # parameters without the input embedding
    layers: int
    attn_width: int  # num_attention_heads x head_dim
    n_adapter: int = 0  # LoRA adapter parameters (A and B of every adapted layer)
    n_frozen: int = 0  # of n_params, those that get no gradient (with LoRA: all of them)

    @classmethod
    def from_model(cls, model) -> "FlopCounter":
        cfg = model.config
        emb = model.get_input_embeddings()
        n_emb = emb.weight.numel() if emb is not None else 0
        total = sum(p.numel() for p in model.parameters())  # a tied embedding / head matrix counts once
        head = model.get_output_embeddings()
        if emb is not None and head is not None and head.weight is emb.weight:
            total += n_emb  # the lookup is free, the head's matmul with the same matrix is not
        heads = int(getattr(cfg, "num_attention_heads"))
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(n_params=total - n_emb, layers=int(cfg.num_hidden_layers), attn_width=heads * head_dim)

    def for_lora(self, adapter_params: int) -> "FlopCounter":
        """This model with `adapter_params` LoRA parameters trained on its frozen weights."""
        return FlopCounter(self.n_params, self.layers, self.attn_width, n_adapter=int(adapter_params), n_frozen=self.n_params)

    def generation(self, prompt_len: int, completion_len: int) -> float:
        """One forward of the generators' model (LoRA: the merged weights, no adapters)."""
        return sequence_forward_flops(self.n_params, self.layers, self.attn_width, prompt_len, completion_len)

    def policy_forward(self, prompt_len: int, completion_len: int) -> float:
        """One no-grad forward of the trained policy (LoRA: its adapters included), e.g. for pi_old."""
        return sequence_forward_flops(self.n_params + self.n_adapter, self.layers, self.attn_width, prompt_len,
                                      completion_len)

    def training(self, prompt_len: int, completion_len: int) -> float:
        L = int(prompt_len) + int(completion_len)
        attention = sequence_forward_flops(0, self.layers, self.attn_width, prompt_len, completion_len)
        forward = 2.0 * (self.n_params + self.n_adapter) * L  # [tokens] x every matmul, adapters included
        weight_grads = 2.0 * (self.n_params - self.n_frozen + self.n_adapter) * L
        return 2.0 * forward + weight_grads + 3.0 * attention


def step_flop_terms(counter: FlopCounter, prompt_len: int, completion_len: int, *, epochs: int = 1,
                    reference: bool = False, old_pass: bool = False) -> list[float]:
    """The FLOPs one trained sequence costs a learner step, as the terms added to the run's count, in order.

    Per update epoch (train.update_epochs; the mini-batches of an epoch cover each sequence once): one
    training pass (forward + backward, `FlopCounter.training`) and, with a KL reference, its forward. Then,
    with `old_pass` (pi_old computed before the first update: a mismatch correction with several updates
    per step), one more forward. With one epoch and neither, [training], as before update epochs existed."""
    terms = []
    for _ in range(int(epochs)):
        terms.append(counter.training(prompt_len, completion_len))
        if reference:  # the KL reference (a copy, or LoRA adapters off): one more forward
            terms.append(counter.generation(prompt_len, completion_len))
    if old_pass:
        terms.append(counter.policy_forward(prompt_len, completion_len))
    return terms
