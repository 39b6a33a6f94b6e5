"""The small testbed's pilot, judged against its pre-registered criteria
(experiments/sweeps/pilots/small_criteria.md): one table per candidate and seed, and the pick.

    python benchmarks/small_pilot.py runs/pilot_small/small_pilot            # markdown for BENCHMARKS.md
    python benchmarks/small_pilot.py runs/pilot_small/small_pilot --json
    python benchmarks/small_pilot.py results/small --study             # the same criteria on the study's baseline

Each run type is a variant of experiments/sweeps/pilots/small.gin: <candidate>-S (ScaleRL, full
budget), -B (baseline, a quarter), -BH (baseline + FP32 head), -BK (baseline + PPO-off-policy-8).
Meters come from the run table (analysis/meters.py); the fit from analysis.scaling_law (the whole-run
protocol: from 0.4 of the run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.compare import tail_values  # noqa: E402
from analysis.protocol import fit_with_protocol  # noqa: E402
from analysis.runs import load_runs, run_curve  # noqa: E402
from analysis.scaling_law import profile_A  # noqa: E402

PILOT_SPEC = Path(__file__).resolve().parents[1] / "experiments" / "sweeps" / "pilots" / "small.gin"
CRITERIA = [  # (id, text, test, the measurements it reads)
    ("1", "completion_tokens_p50 >= 48", lambda m: m["p50"] >= 48, ("p50",)),
    ("2", "p90 / p10 >= 3", lambda m: m["p90"] / m["p10"] >= 3, ("p90", "p10")),
    ("3", "step-0 pass rate in [0.05, 0.50], no smoothing / noise",
     lambda m: 0.05 <= m["r0"] <= 0.50 and m["clean_warm"], ("r0",)),
    ("4", "tail in [0.40, 0.75]", lambda m: 0.40 <= m["tail"] <= 0.75, ("tail",)),
    ("5", "A < 0.95 and identified", lambda m: m["A_identified"] and m["A"] < 0.95, ("A",)),
    ("6", "vocab >= 4096 and FP32 head shrinks the gap >= 30% (mean over seeds)", None, ("gap_b", "gap_bh")),
    ("7", "PPO-off-policy-8 lag_max = 7", lambda m: m["bk_lag_max"] == 7, ("bk_lag_max",)),
    ("8", "PipelineRL-8 lag_max >= 4", lambda m: m["s_lag_max"] >= 4, ("s_lag_max",)),
    ("9", "DAPO clips >= 1% (low + high)", lambda m: m["b_clip"] >= 0.01, ("b_clip",)),
    ("10", "S run <= 10 minutes", lambda m: m["minutes"] <= 10.0, ("minutes",)),
]


def _measured(m: dict, keys) -> bool:
    """Whether a seed has every measurement a criterion reads (a study's fifth ScaleRL seed has no
    fp32_head or off_policy run: criteria 6, 7 and 9 are not measured on it, not failed)."""
    return all(not (isinstance(m[k], float) and math.isnan(m[k])) for k in keys)


def _minutes(run_dir: Path) -> float:
    info = json.loads((run_dir / "run.json").read_text())
    a, b = (dt.datetime.fromisoformat(info[k]) for k in ("started", "finished"))
    return (b - a).total_seconds() / 60.0


def _warm_settings(run_dir: Path) -> dict:
    text = (run_dir / "config.gin").read_text()
    def bound(key: str) -> float:
        m = re.search(rf"^warm_start\.{key} = ([0-9.e-]+)$", text, re.M)
        return float(m.group(1)) if m else math.nan
    return {"label_smoothing": bound("label_smoothing"), "label_noise": bound("label_noise")}


# the study's runs that play the pilot's roles (results/small): S the ScaleRL seeds; B, BH the
# fp32_head sweep's baseline without / with the FP32 head; BK the off_policy sweep's PPO-off-policy-8
STUDY_ROLES = {"S": "scalerl_seeds/scalerl-s{seed}", "B": "fp32_head/bf16-s{seed}",
               "BH": "fp32_head/bf16_fp32_head-s{seed}", "BK": "off_policy/ppo_off_policy-k8-s{seed}"}


def _measure_one(root: Path, table, ev, run: str, key_of) -> dict:
    """What the criteria read for one S run (`run`: its key in `table`), each other role's run
    found at key_of(role) (NaN where that run is missing)."""
    def get(role: str, col: str) -> float:
        key = key_of(role)
        return float(table.loc[key, col]) if key in table.index else math.nan

    row = table.loc[run]
    c, r = run_curve(ev[ev["key"] == run], "flops")
    tail = tail_values({run: (c, r)})[run]
    pf = fit_with_protocol(c, r, protocol="whole")
    prof = profile_A(pf.fit) if pf.fit is not None else None
    warm = _warm_settings(root / run)
    return {
        "p10": float(row["completion_tokens_p10"]), "p50": float(row["completion_tokens_p50"]),
        "p90": float(row["completion_tokens_p90"]), "r0": float(r[0]), "tail": tail,
        "clean_warm": warm["label_smoothing"] == 0.0 and warm["label_noise"] == 0.0,
        "A": pf.fit.A if pf.fit is not None else math.nan,
        "A_lo": prof.low if prof else math.nan, "A_hi": prof.high if prof else math.nan,
        "A_identified": bool(prof.identified) if prof else False,
        "s_lag_max": float(row["lag_max"]), "s_lag_mean": float(row["lag_mean"]),
        "bk_lag_max": get("BK", "lag_max"),
        "b_clip": get("B", "clip_frac_low") + get("B", "clip_frac_high"),
        "b_clip_low": get("B", "clip_frac_low"), "b_clip_high": get("B", "clip_frac_high"),
        "b_ratio": (get("B", "ratio_p01"), get("B", "ratio_p99")),
        "gap_b": get("B", "logprob_gap"), "gap_bh": get("BH", "logprob_gap"),
        "minutes": _minutes(root / run), "steps": int(row["step"]), "flops": float(row["flops"]),
    }


def _tables(root: Path, key):
    """(runs table, eval table), both with `key`: a run's name relative to root, as key(row) makes it."""
    table = load_runs(root, what="runs")
    table["key"] = [key(Path(p).relative_to(root)) for p in table["path"]]
    ev = load_runs(root, what="eval")
    ev["key"] = [key(Path(p).relative_to(root)) for p in ev["path"]]
    return table.set_index("key", drop=False), ev


def measure(root: Path) -> dict:
    """{(candidate, seed): the measurements the criteria read}, from the pilot's runs
    (<candidate>-<role>-s<seed> directly under root)."""
    table, ev = _tables(root, lambda rel: rel.name)
    out = {}
    for run in table.index:
        m = re.fullmatch(r"(.+)-S-s(\d+)", run)
        if not m or table.loc[run, "status"] != "done":
            continue  # not an S run, or still running: judged once it ends
        cand, seed = m.group(1), int(m.group(2))
        out[(cand, seed)] = _measure_one(root, table, ev, run, lambda role: f"{cand}-{role}-s{seed}")
    return out


def measure_study(root: Path, name: str = "study") -> dict:
    """{(name, seed): the measurements the criteria read}, from a study's runs (results/small): the
    roles of STUDY_ROLES, all at the full budget (the pilot ran B, BH and BK to a quarter of it)."""
    table, ev = _tables(root, lambda rel: rel.as_posix())
    s_run = re.compile(re.escape(STUDY_ROLES["S"]).replace(re.escape("{seed}"), r"(\d+)"))
    out = {}
    for run in table.index:
        m = s_run.fullmatch(run)
        if not m or table.loc[run, "status"] != "done":
            continue
        seed = int(m.group(1))
        out[(name, seed)] = _measure_one(root, table, ev, run, lambda role, seed=seed: STUDY_ROLES[role].format(seed=seed))
    return out


def vocabulary_size(root: Path) -> int:
    """The word-level tokenizer's size, from any run's config (the warm start's model)."""
    from components.tasks import make_task

    task = make_task("stories", seed=0, num_train=1, num_eval=1)
    return len(task.vocabulary()) + 8  # the words + the 8 special tokens of components/models.py


def judge(meas: dict, vocab: int) -> dict:
    """{candidate: {criterion id: (met on every seed, text)}}."""
    from experiments.sweep_spec import load_spec

    spec_order = [v.rsplit("-", 1)[0] for v in load_spec(PILOT_SPEC).variants]  # the pre-registered order
    out = {}
    for cand in sorted({c for c, _ in meas}, key=lambda c: spec_order.index(c) if c in spec_order else len(spec_order)):
        seeds = sorted(s for c, s in meas if c == cand)
        rows = {s: meas[(cand, s)] for s in seeds}
        res = {}
        for cid, text, fn, keys in CRITERIA:
            if cid == "6":
                shrink = [1 - r["gap_bh"] / r["gap_b"] for r in rows.values() if _measured(r, keys) and r["gap_b"] > 0]
                mean = sum(shrink) / len(shrink) if shrink else math.nan
                res[cid] = (vocab >= 4096 and mean >= 0.30, f"vocab {vocab}; shrink " + ", ".join(
                    f"{x:+.0%}" for x in shrink) + f" (mean {mean:+.0%})")
                continue
            ok = [bool(fn(r)) if _measured(r, keys) else None for r in rows.values()]  # None: not measured
            judged = [o for o in ok if o is not None]
            res[cid] = (bool(judged) and all(judged), ", ".join("—" if o is None else "yes" if o else "no" for o in ok))
        out[cand] = res
    return out


def markdown(meas: dict, verdict: dict, vocab: int, pick: bool = True) -> str:
    L = ["| candidate / seed | length p10 / p50 / p90 | step-0 | tail | A [95% profile] | lag max S / BK (mean S) "
         "| DAPO clipped low + high | ratio p1 / p99 (B) | gap B / BH | minutes |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    def f(x: float, spec: str) -> str:  # a measurement the seed has no run for: —
        return "—" if isinstance(x, float) and math.isnan(x) else format(x, spec)

    for (cand, seed), m in sorted(meas.items()):
        L.append(f"| {cand} s{seed} | {m['p10']:.0f} / {m['p50']:.0f} / {m['p90']:.0f} | {m['r0']:.3f} | {m['tail']:.3f} | "
                 f"{m['A']:.3f} [{m['A_lo']:.3f}, {m['A_hi']:.3f}]{'' if m['A_identified'] else ' n.i.'} | "
                 f"{m['s_lag_max']:.0f} / {f(m['bk_lag_max'], '.0f')} ({m['s_lag_mean']:.2f}) | "
                 f"{f(m['b_clip_low'], '.2%')} + {f(m['b_clip_high'], '.2%')} | "
                 f"{f(m['b_ratio'][0], '.3f')} / {f(m['b_ratio'][1], '.3f')} | "
                 f"{f(m['gap_b'], '.5f')} / {f(m['gap_bh'], '.5f')} | {m['minutes']:.1f} |")
    L += ["", "| criterion | " + " | ".join(verdict) + " |", "|---|" + "---|" * len(verdict)]
    for cid, text, _, _ in CRITERIA:
        L.append(f"| {cid}: {text} | " + " | ".join(
            f"{'met' if verdict[c][cid][0] else '**not met**'} ({verdict[c][cid][1]})" for c in verdict) + " |")
    met = {c: sum(v[0] for v in verdict[c].values()) for c in verdict}
    if not pick:
        return "\n".join(L + ["", "Criteria met: " + ", ".join(f"{c} {met[c]} of {len(CRITERIA)}" for c in verdict) + "."])
    order = list(verdict)
    full = [c for c in order if met[c] == len(CRITERIA)]
    pick = full[0] if full else max(order, key=lambda c: (met[c], -order.index(c)))
    L += ["", "Criteria met: " + ", ".join(f"{c} {met[c]} of {len(CRITERIA)}" for c in order)
          + f". **Pick: {pick}**" + (" (meets every criterion)" if full else
                                     " (no candidate meets every criterion: the one that meets the most, ties to the earlier)")]
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--study", action="store_true",
                    help="root is a study (results/small): judge the criteria on its ScaleRL seeds, with the fp32_head "
                         "sweep as B / BH and off_policy's ppo_off_policy-k8 as BK, all at the full budget")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    meas = measure_study(args.root) if args.study else measure(args.root)
    if not meas:
        print(f"no finished S run under {args.root}" + (" (scalerl_seeds/scalerl-s*)" if args.study else " (*-S-s*)"),
              file=sys.stderr)
        return 1
    vocab = vocabulary_size(args.root)
    verdict = judge(meas, vocab)
    if args.json:
        print(json.dumps({"runs": {f"{c}-s{s}": m for (c, s), m in meas.items()},
                          "criteria": verdict}, indent=1, default=str))
    else:
        print(markdown(meas, verdict, vocab, pick=not args.study))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
