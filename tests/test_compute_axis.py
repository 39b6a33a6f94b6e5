"""A compute axis that measures the run, not the machine (issue 12, item 1).

The same deterministic run (ppo_off_policy(1), fixed seed: the same samples, the same work) is
trained alone and beside a CPU hog on this 2-core machine. The hog is seen: `contention` (other
work on the run's CPUs) goes from ~0 to ~0.4, flagged > 0.10. Neither axis is contention-proof
here: the paper's `compute_hours` (devices x training wall-clock) moves by up to x1.74, and
`cpu_hours` (the run's CPU time), which stayed within 6% on 2026-11-22, measured x0.79-1.21 on
2026-11-23 (BENCHMARKS.md). So runs reserve their cores, and contended runs are flagged and re-run.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from _helpers_trainer import read_jsonl, tiny_model, write_gin


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


def test_contention_of_a_reading():
    from components.trainer.accounting import contention, proc_stats

    before = {"a": {"cpu_s": 1.0, "runq_s": 0.5}}
    now = {"a": {"cpu_s": 3.0, "runq_s": 1.5}, "b": {"cpu_s": 1.0, "runq_s": 0.0}}
    assert contention(now, before) == pytest.approx(1.0 / (3.0 + 1.0))
    stats = proc_stats()
    assert stats["cpu_s"] > 0 and stats["runq_s"] >= 0 and stats["cpus"] and stats["host"]


def _cpu_s_of(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (/proc/<pid>/stat)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hog_on(cpus) -> subprocess.Popen:
    import os

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(hog.pid, cpus)
    return hog


def _until(cpu_s, target: float, limit_s: float = 20.0) -> None:
    """Wait until `cpu_s()` (seconds of CPU some work has had) reaches `target`: on a busy machine
    the work gets less of its CPU per second, so the window stretches, up to `limit_s`."""
    end = time.monotonic() + limit_s
    while cpu_s() < target and time.monotonic() < end:
        time.sleep(0.05)


def test_foreign_load_sees_a_hog_and_not_the_run_itself():
    """Busy time of the run's CPUs minus the run's own CPU time. Measured against what actually
    ran on the (pinned) CPU in the same windows, so it holds beside other work: our own busy loop
    is not counted as foreign (the share stays below the CPU's busy share by at least half of ours),
    a hog in another process is (at least most of the hog's CPU share), and the run's share lies
    between the two windows'. The windows last until each worker had 0.3 s of CPU."""
    import os

    from components.trainer.accounting import ForeignLoad, cpu_busy_s, proc_stats

    saved = os.sched_getaffinity(0)
    cpu = sorted(saved)[:1]
    os.sched_setaffinity(0, cpu)  # one CPU, so the numbers are not diluted by the other core
    try:
        def me():
            return {"learner-0": {**proc_stats(), "cpus": cpu}}

        load = ForeignLoad()
        load.update(me())
        t0, busy0, mine0 = time.monotonic(), cpu_busy_s(cpu), time.process_time()
        while time.process_time() - mine0 < 0.3 and time.monotonic() - t0 < 20:  # our own work
            sum(i * i for i in range(1000))
        busy, mine = cpu_busy_s(cpu) - busy0, time.process_time() - mine0
        own, _ = load.update(me())
        wall_own = time.monotonic() - t0
        hog = _hog_on(cpu)
        try:
            t1 = time.monotonic()
            _until(lambda: _cpu_s_of(hog.pid), 0.3)  # we sleep, the hog runs on our CPU
            hog_s = _cpu_s_of(hog.pid)
            foreign, run = load.update(me())
            wall_hog = time.monotonic() - t1
        finally:
            hog.kill()
            hog.wait()
    finally:
        os.sched_setaffinity(0, saved)
    assert mine > 0.2 and hog_s > 0.2, (mine, hog_s)  # each had the CPU (else nothing is measured)
    assert own <= busy / wall_own - 0.5 * mine / wall_own, (own, busy / wall_own, mine / wall_own)
    assert foreign >= 0.7 * hog_s / wall_hog, (foreign, hog_s / wall_hog)
    assert min(own, foreign) <= run <= max(own, foreign), (own, run, foreign)


def test_training_clock_pauses_and_resumes():
    from components.trainer.accounting import TrainingClock

    clock = TrainingClock(devices=2, base_s=10.0)
    assert clock.wall_s() == 10.0  # not started: start-up is not billed
    clock.start()
    time.sleep(0.05)
    clock.pause()
    paused_at = clock.wall_s()
    time.sleep(0.1)
    assert clock.wall_s() == pytest.approx(paused_at, abs=1e-3)
    assert clock.resume() >= 0.1
    assert clock.compute_hours(3600.0) == 2.0


def test_flops_count_attention_and_prefill_but_not_the_embedding():
    from components.trainer.accounting import FlopCounter, sequence_forward_flops

    # 2 N per token + 4 x layers x width per (query, key) pair, summed over the causal triangle
    n, layers, width, p, c = 1000, 2, 8, 3, 4
    pairs = sum(t for t in range(1, p + c + 1))
    assert sequence_forward_flops(n, layers, width, p, c) == 2 * n * (p + c) + 4 * layers * width * pairs
    fc = FlopCounter(n_params=n, layers=layers, attn_width=width)
    assert fc.training(p, c) == 3 * fc.generation(p, c)
    assert fc.generation(10, 1) > fc.generation(1, 1)  # prefill is counted


def test_lora_training_flops_skip_the_frozen_weight_gradients():
    """LoRA: forward and activation gradient through base + adapters, weight gradients for the adapters
    only; attention 3x its forward either way; the generators' forward (merged weights) unchanged."""
    from components.trainer.accounting import FlopCounter

    n, na, layers, width, p, c = 1000, 100, 2, 8, 3, 5
    L = p + c
    attention = 4 * layers * width * sum(range(1, L + 1))  # one forward's QK^T and AV
    full = FlopCounter(n_params=n, layers=layers, attn_width=width)
    lora = full.for_lora(na)
    assert full.training(p, c) == 6 * n * L + 3 * attention
    assert lora.training(p, c) == 4 * (n + na) * L + 2 * na * L + 3 * attention  # 43,712 against 54,912
    assert lora.generation(p, c) == full.generation(p, c)


def test_flops_count_a_tied_head_matmul(tmp_path):
    """Tied embeddings: the input lookup is free, the LM head's matmul with the same matrix is not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.trainer.accounting import FlopCounter

    kw = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    tied = FlopCounter.from_model(LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **kw)))
    untied = FlopCounter.from_model(LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **kw)))
    assert tied.n_params == untied.n_params  # the same matmuls
    body = sum(p.numel() for n, p in LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **kw)).named_parameters()
               if "embed_tokens" not in n)
    assert untied.n_params == body


def _run(tmp_path, name: str) -> list[dict]:
    """150 steps (~7 s of training): at 60 steps (~3 s) the run-to-run noise of cpu_hours alone
    was about ±8%, on top of the ~8% less CPU the same run takes beside the hog on 2 cores."""
    from experiments.train import run_training

    gin_file = write_gin(tmp_path / f"{name}.gin", tiny_model(tmp_path.parent / "model"), train__total_steps="150",
                         train__eval_every="100", train__checkpoint_every="100", train__max_tokens="12",
                         train__prompts_per_step="8", train__micro_batch_size="32")
    assert run_training([gin_file], [], str(tmp_path / name), progress=False) == "done"
    return read_jsonl(tmp_path / name / "metrics.jsonl")


def _busiest_processes(window_s: float) -> list[str]:
    """'pid name: share of one CPU' of the 3 busiest processes over the next window_s seconds (/proc)."""
    import os

    def cpu_ticks() -> dict:
        ticks = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            ticks[pid] = (name, int(fields[11]) + int(fields[12]))  # utime + stime
        return ticks

    before = cpu_ticks()
    time.sleep(window_s)
    hz = os.sysconf("SC_CLK_TCK")
    used = sorted(((t - before[pid][1]) / hz / window_s, f"{pid} {name}") for pid, (name, t) in cpu_ticks().items()
                  if pid in before)
    return [f"{who}: {share:.2f}" for share, who in used[::-1][:3]]


def _wait_until_quiet(limit_s: float = 60.0, below: float = 0.05) -> None:
    """The 'alone' run must run alone: wait until the machine's busy share (this process sleeps, so all
    of it is foreign) stays under `below` for a second, e.g. for processes left by earlier tests to end.
    If it never does, fail naming the busiest processes rather than blame the compute axis."""
    import os

    from components.trainer.accounting import cpu_busy_s

    cpus = sorted(os.sched_getaffinity(0))
    deadline, share = time.time() + limit_s, 1.0
    while time.time() < deadline:
        b0, t0 = cpu_busy_s(cpus), time.time()
        time.sleep(1.0)
        share = (cpu_busy_s(cpus) - b0) / ((time.time() - t0) * len(cpus))
        if share < below:
            return
    pytest.fail(f"the machine never went quiet for the 'alone' run: busy share {share:.2f} of {len(cpus)} CPUs "
                f"after {limit_s:.0f} s; busiest: {', '.join(_busiest_processes(1.0))}")


def test_busiest_processes_names_a_hog():
    """The hog's share is measured over the same window, so this holds beside other work: the hog
    is named with its share, or else every process named was busier than it. The window lasts
    until the hog had 0.3 s of CPU (longer on a busy machine)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        start = _cpu_s_of(hog.pid)
        t0 = time.monotonic()
        _until(lambda: _cpu_s_of(hog.pid) - start, 0.05, limit_s=5.0)  # its rate, to size the window
        rate = max((_cpu_s_of(hog.pid) - start) / (time.monotonic() - t0), 0.015)
        window = min(0.3 / rate, 20.0)
        before, t0 = _cpu_s_of(hog.pid), time.monotonic()
        busiest = _busiest_processes(window)
        truth = (_cpu_s_of(hog.pid) - before) / (time.monotonic() - t0)
    finally:
        hog.kill()
        hog.wait()
    named = {who.split(" ")[0]: float(who.rsplit(": ", 1)[1]) for who in busiest}
    assert truth > 0.01 and len(named) == 3, (truth, busiest)
    if str(hog.pid) in named:
        assert abs(named[str(hog.pid)] - truth) <= 0.05 + 0.2 * truth, (truth, busiest)
    else:
        assert min(named.values()) >= truth - 0.05, (truth, busiest)


FAST_TESTS_BESIDE_HOGS_S = 600


@pytest.mark.slow
def test_the_fast_tests_here_pass_beside_a_cpu_hog():
    """A busy machine (a hog on every CPU this process may use) does not fail this file's fast
    tests: they run in a pytest subprocess beside the hogs, which must have run meanwhile."""
    import os
    from pathlib import Path

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", __file__],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=FAST_TESTS_BESIDE_HOGS_S)
        hog_cpu = sum(_cpu_s_of(h.pid) for h in hogs)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "deselected" in proc.stdout, proc.stdout[-2000:]
    assert hog_cpu > 1.0, f"the hogs had {hog_cpu:.1f} s of CPU: the machine was not busy"


@pytest.mark.slow
def test_compute_stays_put_beside_a_cpu_hog_and_the_hog_is_flagged(tmp_path):
    for attempt in range(3):  # a neighbour that starts during the 'alone' run shows as contention: run it again
        _wait_until_quiet()
        alone = _run(tmp_path, f"alone{attempt}")
        if alone[-1]["contention_run"] < 0.10:
            break
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        beside = _run(tmp_path, "beside")
    finally:
        hog.kill()
        hog.wait()
    a, b = alone[-1], beside[-1]
    assert [m["reward_mean"] for m in alone] == [m["reward_mean"] for m in beside]  # the same work
    ratio = b["cpu_hours"] / a["cpu_hours"]
    print(f"beside a CPU hog / alone: cpu_hours x{ratio:.2f}, compute_hours x{b['compute_hours'] / a['compute_hours']:.2f}; "
          f"contention {a['contention_run']:.2f} -> {b['contention_run']:.2f}")
    assert a["contention_run"] < 0.10, "a run alone must not be flagged"
    assert b["contention_run"] > 0.25, "the hog must show as contention (flagged above 0.10)"
    # cpu_hours is NOT asserted within 15%: on this 2-vCPU machine the same run's CPU time beside
    # one hog measured x0.79-1.21 of alone over 2026-11-23 (cache and sibling-thread effects, pinned
    # or not; BENCHMARKS.md "Compute axis beside a CPU hog"), so no axis here is contention-proof;
    # the project flags (above) and re-runs contended runs instead (tests/test_reproduce.py)
    assert 0.5 < ratio < 2.0, f"cpu_hours x{ratio:.2f}: the same work should cost about the same CPU time"
