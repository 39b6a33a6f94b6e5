"""Aggregations (DESIGN.md "Math contracts") and exact micro-batching (the
micro-batch normalisation bug of verl #5625, prime-rl #583, open-instruct #1161).

token_mean : sum over every masked token of the batch / number of masked tokens
sample_mean: mean over sequences of (sum over its tokens / its length)
prompt_mean: mean over prompts of (sum over its G generations' tokens / their total token count)

Micro-batching: `token_weights(name, mask, group_ids, dtype)` is computed on the WHOLE step
batch; each micro-batch contributes `weighted_sum(per_token_loss_mb, weights_mb)`. The
accumulated gradient must equal the whole-batch gradient for every loss x aggregation,
including splits that cut a prompt's generations across micro-batches. Normalising each
micro-batch by its own counts (the verl / prime-rl / open-instruct bug) must NOT.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import components.losses  # noqa: F401  (fills LOSSES)
from components.aggregation import token_weights, weighted_sum
from components.registry import AGGREGATIONS, LOSSES

from _helpers_losses import make_batch, ref_aggregate, ref_weights

torch.set_num_threads(1)

AGGS = ("token_mean", "sample_mean", "prompt_mean")
LOSS_CASES = [
    ("grpo", "wide"),
    ("dapo", "wide"),
    ("cispo", "wide"),
    ("gspo", "narrow"),
    ("ppo_dual_clip", "wide"),
    ("icepop", "wide"),
]
# row splits of the 8-sequence test batch (group ids 7,7,2,7,2,2,4,4)
SPLITS = {
    "cuts-two-prompts": [(0, 3), (3, 8)],
    "uneven": [(0, 5), (5, 8)],
    "one-row-each": [(i, i + 1) for i in range(8)],
    "three-ragged": [(0, 2), (2, 7), (7, 8)],
}


def _loss_tensor(seed=0):
    """Random per-token loss [B, T] (0 on padding), a float64 leaf, with the test batch's mask."""
    batch = make_batch("wide")
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch["mask"].shape, generator=g, dtype=torch.float64)
    loss = torch.where(batch["mask"], loss, 0.0).requires_grad_(True)
    return loss, batch["mask"], batch["group_ids"]


def test_registered():
    assert set(AGGS) <= set(AGGREGATIONS.names())


@pytest.mark.parametrize("agg", AGGS)
def test_signature(agg):
    assert list(inspect.signature(AGGREGATIONS.original(agg)).parameters)[:3] == ["per_token_loss", "mask", "group_ids"]


@pytest.mark.parametrize("agg", AGGS)
def test_value_and_gradient_against_reference(agg):
    loss, mask, gids = _loss_tensor()
    value = AGGREGATIONS.get(agg)(loss, mask, gids)
    assert value.dim() == 0
    assert value.item() == pytest.approx(ref_aggregate(agg, loss.tolist(), mask, gids), rel=1e-13)
    (grad,) = torch.autograd.grad(value, loss)
    torch.testing.assert_close(grad, torch.tensor(ref_weights(agg, mask, gids), dtype=torch.float64), rtol=1e-13, atol=0)


@pytest.mark.parametrize("agg", AGGS)
def test_token_weights_match_reference_and_sum_to_one(agg):
    _, mask, gids = _loss_tensor()
    w = token_weights(agg, mask, gids, torch.float64)
    assert w.shape == mask.shape and w.dtype == torch.float64 and not w.requires_grad
    torch.testing.assert_close(w, torch.tensor(ref_weights(agg, mask, gids), dtype=torch.float64), rtol=1e-13, atol=0)
    assert w.sum().item() == pytest.approx(1.0, rel=1e-13)  # each is a weighted mean
    assert (w[~mask] == 0).all()


def test_the_three_aggregations_differ_on_unequal_lengths_and_agree_on_equal_ones():
    loss, mask, gids = _loss_tensor()
    vals = {a: AGGREGATIONS.get(a)(loss, mask, gids).item() for a in AGGS}
    assert len({round(v, 12) for v in vals.values()}) == 3
    # equal lengths and equal group sizes: all three are the plain token mean
    full = torch.ones(6, 4, dtype=torch.bool)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    vals = [AGGREGATIONS.get(a)(x, full, g).item() for a in AGGS]
    assert vals == pytest.approx([x.mean().item()] * 3, rel=1e-13)


def test_prompt_mean_only_depends_on_the_grouping_not_the_labels():
    loss, mask, gids = _loss_tensor()
    relabelled = torch.tensor([{7: 100, 2: -5, 4: 0}[g] for g in gids.tolist()])
    a = AGGREGATIONS.get("prompt_mean")(loss, mask, gids)
    b = AGGREGATIONS.get("prompt_mean")(loss, mask, relabelled)
    assert a.item() == pytest.approx(b.item(), rel=1e-14)
    # regrouping does change it
    c = AGGREGATIONS.get("prompt_mean")(loss, mask, torch.arange(8))
    assert c.item() != pytest.approx(a.item(), rel=1e-6)
    # one sequence per prompt is sample_mean
    assert c.item() == pytest.approx(AGGREGATIONS.get("sample_mean")(loss, mask, gids).item(), rel=1e-13)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("pad", [float("nan"), float("inf"), 1e6])
def test_padding_in_the_per_token_loss_never_contributes(agg, pad):
    loss, mask, gids = _loss_tensor()
    dirty = torch.where(mask, loss.detach(), pad).requires_grad_(True)
    v, vd = AGGREGATIONS.get(agg)(loss, mask, gids), AGGREGATIONS.get(agg)(dirty, mask, gids)
    assert vd.item() == pytest.approx(v.item(), rel=1e-15)
    (gd,) = torch.autograd.grad(vd, dirty)
    assert torch.isfinite(gd).all() and (gd[~mask] == 0).all()


# ----------------------------------------------------------------------------------------
# micro-batching
def _whole_batch_grad(name, agg, batch):
    logp = batch["logp"].detach().clone().requires_grad_(True)
    per_token = LOSSES.get(name)(logp, batch["gen_logp"], batch["advantages"], batch["mask"])  # [B, T]
    value = AGGREGATIONS.get(agg)(per_token, batch["mask"], batch["group_ids"])
    value.backward()
    return value.detach(), logp.grad


def _micro_batch_grad(name, agg, batch, split):
    """Accumulate weighted_sum over micro-batches with weights from the WHOLE batch."""
    logp = batch["logp"].detach().clone().requires_grad_(True)
    weights = token_weights(agg, batch["mask"], batch["group_ids"], torch.float64)  # [B, T]
    total = 0.0
    for lo, hi in split:
        per_token = LOSSES.get(name)(
            logp[lo:hi], batch["gen_logp"][lo:hi], batch["advantages"][lo:hi], batch["mask"][lo:hi]
        )  # [b, T]
        part = weighted_sum(per_token, weights[lo:hi])
        part.backward()
        total += part.item()
    return total, logp.grad


def _naive_micro_batch_grad(name, agg, batch, split):
    """The bug: aggregate each micro-batch with its own counts, then average the micro-batches."""
    logp = batch["logp"].detach().clone().requires_grad_(True)
    for lo, hi in split:
        per_token = LOSSES.get(name)(
            logp[lo:hi], batch["gen_logp"][lo:hi], batch["advantages"][lo:hi], batch["mask"][lo:hi]
        )
        part = AGGREGATIONS.get(agg)(per_token, batch["mask"][lo:hi], batch["group_ids"][lo:hi]) / len(split)
        part.backward()
    return logp.grad


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name,kind", LOSS_CASES)
def test_micro_batches_with_global_weights_give_the_whole_batch_gradient(name, kind, agg, split):
    batch = make_batch(kind)
    value, grad = _whole_batch_grad(name, agg, batch)
    total, grad_mb = _micro_batch_grad(name, agg, batch, SPLITS[split])
    assert total == pytest.approx(value.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad_mb, grad, rtol=1e-12, atol=1e-15)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize(
    "agg,split",
    [
        ("token_mean", "cuts-two-prompts"),  # 18 vs 23 tokens in the two micro-batches
        ("sample_mean", "uneven"),  # 5 vs 3 sequences
        ("prompt_mean", "cuts-two-prompts"),  # prompts 7 and 2 straddle the split
    ],
)
@pytest.mark.parametrize("name,kind", LOSS_CASES)
def test_per_micro_batch_normalisation_is_wrong(name, kind, agg, split):
    """Demonstrates the bug the global weights avoid: the naive gradient differs."""
    batch = make_batch(kind)
    _, grad = _whole_batch_grad(name, agg, batch)
    naive = _naive_micro_batch_grad(name, agg, batch, SPLITS[split])
    rel_err = (naive - grad).abs().max() / grad.abs().max()
    assert rel_err > 0.05, f"naive micro-batch normalisation should be visibly wrong, rel err {rel_err:.3g}"


def test_naive_token_mean_is_right_only_when_micro_batches_have_equal_token_counts():
    """The control for the demonstration above: the difference comes from unequal counts."""
    batch = make_batch("wide")
    batch["mask"] = torch.zeros_like(batch["mask"])
    batch["mask"][:, :5] = True  # every sequence 5 tokens: equal counts in equal splits
    batch["logp"] = batch["logp"].detach().clone().requires_grad_(True)
    _, grad = _whole_batch_grad("dapo", "token_mean", batch)
    naive = _naive_micro_batch_grad("dapo", "token_mean", batch, [(0, 4), (4, 8)])
    torch.testing.assert_close(naive, grad, rtol=1e-12, atol=1e-15)


def test_token_weights_unknown_aggregation_names_the_choices():
    _, mask, gids = _loss_tensor()
    with pytest.raises(KeyError) as err:
        token_weights("prompt_maen", mask, gids)
    assert "prompt_mean" in str(err.value)


@pytest.mark.parametrize("agg", AGGS)
def test_token_weights_default_dtype_and_float32_weighted_sum(agg):
    loss, mask, gids = _loss_tensor()
    w32 = token_weights(agg, mask, gids)
    assert w32.dtype == torch.float32
    v = weighted_sum(loss.float(), w32)
    assert v.item() == pytest.approx(AGGREGATIONS.get(agg)(loss, mask, gids).item(), rel=1e-5)
