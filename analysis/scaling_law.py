"""The sigmoid compute–performance law (ScaleRL Eq. 1) and the paper's fitting procedure.

    R(C) = R0 + (A − R0) / (1 + (C_mid / C)^B)

- `sigmoid`   evaluates Eq. 1.
- `fit`       the paper's procedure (A.5): a grid over A and C_mid; at every grid point the
              least-squares B; the grid point with the smallest squared error seeds a continuous
              least-squares polish of A, B and C_mid together (scipy), so no estimate sits on a
              grid step. Points below `min_compute` are excluded. R0 is `r0`, or else the first
              measured point. The C_mid grid reaches 1/15 of the fit's first point (the paper's
              100 GPU-h against its 1.5k start) and 10x its last (40k against ~4k).
- `compare`   the paper's rule: A differs by more than the margin (0.02) → higher A wins;
              otherwise refit both at their mean A and compare B (higher wins), then C_mid
              (smaller wins).
- `loo_transform`  Fig 7: log F(R_C) against log C at a common A; the slope is B.
- `bootstrap` seeded bootstrap intervals (resampling evaluation points), beyond the paper.
- `predict`   fit the first fraction of a run's compute, predict its final pass rate with a calibrated
              prediction interval (`prediction_interval`, `predictive_draws`: evaluation noise with
              correlated successive evaluations, the fit's uncertainty by a parametric bootstrap
              refitted in one batch, and the law's spread against a straight line in log compute).
- `profile_A` the 95% profile-likelihood interval of A (B and C_mid free, polished, at each A): A is
              identified when it is at most 0.1 wide and reaches neither the cap nor the floor.

Speed. The paper fits B with `scipy.optimize.curve_fit` at each of 71 × 100 grid points. Here
the same 1-D least-squares problem is solved for every grid point at once in numpy: for fixed
C_mid the logistic s_i(B) = 1 / (1 + (C_mid/C_i)^B) does not depend on A, so the squared error
on a dense B grid is D²·Σs² − 2D·Σs·t + Σt² (D = A − R0, t = R − R0) for all A at the cost of
one pass over C_mid; the best B on that grid is then polished by safeguarded Newton steps on
the exact squared error. Tests check the result against curve_fit at individual grid points.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy.special import expit

__all__ = [
    "FitError",
    "FitResult",
    "Comparison",
    "BootstrapResult",
    "Prediction",
    "sigmoid",
    "fit",
    "default_a_grid",
    "default_c_mid_grid",
    "compare",
    "refit_common_a",
    "loo_transform",
    "bootstrap",
    "predict",
    "AProfile",
    "profile_A",
    "loglinear_fit",
    "prediction_interval",
    "predictive_draws",
    "PredictiveDraws",
    "noise_model",
    "PREDICT_BOOT",
    "MODEL_SPREAD",
    "PIN_WIDTH",
    "A_IDENTIFIED_WIDTH",
    "PAPER_A_GRID",
    "PAPER_C_MID_GRID",
    "A_MARGIN",
]

# The paper's grids (A.5): A in {0.450, 0.455, ..., 0.800}; C_mid in [100, 40000] GPU-h.
PAPER_A_GRID = np.round(np.arange(0.450, 0.8000001, 0.005), 3)  # [71]
PAPER_C_MID_GRID = np.linspace(100.0, 40000.0, 100)  # [100]
# The paper's margin on A (Fig 8a, A.5): fits within ±0.02 are "the same A".
A_MARGIN = 0.02

N_A_DEFAULT = 71
N_C_MID_DEFAULT = 100
# How far the C_mid grid reaches past the fitted points, as the paper's does past its fit window:
# down to 1/15 of the first fitted point (100 GPU-h against the 1.5k cutoff) and up to 10x the last
# (40k GPU-h against the ~4k end of a forward ablation). The polish may leave the grid; it is held
# only POLISH_REACH further out on either side, and a fit that ends on that bound says so.
C_MID_BELOW_FIT_START = 15.0
C_MID_ABOVE_FIT_END = 10.0
POLISH_REACH = 1e3
# B is searched on a log grid in [B_MIN, B_MAX] then polished; a winner on the edge is flagged.
B_MIN, B_MAX, N_B_GRID = 0.02, 50.0, 128
_WORK_ELEMENTS = 2_000_000  # size of the solver's work arrays (memory bound for large grids)
MIN_POINTS = 4  # three free parameters (A, B, C_mid) need at least four points
# A run's A counts only where its 95% profile interval is at most this wide (DESIGN.md
# "Comparing configurations"): wider, the data cannot tell the asymptote from the climb to it.
A_IDENTIFIED_WIDTH = 0.1


class FitError(ValueError):
    """The data cannot be fitted (too few points, NaN, non-increasing compute, no gain)."""


def sigmoid(compute: Any, A: float, B: float, C_mid: float, R0: float) -> np.ndarray:
    """Eq. 1: R0 + (A − R0) / (1 + (C_mid / C)^B). Array in, array out (float64).

    At C = 0 the value is R0 (the limit). Parameters may be arrays that broadcast with C.
    """
    c = np.asarray(compute, dtype=np.float64)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        # (C_mid/C)^B = exp(B·ln(C_mid/C)); expit(−x) = 1/(1+e^x) is overflow-safe.
        log_ratio = np.log(np.asarray(C_mid, dtype=np.float64)) - np.log(c)
        frac = expit(-np.asarray(B, dtype=np.float64) * log_ratio)
    frac = np.where(c <= 0, 0.0, frac)
    return np.asarray(R0 + (np.asarray(A, dtype=np.float64) - R0) * frac, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class FitResult:
    """One fit of Eq. 1. `compute`/`reward` are the points used (after `min_compute`)."""

    A: float
    B: float
    C_mid: float
    R0: float
    sse: float  # sum of squared residuals over the points used
    rmse: float
    r2: float  # 1 − SSE / (total sum of squares about the mean reward) over the points used
    n_points: int
    compute: np.ndarray  # [n] points used in the fit
    reward: np.ndarray  # [n]
    min_compute: float
    a_grid: np.ndarray
    c_mid_grid: np.ndarray
    flags: tuple[str, ...] = ()  # reasons not to trust the numbers; empty when clean
    a_default: bool = True  # A came from the default grid: the polish bounds A by (R0, cap], not the grid

    @property
    def ok(self) -> bool:
        return not self.flags

    def __call__(self, compute: Any) -> np.ndarray:
        return sigmoid(compute, self.A, self.B, self.C_mid, self.R0)

    predict = __call__

    def params(self) -> dict[str, float]:
        return {"A": self.A, "B": self.B, "C_mid": self.C_mid, "R0": self.R0}

    def summary(self) -> dict[str, Any]:
        return {
            **self.params(),
            "sse": self.sse,
            "rmse": self.rmse,
            "r2": self.r2,
            "n_points": self.n_points,
            "fit_from": float(self.compute.min()) if self.n_points else math.nan,
            "fit_to": float(self.compute.max()) if self.n_points else math.nan,
            "flags": "; ".join(self.flags),
        }

    def __repr__(self) -> str:
        flags = f", flags={list(self.flags)}" if self.flags else ""
        return (
            f"FitResult(A={self.A:.4g}, B={self.B:.4g}, C_mid={self.C_mid:.4g}, R0={self.R0:.4g}, "
            f"rmse={self.rmse:.3g}, n_points={self.n_points}{flags})"
        )


# ----------------------------------------------------------------------------- validation


def _validate(compute: Any, reward: Any) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(compute, dtype=np.float64).ravel()
    r = np.asarray(reward, dtype=np.float64).ravel()
    if c.shape != r.shape:
        raise FitError(f"compute and reward differ in length: {c.size} vs {r.size}")
    bad = np.flatnonzero(~np.isfinite(c) | ~np.isfinite(r))
    if bad.size:
        raise FitError(
            f"compute/reward contain NaN or inf at indices {bad[:10].tolist()}: "
            "drop those evaluations before fitting"
        )
    if c.size and c.min() < 0:
        raise FitError(f"compute must be >= 0; got {c.min()!r} at index {int(np.argmin(c))}")
    steps = np.diff(c)
    if np.any(steps <= 0):
        i = int(np.flatnonzero(steps <= 0)[0]) + 1
        raise FitError(
            f"compute must be strictly increasing; compute[{i}]={c[i]!r} <= compute[{i - 1}]={c[i - 1]!r}"
        )
    return c, r


def default_a_grid(r0: float, reward: np.ndarray, n: int = N_A_DEFAULT) -> np.ndarray:
    """The paper's 71-value A grid, adapted to the data.

    The paper's A ∈ [0.45, 0.80] brackets its curves' observed plateau (≈0.6). Here the grid
    runs from half-way between R0 and the best observed reward up to 1.0 (the ceiling of a pass
    rate), or, for rewards outside [0, 1], up to R0 + 3·(best − R0).
    """
    r_max = float(np.max(reward))
    gain = r_max - r0
    lo = r0 + 0.5 * gain
    hi = 1.0 if (r_max <= 1.0 and r0 >= 0.0) else r0 + 3.0 * gain
    if hi <= lo:
        hi = lo + gain
    return np.linspace(lo, hi, n)


def default_c_mid_grid(compute: np.ndarray, n: int = N_C_MID_DEFAULT) -> np.ndarray:
    """100 C_mid values, log-spaced from 1/15 of the smallest positive compute to 10x the largest.

    `compute` holds the points fitted (after the fit's cutoff), so the grid reaches as far below the
    fit window as the paper's [100, 40000] GPU-h reaches below its 1.5k GPU-h cutoff, and as far
    above as 40k lies above the ~4k GPU-h end of its forward ablations. A log grid keeps the same
    relative resolution for a 10-minute CPU run and a 100k GPU-hour run; it only seeds the polish.
    """
    pos = compute[compute > 0]
    return np.geomspace(pos.min() / C_MID_BELOW_FIT_START, pos.max() * C_MID_ABOVE_FIT_END, n)


def _a_cap(r0: float, reward: np.ndarray) -> float:
    """The largest A can be: 1.0 for pass rates (R0 >= 0 and every reward <= 1), else unbounded."""
    return 1.0 if (float(np.max(reward)) <= 1.0 and r0 >= 0.0) else math.inf


# ----------------------------------------------------------------------------- the solver


def _best_b(
    log_c: np.ndarray,  # [n] ln C of the positive-compute points
    t: np.ndarray,  # [n] reward − R0
    w: np.ndarray,  # [n] weights (1, or bootstrap counts)
    const_sse: float,  # weighted squared error of points at C = 0 (model = R0 there)
    d: np.ndarray,  # [nA] A − R0
    c_mid: np.ndarray,  # [nC]
    b_grid: np.ndarray,  # [nB]
    newton_iters: int = 5,
) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares B for every (A, C_mid) grid point. Returns B [nA, nC] and SSE [nA, nC]."""
    u = np.log(c_mid)[:, None] - log_c[None, :]  # [nC, n]   ln(C_mid / C_i)
    tt = float(np.sum(w * t * t)) + const_sse
    # 1) dense B grid; s does not depend on A, so SSE for all A costs one pass over C_mid.
    s = expit(-b_grid[:, None, None] * u[None, :, :])  # [nB, nC, n]
    s2 = np.einsum("kjn,n->kj", s * s, w)  # [nB, nC]
    st = np.einsum("kjn,n->kj", s, w * t)  # [nB, nC]
    del s
    sse_grid = d[:, None, None] ** 2 * s2[None] - 2.0 * d[:, None, None] * st[None] + tt  # [nA, nB, nC]
    k = np.argmin(sse_grid, axis=1)  # [nA, nC]
    sse0 = np.take_along_axis(sse_grid, k[:, None, :], axis=1)[:, 0, :]  # [nA, nC]
    b0 = b_grid[k]  # [nA, nC]
    lo = b_grid[np.maximum(k - 1, 0)]
    hi = b_grid[np.minimum(k + 1, b_grid.size - 1)]
    # 2) safeguarded Newton on the exact SSE(B), inside the bracket around the grid winner.
    b = b0.copy()
    dd = d[:, None, None]  # [nA, 1, 1]
    for _ in range(newton_iters):
        z = b[:, :, None] * u[None, :, :]  # [nA, nC, n]
        s = expit(-z)
        q = s * (1.0 - s)
        ds = -u[None] * q  # ds/dB
        d2s = u[None] ** 2 * q * (1.0 - 2.0 * s)  # d²s/dB²
        e = dd * s - t  # residual
        g = 2.0 * np.sum(w * e * dd * ds, axis=-1)  # [nA, nC]
        h_gn = 2.0 * np.sum(w * (dd * ds) ** 2, axis=-1)
        h = h_gn + 2.0 * np.sum(w * e * dd * d2s, axis=-1)
        h = np.where(h > 1e-300, h, h_gn + 1e-300)  # Gauss-Newton where the Hessian is not positive
        b = np.clip(b - g / h, lo, hi)
    s = expit(-b[:, :, None] * u[None, :, :])
    sse = np.sum(w * (dd * s - t) ** 2, axis=-1) + const_sse  # [nA, nC]
    better = sse <= sse0
    return np.where(better, b, b0), np.where(better, sse, sse0)


def _fit_core(
    c: np.ndarray,
    r: np.ndarray,
    w: np.ndarray,
    r0: float,
    a_grid: np.ndarray,
    c_mid_grid: np.ndarray,
) -> tuple[float, float, float, float, np.ndarray]:
    """Grid search. Returns (A, B, C_mid, sse, B-matrix) of the best grid point."""
    pos = c > 0
    t = r - r0
    const_sse = float(np.sum(w[~pos] * t[~pos] ** 2))
    b_grid = np.geomspace(B_MIN, B_MAX, N_B_GRID)
    log_c, d = np.log(c[pos]), a_grid - r0
    # C_mid in chunks so that the [max(nA, nB), chunk, n] work arrays stay near 2M floats.
    chunk = max(1, _WORK_ELEMENTS // (max(a_grid.size, b_grid.size) * max(int(pos.sum()), 1)))
    parts = [_best_b(log_c, t[pos], w[pos], const_sse, d, c_mid_grid[i:i + chunk], b_grid)
             for i in range(0, c_mid_grid.size, chunk)]
    b_mat = np.concatenate([p[0] for p in parts], axis=1)  # [nA, nC]
    sse = np.concatenate([p[1] for p in parts], axis=1)  # [nA, nC]
    i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
    return float(a_grid[i]), float(b_mat[i, j]), float(c_mid_grid[j]), float(sse[i, j]), b_mat


def _polish(
    c: np.ndarray,  # [n] compute of the fitted points
    r: np.ndarray,  # [n] reward
    w: np.ndarray,  # [n] weights (1, or bootstrap counts)
    r0: float,
    start: tuple[float, float, float],  # (A, B, C_mid): the grid winner
    a_bounds: tuple[float, float],  # A's range; equal ends fix A (a refit at a given A)
    c_mid_bounds: tuple[float, float],
) -> tuple[float, float, float, float]:
    """Continuous least squares of A, ln B and ln C_mid from the grid winner (scipy, bounded trust
    region). Returns (A, B, C_mid, sse); the start itself when the polish does not improve on it."""
    from scipy.optimize import least_squares

    sw = np.sqrt(w)  # [n]
    A0, B0, C0 = start
    fix_a = a_bounds[1] - a_bounds[0] <= 0.0
    lb_b, ub_b = math.log(B_MIN), math.log(B_MAX)
    lb_c, ub_c = math.log(c_mid_bounds[0]), math.log(c_mid_bounds[1])

    def unpack(x: np.ndarray) -> tuple[float, float, float]:
        return (A0, *x) if fix_a else tuple(x)  # type: ignore[return-value]

    def resid(x: np.ndarray) -> np.ndarray:  # [n]
        A, lb, lc = unpack(x)
        return sw * (sigmoid(c, A, math.exp(lb), math.exp(lc), r0) - r)

    pos = c > 0  # [n]
    log_c = np.log(np.where(pos, c, 1.0))  # [n]

    def jac(x: np.ndarray) -> np.ndarray:  # [n, 2 or 3]: d resid / d (A,) ln B, ln C_mid
        A, lb, lc = unpack(x)
        B = math.exp(lb)
        z = B * (log_c - lc)  # [n]   B·ln(C / C_mid)
        s = np.where(pos, expit(z), 0.0)  # [n]   the sigmoid's fraction; 0 at C = 0
        q = (A - r0) * s * (1.0 - s)  # [n]   (A − R0)·ds/dz
        cols = [q * z, -B * q]  # d/d ln B = q·z, d/d ln C_mid = −B·q
        if not fix_a:
            cols.insert(0, s)  # d/dA
        return sw[:, None] * np.stack(cols, axis=1)

    x0 = [min(max(math.log(B0), lb_b), ub_b), min(max(math.log(C0), lb_c), ub_c)]
    lo, hi = [lb_b, lb_c], [ub_b, ub_c]
    if not fix_a:
        x0, lo, hi = [min(max(A0, a_bounds[0]), a_bounds[1]), *x0], [a_bounds[0], *lo], [a_bounds[1], *hi]
    base = float(np.sum(resid(np.asarray(x0)) ** 2))
    try:
        sol = least_squares(resid, np.asarray(x0), jac=jac, bounds=(lo, hi), method="trf", x_scale="jac",
                            xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=400)
    except (ValueError, FloatingPointError):
        return A0, B0, C0, base
    sse = float(np.sum(sol.fun ** 2))
    if not np.isfinite(sse) or sse > base:
        return A0, B0, C0, base
    A, lb, lc = unpack(sol.x)
    return float(A), math.exp(lb), math.exp(lc), sse


def _flags(
    A: float, B: float, C_mid: float, a_bounds: tuple[float, float], c_mid_bounds: tuple[float, float], n: int,
    r2: float, cap: float, c_max: float,
) -> tuple[str, ...]:
    """What the data did not choose: a parameter held at the end of its range, too few points, a
    curve the sigmoid does not explain."""
    flags = []
    if a_bounds[1] > a_bounds[0] and A >= a_bounds[1] - 1e-9:
        where = f"the cap {cap:g}" if a_bounds[1] == cap else "the top of the A grid"
        flags.append(f"A={A:.4g} at the top of its range ({where}): the curve is far from saturating, A is a lower bound")
    if a_bounds[1] > a_bounds[0] and A <= a_bounds[0] + 1e-9:
        flags.append(f"A={A:.4g} at the bottom of its range")
    if C_mid >= c_mid_bounds[1] * (1 - 1e-9):
        flags.append(f"C_mid={C_mid:.4g} at the top of its range ({c_mid_bounds[1]:.4g}): the midpoint lies far past the data")
    if C_mid <= c_mid_bounds[0] * (1 + 1e-9):
        flags.append(f"C_mid={C_mid:.4g} at the bottom of its range ({c_mid_bounds[0]:.4g})")
    if C_mid > c_max and C_mid < c_mid_bounds[1] * (1 - 1e-9):
        flags.append(f"C_mid={C_mid:.4g} beyond the last point ({c_max:.4g}): the curve is seen only before its "
                     "midpoint, A is extrapolated")
    if B <= B_MIN * 1.0001 or B >= B_MAX * 0.9999:
        flags.append(f"B={B:.4g} at the search bound [{B_MIN}, {B_MAX}]")
    if n < 8:
        flags.append(f"only {n} points in the fit")
    if r2 < 0.5:
        flags.append(f"the sigmoid explains little of the variation (R²={r2:.2f}): a flat or noisy curve")
    return tuple(flags)


def _polish_bounds(a: np.ndarray, a_default: bool, r0: float, cap: float,
                   cm: np.ndarray) -> tuple[tuple[float, float], tuple[float, float]]:
    """(A's range, C_mid's range) of the polish. A: (R0, cap] for the default grid, the given grid's
    span otherwise (one value fixes A); C_mid: the grid's span widened POLISH_REACH-fold each way
    (the grid seeds the polish, it does not bound it)."""
    if a_default:
        a_bounds = (r0 + 1e-9 * max(1.0, abs(r0)), cap)
    else:
        a_bounds = (float(a.min()), float(a.max()))
    return a_bounds, (float(cm.min()) / POLISH_REACH, float(cm.max()) * POLISH_REACH)


def fit(
    compute: Any,
    reward: Any,
    *,
    r0: float | None = None,
    min_compute: float = 0.0,
    a_grid: Sequence[float] | np.ndarray | None = None,
    c_mid_grid: Sequence[float] | np.ndarray | None = None,
    polish: bool = True,
) -> FitResult:
    """Fit Eq. 1 by the paper's procedure (PAPER.md §1, A.5), polished continuously.

    compute: [n] strictly increasing, >= 0 (GPU-hours, device-hours or FLOPs).
    reward:  [n] mean pass rate at each compute.
    r0:      R0; default: the reward of the first measured point (smallest compute).
    min_compute: points with compute below it are excluded (the fit's start; analysis/protocol.py).
    a_grid / c_mid_grid: override the grids (a one-value a_grid fixes A, as in a refit). A given
             A grid also bounds the polished A; the default one runs up to the cap (1.0 for pass
             rates). C_mid is never held by its grid: the polish may go POLISH_REACH-fold past it.
    polish:  False keeps the grid winner (the paper's procedure to the letter; B is still exact).

    Raises FitError on NaN, non-increasing compute, fewer than 4 points or a curve without
    gain over R0. Returns a FitResult whose `flags` name anything suspicious (a parameter at the
    end of its range, few points); `result.ok` is False then.
    """
    c_all, r_all = _validate(compute, reward)
    if c_all.size == 0:
        raise FitError("no points to fit")
    if r0 is None:
        r0 = float(r_all[0])
    elif not np.isfinite(r0):
        raise FitError(f"r0 must be finite, got {r0!r}")
    keep = c_all >= min_compute
    c, r = c_all[keep], r_all[keep]
    if c.size < MIN_POINTS:
        raise FitError(
            f"too few points to fit: {c.size} with compute >= min_compute={min_compute!r} "
            f"(of {c_all.size}); need at least {MIN_POINTS}"
        )
    if not np.any(c > 0):
        raise FitError("all points are at compute 0")
    gain = float(np.max(r[c > 0]) - r0)
    if gain <= 1e-6 * max(1.0, abs(r0)):
        raise FitError(
            f"no gain to fit: the best reward {float(np.max(r)):.6g} does not exceed R0={r0:.6g} "
            "(a flat or falling curve has no sigmoid)"
        )
    a = np.asarray(default_a_grid(r0, r[c > 0]) if a_grid is None else a_grid, dtype=np.float64).ravel()
    cm = np.asarray(default_c_mid_grid(c) if c_mid_grid is None else c_mid_grid, dtype=np.float64).ravel()
    if a.size == 0 or cm.size == 0 or np.any(~np.isfinite(a)) or np.any(~np.isfinite(cm)) or np.any(cm <= 0):
        raise FitError("a_grid and c_mid_grid must be non-empty, finite, and C_mid > 0")
    if np.any(np.abs(a - r0) < 1e-12):
        raise FitError(f"a_grid contains A == R0={r0!r}: the curve would be flat")
    w = np.ones_like(c)
    A, B, C_mid, sse, _ = _fit_core(c, r, w, r0, a, cm)
    cap = _a_cap(r0, r)
    a_bounds, c_bounds = _polish_bounds(a, a_grid is None, r0, cap, cm)
    if polish:
        A, B, C_mid, sse = _polish(c, r, w, r0, (A, B, C_mid), a_bounds, c_bounds)
    else:
        a_bounds, c_bounds = (float(a.min()), float(a.max())), (float(cm.min()), float(cm.max()))
    n = int(c.size)
    sst = float(np.sum((r - r.mean()) ** 2))
    r2 = 1.0 - sse / sst if sst > 0 else 0.0
    flags = _flags(A, B, C_mid, a_bounds, c_bounds, n, r2, cap, float(c.max()))
    return FitResult(
        A=A, B=B, C_mid=C_mid, R0=float(r0), sse=sse, rmse=math.sqrt(sse / n), r2=r2, n_points=n,
        compute=c, reward=r, min_compute=float(min_compute), a_grid=a, c_mid_grid=cm, flags=flags,
        a_default=a_grid is None,
    )


def refit_at(result: FitResult, A: float, c_mid_grid: np.ndarray | None = None) -> FitResult:
    """Refit `result`'s points with A fixed (grid over C_mid, B least-squares, then both polished)."""
    return fit(
        result.compute, result.reward, r0=result.R0, min_compute=result.min_compute,
        a_grid=[A], c_mid_grid=result.c_mid_grid if c_mid_grid is None else c_mid_grid,
    )


# ----------------------------------------------------------------------------- profile interval of A


@dataclasses.dataclass(frozen=True)
class AProfile:
    """The profile-likelihood interval of A for one fit (beyond the paper).

    `low`/`high` lie inside the valid range of A: [search floor, cap] with cap = 1.0 for pass
    rates. `at_cap`: the interval reaches the cap (the data cannot rule out a curve that is still
    far from saturating); `at_floor`: it reaches the bottom of the searched range. `identified`:
    at most A_IDENTIFIED_WIDTH wide and reaching neither end (DESIGN.md "Comparing configurations").
    """

    low: float
    high: float
    level: float
    cap: float
    at_cap: bool
    at_floor: bool  # the interval reaches the bottom of the searched range (a lower bound only)
    a_grid: np.ndarray  # [m] the A values profiled (the fine pass)
    sse: np.ndarray  # [m] the least squared error at each A (B and C_mid free)
    threshold: float  # SSE <= threshold is inside the interval

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def identified(self) -> bool:
        return bool(np.isfinite(self.width) and self.width <= A_IDENTIFIED_WIDTH + 1e-12
                    and not self.at_cap and not self.at_floor)

    def describe(self) -> str:
        if self.identified:
            return f"A in [{self.low:.3f}, {self.high:.3f}]"
        why = ("reaches the cap" if self.at_cap else "reaches the search floor" if self.at_floor
               else f"wider than {A_IDENTIFIED_WIDTH}")
        return f"A in [{self.low:.3f}, {self.high:.3f}] (A not identified: {why})"


def _profile_sse(result: FitResult, a_values: np.ndarray, cm: np.ndarray,
                 c_bounds: tuple[float, float]) -> np.ndarray:
    """[m] the least squared error of `result`'s points at each A of `a_values` [m], B and C_mid
    free: the grid solver over `cm` seeds a polish of (B, C_mid) at each A."""
    c, r, r0 = result.compute, result.reward, result.R0
    pos = c > 0
    t, w = r - r0, np.ones_like(c)
    const_sse = float(np.sum(t[~pos] ** 2))
    b_grid = np.geomspace(B_MIN, B_MAX, N_B_GRID)
    chunk = max(1, _WORK_ELEMENTS // (max(a_values.size, b_grid.size) * max(int(pos.sum()), 1)))
    best = np.full(a_values.size, np.inf)  # [m]
    best_b, best_c = np.ones(a_values.size), np.full(a_values.size, float(cm[0]))  # [m]
    for i in range(0, cm.size, chunk):
        b_mat, part = _best_b(np.log(c[pos]), t[pos], w[pos], const_sse, a_values - r0, cm[i:i + chunk], b_grid)
        j = np.argmin(part, axis=1)  # [m]
        val = part[np.arange(a_values.size), j]
        better = val < best
        best = np.where(better, val, best)
        best_b = np.where(better, b_mat[np.arange(a_values.size), j], best_b)
        best_c = np.where(better, cm[i:i + chunk][j], best_c)
    out = np.empty(a_values.size)
    for k, A in enumerate(a_values):
        out[k] = _polish(c, r, w, r0, (float(A), float(best_b[k]), float(best_c[k])), (float(A), float(A)), c_bounds)[3]
    return out


def _crossing(a: np.ndarray, sse: np.ndarray, threshold: float, i_in: int, i_out: int) -> float:
    """Where SSE crosses the threshold between an inside point and the outside point next to it
    (linear in SSE): the interval's end between two profiled values of A."""
    s_in, s_out = float(sse[i_in]), float(sse[i_out])
    if not np.isfinite(s_out) or s_out <= s_in:
        return float(a[i_in])
    f = (threshold - s_in) / (s_out - s_in)
    return float(a[i_in] + min(max(f, 0.0), 1.0) * (a[i_out] - a[i_in]))


_PROFILES: "collections.OrderedDict[bytes, AProfile]" = collections.OrderedDict()  # profile_A's memo
_PROFILES_MAX = 4096


def _profile_key(result: FitResult, level: float, n_grid: int, n_fine: int) -> bytes:
    """What profile_A reads of `result`, hashed: a report that judges one run twice (A, tail and auc
    verdicts, a regenerated report) profiles it once."""
    h = hashlib.blake2b(digest_size=20)
    for arr in (result.compute, result.reward, result.a_grid, result.c_mid_grid):
        a = np.ascontiguousarray(arr, dtype=np.float64)
        h.update(a.size.to_bytes(8, "little"))
        h.update(a.tobytes())
    h.update(np.array([result.R0, result.A, result.sse, level, n_grid, n_fine], dtype=np.float64).tobytes())
    return h.digest()


def profile_A(result: FitResult, *, level: float = 0.95, n_grid: int = 41, n_fine: int = 61) -> AProfile:
    """The profile-likelihood interval of A of `result` (its points and R0); remembered per points
    and fit (the same run judged again costs nothing)."""
    key = _profile_key(result, level, n_grid, n_fine)
    if key in _PROFILES:
        _PROFILES.move_to_end(key)
        return _PROFILES[key]
    prof = _profile_A(result, level=level, n_grid=n_grid, n_fine=n_fine)
    _PROFILES[key] = prof
    while len(_PROFILES) > _PROFILES_MAX:
        _PROFILES.popitem(last=False)
    return prof


def _profile_A(result: FitResult, *, level: float, n_grid: int, n_fine: int) -> AProfile:
    """The profile-likelihood interval of A of `result` (its points and R0).

    For each A from R0 + 0.3·(best − R0) to the cap, B and C_mid are refitted (grid solver, then
    the continuous polish; C_mid from its grid's bottom up to 1000x the largest compute and free
    beyond, as in `fit`); A is inside the interval where that least squared error stays within
    the F-test bound of nonlinear least squares (Bates & Watts):
        SSE(A) <= SSE_min · (1 + F(level; 1, n − 3) / (n − 3)).
    A coarse pass finds the region, a fine pass over it (one coarse step wider each side) places
    the ends, each interpolated to where SSE crosses the bound. The cap is 1.0 for pass rates
    (R0 >= 0 and rewards <= 1), else the fit's own A grid top.
    """
    from scipy.stats import f as f_dist

    n = result.n_points
    c, r, r0 = result.compute, result.reward, result.R0
    best = float(np.max(r[c > 0])) if np.any(c > 0) else float(np.max(r))
    cap = _a_cap(r0, r)
    if not math.isfinite(cap):
        cap = float(result.a_grid.max())
    floor = r0 + 0.3 * (best - r0)
    cm = np.union1d(result.c_mid_grid, np.geomspace(result.c_mid_grid.max(), float(c.max()) * 1e3, 40))
    c_bounds = (float(cm.min()) / POLISH_REACH, float(cm.max()) * POLISH_REACH)
    dof = n - 3
    if dof < 1:
        return AProfile(floor, cap, level, cap, True, True, np.array([floor, cap]), np.full(2, np.nan), math.inf)
    factor = 1.0 + float(f_dist.ppf(level, 1, dof)) / dof

    def keep(a: np.ndarray) -> np.ndarray:
        return a[np.abs(a - r0) > 1e-12]

    coarse = keep(np.linspace(floor, cap, n_grid))  # [m]
    sse_c = _profile_sse(result, coarse, cm, c_bounds)
    sse_min = min(float(sse_c.min()), result.sse)
    inside = np.flatnonzero(sse_c <= sse_min * factor * (1.0 + 1e-12))
    if inside.size == 0:  # the optimum lies between coarse points: search around the fit's own A
        inside = np.array([int(np.argmin(np.abs(coarse - result.A)))])
    a0 = coarse[max(inside[0] - 1, 0)]
    a1 = coarse[min(inside[-1] + 1, coarse.size - 1)]
    fine = keep(np.union1d(np.linspace(a0, a1, n_fine), [min(max(result.A, a0), a1)]))  # [m']
    sse_f = _profile_sse(result, fine, cm, c_bounds)
    sse_min = min(sse_min, float(sse_f.min()))
    threshold = sse_min * factor
    inside = np.flatnonzero(sse_f <= threshold * (1.0 + 1e-12))
    if inside.size == 0:  # cannot happen unless the polish failed everywhere: nothing can be said of A
        return AProfile(floor, cap, level, cap, True, True, fine, sse_f, threshold)
    i0, i1 = int(inside[0]), int(inside[-1])
    low = _crossing(fine, sse_f, threshold, i0, i0 - 1) if i0 > 0 else float(fine[i0])
    high = _crossing(fine, sse_f, threshold, i1, i1 + 1) if i1 < fine.size - 1 else float(fine[i1])
    low, high = min(low, result.A), max(high, min(result.A, cap))
    at_cap = high >= cap - 1e-9
    at_floor = low <= floor + 1e-9
    return AProfile(low, high, level, cap, bool(at_cap), bool(at_floor), fine, sse_f, threshold)


# ----------------------------------------------------------------------------- comparison


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The paper's comparison of two fits. `winner` is "a", "b" or "tie"."""

    winner: str
    decided_by: str  # "A" | "B" | "C_mid" | "tie"
    A_a: float
    A_b: float
    common_A: float | None  # the mean A both were refitted at (None when A decided)
    B_a: float  # B at the common A (original B when A decided)
    B_b: float
    C_mid_a: float
    C_mid_b: float
    explanation: str


def compare(
    a: FitResult, b: FitResult, *, margin: float = A_MARGIN, b_tol: float = 0.01, c_mid_rtol: float = 0.01
) -> Comparison:
    """The paper's rule (§1 "How methods are compared").

    |A_a − A_b| > margin: the higher A wins. Otherwise refit both at their mean A and compare
    B (higher wins; |ΔB| <= b_tol is a tie on B), then C_mid (smaller wins; relative difference
    <= c_mid_rtol is a tie).
    """
    if abs(a.A - b.A) > margin:
        w = "a" if a.A > b.A else "b"
        return Comparison(
            w, "A", a.A, b.A, None, a.B, b.B, a.C_mid, b.C_mid,
            f"A differs by {abs(a.A - b.A):.3f} > margin {margin}: higher A wins ({max(a.A, b.A):.3f})",
        )
    common = 0.5 * (a.A + b.A)
    grid = np.union1d(a.c_mid_grid, b.c_mid_grid)
    ra, rb = refit_at(a, common, grid), refit_at(b, common, grid)
    if abs(ra.B - rb.B) > b_tol:
        w = "a" if ra.B > rb.B else "b"
        return Comparison(
            w, "B", a.A, b.A, common, ra.B, rb.B, ra.C_mid, rb.C_mid,
            f"A within {margin} (refit at A={common:.3f}): higher B wins ({ra.B:.3f} vs {rb.B:.3f})",
        )
    rel = abs(ra.C_mid - rb.C_mid) / max(ra.C_mid, rb.C_mid)
    if rel > c_mid_rtol:
        w = "a" if ra.C_mid < rb.C_mid else "b"
        return Comparison(
            w, "C_mid", a.A, b.A, common, ra.B, rb.B, ra.C_mid, rb.C_mid,
            f"A and B tied (A={common:.3f}, B {ra.B:.3f} vs {rb.B:.3f}): smaller C_mid wins "
            f"({ra.C_mid:.4g} vs {rb.C_mid:.4g})",
        )
    return Comparison(
        "tie", "tie", a.A, b.A, common, ra.B, rb.B, ra.C_mid, rb.C_mid,
        f"A, B and C_mid all tied at A={common:.3f}",
    )


def refit_common_a(fits: Mapping[str, FitResult], A: float | None = None) -> dict[str, FitResult]:
    """Refit every fit at one A (default: the mean of their A), as for the LOO table (Fig 7)."""
    if not fits:
        return {}
    common = float(np.mean([f.A for f in fits.values()])) if A is None else float(A)
    grid = np.unique(np.concatenate([f.c_mid_grid for f in fits.values()]))
    return {name: refit_at(f, common, grid) for name, f in fits.items()}


def loo_transform(
    compute: Any, reward: Any, *, A: float, B: float, C_mid: float, R0: float
) -> tuple[np.ndarray, np.ndarray]:
    """Fig 7: (log C, log F(R_C)) with F(R) = C_mid^B / ((A − R0)/(R − R0) − 1).

    Under Eq. 1, F(R_C) = C^B, so log F against log C is a line of slope B through the origin.
    Only points with compute > 0 and R0 < R < A (where F is defined) are returned.
    """
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    ok = (c > 0) & ((r - R0) * np.sign(A - R0) > 0) & ((A - r) * np.sign(A - R0) > 0)
    y = (A - R0) / (r[ok] - R0) - 1.0
    log_f = B * math.log(C_mid) - np.log(y)
    return np.log(c[ok]), log_f


# ----------------------------------------------------------------------------- bootstrap


@dataclasses.dataclass(frozen=True)
class BootstrapResult:
    fit: FitResult
    samples: np.ndarray  # [n_boot, 3] columns A, B, C_mid
    level: float

    def interval(self, name: str) -> tuple[float, float]:
        col = {"A": 0, "B": 1, "C_mid": 2}[name]
        q = (1.0 - self.level) / 2.0
        lo, hi = np.quantile(self.samples[:, col], [q, 1.0 - q])
        return float(lo), float(hi)

    def intervals(self) -> dict[str, tuple[float, float]]:
        return {k: self.interval(k) for k in ("A", "B", "C_mid")}


def bootstrap(
    compute: Any,
    reward: Any,
    *,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    progress: bool = False,
    **fit_kwargs: Any,
) -> BootstrapResult:
    """Percentile bootstrap intervals for A, B and C_mid.

    Resamples the evaluation points used in the fit with replacement (seeded), keeping R0 and
    the grids of the full-data fit; each resample is refitted by the same procedure.
    """
    base = fit(compute, reward, **fit_kwargs)
    rng = np.random.default_rng(seed)
    n = base.n_points
    out = np.empty((n_boot, 3))
    it: Iterable[int] = range(n_boot)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="bootstrap", unit="fit")
    for k in it:
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(np.float64)  # [n] counts
        out[k] = _refit_weighted(base, w)
    return BootstrapResult(base, out, level)


def _refit_weighted(base: FitResult, w: np.ndarray) -> tuple[float, float, float]:
    """(A, B, C_mid) of `base`'s points refitted with weights `w` [n] (bootstrap counts): the same
    grid and polish as `fit`."""
    A, B, C_mid, _, _ = _fit_core(base.compute, base.reward, w, base.R0, base.a_grid, base.c_mid_grid)
    cap = _a_cap(base.R0, base.reward)
    a_bounds, c_bounds = _polish_bounds(base.a_grid, base.a_default, base.R0, cap, base.c_mid_grid)
    A, B, C_mid, _ = _polish(base.compute, base.reward, w, base.R0, (A, B, C_mid), a_bounds, c_bounds)
    return A, B, C_mid


# ----------------------------------------------------------------------------- prediction


def loglinear_fit(compute: Any, reward: Any) -> tuple[float, float]:
    """(intercept, slope) of reward = intercept + slope · ln C by least squares over the points
    with C > 0: the baseline a sigmoid prediction must beat."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    keep = c > 0
    if keep.sum() < 2:
        raise FitError("the log-linear baseline needs two points with compute > 0")
    slope, intercept = np.polyfit(np.log(c[keep]), r[keep], 1)
    return float(intercept), float(slope)


# The prediction interval (issue 41). The interval of the observed end accounts for
# - the evaluation noise of the fitted points and of the end itself: AR(1) noise (successive
#   evaluations of one run are correlated), its sd drawn from its scaled inverse-chi² distribution
#   (a short prefix estimates it from a few residuals);
# - the fit's uncertainty: every simulated prefix is refitted (a parametric bootstrap, all
#   replicates at once by a batched Levenberg-Marquardt from the fit);
# - the law's own uncertainty over the extrapolated range: a prefix that has not seen the bend
#   fits a straight line in log compute about as well, and the two extrapolations disagree; the
#   interval adds a normal term with the sd of a uniform spread over that disagreement (|g|/√12).
PREDICT_BOOT = 200  # replicates behind a prediction interval
MODEL_SPREAD = 1.0 / math.sqrt(12.0)  # the sd of a uniform over [0, 1]: a uniform spread over the gap
AR_MAX = 0.9  # the largest lag-1 correlation of the noise the interval assumes
PIN_WIDTH = A_IDENTIFIED_WIDTH  # an interval of the end wider than this: the prefix cannot pin the end
_LM_ITERS = 60


def _batch_refit(c: np.ndarray, Y: np.ndarray, r0: float, start: tuple[float, float, float],
                 a_bounds: tuple[float, float], c_mid_bounds: tuple[float, float],
                 iters: int = _LM_ITERS) -> np.ndarray:
    """Least squares of Eq. 1 on K curves at once: c [n] the fitted compute, Y [K, n] the rewards.
    Levenberg-Marquardt in (A, ln B, ln C_mid), every replicate started at `start` (the fit it
    was simulated from) with its own damping, steps projected onto the polish's bounds. Returns
    [K, 3] columns A, B, C_mid (the replicates of a parametric bootstrap lie near the start, so a
    local solver finds what `fit`'s grid and polish find: tests check it against `fit`)."""
    K, n = Y.shape
    pos = c > 0  # [n] points at C = 0 sit at R0 whatever the parameters
    lc = np.log(np.where(pos, c, 1.0))  # [n]
    lo = np.array([a_bounds[0], math.log(B_MIN), math.log(c_mid_bounds[0])])
    hi = np.array([a_bounds[1], math.log(B_MAX), math.log(c_mid_bounds[1])])
    th = np.tile(np.clip([start[0], math.log(start[1]), math.log(start[2])], lo, hi), (K, 1))  # [K, 3]

    def model(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        z = np.exp(t[:, 1:2]) * (lc[None] - t[:, 2:3])  # [K, n] B·ln(C / C_mid)
        s = np.where(pos[None], expit(z), 0.0)
        return r0 + (t[:, 0:1] - r0) * s, s, z

    f, s, z = model(th)
    res = f - Y  # [K, n]
    sse = np.sum(res ** 2, axis=1)  # [K]
    lam = np.full(K, 1e-3)
    eye = np.eye(3)
    for _ in range(iters):
        d, b = th[:, 0:1] - r0, np.exp(th[:, 1:2])
        q = s * (1.0 - s)
        J = np.stack([s, d * q * z, -d * q * b], axis=-1)  # [K, n, 3] d model / d (A, ln B, ln C_mid)
        JtJ = np.einsum("kni,knj->kij", J, J)  # [K, 3, 3]
        g = np.einsum("kni,kn->ki", J, res)  # [K, 3]
        M = JtJ + lam[:, None, None] * (np.einsum("kii->ki", JtJ)[:, :, None] * eye + 1e-12 * eye)
        try:
            step = -np.linalg.solve(M, g[..., None])[..., 0]  # [K, 3]
        except np.linalg.LinAlgError:  # a singular system (a degenerate replicate): stop where it is
            break
        new = np.clip(th + step, lo, hi)
        f2, s2, z2 = model(new)
        res2 = f2 - Y
        sse2 = np.sum(res2 ** 2, axis=1)
        ok = np.isfinite(sse2) & (sse2 < sse)
        th = np.where(ok[:, None], new, th)
        s, z, res = np.where(ok[:, None], s2, s), np.where(ok[:, None], z2, z), np.where(ok[:, None], res2, res)
        sse = np.where(ok, sse2, sse)
        lam = np.clip(np.where(ok, lam / 3.0, lam * 4.0), 1e-10, 1e10)
    return np.stack([th[:, 0], np.exp(th[:, 1]), np.exp(th[:, 2])], axis=1)


def _ar1(rng: np.random.Generator, sd: np.ndarray, n: int, phi: float) -> np.ndarray:
    """[K, n] stationary AR(1) noise with lag-1 correlation phi and marginal sd `sd` [K]."""
    z = rng.standard_normal((sd.size, n))
    if phi > 0 and n > 1:
        scale = math.sqrt(1.0 - phi * phi)
        for i in range(1, n):
            z[:, i] = phi * z[:, i - 1] + scale * z[:, i]
    return z * sd[:, None]


def noise_model(res: FitResult) -> tuple[float, float, float]:
    """(sd, lag-1 correlation, degrees of freedom) of a fit's evaluation noise, from its residuals at
    C > 0 (a point at C = 0 sits at R0 by construction). sd² = SSE / (m − 3); the lag-1
    autocorrelation of the residuals, corrected for the fit (the residuals of a 3-parameter fit to
    white noise have lag-1 correlation ≈ −3/m: measured, tests/test_prediction.py), clipped to
    [0, AR_MAX]; the degrees of freedom shrink by (1 − φ)/(1 + φ) for correlated noise."""
    pos = res.compute > 0
    e = (res.reward - res(res.compute))[pos]  # [m]
    m = e.size
    df = max(m - 3, 1)
    ss = float(np.sum(e * e))
    sd = math.sqrt(ss / df)
    phi = 0.0
    if m >= 5 and ss > 0:
        phi = min(max(float(np.sum(e[1:] * e[:-1])) / ss + 3.0 / m, 0.0), AR_MAX)
    return sd, phi, max(df * (1.0 - phi) / (1.0 + phi), 1.0)


def _valid_range(res: FitResult) -> tuple[float, float]:
    """Where an observed pass rate can lie: [0, 1] for pass rates, else unbounded."""
    if res.R0 >= 0 and float(np.max(res.reward)) <= 1.0:
        return min(0.0, float(np.min(res.reward))), 1.0
    return -math.inf, math.inf


@dataclasses.dataclass(frozen=True)
class PredictiveDraws:
    """Draws of the observed value at `at` (a mean over the evaluations at `at`) given a fit."""

    center: float  # the law's prediction
    draws: np.ndarray  # [K] fit uncertainty + evaluation noise + the law's spread
    baseline: float  # the log-linear line's prediction from the same points
    sd: float  # the evaluation noise (sd, lag-1 correlation, degrees of freedom): `noise_model`
    phi: float
    df: float
    valid: tuple[float, float]  # the range an observation can take

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        """The percentile interval at `level`, inside the valid range."""
        q = (1.0 - level) / 2.0
        lo, hi = np.quantile(self.draws, [q, 1.0 - q])
        return float(min(max(lo, self.valid[0]), self.valid[1])), float(max(min(hi, self.valid[1]), self.valid[0]))


def predictive_draws(res: FitResult, at: Any, *, n_boot: int = PREDICT_BOOT, seed: int = 0) -> PredictiveDraws:
    """The calibrated predictive distribution of the observed value at compute `at` (a number: one
    evaluation; an array: the mean of evaluations there, e.g. a tail window) from the fit `res`.

    Parametric bootstrap: n_boot noise series (AR(1), `noise_model`, the sd drawn from its scaled
    inverse-chi² distribution) added to the fitted curve at the fitted points, each refitted
    (`_batch_refit`); the refitted law at `at`, plus the noise of the evaluations at `at` (the
    same sd, their mean's correlation), plus the law's spread: a normal term of sd
    MODEL_SPREAD·|g|, g the gap between the log-linear line (fitted on the same points) and the
    law at `at`. Seeded: the same inputs give the same draws."""
    at_c = np.atleast_1d(np.asarray(at, dtype=np.float64))  # [m_at]
    rng = np.random.default_rng(seed)
    sd, phi, df = noise_model(res)
    pos = res.compute > 0
    fitted = res(res.compute)  # [n]
    center = float(np.mean(res(at_c)))
    a0, a1 = loglinear_fit(res.compute, res.reward)
    baseline = float(np.mean(a0 + a1 * np.log(at_c)))
    valid = _valid_range(res)
    if n_boot <= 0:
        return PredictiveDraws(center, np.array([center]), baseline, sd, phi, df, valid)
    sds = sd * np.sqrt(df / rng.chisquare(df, n_boot))  # [K]
    Y = np.tile(fitted, (n_boot, 1))  # [K, n]
    Y[:, pos] += _ar1(rng, sds, int(pos.sum()), phi)
    cap = _a_cap(res.R0, res.reward)
    a_bounds, c_bounds = _polish_bounds(res.a_grid, res.a_default, res.R0, cap, res.c_mid_grid)
    th = _batch_refit(res.compute, Y, res.R0, (res.A, res.B, res.C_mid), a_bounds, c_bounds)  # [K, 3]
    law = np.mean(sigmoid(at_c[None, :], th[:, 0:1], th[:, 1:2], th[:, 2:3], res.R0), axis=1)  # [K]
    k = np.arange(at_c.size)
    corr = float(np.mean(phi ** np.abs(k[:, None] - k[None, :])))  # var of the mean over sd²
    noise = rng.standard_normal(n_boot) * sds * math.sqrt(corr)
    spread = rng.standard_normal(n_boot) * MODEL_SPREAD * abs(baseline - center)
    return PredictiveDraws(center, law + noise + spread, baseline, sd, phi, df, valid)


def prediction_interval(res: FitResult, at: Any, *, n_boot: int = PREDICT_BOOT, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
    """The `level` prediction interval of the observed value at compute `at` from the fit `res`
    (`predictive_draws`): evaluation noise, correlated; the fit's uncertainty; the law's spread
    over the extrapolated range. Percentile interval inside the valid range (0-1 for pass
    rates). Its coverage is measured: BENCHMARKS.md "Calibrated prediction"."""
    return predictive_draws(res, at, n_boot=n_boot, seed=seed).interval(level)


@dataclasses.dataclass(frozen=True)
class Prediction:
    fit: FitResult  # fitted on compute <= cutoff
    fraction: float
    cutoff: float
    final_compute: float
    predicted_final: float
    observed_final: float
    error: float  # predicted − observed at the final point
    heldout_compute: np.ndarray  # [m] points after the cutoff
    heldout_reward: np.ndarray
    heldout_predicted: np.ndarray
    heldout_mae: float
    # the log-linear baseline on the same points (reward = a + b·ln C)
    baseline_final: float = math.nan
    baseline_error: float = math.nan
    # the sigmoid's prediction interval for the observed end (NaN when n_boot = 0)
    low: float = math.nan
    high: float = math.nan
    level: float = 0.95
    # the last value before the cutoff, as a prediction of the end (the naive baseline)
    last_value: float = math.nan
    noise_sd: float = math.nan  # the fitted points' evaluation noise and its lag-1 correlation
    noise_phi: float = math.nan

    @property
    def covered(self) -> bool | None:
        """Whether the observed end falls inside the prediction interval (None: no interval)."""
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            return None
        return bool(self.low <= self.observed_final <= self.high)

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def pinned(self) -> bool | None:
        """Whether the prefix pins the end: its interval is at most PIN_WIDTH (0.1) wide (None: no
        interval)."""
        if not math.isfinite(self.width):
            return None
        return bool(self.width <= PIN_WIDTH)

    def pin_text(self) -> str:
        """'' when the prefix pins the end; else why not, in words."""
        if self.pinned is None:
            return "no interval"
        if self.pinned:
            return ""
        return (f"the first {self.fraction:.0%} cannot pin the end: its {self.level:.0%} interval "
                f"[{self.low:.3f}, {self.high:.3f}] is {self.width:.3f} wide (> {PIN_WIDTH:g})")

    def summary(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "cutoff": self.cutoff,
            "final_compute": self.final_compute,
            "predicted_final": self.predicted_final,
            "observed_final": self.observed_final,
            "error": self.error,
            "abs_error": abs(self.error),
            "heldout_mae": self.heldout_mae,
            "n_heldout": int(self.heldout_compute.size),
            "baseline_final": self.baseline_final,
            "baseline_error": self.baseline_error,
            "last_value": self.last_value,
            "last_error": self.last_value - self.observed_final,
            "predicted_low": self.low,
            "predicted_high": self.high,
            "covered": self.covered,
            "pinned": self.pinned,
        }


def predict(
    compute: Any, reward: Any, *, fraction: float = 0.5, n_boot: int = 0, seed: int = 0,
    level: float = 0.95, **fit_kwargs: Any,
) -> Prediction:
    """Fit on compute <= fraction × final compute; predict the final pass rate, with its interval.

    The error is predicted − observed at the last point; `heldout_mae` averages over all points
    after the cutoff (the paper's "×" markers). Beside it, the log-linear baseline (reward =
    a + b·ln C) fitted on the same points (those the sigmoid used) and the last value before the
    cutoff predict the same end. n_boot > 0 (PREDICT_BOOT = 200 is what `scalerl fit --fraction`,
    the report and the benchmark use) adds the calibrated prediction interval of the observed end
    (`prediction_interval`: `low`, `high`, `covered`; `pinned` is False, and `pin_text` says so,
    when it is wider than PIN_WIDTH: the prefix cannot pin the end); n_boot = 0: the point
    prediction only.
    fit_kwargs go to `fit` (min_compute: where the fit starts; r0 defaults to the first reward).
    """
    if not 0.0 < fraction < 1.0:
        raise FitError(f"fraction must be in (0, 1), got {fraction!r}")
    c, r = _validate(compute, reward)
    if c.size == 0:
        raise FitError("no points")
    cutoff = fraction * float(c[-1])
    head = c <= cutoff
    if head.all():
        raise FitError("no points after the cutoff to predict")
    if "r0" not in fit_kwargs:
        fit_kwargs["r0"] = float(r[0])
    res = fit(c[head], r[head], **fit_kwargs)
    tail_c, tail_r = c[~head], r[~head]
    pred = res(tail_c)
    a0, a1 = loglinear_fit(res.compute, res.reward)
    base = a0 + a1 * math.log(float(c[-1]))
    draws = predictive_draws(res, float(c[-1]), n_boot=n_boot, seed=seed)
    lo, hi = draws.interval(level) if n_boot > 0 else (math.nan, math.nan)
    return Prediction(
        fit=res, fraction=float(fraction), cutoff=cutoff, final_compute=float(c[-1]),
        predicted_final=float(pred[-1]), observed_final=float(tail_r[-1]),
        error=float(pred[-1] - tail_r[-1]), heldout_compute=tail_c, heldout_reward=tail_r,
        heldout_predicted=pred, heldout_mae=float(np.mean(np.abs(pred - tail_r))),
        baseline_final=float(base), baseline_error=float(base - tail_r[-1]), low=lo, high=hi, level=level,
        last_value=float(r[head][-1]), noise_sd=draws.sd, noise_phi=draws.phi,
    )
