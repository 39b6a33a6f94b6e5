"""Fit speed: `analysis.scaling_law.fit` against the naive loop of scipy curve_fit calls.

The naive loop is the paper's procedure written directly: for each of the 71 × 100 (A, C_mid)
grid points, `curve_fit` fits B (default initialisation), and the grid point with the
smallest squared error wins. Both run on the same noisy 75-point curve (the paper's 100k run
has about 75 evaluation points), with the same grids, in one process, so the ratio is
meaningful on a shared machine. Also reports how far apart the two winners are.

    python benchmarks/fit_speed.py [--points 75] [--repeats 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from analysis.scaling_law import default_a_grid, default_c_mid_grid, fit, sigmoid


def _model(A: float, cm: float, r0: float):
    def f(C, B):  # curve_fit counts the parameters after the first: B only
        return sigmoid(C, A, B, cm, r0)

    return f


def naive_fit(c: np.ndarray, r: np.ndarray, r0: float, a_grid: np.ndarray, c_mid_grid: np.ndarray):
    """The paper's loop: curve_fit for B at every grid point. Returns (A, B, C_mid, sse)."""
    best = (np.nan, np.nan, np.nan, np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        for A in a_grid:
            for cm in c_mid_grid:
                f = _model(A, cm, r0)
                try:
                    (b,), _ = curve_fit(f, c, r)
                except RuntimeError:  # no convergence at this grid point
                    continue
                sse = float(np.sum((f(c, b) - r) ** 2))
                if sse < best[3]:
                    best = (float(A), float(b), float(cm), sse)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=75)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of the fast fit (best is reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    # Table 1, ScaleRL row (C_mid 2542, B 1.92, A 0.610), 16k GPU-h as in the LOO runs.
    A, B, C_mid, R0 = 0.610, 1.92, 2542.0, 0.30
    c = np.linspace(0.0, 16000.0, args.points)
    r = sigmoid(c, A, B, C_mid, R0) + rng.normal(0.0, 0.01, c.size)
    r[0] = R0
    a_grid, cm_grid = default_a_grid(R0, r[1:]), default_c_mid_grid(c)

    fit(c, r)  # warm-up (imports, allocations)
    fast_times, fast_cpu = [], []
    for _ in range(args.repeats):
        t0, p0 = time.perf_counter(), time.process_time()
        res = fit(c, r)
        fast_times.append(time.perf_counter() - t0)
        fast_cpu.append(time.process_time() - p0)
    t0, p0 = time.perf_counter(), time.process_time()
    nA, nB, nC, nsse = naive_fit(c, r, R0, a_grid, cm_grid)
    naive_time, naive_cpu = time.perf_counter() - t0, time.process_time() - p0

    fast, fcpu = min(fast_times), min(fast_cpu)
    print(f"# fit speed, {args.points}-point curve, grid {a_grid.size} A x {cm_grid.size} C_mid")
    print(f"# machine: {platform.node()} {platform.machine()}, python {platform.python_version()}")
    print()
    print("| method | wall (s) | CPU (s) | ratio (wall) | ratio (CPU) | A | B | C_mid | SSE |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| analysis.scaling_law.fit (vectorised B solve), best of {args.repeats} | {fast:.3f} | {fcpu:.3f} | 1.0 | 1.0 "
          f"| {res.A:.4f} | {res.B:.4f} | {res.C_mid:.1f} | {res.sse:.6f} |")
    print(f"| naive loop, curve_fit per grid point ({a_grid.size * cm_grid.size} calls) | {naive_time:.2f} | {naive_cpu:.2f} "
          f"| {naive_time / fast:.1f} | {naive_cpu / fcpu:.1f} | {nA:.4f} | {nB:.4f} | {nC:.1f} | {nsse:.6f} |")
    print()
    print(f"true: A={A} B={B} C_mid={C_mid}; fast SSE - naive SSE = {res.sse - nsse:+.3e}")


if __name__ == "__main__":
    main()
