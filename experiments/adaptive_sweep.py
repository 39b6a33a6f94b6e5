"""`scalerl sweep SPEC --adaptive`: run a sweep rung by rung and stop the configurations that have lost.

Every configuration × seed starts with the first rung's share of the sweep's compute budget
(`train.compute_budget_flops`: the tiny scale binds it, a paper-scale sweep must set it). After a
rung the rule of `analysis.adaptive.decide_rung` (`--stop-rule tail|law|both`) compares every
configuration with the current leader on its OWN paired interval over the seeds both ran (Holm
over the rung's comparisons; never noise pooled from other pairs): `worse` stops a loser,
`equivalent` stops a tie (`--keep-equivalent` keeps it); under the law rule, a configuration whose
calibrated predicted end lies below the leader's lower bound stops. The leader and the
inconclusive go on. A run that goes on is resumed from its own checkpoint in its own run
directory with the next rung's budget, so its curve continues (no step is recomputed or
repeated). At the last rung whatever is left runs to the full budget; `--stop-when-decided` ends
the sweep as soon as one configuration is left (its winner is then not trained to the end).

Before anything is submitted (`check_adaptive`, also on `--dry-run`): the sweep must have one
compute budget for every run, and at least two seeds shared by every configuration (a stop rests
on per-seed differences); the dry run prints each rung's budget per run and per configuration
(`rung_budgets`).

Every decision is a line of `<sweep dir>/adaptive.jsonl` (rung, the pair compared, n, the
interval and its level, the rule, the metric, the verdict and the action). Re-running the same
command continues at the rung it was in and never re-decides a recorded stop: a rung whose
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
           "stop_text", "check_adaptive", "rung_budgets", "print_rung_budgets", "MIN_PAIRED_SEEDS"]

ADAPTIVE_FILE = "adaptive.jsonl"
MIN_PAIRED_SEEDS = 2  # a paired interval needs two per-seed differences


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
    """'stopped (rung 0.25: worse than cispo by -0.120 [-0.150, -0.090])' for `scalerl status`; a stop
    by the law says so ('..., predicted by the law')."""
    what = "worse than" if decision.get("verdict") == "worse" else "equivalent to"
    d, lo, hi = decision.get("delta"), decision.get("low"), decision.get("high")
    ev = f" by {d:+.3f} [{lo:+.3f}, {hi:+.3f}]" if None not in (d, lo, hi) else ""
    law = ", predicted by the law" if str(decision.get("rule", "")).startswith("law") else ""
    return f"stopped (rung {decision['rung']:g}: {what} {decision['best']}{ev}{law})"


def check_adaptive(runs: Sequence[Any], rungs: Sequence[float], *, seeds_flag: str = "--seeds") -> float:
    """Refuse an adaptive sweep that cannot work, before anything is submitted (and on --dry-run):
    every run needs the same compute budget (`train.compute_budget_flops`; the tiny scale binds it,
    a paper-scale sweep must set it), and every configuration at least MIN_PAIRED_SEEDS seeds that
    every other configuration also runs (a stop rests on the per-seed differences of the pair).
    Returns the budget; raises AdaptiveError saying what to add."""
    from analysis.adaptive import parse_rungs
    from analysis.runs import config_name

    parse_rungs(rungs)
    budgets = {budget_of(r.bindings) for r in runs}
    if len(budgets) != 1 or None in budgets:
        raise AdaptiveError(f"an adaptive sweep needs one compute budget for every run ({BUDGET_KEY}; the tiny scale "
                            f"sets it, a paper-scale sweep must); got {sorted(str(b) for b in budgets)}: add "
                            f"--gin '{BUDGET_KEY} = <FLOPs>'. Nothing submitted.")
    seeds: dict[str, set] = {}
    for r in runs:
        seeds.setdefault(config_name(r.name), set()).add(r.seed)
    if len(seeds) < 2:
        raise AdaptiveError(f"an adaptive sweep compares configurations; this one has {len(seeds)} "
                            f"({', '.join(seeds) or 'none'}). Nothing submitted.")
    shared = set.intersection(*seeds.values())
    if len(shared) < MIN_PAIRED_SEEDS:
        per = ", ".join(f"{c}: {sorted(s)}" for c, s in seeds.items())
        raise AdaptiveError(f"an adaptive sweep stops a configuration only on its own paired interval against the "
                            f"leader, over the seeds both ran: it needs >= {MIN_PAIRED_SEEDS} seeds shared by every "
                            f"configuration, and this sweep has {len(shared)} ({per}); with one seed nothing can ever "
                            f"be stopped. Add seeds, e.g. {seeds_flag} 0 1 2. Nothing submitted.")
    return float(budgets.pop())


def rung_budgets(runs: Sequence[Any], rungs: Sequence[float], budget: float) -> list[dict]:
    """Per rung: its share, the FLOPs each run trains to, the runs, and per configuration the FLOPs
    its seeds use by then (every configuration still running)."""
    from analysis.runs import config_name

    per_config: dict[str, int] = {}
    for r in runs:
        per_config[config_name(r.name)] = per_config.get(config_name(r.name), 0) + 1
    out = []
    for rung in rungs:
        out.append({"rung": float(rung), "flops_per_run": rung * budget, "runs": len(runs),
                    "configs": {c: n * rung * budget for c, n in per_config.items()}})
    return out


def print_rung_budgets(runs: Sequence[Any], rungs: Sequence[float], budget: float, console: Any, *,
                       stop_rule: str, finish_leader: bool) -> None:
    """The dry run's table of rung budgets: what each configuration has used by each rung if it is
    still running, and the bounds of the sweep's compute."""
    from rich.table import Table

    rows = rung_budgets(runs, rungs, budget)
    configs = list(rows[0]["configs"]) if rows else []
    t = Table(title=f"adaptive rungs ({stop_rule} rule; budget W = {budget:.4g} FLOPs per run)")
    for head in ("rung", "FLOPs per run", *[f"{c} (all seeds)" for c in configs]):
        t.add_column(head, overflow="fold")
    for row in rows:
        t.add_row(f"{row['rung']:g} W", f"{row['flops_per_run']:.4g}", *[f"{row['configs'][c]:.4g}" for c in configs])
    console.print(t)
    full = len(runs) * budget
    n_cfg = len(configs)
    lead = sum(1 for r in runs) / max(n_cfg, 1)
    least = (full - lead * budget) * rungs[0] + lead * budget * (rungs[0] if not finish_leader else 1.0)
    console.print(f"full sweep: {full:.4g} FLOPs ({len(runs)} runs x {budget:.4g}); adaptive: at most that (nothing "
                  f"stopped), at least {least:.4g} ({least / full:.0%}: every configuration but the leader stopped at "
                  f"the first rung{'' if finish_leader else ', and the sweep decided there'})", highlight=False)


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
    from components.trainer.run_owner import reopen

    reopen(run_dir, adaptive=f"continues to rung {rung:g} of the adaptive sweep")


def _evidence(sweep_dir: Path, sweep: str, configs: set[str], rung: float, budget: float, compute: str, *,
              law: bool = False):
    """config -> seed -> analysis.adaptive.Evidence of the runs of `configs` cut at rung × budget (with
    law: each run's calibrated prediction of its tail at the budget, its fit starting where the
    sweep's protocol starts one)."""
    from analysis.adaptive import _protocol_start, rung_evidence, sweep_curves
    from analysis.runs import load_runs

    ev, runs = load_runs(sweep_dir, what="eval"), load_runs(sweep_dir, what="runs")
    curves, cfg, seed = sweep_curves(ev, runs[runs["config"].isin(configs)], compute)
    out: dict[str, dict] = {}
    for path, e in rung_evidence(curves, budget, rung, law=law, min_fraction=_protocol_start(sweep)).items():
        out.setdefault(cfg[path], {})[seed[path]] = e
    return out


def run_adaptive(spec: Any, runs: Sequence[Any], opts: Any, root: Path, *, rungs: Sequence[float],
                 equivalence: float, keep_equivalent: bool, console: Any, poll_s: float = 10.0,
                 retry_failed: bool = False, stop_rule: str | None = None, finish_leader: bool = True) -> int:
    """Run `runs` (one sweep, expanded) rung by rung; 0 when every rung is decided, 1 on a failed run
    (re-running the same command goes on from there), 2 when the sweep cannot be adaptive."""
    from analysis.adaptive import DEFAULT_STOP_RULE, Decision, decide_rung, parse_rungs, parse_stop_rule
    from analysis.runs import config_name
    from experiments.run_settings import check_planned
    from experiments.run_state import Planned, plan
    from experiments.submission import submit, wait

    rungs = parse_rungs(rungs)
    stop_rule = parse_stop_rule(stop_rule or DEFAULT_STOP_RULE)
    budget = check_adaptive(runs, rungs)
    sweep_dir = Path(root) / spec.name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    n_early = sum(1 for r in rungs if r < 1.0)
    recorded = read_decisions(sweep_dir)
    decided = {float(d["rung"]) for d in recorded}
    stopped = set(stopped_configs(sweep_dir))
    if any(d.get("rule", "").startswith("decided") for d in recorded):
        console.print(f"the sweep was decided before ({ADAPTIVE_FILE}): nothing to run", highlight=False)
        return 0
    for rung in rungs:
        if rung in decided:
            console.print(f"rung {rung:g}: decided before ({ADAPTIVE_FILE}); "
                          f"stopped so far: {', '.join(sorted(stopped)) or 'none'}", highlight=False)
            continue
        alive = [r for r in runs if config_name(r.name) not in stopped]
        cut = rung * budget
        rung_runs = [dataclasses.replace(r, bindings=tuple(r.bindings) + (f"{BUDGET_KEY} = {cut:g}",)) for r in alive]
        planned = []
        # each rung extends its runs' budget; any other setting that differs from a run's recorded one is refused
        rung_plan = check_planned(plan(rung_runs, root, retry_failed=retry_failed), _rung_configs(rung_runs),
                                  extend=True)
        refused = [p for p in rung_plan if p.action == "skip-refused"]
        for p in refused:
            console.print(f"[red]{p.run.name} refused:[/red] {p.reason}", highlight=False)
        if refused:
            console.print(f"rung {rung:g} not decided: {len(refused)} run(s) ran with other settings (their directories "
                          "are left as they were); re-run with the settings they recorded, or another --runs directory",
                          highlight=False)
            return 1
        for p in rung_plan:
            logged = _logged_flops(p.run_dir)
            if p.action == "skip-done" and logged is not None and logged < cut * (1 - 1e-9):
                _reopen(p.run_dir, rung)  # finished the previous rung: goes on from its checkpoint
                p = Planned(p.run, p.run_dir, "resume", f"continues from its checkpoint to rung {rung:g}", extend=True)
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
        evidence = _evidence(sweep_dir, spec.name, {config_name(r.name) for r in alive}, rung, budget, "flops",
                             law=stop_rule in ("law", "both"))
        decisions = decide_rung(evidence, rung, n_early_rungs=n_early, equivalence=equivalence,
                                keep_equivalent=keep_equivalent, stop_rule=stop_rule)
        left = {d.config for d in decisions if d.action != "stop"}
        if not finish_leader and rung < 1.0 and len(left) == 1:  # decided: nothing is left to compare with
            (leader,) = left
            decisions.append(Decision(rung, leader, leader, "measured tail", None, "best", "done",
                                      rule="decided: every other configuration stopped (--stop-when-decided)"))
        _append(sweep_dir, [{**d.as_dict(), "budget": budget, "cut": cut, "equivalence": equivalence,
                             "stop_rule": stop_rule} for d in decisions])
        for d in decisions:
            console.print(d.text(), highlight=False)
            if d.action == "stop":
                stopped.add(d.config)
        if decisions[-1].rule.startswith("decided"):
            console.print(f"the sweep is decided at rung {rung:g}: {decisions[-1].config}", highlight=False)
            return 0
    return 0


def _rung_configs(rung_runs: Sequence[Any]) -> dict:
    """{run name: RunConfig} of a rung's runs (their settings, the rung's budget included); {} when the
    trainer target's configs cannot be parsed here (a stand-in trainer): nothing is compared then."""
    from experiments.run_config import parse_run_configs

    return {name: rc for name, rc in parse_run_configs(rung_runs).items() if rc is not None}


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
