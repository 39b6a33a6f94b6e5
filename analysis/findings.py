"""The paper's finding for every ablation, as data (PAPER.md §3; arXiv v1 figure numbers).

One `Finding` per sweep spec in experiments/sweeps/: the paper's words, and the claims they
make as checkable comparisons between the sweep's configurations (named as `scalerl sweep`
names them: the run name without `-s<seed>`). `analysis.study` judges each claim on our
runs by the paper's comparison rule with the measured margin on A. math_code has no claim:
the paper reports its per-task fits (Fig 11 and Table 1 draw them) and compares nothing.

Claim kinds (a, b are configurations):
- `a_higher_A`  A(a) > A(b) by more than the margin. Ours within the margin: inconclusive.
- `same_A`      |A(a) − A(b)| <= the margin (the paper's "similar", "no significant
                difference": it has a margin for A only, "no general margin for B").
- `a_better`    a wins the comparison rule (higher A, or at a common A higher B / smaller C_mid).
                Ours tied: inconclusive.
- `a_not_worse` a wins or ties (e.g. "the length penalty does not improve performance").
- `peak_A`      over the configs ordered by value, A rises then falls: the highest mean A is
                at an interior value and beats both ends by more than the margin.
- `seed_spread` the configs are seeds of one recipe: their A spread (half the range) is
                within the paper's ±0.02.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Claim", "Finding", "Mechanism", "FINDINGS", "CLAIM_KINDS", "NOT_AT_TINY_SCALE"]

CLAIM_KINDS = ("a_higher_A", "same_A", "a_better", "a_not_worse", "peak_A", "seed_spread")


@dataclasses.dataclass(frozen=True)
class Claim:
    kind: str
    a: str = ""
    b: str = ""
    note: str = ""  # the paper's numbers behind this claim, when it has them

    def __post_init__(self):
        if self.kind not in CLAIM_KINDS:
            raise ValueError(f"unknown claim kind {self.kind!r}; choose from {', '.join(CLAIM_KINDS)}")
        if self.kind in ("a_higher_A", "same_A", "a_better", "a_not_worse") and not (self.a and self.b):
            raise ValueError(f"claim {self.kind} needs two configurations a and b")

    def text(self) -> str:
        return {
            "a_higher_A": f"A({self.a}) > A({self.b})",
            "same_A": f"A({self.a}) ≈ A({self.b})",
            "a_better": f"{self.a} better than {self.b}",
            "a_not_worse": f"{self.a} not worse than {self.b}",
            "peak_A": "A rises then falls with the value",
            "seed_spread": "seeds agree on A within ±0.02",
        }[self.kind]

    def id(self, sweep: str) -> str:
        """A stable key (for reasons.yaml): '<sweep>/<kind>:<a>,<b>'."""
        pair = ",".join(x for x in (self.a, self.b) if x)
        return f"{sweep}/{self.kind}" + (f":{pair}" if pair else "")


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """What a sweep's claims rest on, measured in its own runs: the configuration `on` has a
    mechanism that exists to shrink `metric` (a metrics.jsonl key, averaged over each run), `off`
    lacks it. Where `off` leaves it nothing to remove (`analysis.study.mechanism_check`), the
    mechanism cannot act at this scale and the claims are `not testable`, not judged."""

    metric: str
    on: str
    off: str
    what: str  # what `metric` is, in words
    min_share: float = 0.1  # the mechanism acts when it can be shown to remove more than this share of `off`'s value


@dataclasses.dataclass(frozen=True)
class Finding:
    sweep: str
    figure: str  # arXiv v1 figure (ICLR number in brackets where it differs)
    title: str
    paper: str  # the paper's finding, from PAPER.md §3
    claims: tuple[Claim, ...]
    mechanism: Mechanism | None = None
    # run-table meters (analysis/meters.py) that show whether the finding's mechanism acts; printed
    # beside each of its claims
    meters: tuple[str, ...] = ()


# the meters each finding's claims are printed beside (analysis/meters.py)
_LAG = ("lag_mean", "lag_max", "ratio_p01", "ratio_p99")
_CLIP = ("clip_frac_low", "clip_frac_high", "ratio_p01", "ratio_p99")
_LENGTH = ("completion_tokens_p10", "completion_tokens_p50", "completion_tokens_p90")
_ZERO_VAR = ("zero_variance_frac",)
_POOL = ("pool_left_min", "zero_variance_frac")
_CUT = ("completion_tokens_p90", "truncation_frac", "interrupted_frac")
_GAP = ("logprob_gap",)
_ALL = ("clip_frac_low", "clip_frac_high", "lag_mean", "logprob_gap", "completion_tokens_p50")

_NOT_IN_FIG7 = "not in v1's Fig 7 legend (ICLR A.20 names a LOO-Uniform-Sampling run); judged by the LOO rule"


def _loo(variant: str, note: str = "", same_note: str = "") -> tuple[Claim, ...]:
    return (Claim("same_A", "scalerl", variant, same_note or "all LOO runs reach A within ±0.02 of ScaleRL"),
            Claim("a_better", "scalerl", variant, note or "ScaleRL has the highest B at a common A"))


FINDINGS: dict[str, Finding] = {f.sweep: f for f in [
    Finding("off_policy", "Fig 4a", "Off-policy scheme",
            "Similar A; PipelineRL-k has a much larger B than PPO-off-policy-k (more efficient, "
            "slightly better at large compute). A ≈ 0.52 for both [fig-read].",
            (Claim("same_A", "pipeline_rl-k8", "ppo_off_policy-k8"),
             Claim("a_better", "pipeline_rl-k8", "ppo_off_policy-k8", "much larger B"),
             Claim("a_better", "pipeline_rl-k8", "ppo_off_policy-k1",
                   "the text confirms k ∈ {1, 8} but gives B only as PipelineRL-k vs PPO-off-policy-k "
                   "(PAPER.md §6.8)")),
            meters=_LAG),
    Finding("pipeline_k", "Fig 4b", "PipelineRL max off-policyness k",
            "k = 4 and k = 8 equally good; 8 adopted.",
            (Claim("same_A", "k4", "k8"),),
            meters=_LAG),
    Finding("loss_type", "Fig 5a", "Loss type",
            "GSPO and CISPO raise A substantially over DAPO; CISPO is slightly better late and is "
            "chosen. DAPO A ≈ 0.52, CISPO/GSPO A ≈ 0.595 [fig-read].",
            (Claim("a_higher_A", "cispo", "dapo", "0.595 vs 0.52 [fig-read]"),
             Claim("a_higher_A", "gspo", "dapo", "0.595 vs 0.52 [fig-read]"),
             Claim("same_A", "cispo", "gspo", "both ≈ 0.595 [fig-read]")),
            meters=_CLIP),
    Finding("fp32_head", "Fig 5b", "FP32 LM head",
            "The FP32 LM head on generator and trainer raises A from 0.52 to 0.61 [paper].",
            (Claim("a_higher_A", "bf16_fp32_head", "bf16", "A 0.61 vs 0.52 [paper]"),),
            Mechanism("logprob_gap", on="bf16_fp32_head", off="bf16",
                      what="the mean |trainer − generator| log-prob gap per token (tokens of lag 0 where logged), "
                           "the mismatch the FP32 head shrinks"),
            _GAP),
    Finding("loss_aggregation", "Fig 14a", "Loss aggregation",
            "Prompt-level averaging has the highest A and is adopted.",
            (Claim("a_higher_A", "prompt_mean", "sample_mean"),
             Claim("a_higher_A", "prompt_mean", "token_mean")),
            meters=_LENGTH),
    Finding("advantage_norm", "Fig 14b", "Advantage normalization",
            "Prompt-level, batch-level and no normalization are all similar; batch-level is adopted "
            "as theoretically sound and marginally better.",
            (Claim("same_A", "batch", "prompt"), Claim("same_A", "batch", "none")),
            meters=_ZERO_VAR),
    Finding("zero_variance_filtering", "Fig 6a", "Zero-variance filtering",
            "Dropping zero-variance prompts from the loss (effective batch) gives a higher A.",
            (Claim("a_higher_A", "zero_variance_filter", "all_prompts"),),
            meters=_ZERO_VAR),
    Finding("no_positive_resampling", "Fig 6b", "No-Positive-Resampling",
            "Dropping prompts with pass rate >= 0.9 for good scales better and gives a higher A.",
            (Claim("a_higher_A", "no_positive_resampling", "uniform"),),
            meters=_POOL),
    Finding("length_control", "LOO-lp (Fig 7)", "Length control",
            "Replacing forced interruptions with the length penalty does not improve performance.",
            (Claim("a_not_worse", "interruption", "length_penalty"),),
            meters=_CUT),
    Finding("batch_size", "Fig 10a, Table 1", "Batch size",
            "Larger batches are slower early but reach a higher A: bs512 A 0.605, bs768 0.610, "
            "bs2048 0.645 (Table 1).",
            (Claim("a_higher_A", "bs2048", "bs768", "0.645 vs 0.610 [paper]"),
             Claim("a_higher_A", "bs2048", "bs512", "0.645 vs 0.605 [paper]"),
             Claim("same_A", "bs768", "bs512", "0.610 vs 0.605 [paper]")),
            meters=_POOL),
    Finding("generation_length", "Fig 9a, Table 1", "Generation length",
            "The 32k budget has lower B and higher C_mid but a higher A (0.645 vs 0.610), "
            "overtaking 14k later.",
            (Claim("a_higher_A", "gen32k", "gen14k", "0.645 vs 0.610 [paper]"),),
            meters=_CUT),
    Finding("generations_per_prompt", "Fig 17a, Table 1", "Generations per prompt",
            "Essentially unchanged at a fixed total batch (second-order). Table 1: 8gen 0.585, "
            "16gen 0.610, 24gen 0.590, 32gen 0.595.",
            (Claim("same_A", "gen16", "gen8", "0.610 vs 0.585 [paper]: just outside ±0.02 in Table 1"),
             Claim("same_A", "gen16", "gen24", "0.610 vs 0.590 [paper]: at the edge of ±0.02 in Table 1"),
             Claim("same_A", "gen16", "gen32", "0.610 vs 0.595 [paper]")),
            meters=_ZERO_VAR),
    Finding("dapo_clip", "Fig 19a", "DAPO ε_max",
            "ε_max changes A itself: A rises, then falls, as ε_max grows.",
            (Claim("peak_A"),),
            meters=_CLIP),
    Finding("cispo_clip", "Fig 19b", "CISPO ε_max",
            "ε_max in {4, 5, 8}: no significant difference.",
            (Claim("same_A", "eps_max4.0", "eps_max5.0"), Claim("same_A", "eps_max4.0", "eps_max8.0")),
            meters=_CLIP),
    Finding("gspo_clip", "Fig 20", "GSPO clipping scale",
            "The original 1e-4 scale scales poorly; the 1e-3 scale is as good or better; "
            "upper 5e-3 / lower 3e-3 is slightly best.",
            (Claim("a_better", "gspo_4_3_e3", "gspo_4_3_e4"),
             Claim("a_better", "gspo_5_3_e3", "gspo_4_3_e4"),
             Claim("a_not_worse", "gspo_5_3_e3", "gspo_4_3_e3")),
            meters=_CLIP),
    Finding("leave_one_out", "Fig 7, Fig 15", "Leave-one-out from ScaleRL",
            "Every LOO variant reaches A within ±0.02 of ScaleRL; ScaleRL has the highest B after "
            "refitting at a common A (CISPO vs DAPO: B 2.01 vs 1.77 [paper]). The length penalty "
            "does not improve performance.",
            _loo("loo-8op") + _loo("loo-dapo", "B 2.01 vs 1.77 [paper]")
            + _loo("loo-fp32", "little difference at 8B: A 0.610, C_mid 2857 vs 2542 [fig-read]")
            + _loo("loo-savg") + _loo("loo-plan") + _loo("loo-batch")
            + (Claim("same_A", "scalerl", "loo-lp"), Claim("a_not_worse", "scalerl", "loo-lp"))
            + _loo("loo-uniform", _NOT_IN_FIG7, _NOT_IN_FIG7),
            meters=_ALL),
    Finding("recipes", "Fig 2", "Prevalent recipes vs ScaleRL",
            "ScaleRL has the highest A (0.61). Per-recipe readings conflict: DeepSeek < 0.5, "
            "DAPO ≈ 0.52, Magistral ≈ 0.53, MiniMax ≈ 0.58 or 0.610 [fig-read].",
            (Claim("a_higher_A", "scalerl", "deepseek_grpo", "0.61 vs < 0.5 [fig-read]"),
             Claim("a_higher_A", "scalerl", "qwen_dapo", "0.61 vs ≈ 0.52 [fig-read]"),
             Claim("a_higher_A", "scalerl", "magistral", "0.61 vs ≈ 0.53 [fig-read]"),
             Claim("a_better", "scalerl", "minimax", "MiniMax A ≈ 0.58 or 0.610 [fig-read, conflicting]")),
            meters=_ALL),
    Finding("math_code", "Fig 11, Table 1", "Math + code",
            "Training on math + code gives clean, parallel per-task curves: math C_mid 2896, B 2.05, "
            "A 0.595; code C_mid 1675, B 1.09, A 0.615 [paper]; the math-only ScaleRL run is the "
            "reference. At tiny scale the mixture is arithmetic + reasoning-gym spell_backward "
            "(a stand-in for code); Fig 11 and Table 1 draw the per-task fits.",
            ()),
    Finding("scalerl_seeds", "Fig 8a", "Independent ScaleRL seeds",
            "Three seeds give A within ±0.015; the paper adopts ±0.02 as its margin on A.",
            (Claim("seed_spread", note="±0.015 [paper]"),)),
]}

# Figures the tiny scale cannot draw, and why. Keyed by arXiv v1 figure id.
NOT_AT_TINY_SCALE: dict[str, str] = {
    "fig1a": "model size: the paper compares an 8B dense model with Llama-4 Scout (17B×16 MoE); the tiny "
             "scale has one ~0.4M-parameter model and no model-size sweep (no experiments/sweeps spec).",
    "fig1b": "downstream AIME-24 of the 8B and Scout runs: no model-size sweep at tiny scale, and AIME problems "
             "are far beyond a model that learns two-operand arithmetic.",
    "fig8b": "FP32 LM head on Scout (MoE): needs the 17B×16 MoE model.",
    "fig11": "joint math + code: drawn only from the math_code sweep, whose tiny mixture is arithmetic + "
             "reasoning-gym spell_backward, a stand-in for code (a real code task needs a model that writes "
             "programs and the sandboxed verifier, components/tasks code_file, at a size that learns).",
    "fig18": "LiveCodeBench and AIME-24 of the math + code run: as Fig 11, and benchmarks a tiny model cannot "
             "score on.",
    "fig9b": "AIME-24 by generation length: downstream benchmark records exist only where the runs log them; "
             "the tiny arithmetic task has no AIME-like benchmark.",
    "fig10b": "AIME-24 by batch size: as Fig 9b.",
    "fig17b": "AIME-24 by generations per prompt: as Fig 9b.",
    "table1 (Scout, math+code rows)": "the -Scout row needs the MoE model; the math+code rows come from the "
                                      "math_code sweep's stand-in mixture (as Fig 11).",
}
