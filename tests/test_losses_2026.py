"""The losses and the aggregation added in 2026 (issue 43 item 4) against float64 references from their papers.

sapo (arXiv 2511.20347), gmpo (arXiv 2507.20673), clip_cov and kl_cov (arXiv 2505.22617), and the
dr_grpo aggregation (arXiv 2503.20783). The references (`_helpers_losses_2026.py`) walk tokens with
plain Python floats; gradients are their hand-derived per-token derivatives times the aggregation
weights (`_helpers_losses.ref_weights`), or autograd through a direct float64 formula of the
paper's sequence objective (GMPO).
"""

from __future__ import annotations

import inspect
import math

import gin
import pytest
import torch

import components.aggregation  # noqa: F401  (fills AGGREGATIONS)
from components.aggregation import token_weights, weighted_sum
from components.losses import loss_diagnostics, token_covariance
from components.registry import AGGREGATIONS, LOSSES

from _helpers_losses import make_batch, ref_aggregate, ref_weights, times
from _helpers_losses_2026 import (
    DEFAULTS_2026,
    ref_clip_cov,
    ref_clip_cov_candidates,
    ref_covariance,
    ref_dr_grpo,
    ref_gmpo,
    ref_gmpo_clipped,
    ref_gmpo_objectives,
    ref_kl_cov,
    ref_kl_cov_selected,
    ref_sapo,
    ref_sapo_weight,
)

torch.set_num_threads(1)

NEW_LOSSES = ("sapo", "gmpo", "clip_cov", "kl_cov")
AGGS = ("token_mean", "sample_mean", "prompt_mean")


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _run(name, batch, **hp):
    return LOSSES.get(name)(batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"], **hp)


def _args(batch):
    return batch["logp"], batch["gen_logp"], batch["advantages"], batch["mask"]


def _scaled(batch, factor):
    """The batch with its advantages times `factor` (covariances scale with them)."""
    return {**batch, "advantages": batch["advantages"] * factor}


def _assert_off(values, bounds, what):
    for v in values:
        for th in bounds:
            assert abs(v - th) > 1e-6, f"test batch has a {what} on the bound {th}: ties make sub-gradients ambiguous"


def _reference(name, batch, detached=None, **hp):
    hp = {**DEFAULTS_2026[name], **hp}
    args = _args(batch)
    if name == "sapo":
        return ref_sapo(*args, **hp)
    if name == "gmpo":
        return ref_gmpo(*args, **hp)
    if name == "kl_cov":
        return ref_kl_cov(*args, **hp)
    if detached is None:  # every candidate detached: the deterministic regime
        _, candidates, count = ref_clip_cov_candidates(*args, **hp)
        assert count >= len(candidates)
        detached = candidates
    return ref_clip_cov(*args, detached, **hp)


# (loss, hyper-parameters, advantage scale): defaults and non-default settings that hit every region
CASES = [
    ("sapo", {}, 1.0),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 3.5}, 1.0),
    ("gmpo", {}, 1.0),
    ("gmpo", {"eps_low": 0.2, "eps_high": 0.3}, 1.0),
    ("clip_cov", {}, 1.0),  # no candidate in (1, 5): the PPO surrogate with clip range [0, 2]
    ("clip_cov", {"cov_lb": 0.3, "cov_ub": 2.0, "ratio": 0.5}, 1.0),  # 7 candidates, 20 to detach: all
    ("clip_cov", {"cov_lb": 0.3, "cov_ub": 2.0, "ratio": 1.0, "eps_low": 0.2, "eps_high": 0.2}, 1.0),
    ("kl_cov", {}, 1.0),  # top 1 of 41 tokens
    ("kl_cov", {"ratio": 0.1, "kl_coef": 0.5}, 1.0),  # top 4
    ("kl_cov", {"ratio": 0.3, "kl_coef": 2.0}, 3.0),
]
CASE_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in hp.items()) or 'default'}-x{s:g}" for n, hp, s in CASES]


def _batch(scale=1.0, **kw):
    batch = make_batch("wide", **kw)
    return _scaled(batch, scale) if scale != 1.0 else batch


# ----------------------------------------------------------------------------------------
# the public contract
def test_registered_with_the_loss_signature_and_defaults():
    assert set(NEW_LOSSES) <= set(LOSSES.names()) and "dr_grpo" in AGGREGATIONS.names()
    for name in NEW_LOSSES:
        params = list(inspect.signature(LOSSES.original(name)).parameters.values())
        assert [p.name for p in params[:4]] == ["logp", "gen_logp", "advantages", "mask"]
        assert {p.name: p.default for p in LOSSES.params(name)} == DEFAULTS_2026[name]
        assert LOSSES.diagnostics_of(name) is not None
        doc = inspect.getdoc(LOSSES.original(name))
        assert "arXiv" in doc and "verl" in doc, f"{name}: the docstring names the paper and the peer checked"
    assert {p.name: p.default for p in AGGREGATIONS.params("dr_grpo")} == {"max_tokens": None}


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_per_token_loss_shape_dtype_and_float32(name):
    batch = _batch()
    torch.manual_seed(0)
    out = _run(name, batch)
    assert out.shape == batch["mask"].shape and out.dtype == torch.float64
    torch.manual_seed(0)
    out32 = LOSSES.get(name)(batch["logp"].float(), batch["gen_logp"].float(), batch["advantages"].float(), batch["mask"])
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name,binding,bad",
    [("sapo", "sapo.tau_pos = 0.0", "must be > 0"), ("gmpo", "gmpo.eps_low = -0.1", "must be >= 0"),
     ("clip_cov", "clip_cov.ratio = 0.0", r"must be in \(0, 1\]"), ("clip_cov", "clip_cov.eps_low = 1.5", r"must be in \[0, 1\]"),
     ("kl_cov", "kl_cov.kl_coef = -1.0", "must be >= 0"), ("kl_cov", "kl_cov.ratio = 2.0", r"must be in \(0, 1\]")],
)
def test_out_of_range_hyper_parameters_are_refused_by_the_registry(name, binding, bad):
    from components.registry import ParamRangeError

    LOSSES.check_params(name)  # the defaults pass
    gin.parse_config(binding)
    from components.trainer.gin_config import bound_values

    with pytest.raises(ParamRangeError, match=rf"{name}\.\w+ = .* is out of range: {bad}"):
        LOSSES.check_params(name, bound_values(LOSSES, name))


def test_clip_cov_refuses_crossed_covariance_bounds():
    with pytest.raises(ValueError, match="cov_lb < cov_ub, got cov_lb = 2.0, cov_ub = 1.0"):
        _run("clip_cov", _batch(), cov_lb=2.0, cov_ub=1.0)


# ----------------------------------------------------------------------------------------
# value and gradient against the papers' formulas, through every aggregation
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name,hp,scale", CASES, ids=CASE_IDS)
def test_value_and_gradient_against_reference(name, hp, scale, agg):
    batch = _batch(scale)
    per_token = _run(name, batch, **hp)  # [B, T]
    ref_loss, ref_dloss = _reference(name, batch, **hp)
    torch.testing.assert_close(per_token.detach(), torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    value = AGGREGATIONS.get(agg)(per_token, batch["mask"], batch["group_ids"])
    assert value.item() == pytest.approx(ref_aggregate(agg, ref_loss, batch["mask"], batch["group_ids"]), rel=1e-12, abs=1e-14)
    (grad,) = torch.autograd.grad(value, batch["logp"])
    expected = times(ref_weights(agg, batch["mask"], batch["group_ids"]), ref_dloss)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name,hp,scale", CASES, ids=CASE_IDS)
def test_cases_exercise_what_they_claim(name, hp, scale):
    """Guard on the test data: no ratio or covariance on a bound, and each case hits both regimes."""
    batch = _batch(scale)
    hp_all = {**DEFAULTS_2026[name], **hp}
    args = _args(batch)
    log_r = (batch["logp"].detach() - batch["gen_logp"])[batch["mask"]].tolist()
    _, dloss = _reference(name, batch, **hp)
    assert any(d != 0.0 for row in dloss for d in row)
    if name == "gmpo":
        _assert_off(log_r, (-hp_all["eps_low"], hp_all["eps_high"]), "log-ratio")
        assert ref_gmpo_clipped(*args, **hp_all), "no token clipped"
    if name in ("clip_cov", "kl_cov"):
        _assert_off(list(ref_covariance(batch["logp"], batch["advantages"], batch["mask"]).values()),
                    (hp_all.get("cov_lb", 0.0), hp_all.get("cov_ub", 0.0)), "covariance")
        _assert_off(log_r, (0.0, math.log(1 + hp_all.get("eps_high", 0.0)), math.log(max(1 - hp_all.get("eps_low", 0.0), 1e-300))),
                    "log-ratio")
    if name == "sapo":
        weights = [w for _, _, w in ref_sapo_weight(*args, **hp_all)]
        assert min(weights) < 0.5 < max(weights) and max(weights) < 1.0
        _assert_off(weights, (0.5,), "gate weight")


def _sequence_level_gmpo(logp, gen_logp, advantages, mask, eps_low, eps_high):
    """-(1/B) sum_i sgn(A_i) (prod_t |min(rho_t A_i, clip(rho_t, e^-eps_low, e^eps_high) A_i)|)^(1/|o_i|), in torch float64."""
    terms = []
    for i in range(logp.shape[0]):
        toks = mask[i]
        a = advantages[i]
        rho = torch.exp(logp[i][toks] - gen_logp[i][toks])
        clipped = torch.clamp(rho, math.exp(-eps_low), math.exp(eps_high))
        prod = torch.prod(torch.minimum(rho * a, clipped * a).abs())
        terms.append(torch.sign(a) * prod ** (1.0 / int(toks.sum())))
    return -torch.stack(terms).mean()


@pytest.mark.parametrize("eps_low,eps_high", [(0.4, 0.4), (0.2, 0.3), (0.05, 0.1)])
def test_gmpo_sample_mean_is_the_sequence_level_objective(eps_low, eps_high):
    batch = _batch()
    hp = {"eps_low": eps_low, "eps_high": eps_high}
    value = AGGREGATIONS.get("sample_mean")(_run("gmpo", batch, **hp), batch["mask"], batch["group_ids"])
    (grad,) = torch.autograd.grad(value, batch["logp"])
    logp2 = batch["logp"].detach().clone().requires_grad_(True)
    seq_value = _sequence_level_gmpo(logp2, batch["gen_logp"], batch["advantages"], batch["mask"], **hp)
    (seq_grad,) = torch.autograd.grad(seq_value, logp2)
    J = ref_gmpo_objectives(*_args(batch), **hp)
    assert seq_value.item() == pytest.approx(-sum(J) / len(J), rel=1e-12)
    assert value.item() == pytest.approx(seq_value.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, seq_grad, rtol=1e-10, atol=1e-14)


def test_gmpo_is_a_geometric_not_an_arithmetic_mean():
    """One sequence, log-ratios +0.3 and -0.3 (inside the clip): S = exp(0) = 1, the arithmetic mean of rho is cosh 0.3."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    gen = torch.full((1, 2), -1.0, dtype=torch.float64)
    logp = (gen + torch.tensor([[0.3, -0.3]], dtype=torch.float64)).requires_grad_(True)
    out = LOSSES.get("gmpo")(logp, gen, torch.tensor([2.0], dtype=torch.float64), mask)
    torch.testing.assert_close(out, torch.full((1, 2), -2.0, dtype=torch.float64))


def test_sapo_gate_is_one_on_policy_and_smooth_not_hard():
    """On-policy the gradient is the plain policy gradient (-A); far off-policy it fades without a jump."""
    n = 9
    gen = torch.full((n, 1), -1.0, dtype=torch.float64)
    log_r = torch.linspace(-0.8, 0.8, n, dtype=torch.float64)[:, None]
    logp = (gen + log_r).requires_grad_(True)
    adv = torch.ones(n, dtype=torch.float64)
    out = LOSSES.get("sapo")(logp, gen, adv, torch.ones(n, 1, dtype=torch.bool))
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert grad[n // 2, 0].item() == pytest.approx(-1.0, rel=1e-12)  # rho = 1: weight 1, d rho/d logp = 1
    assert out[n // 2, 0].item() == pytest.approx(-2.0, rel=1e-12)  # -(4/tau) sigmoid(0) A = -2 A
    assert (grad < 0).all()  # never zeroed (GRPO would zero rho > 1.2 here)
    # extreme ratios: finite value, finite (vanishing) gradient
    big = torch.tensor([[80.0], [-80.0]], dtype=torch.float64, requires_grad=True)
    out = LOSSES.get("sapo")(big, torch.zeros(2, 1, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64),
                             torch.ones(2, 1, dtype=torch.bool))
    (g,) = torch.autograd.grad(out.sum(), big)
    assert torch.isfinite(out).all() and torch.isfinite(g).all() and (g == 0).all()


# ----------------------------------------------------------------------------------------
# Clip-Cov's random draw
def _detached_tokens(out, grad, mask):
    """Tokens with value 0 and no gradient (every advantage is non-zero in the batch used)."""
    return {(b, t) for b, t in mask.nonzero().tolist() if out[b, t] == 0 and grad[b, t] == 0}


@pytest.mark.parametrize("hp,scale", [({}, 3.0), ({"cov_lb": 0.1, "cov_ub": 5.0, "ratio": 0.05}, 1.0)],
                         ids=["defaults-x3", "lb0.1-ratio0.05"])
def test_clip_cov_detaches_a_random_subset_of_the_candidates(hp, scale):
    batch = _scaled(make_batch("wide"), scale)
    batch["advantages"] = torch.where(batch["advantages"] == 0, 0.6, batch["advantages"])
    hp_all = {**DEFAULTS_2026["clip_cov"], **hp}
    clipped, candidates, count = ref_clip_cov_candidates(*_args(batch), **hp_all)
    assert len(candidates) > count >= 1, "the case must be in the random regime"
    _assert_off(list(ref_covariance(batch["logp"], batch["advantages"], batch["mask"]).values()),
                (hp_all["cov_lb"], hp_all["cov_ub"]), "covariance")
    seen = set()
    for seed in range(40):
        torch.manual_seed(seed)
        out = _run("clip_cov", batch, **hp)
        (grad,) = torch.autograd.grad(out.sum(), batch["logp"])
        detached = _detached_tokens(out.detach(), grad, batch["mask"])
        assert len(detached) == count and detached <= candidates  # exactly `count`, only candidates
        ref_loss, ref_d = ref_clip_cov(*_args(batch), detached, **hp_all)  # everything else is the formula
        torch.testing.assert_close(out.detach(), torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, torch.tensor(ref_d, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        torch.manual_seed(seed)  # the global generator decides: the same seed, the same draw
        again = _run("clip_cov", batch, **hp).detach()
        assert torch.equal(again, out.detach())
        seen |= detached
    assert seen == candidates, "every candidate is drawn sometimes (not always the first ones)"


# ----------------------------------------------------------------------------------------
# diagnostics: clip_frac
def _zero_grad_frac(out, batch):
    (grad,) = torch.autograd.grad(out.sum(), batch["logp"])
    return ((grad == 0) & batch["mask"]).sum().item() / batch["mask"].sum().item()


@pytest.mark.parametrize("name,hp,scale", [c for c in CASES if c[0] in ("gmpo", "clip_cov")],
                         ids=[i for i, c in zip(CASE_IDS, CASES) if c[0] in ("gmpo", "clip_cov")])
def test_clip_frac_is_the_fraction_of_zero_gradient_tokens(name, hp, scale):
    batch = _batch(scale)
    batch["advantages"] = torch.where(batch["advantages"] == 0, 0.6, batch["advantages"])
    got = loss_diagnostics(name, *_args(batch), **hp)
    assert got["clip_frac"] == pytest.approx(_zero_grad_frac(_run(name, batch, **hp), batch), abs=1e-15)
    if name == "gmpo":
        n = batch["mask"].sum().item()
        assert got["clip_frac"] == pytest.approx(len(ref_gmpo_clipped(*_args(batch), **{**DEFAULTS_2026[name], **hp})) / n)


def test_clip_cov_clip_frac_in_the_random_regime_counts_both_kinds():
    batch = _scaled(make_batch("wide"), 3.0)
    batch["advantages"] = torch.where(batch["advantages"] == 0, 0.6, batch["advantages"])
    clipped, candidates, count = ref_clip_cov_candidates(*_args(batch), **DEFAULTS_2026["clip_cov"])
    n = batch["mask"].sum().item()
    got = loss_diagnostics("clip_cov", *_args(batch))
    assert got["clip_frac"] == pytest.approx((len(clipped) + min(count, len(candidates))) / n, abs=1e-15)
    assert got["clip_cov_frac"] == pytest.approx(min(count, len(candidates)) / n, abs=1e-15)
    torch.manual_seed(1)
    assert got["clip_frac"] == pytest.approx(_zero_grad_frac(_run("clip_cov", batch), batch), abs=1e-15)


@pytest.mark.parametrize("hp", [{}, {"ratio": 0.1, "kl_coef": 0.5}])
def test_kl_cov_clip_frac_is_the_penalised_fraction(hp):
    batch = _batch()
    selected = ref_kl_cov_selected(batch["logp"], batch["advantages"], batch["mask"], {**DEFAULTS_2026["kl_cov"], **hp}["ratio"])
    got = loss_diagnostics("kl_cov", *_args(batch), **hp)
    assert got["clip_frac"] == pytest.approx(len(selected) / batch["mask"].sum().item(), abs=1e-15)


@pytest.mark.parametrize("hp", [{}, {"tau_pos": 2.0, "tau_neg": 3.5}])
def test_sapo_diagnostics_against_reference(hp):
    batch = _batch()
    weights = [w for _, _, w in ref_sapo_weight(*_args(batch), **{**DEFAULTS_2026["sapo"], **hp})]
    got = loss_diagnostics("sapo", *_args(batch), **hp)
    assert got["clip_frac"] == pytest.approx(sum(w < 0.5 for w in weights) / len(weights), abs=1e-15)
    assert got["sapo_gate_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-12)
    assert 0 < got["clip_frac"] < 1


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_diagnostics_take_the_runs_values_and_handle_an_empty_mask(name):
    """The hook gets the hyper-parameters it is given (the learner passes the run's resolved
    values, issue 42); a gin binding is not read."""
    batch = _batch()
    binding, override = {"sapo": ("sapo.tau_pos = 4.0", {"tau_pos": 4.0}), "gmpo": ("gmpo.eps_high = 0.05", {"eps_high": 0.05}),
                         "clip_cov": ("clip_cov.eps_high = 0.1", {"eps_high": 0.1}),
                         "kl_cov": ("kl_cov.ratio = 0.3", {"ratio": 0.3})}[name]
    default = loss_diagnostics(name, *_args(batch))["clip_frac"]
    assert default != loss_diagnostics(name, *_args(batch), **override)["clip_frac"]
    gin.parse_config(binding)
    assert loss_diagnostics(name, *_args(batch))["clip_frac"] == default
    empty = torch.zeros_like(batch["mask"])
    assert all(math.isnan(v) for v in loss_diagnostics(name, batch["logp"], batch["gen_logp"], batch["advantages"], empty).values())


# ----------------------------------------------------------------------------------------
# padding, gen_logp, gin
@pytest.mark.parametrize("pad", [float("nan"), float("inf"), float("-inf"), 1e4])
@pytest.mark.parametrize("name,hp,scale", CASES, ids=CASE_IDS)
def test_padding_never_contributes(name, hp, scale, pad):
    clean, dirty = _batch(scale), _batch(scale, pad_value=pad)
    mask = clean["mask"]
    torch.manual_seed(0)
    out_clean = _run(name, clean, **hp)
    torch.manual_seed(0)
    out_dirty = _run(name, dirty, **hp)
    assert (out_dirty[~mask] == 0).all()
    torch.testing.assert_close(out_dirty, out_clean, rtol=0, atol=0)
    (g_clean,) = torch.autograd.grad(out_clean.sum(), clean["logp"])
    (g_dirty,) = torch.autograd.grad(out_dirty.sum(), dirty["logp"])
    assert torch.isfinite(g_dirty).all() and (g_dirty[~mask] == 0).all()
    torch.testing.assert_close(g_dirty, g_clean, rtol=0, atol=0)


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_an_all_padding_row_and_an_empty_batch(name):
    batch = make_batch("wide", pad_value=float("nan"))
    mask = batch["mask"].clone()
    mask[2] = False
    logp = torch.where(mask, batch["logp"].detach(), float("-inf")).requires_grad_(True)
    out = LOSSES.get(name)(logp, batch["gen_logp"], batch["advantages"], mask)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert torch.isfinite(out).all() and (out[2] == 0).all() and torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    # the learner pads ranks with all-masked dummy micro-batches: zero loss, zero gradient, no error
    empty = torch.zeros_like(mask)
    out = LOSSES.get(name)(logp, batch["gen_logp"], batch["advantages"], empty)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert (out == 0).all() and (grad == 0).all()


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_gen_logp_gets_no_gradient(name):
    batch = _batch()
    gen = batch["gen_logp"].clone().requires_grad_(True)
    out = LOSSES.get(name)(batch["logp"], gen, batch["advantages"], batch["mask"])
    (g,) = torch.autograd.grad(out.sum(), gen, allow_unused=True)
    assert g is None or (g == 0).all()


@pytest.mark.parametrize(
    "name,binding,hp",
    [("sapo", "sapo.tau_neg = 3.5\nsapo.tau_pos = 2.0", {"tau_pos": 2.0, "tau_neg": 3.5}),
     ("gmpo", "gmpo.eps_low = 0.2\ngmpo.eps_high = 0.3", {"eps_low": 0.2, "eps_high": 0.3}),
     ("clip_cov", "losses.clip_cov.cov_lb = 0.3\nclip_cov.cov_ub = 2.0\nclip_cov.ratio = 0.5",
      {"cov_lb": 0.3, "cov_ub": 2.0, "ratio": 0.5}),
     ("kl_cov", "kl_cov.ratio = 0.1\nkl_cov.kl_coef = 0.5", {"ratio": 0.1, "kl_coef": 0.5})],
)
def test_gin_bound_hparams_are_honoured(name, binding, hp):
    batch = _batch()
    default_out = _run(name, batch).detach()
    gin.parse_config(binding)
    out = _run(name, batch).detach()
    ref, _ = _reference(name, batch, **hp)
    torch.testing.assert_close(out, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert not torch.equal(out, default_out)


# ----------------------------------------------------------------------------------------
# micro-batching: the row-local losses are exact, the covariance losses are per micro-batch (documented)
SPLITS = [[(0, 3), (3, 8)], [(0, 5), (5, 8)], [(i, i + 1) for i in range(8)]]


def _grad(name, batch, agg, split, **hp):
    logp = batch["logp"].detach().clone().requires_grad_(True)
    weights = token_weights(agg, batch["mask"], batch["group_ids"], torch.float64)  # [B, T] on the whole batch
    for lo, hi in split:
        per_token = LOSSES.get(name)(logp[lo:hi], batch["gen_logp"][lo:hi], batch["advantages"][lo:hi],
                                     batch["mask"][lo:hi], **hp)  # [b, T]
        weighted_sum(per_token, weights[lo:hi]).backward()
    return logp.grad


@pytest.mark.parametrize("split", range(len(SPLITS)))
@pytest.mark.parametrize("agg", AGGS + ("dr_grpo",))
@pytest.mark.parametrize("name", ["sapo", "gmpo"])
def test_row_local_losses_are_exact_under_micro_batching(name, agg, split):
    batch = _batch()
    whole = _grad(name, batch, agg, [(0, 8)])
    torch.testing.assert_close(_grad(name, batch, agg, SPLITS[split]), whole, rtol=1e-12, atol=1e-15)
    assert whole.abs().sum() > 0


def test_covariance_losses_depend_on_the_micro_batch_as_documented():
    """kl_cov on a one-row micro-batch picks that row's own top token: not the whole batch's choice."""
    batch = _batch()
    hp = {"ratio": 0.1}
    whole = _grad("kl_cov", batch, "token_mean", [(0, 8)], **hp)
    split = _grad("kl_cov", batch, "token_mean", SPLITS[2], **hp)
    assert (split - whole).abs().max() > 1e-3
    # a single micro-batch holding the step is the whole-batch loss
    torch.testing.assert_close(_grad("kl_cov", batch, "token_mean", [(0, 8)], **hp), whole, rtol=0, atol=0)
    # the covariance is over the tokens given: a row alone has its own means
    one = token_covariance(batch["logp"][:1], batch["advantages"][:1], batch["mask"][:1])
    assert one.abs().max() < 1e-12  # one sequence: A_t - mean A = 0 on every token (up to rounding)


# ----------------------------------------------------------------------------------------
# the dr_grpo aggregation
def _loss_tensor(seed=0):
    batch = make_batch("wide")
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch["mask"].shape, generator=g, dtype=torch.float64)
    return torch.where(batch["mask"], loss, 0.0).requires_grad_(True), batch["mask"], batch["group_ids"]


@pytest.mark.parametrize("max_tokens", [None, 9, 1024])
def test_dr_grpo_value_and_gradient_against_reference(max_tokens):
    loss, mask, gids = _loss_tensor()
    if max_tokens is not None:
        gin.parse_config(f"dr_grpo.max_tokens = {max_tokens}")
    value = AGGREGATIONS.get("dr_grpo")(loss, mask, gids)
    expected, w = ref_dr_grpo(loss.tolist(), mask, max_tokens)
    assert value.dim() == 0 and value.item() == pytest.approx(expected, rel=1e-13)
    (grad,) = torch.autograd.grad(value, loss)
    torch.testing.assert_close(grad, torch.tensor(w, dtype=torch.float64), rtol=1e-13, atol=0)
    torch.testing.assert_close(token_weights("dr_grpo", mask, gids, torch.float64), torch.tensor(w, dtype=torch.float64),
                               rtol=1e-13, atol=0)


def test_dr_grpo_has_no_length_bias_and_a_constant_normaliser():
    """Each token weighs 1/(B L) whatever its sequence's length (sample_mean gives a short sequence's token more),
    and the normaliser does not move with the longest completion once max_tokens is bound."""
    loss, mask, gids = _loss_tensor()
    w = token_weights("dr_grpo", mask, gids, torch.float64)
    assert torch.unique(w[mask]).numel() == 1
    gin.parse_config("dr_grpo.max_tokens = 64")
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], 7, dtype=torch.bool)], 1)
    padded = torch.cat([loss.detach(), torch.zeros(mask.shape[0], 7, dtype=torch.float64)], 1)
    a = AGGREGATIONS.get("dr_grpo")(loss, mask, gids).item()
    assert AGGREGATIONS.get("dr_grpo")(padded, padded_mask, gids).item() == pytest.approx(a, rel=1e-15)
    assert a == pytest.approx(loss.detach()[mask].sum().item() / (8 * 64), rel=1e-13)


@pytest.mark.parametrize("split", range(len(SPLITS)))
@pytest.mark.parametrize("name", ["grpo", "cispo", "sapo"])
def test_dr_grpo_micro_batches_with_global_weights_are_exact(name, split):
    batch = _batch()
    gin.parse_config("dr_grpo.max_tokens = 16")
    logp = batch["logp"].detach().clone().requires_grad_(True)
    value = AGGREGATIONS.get("dr_grpo")(LOSSES.get(name)(logp, batch["gen_logp"], batch["advantages"], batch["mask"]),
                                        batch["mask"], batch["group_ids"])
    (whole,) = torch.autograd.grad(value, logp)
    torch.testing.assert_close(_grad(name, batch, "dr_grpo", SPLITS[split]), whole, rtol=1e-12, atol=1e-15)
    # naive: each micro-batch normalised by its own sequence count is wrong for unequal micro-batches
    if split == 1:
        naive = torch.zeros_like(whole)
        for lo, hi in SPLITS[split]:
            lp = batch["logp"].detach().clone().requires_grad_(True)
            part = AGGREGATIONS.get("dr_grpo")(LOSSES.get(name)(lp[lo:hi], batch["gen_logp"][lo:hi], batch["advantages"][lo:hi],
                                                                batch["mask"][lo:hi]), batch["mask"][lo:hi], batch["group_ids"][lo:hi])
            naive += torch.autograd.grad(part / len(SPLITS[split]), lp)[0]
        assert (naive - whole).abs().max() / whole.abs().max() > 0.05


def test_dr_grpo_refuses_a_bad_constant():
    from components.registry import ParamRangeError

    from components.trainer.gin_config import bound_values

    gin.parse_config("dr_grpo.max_tokens = 0")
    with pytest.raises(ParamRangeError, match=r"dr_grpo\.max_tokens = 0 is out of range: must be an integer >= 1"):
        AGGREGATIONS.check_params("dr_grpo", bound_values(AGGREGATIONS, "dr_grpo"))
