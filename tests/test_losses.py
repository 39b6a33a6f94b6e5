"""Losses (DESIGN.md "Math contracts", PAPER.md §5) against float64 references from the formulas.

The references live in `_helpers_losses.py` and walk tokens with plain Python floats; the
gradients are the hand-derived per-token derivatives times the aggregation weights.
"""

from __future__ import annotations

import inspect
import math

import gin
import pytest
import torch

import components.aggregation  # noqa: F401  (fills AGGREGATIONS)
from components.losses import loss_diagnostics
from components.registry import AGGREGATIONS, LOSSES

from _helpers_losses import (
    DEFAULTS,
    make_batch,
    ref_aggregate,
    ref_clipped_tokens,
    ref_per_token,
    ref_weights,
    times,
)

torch.set_num_threads(1)

PAPER_LOSSES = ("grpo", "dapo", "cispo", "gspo")
EXTRA_LOSSES = ("ppo_dual_clip", "icepop", "dppo")
AGGS = ("token_mean", "sample_mean", "prompt_mean")

# (loss, hyper-parameters, batch kind): defaults and one non-default setting per loss
CASES = [
    ("grpo", {}, "wide"),
    ("grpo", {"eps": 0.1}, "wide"),
    ("dapo", {}, "wide"),
    ("dapo", {"eps_low": 0.1, "eps_high": 0.4}, "wide"),
    ("cispo", {}, "wide"),
    ("cispo", {"eps_max": 1.5}, "wide"),
    ("gspo", {}, "narrow"),
    ("gspo", {"eps_low": 0.05, "eps_high": 0.1}, "wide"),
    ("ppo_dual_clip", {}, "wide"),
    ("ppo_dual_clip", {"eps_low": 0.1, "eps_high": 0.28, "dual_clip": 2.0}, "wide"),
    ("icepop", {}, "wide"),
    ("icepop", {"low": 0.8, "high": 1.2}, "wide"),
    ("dppo", {}, "wide"),
    ("dppo", {"delta_low": 0.1, "delta_high": 0.3}, "wide"),
    ("dppo", {"kl_tau": 0.5}, "wide"),  # prime-rl's squared log-ratio term (1e-3 there), made large
]
CASE_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in hp.items()) or 'default'}" for n, hp, _ in CASES]


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _run(name, batch, **hp):
    return LOSSES.get(name)(batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)


# ----------------------------------------------------------------------------------------
# the public contract
def test_paper_losses_and_extras_are_registered():
    assert set(PAPER_LOSSES + EXTRA_LOSSES) <= set(LOSSES.names())


@pytest.mark.parametrize("name", PAPER_LOSSES + EXTRA_LOSSES)
def test_signature_and_defaults(name):
    sig = inspect.signature(LOSSES.original(name))
    params = list(sig.parameters.values())
    assert [p.name for p in params[:4]] == ["logp", "gen_logp", "advantages", "mask"]
    hparams = {p.name: p.default for p in params[4:]}
    assert hparams == DEFAULTS[name]
    assert {p.name: p.default for p in LOSSES.params(name)} == DEFAULTS[name]


@pytest.mark.parametrize("name", PAPER_LOSSES + EXTRA_LOSSES)
def test_returns_per_token_loss_same_shape_and_dtype(name):
    batch = make_batch("wide")
    out = _run(name, batch)
    assert out.shape == batch["mask"].shape and out.dtype == torch.float64
    out32 = LOSSES.get(name)(batch["logp"].float(), batch["gen_logp"].float(), batch["advantages"].float(), batch["mask"])
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out.detach(), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------
# every loss x every aggregation: value and gradient
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name,hp,kind", CASES, ids=CASE_IDS)
def test_value_and_gradient_against_reference(name, hp, kind, agg):
    batch = make_batch(kind)
    per_token = _run(name, batch, **hp)  # [B, T]
    ref_loss, ref_dloss = ref_per_token(name, batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    torch.testing.assert_close(per_token.detach(), torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-12, atol=1e-12)

    value = AGGREGATIONS.get(agg)(per_token, batch["mask"], batch["group_ids"])  # []
    assert value.dim() == 0
    expected = ref_aggregate(agg, ref_loss, batch["mask"], batch["group_ids"])
    assert value.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)

    (grad,) = torch.autograd.grad(value, batch["logp"])
    expected_grad = times(ref_weights(agg, batch["mask"], batch["group_ids"]), ref_dloss)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name,hp,kind", CASES, ids=CASE_IDS)
def test_cases_exercise_both_gradient_regimes(name, hp, kind):
    """Guard on the test data itself: each case has tokens with and without gradient."""
    batch = make_batch(kind)
    _, d = ref_per_token(name, batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    clipped = ref_clipped_tokens(name, batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    flat_d = [x for row in d for x in row]
    assert any(x != 0.0 for x in flat_d)
    assert any(c for row in clipped for c in row), "no token is clipped/truncated: the case tests nothing"


# ----------------------------------------------------------------------------------------
# GSPO: sample_mean of GSPO-token == sequence-level GSPO
def _sequence_level_gspo_loss(logp, gen_logp, advantages, mask, eps_low, eps_high):
    """-(1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), s_i the geometric-mean ratio."""
    terms = []
    for i in range(logp.shape[0]):
        toks = mask[i]
        s_i = torch.exp((logp[i][toks] - gen_logp[i][toks]).sum() / toks.sum())  # length-normalised
        a = advantages[i]
        terms.append(torch.minimum(s_i * a, torch.clamp(s_i, 1 - eps_low, 1 + eps_high) * a))
    return -torch.stack(terms).mean()


@pytest.mark.parametrize(
    "kind,eps_low,eps_high", [("narrow", 3e-3, 5e-3), ("wide", 0.05, 0.1), ("wide", 0.3, 0.5)]
)
def test_gspo_sample_mean_equals_sequence_level_objective(kind, eps_low, eps_high):
    batch = make_batch(kind)
    hp = {"eps_low": eps_low, "eps_high": eps_high}
    value = AGGREGATIONS.get("sample_mean")(_run("gspo", batch, **hp), batch["mask"], batch["group_ids"])
    (grad,) = torch.autograd.grad(value, batch["logp"])

    logp2 = batch["logp"].detach().clone().requires_grad_(True)
    seq_value = _sequence_level_gspo_loss(logp2, batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    (seq_grad,) = torch.autograd.grad(seq_value, logp2)

    assert value.item() == pytest.approx(seq_value.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, seq_grad, rtol=1e-10, atol=1e-14)
    assert seq_grad.abs().sum() > 0  # some sequence is unclipped


def test_gspo_ratio_is_length_normalised():
    """Two sequences with the same per-token log-ratio but different lengths have the same s."""
    T = 8
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, :2], mask[1, :8] = True, True
    gen_logp = torch.full((2, T), -1.0, dtype=torch.float64)
    logp = (gen_logp + 0.004).requires_grad_(True)  # s = exp(0.004) for both, inside [1-3e-3, 1+5e-3]
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    out = LOSSES.get("gspo")(logp, gen_logp, adv, mask)
    expected = -math.exp(0.004)
    torch.testing.assert_close(out[mask], torch.full((10,), expected, dtype=torch.float64))
    # without the 1/|y| exponent the 8-token sequence's ratio would be exp(0.032): clipped
    (grad,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(grad[mask], torch.full((10,), expected, dtype=torch.float64))


# ----------------------------------------------------------------------------------------
# CISPO: gradient sg(min(rho, eps_max)) * A * grad log pi
@pytest.mark.parametrize("eps_max", [4.0, 1.5])
def test_cispo_gradient_has_no_path_through_the_weight(eps_max):
    batch = make_batch("wide")
    logp, gen_logp, adv, mask = batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"]
    out = LOSSES.get("cispo")(logp, gen_logp, adv, mask, eps_max=eps_max)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    rho = torch.exp(logp.detach() - gen_logp)
    weight = torch.clamp(rho, max=eps_max)
    expected = torch.where(mask, -weight * adv[:, None], torch.zeros_like(rho))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    # every token with A != 0 keeps a gradient, truncated ones included (nothing is zeroed)
    truncated = mask & (rho > eps_max) & (adv[:, None] != 0)
    assert truncated.any()
    torch.testing.assert_close(grad[truncated], (-eps_max * adv[:, None].expand_as(rho))[truncated])
    live = mask & (adv[:, None] != 0)
    assert (grad[live] != 0).all()
    # a weight with gradient would add -A * rho * logp per untruncated token: must be absent
    with_weight_grad = expected + torch.where(mask & (rho < eps_max), -adv[:, None] * rho * logp.detach(), 0.0)
    assert not torch.allclose(grad, with_weight_grad)


def test_cispo_absolute_cap_not_one_plus_eps():
    """ScaleRL Eq. 4 caps at eps_max itself: rho = 3 with eps_max = 4 is NOT truncated."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    gen_logp = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    logp = torch.tensor([[-2.0 + math.log(3.0), -2.0 + math.log(6.0)]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0], dtype=torch.float64)
    out = LOSSES.get("cispo")(logp, gen_logp, adv, mask)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-3.0, -4.0]], dtype=torch.float64))


# ----------------------------------------------------------------------------------------
# DAPO: asymmetric clip
def _one_token_batch(rhos, advs):
    n = len(rhos)
    gen_logp = torch.full((n, 1), -1.5, dtype=torch.float64)
    logp = (gen_logp + torch.log(torch.tensor(rhos, dtype=torch.float64))[:, None]).requires_grad_(True)
    return logp, gen_logp, torch.tensor(advs, dtype=torch.float64), torch.ones(n, 1, dtype=torch.bool)


def test_dapo_asymmetric_clip_zeroes_gradient_exactly_where_the_formula_says():
    # (rho, A, gradient flows?) for eps_low = 0.2, eps_high = 0.28
    table = [
        (1.30, 1.0, False),   # A>0, rho > 1+eps_high: clipped
        (1.281, 1.0, False),  # just above the upper bound
        (1.279, 1.0, True),   # just below the upper bound
        (1.25, 1.0, True),    # inside DAPO's range though outside GRPO's 1.2
        (0.50, 1.0, True),    # A>0 never clips on the low side
        (0.79, 2.0, True),
        (0.70, -1.0, False),  # A<0, rho < 1-eps_low: clipped
        (0.799, -1.0, False),  # just below the lower bound
        (0.801, -1.0, True),  # just above it
        (1.50, -1.0, True),   # A<0 never clips on the high side
        (1.10, -0.5, True),
    ]
    rhos, advs, flows = zip(*table)
    logp, gen_logp, adv, mask = _one_token_batch(rhos, advs)
    out = LOSSES.get("dapo")(logp, gen_logp, adv, mask)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    for (rho, a, flow), g in zip(table, grad[:, 0].tolist()):
        if flow:
            assert g == pytest.approx(-a * rho, rel=1e-12), (rho, a)
        else:
            assert g == 0.0, (rho, a)
    # the value on the clipped side is the clipped objective
    torch.testing.assert_close(out[0, 0], torch.tensor(-1.28, dtype=torch.float64))
    torch.testing.assert_close(out[6, 0], torch.tensor(0.8, dtype=torch.float64))
    # GRPO (symmetric 0.2) clips rho = 1.25 with A>0, DAPO does not
    out_grpo = LOSSES.get("grpo")(logp, gen_logp, adv, mask)
    (grad_grpo,) = torch.autograd.grad(out_grpo.sum(), logp)
    assert grad_grpo[3, 0] == 0.0 and grad[3, 0] != 0.0


# ----------------------------------------------------------------------------------------
# padding
@pytest.mark.parametrize("pad", [float("nan"), float("inf"), float("-inf"), 1e4])
@pytest.mark.parametrize("name,hp,kind", CASES, ids=CASE_IDS)
def test_padding_never_contributes(name, hp, kind, pad):
    clean = make_batch(kind, pad_value=0.0)
    dirty = make_batch(kind, pad_value=pad)
    mask = clean["mask"]
    out_clean = _run(name, clean, **hp)
    out_dirty = _run(name, dirty, **hp)
    assert (out_dirty[~mask] == 0).all(), "loss must be exactly 0 on padding"
    torch.testing.assert_close(out_dirty, out_clean, rtol=0, atol=0)
    for agg in AGGS:
        v_clean = AGGREGATIONS.get(agg)(out_clean, mask, clean["group_ids"])
        v_dirty = AGGREGATIONS.get(agg)(out_dirty, mask, dirty["group_ids"])
        (g_clean,) = torch.autograd.grad(v_clean, clean["logp"], retain_graph=True)
        (g_dirty,) = torch.autograd.grad(v_dirty, dirty["logp"], retain_graph=True)
        assert torch.isfinite(v_dirty) and v_dirty.item() == v_clean.item()
        assert torch.isfinite(g_dirty).all() and (g_dirty[~mask] == 0).all()
        torch.testing.assert_close(g_dirty, g_clean, rtol=0, atol=0)


@pytest.mark.parametrize("name", PAPER_LOSSES + EXTRA_LOSSES)
def test_an_all_padding_row_is_zero_with_zero_gradient(name):
    batch = make_batch("narrow" if name == "gspo" else "wide", pad_value=float("nan"))
    mask = batch["mask"].clone()
    mask[2] = False  # a sequence with no trained token (its values are garbage too)
    logp = torch.where(mask, batch["logp"].detach(), float("-inf")).requires_grad_(True)
    out = LOSSES.get(name)(logp, batch["gen_logp"], batch["advantages"], mask)
    assert torch.isfinite(out).all() and (out[2] == 0).all()
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert torch.isfinite(grad).all() and (grad[2] == 0).all() and (grad[~mask] == 0).all()


@pytest.mark.parametrize("name,hp,kind", CASES, ids=CASE_IDS)
def test_extra_padding_columns_change_nothing(name, hp, kind):
    batch = make_batch(kind)
    B, T = batch["mask"].shape
    padded = {
        "logp": torch.cat([batch["logp"].detach(), torch.randn(B, 5, dtype=torch.float64)], 1).requires_grad_(True),
        "gen_logp": torch.cat([batch["gen_logp"], torch.randn(B, 5, dtype=torch.float64)], 1),
        "advantages": batch["advantages"],
        "mask": torch.cat([batch["mask"], torch.zeros(B, 5, dtype=torch.bool)], 1),
        "group_ids": batch["group_ids"],
    }
    for agg in AGGS:
        v = AGGREGATIONS.get(agg)(_run(name, batch, **hp), batch["mask"], batch["group_ids"])
        vp = AGGREGATIONS.get(agg)(_run(name, padded, **hp), padded["mask"], padded["group_ids"])
        (g,) = torch.autograd.grad(v, batch["logp"])
        (gp,) = torch.autograd.grad(vp, padded["logp"])
        assert vp.item() == pytest.approx(v.item(), rel=1e-14, abs=1e-16)
        torch.testing.assert_close(gp[:, :T], g, rtol=1e-14, atol=0)
        assert (gp[:, T:] == 0).all()


@pytest.mark.parametrize("name", PAPER_LOSSES + EXTRA_LOSSES)
def test_gen_logp_gets_no_gradient(name):
    """gen_logp is the generator's recorded log-prob: a constant, even if it carries grad."""
    batch = make_batch("narrow" if name == "gspo" else "wide")
    gen = batch["gen_logp"].clone().requires_grad_(True)
    out = LOSSES.get(name)(batch["logp"], gen, batch["advantages"], batch["mask"])
    (g,) = torch.autograd.grad(out.sum(), gen, allow_unused=True)
    assert g is None or (g == 0).all()
    (g_logp,) = torch.autograd.grad(out.sum(), batch["logp"])
    assert g_logp.abs().sum() > 0


# ----------------------------------------------------------------------------------------
# gin binds hyper-parameters as <name>.<param>
@pytest.mark.parametrize(
    "name,binding,hp",
    [
        ("grpo", "grpo.eps = 0.1", {"eps": 0.1}),
        ("dapo", "dapo.eps_high = 0.4", {"eps_high": 0.4}),
        ("cispo", "cispo.eps_max = 1.5", {"eps_max": 1.5}),
        ("gspo", "gspo.eps_low = 0.05\ngspo.eps_high = 0.1", {"eps_low": 0.05, "eps_high": 0.1}),
        ("ppo_dual_clip", "ppo_dual_clip.dual_clip = 2.0", {"dual_clip": 2.0}),
        ("icepop", "icepop.low = 0.8\nicepop.high = 1.2", {"low": 0.8, "high": 1.2}),
        ("dppo", "dppo.delta_low = 0.1\ndppo.delta_high = 0.3", {"delta_low": 0.1, "delta_high": 0.3}),
        ("cispo", "losses.cispo.eps_max = 1.5", {"eps_max": 1.5}),  # family-scoped form
    ],
)
def test_gin_bound_hparams_are_honoured(name, binding, hp):
    batch = make_batch("wide")
    default_out = _run(name, batch).detach()
    gin.parse_config(binding)
    out = _run(name, batch)
    ref, _ = ref_per_token(name, batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    torch.testing.assert_close(out.detach(), torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert not torch.equal(out.detach(), default_out), "the binding changed nothing: test data too weak"


# ----------------------------------------------------------------------------------------
# diagnostics
def _ref_diagnostics(name, batch, **hp):
    mask = batch["mask"]
    clipped = ref_clipped_tokens(name, batch["logp"], batch["gen_logp"], batch["advantages"], mask, **hp)
    lp, glp, m = batch["logp"].tolist(), batch["gen_logp"].tolist(), mask.tolist()
    log_r = [lp[b][t] - glp[b][t] for b in range(len(m)) for t in range(len(m[0])) if m[b][t]]
    n_clip = sum(c for row in clipped for c in row)
    ratios = [math.exp(x) for x in log_r]
    # the side of each clipped token: the ratio the clip acts on below 1 (low) or not (high); GSPO's is
    # the sequence ratio, exp(mean log-ratio over the sequence's tokens)
    def acting_log_ratio(b, t):
        if name == "gspo":
            row = [lp[b][u] - glp[b][u] for u in range(len(m[0])) if m[b][u]]
            return sum(row) / len(row)
        return lp[b][t] - glp[b][t]

    low = sum(1 for b in range(len(m)) for t in range(len(m[0]))
              if m[b][t] and clipped[b][t] and acting_log_ratio(b, t) < 0)
    return {
        "clip_frac_low": low / len(log_r),
        "clip_frac_high": (n_clip - low) / len(log_r),
        "clip_frac": n_clip / len(log_r),
        "is_ratio_mean": sum(ratios) / len(ratios),
        "is_ratio_min": min(ratios),
        "is_ratio_max": max(ratios),
        "log_ratio_abs_mean": sum(abs(x) for x in log_r) / len(log_r),
    }


@pytest.mark.parametrize("name,hp,kind", CASES, ids=CASE_IDS)
def test_loss_diagnostics_against_reference(name, hp, kind):
    batch = make_batch(kind)
    got = loss_diagnostics(name, batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    expected = _ref_diagnostics(name, batch, **hp)
    assert set(got) == set(expected)
    for key, val in expected.items():
        assert got[key] == pytest.approx(val, rel=1e-12, abs=1e-15), key
    assert 0 < got["clip_frac"] < 1


_ZERO_GRAD_CASES = [(i, c) for i, c in zip(CASE_IDS, CASES) if c[0] != "cispo" and not c[1].get("kl_tau")]


@pytest.mark.parametrize("name,hp,kind", [c for _, c in _ZERO_GRAD_CASES], ids=[i for i, _ in _ZERO_GRAD_CASES])
def test_clip_frac_counts_exactly_the_zero_gradient_tokens(name, hp, kind):
    """For clipping / masking losses, 'clipped' == 'no gradient' (every advantage non-zero here; DPPO's
    kl_tau term keeps a gradient on the masked tokens, so its kl_tau case is not one of them)."""
    batch = make_batch(kind)
    batch["advantages"] = torch.where(batch["advantages"] == 0, 0.6, batch["advantages"])
    out = _run(name, batch, **hp)
    (grad,) = torch.autograd.grad(out.sum(), batch["logp"])
    frac_zero = ((grad == 0) & batch["mask"]).sum().item() / batch["mask"].sum().item()
    got = loss_diagnostics(name, batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    assert got["clip_frac"] == pytest.approx(frac_zero, abs=1e-15)


def test_loss_diagnostics_take_the_runs_values_as_arguments_and_never_read_gin():
    """The learner passes the run's resolved hyper-parameters (issue 42); a gin binding made after
    the run was resolved changes nothing."""
    batch = make_batch("wide")
    args = (batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"])
    default = loss_diagnostics("cispo", *args)
    assert default["clip_frac"] == pytest.approx(_ref_diagnostics("cispo", batch)["clip_frac"])
    explicit = loss_diagnostics("cispo", *args, eps_max=1.5)
    assert explicit["clip_frac"] == pytest.approx(_ref_diagnostics("cispo", batch, eps_max=1.5)["clip_frac"])
    assert explicit["clip_frac"] > default["clip_frac"]
    gin.parse_config("cispo.eps_max = 1.5")
    assert loss_diagnostics("cispo", *args)["clip_frac"] == pytest.approx(default["clip_frac"])


def test_loss_diagnostics_ignore_padding_and_handle_empty_mask():
    clean, dirty = make_batch("wide"), make_batch("wide", pad_value=float("nan"))
    a = loss_diagnostics("dapo", clean["logp"], clean["gen_logp"], clean["advantages"], clean["mask"])
    b = loss_diagnostics("dapo", dirty["logp"], dirty["gen_logp"], dirty["advantages"], dirty["mask"])
    assert a == b
    empty = torch.zeros_like(clean["mask"])
    d = loss_diagnostics("dapo", clean["logp"], clean["gen_logp"], clean["advantages"], empty)
    assert all(math.isnan(v) for v in d.values())


def test_loss_diagnostics_unknown_loss_names_choices():
    batch = make_batch("wide")
    with pytest.raises(KeyError) as err:
        loss_diagnostics("cipso", batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"])
    assert "cispo" in str(err.value)


def test_loss_diagnostics_do_not_build_a_graph():
    batch = make_batch("wide")
    got = loss_diagnostics("grpo", batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"])
    assert all(isinstance(v, float) for v in got.values())
    assert batch["logp"].grad is None
