"""`scalerl sweep SPEC --adaptive`: run a sweep rung by rung and stop the configurations that have lost.

Every configuration × seed starts with the first rung's share of the sweep's compute budget
(`train.compute_budget_flops`: the tiny scale binds it, a paper-scale sweep must set it). After a
rung the rule of `analysis.adaptive.decide_rung` compares every configuration with the current
best, paired by seed: `worse` stops a loser, `equivalent` stops a tie (`--keep-equivalent` keeps
it), the best and the inconclusive go on. A run that goes on is resumed from its own checkpoint in
its own run directory with the next rung's budget, so its curve continues (no step is recomputed
or repeated). At the last rung whatever is left runs to the full budget.

Every decision is a line of `<sweep dir>/adaptive.jsonl` (rung, configuration, the best, the
evidence: delta, interval, n, paired, which metric; the verdict and the action). Re-running the
same command continues at the rung it was in and never re-decides a recorded stop: a rung whose
decisions are in the file is done, and a stopped configuration is never submitted again.
`scalerl status` shows a stopped configuration as `stopped (rung r: worse than X by d [lo, hi])`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

from experiments.sweep_spec import BUDGET_KEY, budget_of

__all__ = ["ADAPTIVE_FILE", "AdaptiveError", "read_decisions", "stopped_configs", "budget_of", "run_adaptive",
           "stop_text"]

ADAPTIVE_FILE = "adaptive.jsonl"


class AdaptiveError(ValueError):
    """An adaptive sweep cannot start (no compute budget, bad rungs); nothing was submitted."""


def read_decisions(sweep_dir: Path) -> list[dict]:
    """Every decision recorded in `<sweep dir>/adaptive.jsonl`, in order (a torn last line is skipped)."""
    from analysis.runs import read_jsonl

    rows, _ = read_jsonl(Path(sweep_dir) / ADAPTIVE_FILE)
    return rows


def stopped_configs(sweep_dir: Path) -> dict[str, dict]:
    """configuration -> the decision that stopped it."""
    return {d["config"]: d for d in read_decisions(sweep_dir) if d.get("action") == "stop"}


def stop_text(decision: dict) -> str:
    """'stopped (rung 0.25: worse than cispo by -0.120 [-0.150, -0.090])' for `scalerl status`."""
    what = "worse than" if decision.get("verdict") == "worse" else "equivalent to"
    d, lo, hi = decision.get("delta"), decision.get("low"), decision.get("high")
    ev = f" by {d:+.3f} [{lo:+.3f}, {hi:+.3f}]" if None not in (d, lo, hi) else ""
    return f"stopped (rung {decision['rung']:g}: {what} {decision['best']}{ev})"


def _append(sweep_dir: Path, rows: Sequence[dict]) -> None:
    """A rung's decisions in ONE write (a crash cannot leave half a rung recorded), synced."""
    import os

    with open(Path(sweep_dir) / ADAPTIVE_FILE, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def _reopen(run_dir: Path, rung: float) -> None:
    """A run that finished the previous rung's budget is marked to go on: the trainer resumes it
    from its latest checkpoint instead of returning at once for a done run."""
    from experiments.run_state import read_json, write_json_atomic

    path = run_dir / "run.json"
    info = read_json(path) or {}
    if info.get("status") == "done":
        info.update(status="interrupted", adaptive=f"continues to rung {rung:g} of the adaptive sweep")
        write_json_atomic(path, info)


def _evidence(sweep_dir: Path, configs: set[str], rung: float, budget: float, compute: str):
    """config -> seed -> analysis.adaptive.Evidence of the runs of `configs` cut at rung × budget."""
    from analysis.adaptive import rung_evidence, sweep_curves
    from analysis.runs import load_runs

    ev, runs = load_runs(sweep_dir, what="eval"), load_runs(sweep_dir, what="runs")
    curves, cfg, seed, ep1 = sweep_curves(ev, runs[runs["config"].isin(configs)], compute)
    out: dict[str, dict] = {}
    for path, e in rung_evidence(curves, budget, rung, ep1).items():
        out.setdefault(cfg[path], {})[seed[path]] = e
    return out


def run_adaptive(spec: Any, runs: Sequence[Any], opts: Any, root: Path, *, rungs: Sequence[float],
                 equivalence: float, keep_equivalent: bool, console: Any, poll_s: float = 10.0,
                 retry_failed: bool = False) -> int:
    """Run `runs` (one sweep, expanded) rung by rung; 0 when every rung is decided, 1 on a failed run
    (re-running the same command goes on from there), 2 when the sweep cannot be adaptive."""
    from analysis.adaptive import decide_rung, parse_rungs, stop_level
    from analysis.runs import config_name
    from experiments.run_state import Planned, plan
    from experiments.submission import submit, wait

    rungs = parse_rungs(rungs)
    budgets = {budget_of(r.bindings) for r in runs}
    if len(budgets) != 1 or None in budgets:
        raise AdaptiveError(f"an adaptive sweep needs one compute budget for every run ({BUDGET_KEY}; the tiny scale "
                            f"sets it); got {sorted(str(b) for b in budgets)}: add --gin '{BUDGET_KEY} = <FLOPs>'")
    budget = budgets.pop()
    sweep_dir = Path(root) / spec.name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    configs = list(dict.fromkeys(config_name(r.name) for r in runs))
    level = stop_level(len(configs), sum(1 for r in rungs if r < 1.0))
    decided = {float(d["rung"]) for d in read_decisions(sweep_dir)}
    stopped = set(stopped_configs(sweep_dir))
    for rung in rungs:
        if rung in decided:
            console.print(f"rung {rung:g}: decided before ({ADAPTIVE_FILE}); "
                          f"stopped so far: {', '.join(sorted(stopped)) or 'none'}", highlight=False)
            continue
        alive = [r for r in runs if config_name(r.name) not in stopped]
        cut = rung * budget
        rung_runs = [dataclasses.replace(r, bindings=tuple(r.bindings) + (f"{BUDGET_KEY} = {cut:g}",)) for r in alive]
        planned = []
        for p in plan(rung_runs, root, retry_failed=retry_failed):
            logged = _logged_flops(p.run_dir)
            if p.action == "skip-done" and logged is not None and logged < cut * (1 - 1e-9):
                _reopen(p.run_dir, rung)  # finished the previous rung: goes on from its checkpoint
                p = Planned(p.run, p.run_dir, "resume", f"continues from its checkpoint to rung {rung:g}")
            planned.append(p)
        console.print(f"rung {rung:g} ({cut:.3g} FLOPs): {sum(not p.action.startswith('skip') for p in planned)} of "
                      f"{len(planned)} runs to train", highlight=False)
        submitted = submit(planned, opts, root, spec.name)
        outcomes = wait(submitted, poll_s=poll_s) if submitted else {}
        failed = {k: v for k, v in outcomes.items() if v[0] != "done"}
        if failed:
            for name, (_, err) in failed.items():
                console.print(f"[red]{name} failed:[/red] {err}")
            console.print(f"rung {rung:g} not decided: {len(failed)} run(s) failed; the same command goes on from here "
                          "(--retry-failed to train them again)")
            return 1
        short = _not_at(root, spec.name, alive, cut)
        if short:  # still queued or running elsewhere, failed before, or cut short: decide on whole rungs only
            console.print(f"rung {rung:g} not decided: {len(short)} run(s) have not reached {cut:.3g} FLOPs ("
                          + ", ".join(short[:8]) + (" ..." if len(short) > 8 else "") + "); the same command goes on "
                          "from here once they have (--retry-failed trains failed ones again)", highlight=False)
            return 1
        evidence = _evidence(sweep_dir, {config_name(r.name) for r in alive}, rung, budget, "flops")
        decisions = decide_rung(evidence, rung, equivalence=equivalence, keep_equivalent=keep_equivalent, level=level)
        _append(sweep_dir, [{**d.as_dict(), "budget": budget, "cut": cut, "equivalence": equivalence}
                            for d in decisions])
        for d in decisions:
            console.print(d.text(), highlight=False)
            if d.action == "stop":
                stopped.add(d.config)
    return 0


def _not_at(root: Path, sweep: str, runs: Sequence[Any], cut: float) -> list[str]:
    """The runs (names, with why) that have not finished this rung: not done, or short of its FLOPs."""
    from experiments.run_state import read_json

    out = []
    for r in runs:
        run_dir = Path(root) / sweep / r.name
        status = (read_json(run_dir / "run.json") or {}).get("status")
        flops = _logged_flops(run_dir)
        if status != "done":
            out.append(f"{r.name} ({status or 'not started'})")
        elif flops is None or flops < cut * (1 - 1e-9):
            out.append(f"{r.name} (at {flops or 0:.3g} FLOPs)")
    return out


def _logged_flops(run_dir: Path) -> float | None:
    from analysis.runs import read_jsonl

    rows, _ = read_jsonl(Path(run_dir) / "metrics.jsonl")
    x = rows[-1].get("flops") if rows else None
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
