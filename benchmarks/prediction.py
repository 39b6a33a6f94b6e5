"""Prediction from a prefix, measured on a folder of finished runs (issue 41).

Every finished run under each RESULTS folder is cut at 25%, 50% and 75% of its final compute and
fitted as `scalerl fit RESULTS --fraction F` fits it; its final pass rate is predicted by the
sigmoid (with its calibrated 95% interval), a straight line in log compute and the last value
(`analysis/prediction.py`). Per prefix: median |error| and bias of each, how often the sigmoid
beats the line, and the interval's coverage (target 90-97%).

    python benchmarks/prediction.py results/tiny results/tiny_long [--boot 200] [--csv DIR]
    python benchmarks/prediction.py --synthetic 240 [--phi 0,0.6]   # runs of known truth, AR(1) noise
    python benchmarks/prediction.py results/tiny --spread 0          # ablation: without the law's spread

`--synthetic N`: N runs of known truth shaped like the tiny studies' (R0 0.15-0.2, A 0.75-0.98, B
0.8-1.4, C_mid 0.1-0.5 of the run, 21 or 32 evaluations) with AR(1) evaluation noise (sd
0.006-0.014, lag-1 correlation drawn from --phi), each fitted from 0.4 of each prefix (the
forward-ablation protocol's start), as tests/test_prediction.py does at 50%.
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings
from pathlib import Path

from _machine import cpu_model


def _synthetic(n: int, phi: list[float], boot: int) -> None:
    """Coverage of the 95% interval on n runs of known truth, at each prefix."""
    import numpy as np

    from analysis.prediction import FRACTIONS
    from analysis.scaling_law import FitError, _ar1, predict, sigmoid

    t = time.time()
    rng = np.random.default_rng(2024)
    runs = []
    for _ in range(n):
        k = int(rng.choice([21, 32]))
        c = np.linspace(0.0, 1e13, k)
        law = dict(A=rng.uniform(0.75, 0.98), B=rng.uniform(0.8, 1.4), C_mid=rng.uniform(0.1, 0.5) * 1e13,
                   R0=rng.uniform(0.15, 0.2))
        noise = _ar1(rng, np.array([rng.uniform(0.006, 0.014)]), k, rng.uniform(phi[0], phi[-1]))[0]
        runs.append((c, sigmoid(c, **law) + noise))
    print(f"\nsynthetic: {n} runs, AR(1) noise with lag-1 correlation in [{phi[0]:g}, {phi[-1]:g}], fit from 0.4 of "
          f"the prefix, {boot} replicates")
    print("| prefix | fitted | median abs. error / bias | 95% interval covers | median width |")
    print("|---|---|---|---|---|")
    for f in FRACTIONS:
        cov, err, wid = [], [], []
        for i, (c, r) in enumerate(runs):
            try:
                p = predict(c, r, fraction=f, n_boot=boot, seed=i, min_compute=0.4 * f * c[-1])
            except FitError:
                continue
            cov.append(p.covered)
            err.append(p.error)
            wid.append(p.width)
        e = np.asarray(err)
        print(f"| {f:.0%} | {len(cov)} | {np.median(np.abs(e)):.3f} / {e.mean():+.3f} | **{np.mean(cov):.1%}** | "
              f"{np.median(wid):.3f} |")
    print(f"({time.time() - t:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    from analysis.prediction import markdown, measure, summarize
    from analysis.scaling_law import PREDICT_BOOT

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", help="folders of finished runs (a study: results/tiny)")
    parser.add_argument("--boot", type=int, default=PREDICT_BOOT, help=f"replicates per interval (default {PREDICT_BOOT})")
    parser.add_argument("--csv", default=None, metavar="DIR", help="also write DIR/<folder>_prediction.csv (per run)")
    parser.add_argument("--spread", type=float, default=None, metavar="K",
                        help="ablation: the law's spread factor (default analysis.scaling_law.MODEL_SPREAD = 1/√12; "
                             "0: without it)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0, as `scalerl fit`)")
    parser.add_argument("--synthetic", type=int, default=0, metavar="N", help="also N synthetic runs of known truth")
    parser.add_argument("--phi", default="0,0.6", metavar="LO,HI", help="--synthetic: the noise's lag-1 correlation range")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import analysis.scaling_law as law

    if args.spread is not None:
        law.MODEL_SPREAD = float(args.spread)
    print(f"machine: {cpu_model()}; python {platform.python_version()}; law's spread {law.MODEL_SPREAD:.3f}")
    if args.synthetic:
        _synthetic(args.synthetic, [float(x) for x in args.phi.split(",")], args.boot)
    for folder in args.results:
        t = time.time()
        rows = measure(folder, n_boot=args.boot, seed=args.seed)
        if rows.empty:
            print(f"\n{folder}: no runs")
            continue
        table = summarize(rows)
        print(f"\n{folder}: {int((rows['fraction'] == rows['fraction'].iloc[0]).sum())} finished runs, {args.boot} "
              f"replicates per interval, seed {args.seed}, "
              f"{time.time() - t:.0f} s")
        print("\n".join(markdown(table)))
        if args.csv:
            out = Path(args.csv)
            out.mkdir(parents=True, exist_ok=True)
            rows.to_csv(out / f"{Path(folder).name}_prediction.csv", index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
