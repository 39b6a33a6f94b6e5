"""The adaptive rule's frontier: agreement with the full sweep against compute, over rung schedules,
stop rules, the tie test's level and whether the last configuration runs to the end (issue 41, item 6).

Every finished sweep with two or more configurations under each RESULTS folder is replayed
(`analysis.adaptive.replay`: each run's logs cut at each rung) under every combination; a row
says how many sweeps agree with the full sweep (`same` or `equivalent` on the full data) and the
mean share of the full sweeps' compute used. The goal: >= 90% agreeing at <= 50% compute.

    python benchmarks/adaptive_frontier.py results/tiny results/tiny_long [--rules tail,law,both]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time
import warnings

from _machine import cpu_model

SCHEDULES = ("0.25,0.5,1", "0.5,1", "0.25,1", "0.33,0.67,1", "0.125,0.25,0.5,1", "0.1,0.2,0.4,1", "0.2,0.4,1",
             "0.15,0.3,1", "0.1,0.3,1", "0.1,0.25,0.5,1", "0.1,0.2,0.3,0.4,1", "0.1,0.15,0.2,0.4,1",
             "0.05,0.1,0.2,0.4,1")


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from analysis.adaptive import parse_rungs, replay
    from analysis.runs import load_runs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    parser.add_argument("--schedules", default=";".join(SCHEDULES), help="';'-separated rung lists")
    parser.add_argument("--rules", default="tail,law,both")
    parser.add_argument("--tie-alpha", default="0.05,0.025", help="levels of the tie test (TOST per rung)")
    parser.add_argument("--finish", default="yes,no", help="does the last configuration run to the end: yes, no")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    print(f"machine: {cpu_model()}; python {platform.python_version()}")
    t0 = time.time()
    tables = {p: (load_runs(p, what="eval"), load_runs(p, what="runs")) for p in args.results}
    caches: dict = {p: {} for p in args.results}
    print("| rungs | rule | tie test | last one | agree | same / equivalent / undecided / different | mean compute "
          "| " + " | ".join(f"{p}: agree, compute" for p in args.results) + " | not agreeing |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(args.results) + "---|")
    for sched, rule, ta, fin in itertools.product(args.schedules.split(";"), args.rules.split(","),
                                                  [float(x) for x in args.tie_alpha.split(",")],
                                                  args.finish.split(",")):
        rungs = parse_rungs(sched)
        per = {p: replay(p, rungs=rungs, stop_rule=rule, tie_alpha=ta, finish_leader=fin == "yes", tables=tables[p],
                         cache=caches[p]) for p in args.results}
        res = [r for rs in per.values() for r in rs]
        n = {a: sum(r.agreement == a for r in res) for a in ("same", "equivalent", "undecided", "different")}
        fails = ", ".join(f"{p.rstrip('/').split('/')[-1]}/{r.sweep} ({r.agreement})"
                          for p, rs in per.items() for r in rs if not r.agrees)
        cols = " | ".join(f"{sum(r.agrees for r in rs)}/{len(rs)}, {np.mean([r.compute_fraction for r in rs]):.0%}"
                          for rs in per.values())
        print(f"| {','.join(f'{x:g}' for x in rungs)} | {rule} | {1 - 2 * ta:.0%} inside ±δ | "
              f"{'runs to the end' if fin == 'yes' else 'stops when decided'} | "
              f"{sum(r.agrees for r in res)}/{len(res)} ({np.mean([r.agrees for r in res]):.0%}) | "
              f"{n['same']} / {n['equivalent']} / {n['undecided']} / {n['different']} | "
              f"{np.mean([r.compute_fraction for r in res]):.1%} | {cols} | {fails or '—'} |", flush=True)
    print(f"\n{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
