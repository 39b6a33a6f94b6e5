"""Analysis of logged runs: loading (pandas), the sigmoid law and the paper's fit (scipy),
comparison by the paper's rule, bootstrap intervals and prediction from a partial run.

    from analysis import load_runs, fit, fit_run, summarize
    ev = load_runs("runs/loss_type")                     # one row per evaluation
    res = fit_run(ev[ev.run == "loss=cispo-seed0"])       # FitResult (A, B, C_mid, R0) or None
    sweeps = summarize("results/tiny")                    # per sweep: the paper's protocol, margin, claims
"""

from analysis.protocol import PROTOCOLS, Margin, fit_with_protocol
from analysis.runs import fit_run, fit_runs, load_runs
from analysis.scaling_law import (
    A_MARGIN,
    BootstrapResult,
    Comparison,
    FitError,
    FitResult,
    Prediction,
    bootstrap,
    compare,
    fit,
    loo_transform,
    predict,
    refit_common_a,
    sigmoid,
)
from analysis.study import summarize

__all__ = [
    "PROTOCOLS", "Margin", "fit_with_protocol", "summarize",
    "A_MARGIN", "BootstrapResult", "Comparison", "FitError", "FitResult", "Prediction", "bootstrap", "compare", "fit",
    "fit_run", "fit_runs", "load_runs", "loo_transform", "predict", "refit_common_a", "sigmoid",
]
