"""The paper's fit protocol, in one place: which part of a run is fitted, where the fit starts,
the margin on A, and when a run's compute axis is not trusted (CPU contention).

Protocols (PAPER.md §1 "Fitting procedure" and "Extrapolation protocols"):

| name      | fitted range                | used for (paper)                                                     |
|-----------|-----------------------------|----------------------------------------------------------------------|
| `whole`   | the whole run               | forward ablations (Figs 4-6, 14, 19, 20): 3.5-4k GPU-h, fitted whole |
| `loo`     | first half of the run       | leave-one-out and independent ScaleRL runs: fit to 8k of 16k GPU-h   |
| `scaling` | first half of the run       | Section 5 axes and the large runs (Figs 1a, 9, 10, 17, Table 1)      |
| `recipes` | first half of the run       | Fig 2: fitted, then extended (cutoff not in the text)                |

Which figure uses which protocol is set per figure in `analysis/figure_specs.py`; a sweep takes
the protocol of the figures that draw it (`sweep_protocol`).

`min_compute` (where the fit starts), rule "paper" (the default): the paper skips its first
~1.5k GPU-h and fits from there (PAPER.md §1). The default keeps that cutoff where the paper has
it, as a FRACTION OF THE FITTED RANGE: 1.5k of the 3.75k GPU-h of a forward ablation (0.40, the
whole-run fits), of the 8k fitted in a LOO run (0.19), of the ~50k fitted for the large runs
(0.03), of the ~16k fitted for the Fig 2 recipes (0.094; a secondary figure reading). The
fraction is of the fitted range's end (`fit_fraction` × the run's final compute). The paper calls
its cutoff "about one epoch", but where a run's first epoch ends depends on the size of its
prompt pool, which a study chooses (a pool sized so that No-Positive-Resampling never runs dry
puts the end of epoch 1 near the end of the run: 0.67 in results/tiny_long), so the epoch is not
the rule.
Rule "epoch" takes the end of epoch 1 for every fit (a run that logs no `epoch`, or never
reaches epoch 1, starts at the protocol's fraction instead); "none" fits from the first point; a
number is an absolute compute value.

The margin on A (`Margin`): see analysis/README.md "The margin on A".
Contention: a run whose cumulative `contention_run` (the share of its CPUs that other work used,
from /proc/stat; components/trainer/accounting.py) exceeds CONTENTION_LIMIT shared its cores. Its
compute axis is stretched when that work took CPU time the run's own threads were waiting for: their
run-queue share (`runq_run`, schedstat) above RUNQ_LIMIT. Both must hold for the flag (`contended`);
a run that does not log its run-queue share is judged by `contention_run` alone. Work that only
used CPU time the run left idle (a study run with CPU priority beside other jobs) stretches nothing:
the small study's first four runs (dapo, beside 20-24% foreign load, at a 2.7-4.8% run-queue share)
trained at 0.00082-0.00083 compute-hours per step, as the pilot's baseline runs did beside 5%
(0.00082-0.00084).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from analysis.figure_specs import FIGURES
from analysis.scaling_law import A_MARGIN, FitError, FitResult, fit

__all__ = [
    "CONTENTION_LIMIT",
    "RUNQ_LIMIT",
    "PAPER_MIN_COMPUTE_GPUH",
    "Protocol",
    "PROTOCOLS",
    "DEFAULT_PROTOCOL",
    "get_protocol",
    "sweep_protocol",
    "parse_min_compute",
    "resolve_min_compute",
    "ProtocolFit",
    "fit_with_protocol",
    "epoch1_compute",
    "is_contended",
    "Margin",
    "margin_from_seed_fits",
    "t_quantile",
]

CONTENTION_LIMIT = 0.10  # a run whose CPUs other work used above this share is flagged ...
RUNQ_LIMIT = 0.10  # ... when its own threads also waited for a CPU above this share of their time
PAPER_MIN_COMPUTE_GPUH = 1500.0  # the paper's fit cutoff (~1 epoch of its pool, A.5-A.7)


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    fit_fraction: float  # fit on compute <= fit_fraction × the run's final compute (1.0: the whole run)
    fallback_min_fraction: float  # the paper's cutoff: the fit starts at this fraction of the fitted range's end
    paper: str  # what the paper does, with where it says so

    def __post_init__(self):
        if not 0.0 < self.fit_fraction <= 1.0:
            raise ValueError(f"fit_fraction must be in (0, 1], got {self.fit_fraction!r}")
        if not 0.0 <= self.fallback_min_fraction < 1.0:
            raise ValueError(f"fallback_min_fraction must be in [0, 1), got {self.fallback_min_fraction!r}")

    def range_text(self, fit_fraction: float | None = None) -> str:
        f = self.fit_fraction if fit_fraction is None else fit_fraction
        return "whole run" if f >= 1.0 else f"first {f:.0%} of the run"

    def start_text(self, fit_fraction: float | None = None) -> str:
        """Where the default ("paper") rule starts this protocol's fits, in words."""
        return f"{self.fallback_min_fraction:.2g} of the fitted range (the paper's 1.5k GPU-h)"

    def describe(self, fit_fraction: float | None = None) -> str:
        """One line for a figure subtitle or a report: 'whole run, fit from 0.4 of the fitted range ...'."""
        return f"{self.range_text(fit_fraction)}, fit from {self.start_text(fit_fraction)} ({self.name} protocol)"


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in [
    Protocol("whole", 1.0, 1500.0 / 3750.0,
             "forward ablations: the whole 3.5-4k GPU-h run is fitted, points before ~1.5k GPU-h "
             "(about one epoch) excluded (PAPER.md §1 A.5-A.7)"),
    Protocol("loo", 0.5, 1500.0 / 8000.0,
             "leave-one-out and independent ScaleRL runs: fit 1.5k-8k of 16k GPU-h, extrapolate to 16k "
             "(PAPER.md §1 'Extrapolation protocols', A.6)"),
    Protocol("scaling", 0.5, 1500.0 / 50000.0,
             "Section 5 scaling axes and the large runs: fit the first half of the budget (100k run: "
             "1.5k-50k of 100k), then extend (PAPER.md §1, A.7)"),
    Protocol("recipes", 0.5, 1500.0 / 16000.0,
             "Fig 2 recipes: fitted, then extended ('×'); the cutoff is not in the text (a secondary "
             "reading: ~16k of 32k), so the first half as for the other prediction figures"),
]}
DEFAULT_PROTOCOL = "whole"


def get_protocol(name: str | Protocol | None) -> Protocol:
    if isinstance(name, Protocol):
        return name
    key = DEFAULT_PROTOCOL if name is None else str(name)
    if key not in PROTOCOLS:
        raise ValueError(f"unknown fit protocol {key!r}; choose from: {', '.join(PROTOCOLS)}")
    return PROTOCOLS[key]


def sweep_protocol(sweep: Any) -> Protocol:
    """The protocol of the figures that draw `sweep` (analysis/figure_specs.py); `whole` (a
    forward ablation) for a sweep that no fitted figure draws."""
    names = {f.protocol for f in FIGURES.values() if not f.synthetic and f.protocol and sweep in f.sweeps}
    if len(names) > 1:
        raise ValueError(f"figures drawing sweep {sweep!r} disagree on the fit protocol: {sorted(names)} "
                         "(analysis/figure_specs.py)")
    return get_protocol(names.pop() if names else DEFAULT_PROTOCOL)


# ----------------------------------------------------------------------------- min_compute


def parse_min_compute(value: Any) -> str | float:
    """'paper' (default: the paper's start for the protocol, see the module doc), 'epoch' (the
    end of the first epoch for every fit), 'none' (0: fit from the first point) or a number
    (absolute compute, in the units of the compute axis)."""
    if value is None:
        return "paper"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"min_compute must be >= 0 and finite, got {value!r}")
        return float(value)
    text = str(value).strip().lower()
    if text in ("paper", "auto", "default"):
        return "paper"
    if text in ("epoch", "epoch1"):
        return "epoch"
    if text in ("none", "0", "off"):
        return 0.0
    try:
        return parse_min_compute(float(text))
    except ValueError:
        raise ValueError(f"min_compute must be 'paper', 'epoch', 'none' or a number >= 0; got {value!r}") from None


def epoch1_compute(metrics_rows: Sequence[dict], compute: str = "compute_hours") -> tuple[float | None, float | None]:
    """(compute at the first metrics line with epoch >= 1, the largest epoch logged).

    (None, None) when no line carries `epoch`; (None, max epoch) when the run never reached 1.
    """
    last_epoch = None
    for row in metrics_rows:
        e = row.get("epoch")
        if not isinstance(e, (int, float)) or isinstance(e, bool) or not math.isfinite(e):
            continue
        last_epoch = e if last_epoch is None else max(last_epoch, e)
        if e >= 1.0:
            c = row.get(compute)
            if isinstance(c, (int, float)) and math.isfinite(c):
                return float(c), None
    return None, last_epoch


def resolve_min_compute(
    rule: str | float, *, epoch1: float | None, max_epoch: float | None, cutoff: float, protocol: Protocol,
    fit_fraction: float | None = None,
) -> tuple[float, str]:
    """(min_compute, the rule that set it, in words). cutoff: where the fitted range ends;
    fit_fraction: that range as a fraction of the run (None: the protocol's)."""
    rule = parse_min_compute(rule)
    if isinstance(rule, float):
        return rule, ("none" if rule == 0.0 else f"fixed {rule:.4g}")
    frac = protocol.fallback_min_fraction
    if rule == "paper":
        return frac * cutoff, (f"{frac:.2g} of the fitted range (the paper's 1.5k GPU-h of its "
                               f"{protocol.name} fit range)")
    if epoch1 is not None and math.isfinite(epoch1):
        return float(epoch1), "end of epoch 1"
    why = "no epoch logged" if max_epoch is None else f"run ends at epoch {max_epoch:.2f} < 1"
    return frac * cutoff, f"{frac:.2g} of the fitted range ({why}; paper: 1.5k GPU-h of its {protocol.name} fit range)"


@dataclasses.dataclass(frozen=True)
class ProtocolFit:
    """A run fitted by a protocol. `fit` is None when it could not be fitted (`reason`)."""

    fit: FitResult | None
    protocol: Protocol
    fit_fraction: float
    cutoff: float  # the fitted range ends here
    min_compute: float  # ... and starts here
    min_rule: str
    reason: str
    compute: np.ndarray  # [n] every evaluation of the run
    reward: np.ndarray  # [n]

    @property
    def final_compute(self) -> float:
        return float(self.compute[-1]) if self.compute.size else math.nan

    def describe(self) -> str:
        return f"{self.protocol.range_text(self.fit_fraction)}, from {self.min_rule}"


def fit_with_protocol(
    compute: Any,
    reward: Any,
    *,
    protocol: Protocol | str | None = None,
    min_compute: str | float = "paper",
    epoch1: float | None = None,
    max_epoch: float | None = None,
    fit_fraction: float | None = None,
    min_points: int = 0,
) -> ProtocolFit:
    """Fit one run's (compute, pass rate) points the way the protocol says.

    compute/reward: [n] the run's evaluations sorted by compute (R0 = the first one).
    fit_fraction overrides the protocol's (e.g. 0.5 to predict the end from the first half).
    min_points: fewer evaluations than this in the whole run -> not fitted.
    Every figure, `scalerl fit`, `scalerl status` and the reproduction report fit through here.
    """
    proto = get_protocol(protocol)
    frac = proto.fit_fraction if fit_fraction is None else float(fit_fraction)
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction!r}")
    c = np.asarray(compute, dtype=np.float64).ravel()  # [n]
    r = np.asarray(reward, dtype=np.float64).ravel()  # [n]
    if c.size == 0:
        return ProtocolFit(None, proto, frac, math.nan, math.nan, "", "no evaluations", c, r)
    cutoff = float(c[-1]) * frac
    mc, rule = resolve_min_compute(min_compute, epoch1=epoch1, max_epoch=max_epoch, cutoff=cutoff, protocol=proto,
                                   fit_fraction=frac)
    if c.size < min_points:
        return ProtocolFit(None, proto, frac, cutoff, mc, rule,
                           f"{c.size} evaluations (< min_points {min_points})", c, r)
    head = c <= cutoff * (1.0 + 1e-12)
    try:
        res = fit(c[head], r[head], r0=float(r[0]), min_compute=mc)
    except FitError as e:
        return ProtocolFit(None, proto, frac, cutoff, mc, rule, f"{e} [min_compute: {rule}]", c, r)
    return ProtocolFit(res, proto, frac, cutoff, mc, rule, "", c, r)


def _finite(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def is_contended(contention_run: Any, runq_run: Any = None, limit: float = CONTENTION_LIMIT,
                 runq_limit: float = RUNQ_LIMIT) -> bool:
    """Other work slowed the run: it used more than `limit` of the run's CPUs (`contention_run`)
    and the run's own threads waited for a CPU more than `runq_limit` of their time (`runq_run`;
    None or NaN, a run that does not log it: judged by `contention_run` alone)."""
    x = _finite(contention_run)
    if x is None or x <= limit:
        return False
    q = _finite(runq_run)
    return q is None or q > runq_limit


# ----------------------------------------------------------------------------- the margin on A


def t_quantile(df: int, level: float = 0.95) -> float:
    """The two-sided `level` quantile of Student's t with `df` degrees of freedom."""
    from scipy.special import stdtrit

    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df!r}")
    return float(stdtrit(df, 0.5 + level / 2.0))


@dataclasses.dataclass(frozen=True)
class Margin:
    """The margin on A of the comparison rule.

    From seeds: s = the pooled standard deviation of the fitted A across seeds of the same
    config (df = Σ (seeds − 1)); two configs with n_a and n_b seeds, compared by their mean A,
    tie when |ΔA| <= t(0.975, df) · s · sqrt(1/n_a + 1/n_b), the half-width of the 95%
    interval of ΔA when both have the same true A. `value` is that margin for two configs of
    `n` seeds each (n = the sweep's usual seeds per config). Without seeds: the paper's 0.02.
    """

    value: float
    source: str  # "seeds of this sweep" | "seeds of <sweep>" | "paper (no seeds)" | "fixed"
    s: float | None = None
    df: int = 0
    n: int = 1
    level: float = 0.95

    def for_pair(self, n_a: int, n_b: int) -> float:
        if self.s is None or self.df < 1:
            return self.value
        return t_quantile(self.df, self.level) * self.s * math.sqrt(1.0 / max(n_a, 1) + 1.0 / max(n_b, 1))

    def describe(self) -> str:
        if self.s is None:
            return f"±{self.value:.3g} ({self.source})"
        return (f"±{self.value:.3g} ({self.source}: s_A={self.s:.3g}, df={self.df}, "
                f"{self.n} seed{'s' if self.n != 1 else ''} per config)")

    @classmethod
    def fixed(cls, value: float) -> "Margin":
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"margin must be >= 0, got {value!r}")
        return cls(float(value), "fixed")

    @classmethod
    def paper(cls) -> "Margin":
        return cls(A_MARGIN, "paper (no seeds)")


def margin_from_seed_fits(
    a_by_config: dict[str, Sequence[float]], *, n: int | None = None, source: str = "seeds of this sweep",
    level: float = 0.95,
) -> Margin | None:
    """The seed margin from fitted A per config (configs with one fitted seed add nothing);
    None when no config has two fitted seeds."""
    ss, df, sizes = 0.0, 0, []
    for values in a_by_config.values():
        a = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
        if a.size >= 2:
            ss += float(np.sum((a - a.mean()) ** 2))
            df += a.size - 1
            sizes.append(a.size)
    if df < 1:
        return None
    s = math.sqrt(ss / df)
    n = int(n if n is not None else int(np.median(sizes)))
    value = t_quantile(df, level) * s * math.sqrt(2.0 / max(n, 1))
    return Margin(value, source, s, df, n, level)
