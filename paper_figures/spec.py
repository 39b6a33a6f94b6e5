"""Which runs feed which paper figure: the one table to adjust.

A figure takes the runs whose run.json `sweep` is one of `sweeps`; when no run matches by sweep
name, the runs whose `factor` is one of `factors`. A factor matches exactly or when one is a
dotted suffix of the other ("dapo.eps_high" matches "losses.dapo.eps_high", "loss" matches
"train.loss"; listing a bare "eps_high" would also match GSPO's).
Sweep names and factors follow experiments/sweeps/*.gin.
Figures with `synthetic=True` illustrate Eq. 1 and need no runs.
Figure numbers are arXiv v1 numbers (PAPER.md §4).
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
               sweeps=("model_size", "scalerl", "scale"), factors=("model.path", "model_size")),
    FigureSpec("fig2", "Prevalent recipes vs ScaleRL", sweeps=("recipes",), legend="A"),
    FigureSpec("fig3", "The sigmoid law (Eq. 1)", synthetic=True),
    FigureSpec("fig12", "Eq. 1: varying B and C_mid", synthetic=True),
    FigureSpec("fig13", "Eq. 1: varying A; a crossover", synthetic=True),
    FigureSpec("fig4a", "PPO-off-policy-k vs PipelineRL-k", sweeps=("off_policy", "offpolicy"),
               factors=("train.off_policy",)),
    FigureSpec("fig4b", "PipelineRL maximum off-policyness k", sweeps=("pipeline_k",), factors=("pipeline_rl.k",)),
    FigureSpec("fig5a", "Loss type", sweeps=("loss_type",), factors=("train.loss",)),
    FigureSpec("fig5b", "FP32 LM head", sweeps=("fp32_head",), factors=("train.precision",)),
    # curriculum sweeps share the factor train.curriculum: matched by sweep name only
    FigureSpec("fig6a", "Zero-variance filtering", sweeps=("zero_variance_filtering", "zero_variance_filter")),
    FigureSpec("fig6b", "No-Positive-Resampling", sweeps=("no_positive_resampling",)),
    FigureSpec("fig7", "Leave-one-out: log F(R_C) vs log C at a common A", sweeps=("leave_one_out", "loo"),
               factors=("leave_one_out",)),
    FigureSpec("fig8a", "Independent seeds and the ±0.02 margin on A", sweeps=("scalerl_seeds", "seeds"),
               legend="ABC"),
    FigureSpec("fig9a", "Generation length", sweeps=("generation_length",),
               factors=("interruption.thinking_max", "train.max_tokens")),
    FigureSpec("fig10a", "Batch size", sweeps=("batch_size",), factors=("train.prompts_per_step",)),
    FigureSpec("fig14a", "Loss aggregation", sweeps=("loss_aggregation",), factors=("train.aggregation",)),
    FigureSpec("fig14b", "Advantage normalization", sweeps=("advantage_norm",), factors=("train.advantage_norm",)),
    FigureSpec("fig15", "Leave-one-out variants", sweeps=("leave_one_out", "loo"), factors=("leave_one_out",)),
    FigureSpec("fig16", "Entropy vs training step, by batch size", sweeps=("batch_size",),
               factors=("train.prompts_per_step",)),
    FigureSpec("fig17a", "Generations per prompt", sweeps=("generations_per_prompt",),
               factors=("train.generations_per_prompt",)),
    FigureSpec("fig19a", "DAPO ε_max", sweeps=("dapo_clip",), factors=("dapo.eps_high",)),
    FigureSpec("fig19b", "CISPO ε_max", sweeps=("cispo_clip",), factors=("cispo.eps_max",)),
    FigureSpec("fig20", "GSPO clipping scale", sweeps=("gspo_clip",), factors=("gspo.eps_high",)),
    FigureSpec("table1", "Table 1: fitted C_mid, B, A of the ScaleRL variants",
               sweeps=("model_size", "batch_size", "generation_length", "generations_per_prompt"),
               factors=("model.path", "train.prompts_per_step", "interruption.thinking_max",
                        "train.generations_per_prompt"), legend="ABC"),
]}
