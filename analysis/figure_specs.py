"""Which runs feed which paper figure: the one table to adjust (paper_figures/ draws the
figures; analysis reads each sweep's fit protocol from it, `analysis.protocol.sweep_protocol`).

A figure takes the runs whose run.json `sweep` is one of `sweeps`; when no run matches by sweep
name, the runs whose `factor` is one of `factors`. A factor matches exactly or when one is a
dotted suffix of the other ("dapo.eps_high" matches "losses.dapo.eps_high", "loss" matches
"train.loss"; listing a bare "eps_high" would also match GSPO's).
Sweep names and factors follow experiments/sweeps/*.gin.
Figures with `synthetic=True` illustrate Eq. 1 and need no runs.
Figure numbers are arXiv v1 numbers (PAPER.md §4).

`protocol` is the paper's fit protocol for the figure (analysis/protocol.py, PAPER.md §1):
"whole" = the whole run is fitted (forward ablations); "loo" = the first half (leave-one-out
and the independent ScaleRL runs: 8k of 16k GPU-h); "scaling" = the first half (Section 5
axes and the large runs); "recipes" = the first half (Fig 2, fitted then extended); "" = the
figure fits nothing (one that fits anyway uses "whole"). A sweep takes the protocol of the
figures that draw it (`scalerl fit` and the reproduction report use it too), so figures
sharing a sweep must agree.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FigureSpec:
    id: str  # also the module name in paper_figures/ and the output file stem
    title: str
    sweeps: tuple[str, ...] = ()
    factors: tuple[str, ...] = ()
    synthetic: bool = False
    legend: str = "AB"  # which fitted parameters the legend carries: "A", "AB" or "ABC"
    protocol: str = ""  # the paper's fit protocol (see above); "" when the figure fits nothing

    def describe_need(self) -> str:
        if self.synthetic:
            return "nothing (illustration of Eq. 1)"
        parts = []
        if self.sweeps:
            parts.append("sweep " + " | ".join(self.sweeps))
        if self.factors:
            parts.append("factor " + " | ".join(self.factors))
        return "runs with " + " or ".join(parts)


FIGURES: dict[str, FigureSpec] = {s.id: s for s in [
    FigureSpec("fig1a", "ScaleRL: fit on the first part, extrapolate (model size)",
               sweeps=("model_size", "scalerl", "scale"), factors=("model.path", "model_size"), protocol="scaling"),
    FigureSpec("fig2", "Prevalent recipes vs ScaleRL", sweeps=("recipes",), legend="A", protocol="recipes"),
    FigureSpec("fig3", "The sigmoid law (Eq. 1)", synthetic=True, protocol=""),
    FigureSpec("fig12", "Eq. 1: varying B and C_mid", synthetic=True, protocol=""),
    FigureSpec("fig13", "Eq. 1: varying A; a crossover", synthetic=True, protocol=""),
    FigureSpec("fig4a", "PPO-off-policy-k vs PipelineRL-k", sweeps=("off_policy", "offpolicy"),
               factors=("train.off_policy",), protocol="whole"),
    FigureSpec("fig4b", "PipelineRL maximum off-policyness k", sweeps=("pipeline_k",), factors=("pipeline_rl.k",), protocol="whole"),
    FigureSpec("fig5a", "Loss type", sweeps=("loss_type",), factors=("train.loss",), protocol="whole"),
    FigureSpec("fig5b", "FP32 LM head", sweeps=("fp32_head",), factors=("train.precision",), protocol="whole"),
    # curriculum sweeps share the factor train.curriculum: matched by sweep name only
    FigureSpec("fig6a", "Zero-variance filtering", sweeps=("zero_variance_filtering", "zero_variance_filter"), protocol="whole"),
    FigureSpec("fig6b", "No-Positive-Resampling", sweeps=("no_positive_resampling",), protocol="whole"),
    FigureSpec("fig7", "Leave-one-out: log F(R_C) vs log C at a common A", sweeps=("leave_one_out", "loo"),
               factors=("leave_one_out",), protocol="loo"),
    FigureSpec("fig8a", "Independent seeds and the margin on A", sweeps=("scalerl_seeds", "seeds"),
               legend="ABC", protocol="loo"),
    FigureSpec("fig9a", "Generation length", sweeps=("generation_length",),
               factors=("interruption.thinking_max", "train.max_tokens"), protocol="scaling"),
    FigureSpec("fig10a", "Batch size", sweeps=("batch_size",), factors=("train.prompts_per_step",),
               protocol="scaling"),
    FigureSpec("fig14a", "Loss aggregation", sweeps=("loss_aggregation",), factors=("train.aggregation",), protocol="whole"),
    FigureSpec("fig14b", "Advantage normalization", sweeps=("advantage_norm",), factors=("train.advantage_norm",), protocol="whole"),
    FigureSpec("fig15", "Leave-one-out variants", sweeps=("leave_one_out", "loo"), factors=("leave_one_out",),
               protocol="loo"),
    FigureSpec("fig16", "Entropy vs training step, by batch size", sweeps=("batch_size",),
               factors=("train.prompts_per_step",), protocol=""),
    FigureSpec("fig17a", "Generations per prompt", sweeps=("generations_per_prompt",),
               factors=("train.generations_per_prompt",), protocol="scaling"),
    FigureSpec("fig19a", "DAPO ε_max", sweeps=("dapo_clip",), factors=("dapo.eps_high",), protocol="whole"),
    FigureSpec("fig19b", "CISPO ε_max", sweeps=("cispo_clip",), factors=("cispo.eps_max",), protocol="whole"),
    FigureSpec("fig20", "GSPO clipping scale", sweeps=("gspo_clip",), factors=("gspo.eps_high",), protocol="whole"),
    # downstream benchmarks (eval.jsonl lines with a "benchmark" key): the runs of the "a" panels; no fit
    FigureSpec("fig1b", "ScaleRL runs: downstream benchmark (AIME-24) vs compute",
               sweeps=("model_size", "scalerl", "scale"), factors=("model.path", "model_size"), protocol=""),
    FigureSpec("fig9b", "Generation length: downstream benchmark vs compute", sweeps=("generation_length",),
               factors=("interruption.thinking_max", "train.max_tokens"), protocol=""),
    FigureSpec("fig10b", "Batch size: downstream benchmark vs compute", sweeps=("batch_size",),
               factors=("train.prompts_per_step",), protocol=""),
    FigureSpec("fig17b", "Generations per prompt: downstream benchmark vs compute", sweeps=("generations_per_prompt",),
               factors=("train.generations_per_prompt",), protocol=""),
    # task mixtures (train.task = {task: weight}): per-task held-out curves; without a matching
    # sweep, every run whose eval.jsonl carries two or more per-task pass rates
    FigureSpec("fig11", "Math + code run: held-out pass rate per task", sweeps=("math_code", "mixture", "tiny_mixture"),
               factors=("train.task",), protocol="scaling"),
    FigureSpec("fig18", "Math + code run: downstream benchmarks vs compute", sweeps=("math_code", "mixture", "tiny_mixture"),
               factors=("train.task",), protocol=""),
    FigureSpec("table1", "Table 1: fitted C_mid, B, A of the ScaleRL variants",
               sweeps=("model_size", "batch_size", "generation_length", "generations_per_prompt"),
               factors=("model.path", "train.prompts_per_step", "interruption.thinking_max",
                        "train.generations_per_prompt"), legend="ABC", protocol="scaling"),
]}
