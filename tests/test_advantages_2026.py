"""The advantage estimators added in 2026 (issue 43 item 4) against float64 references.

rloo:         A_i = r_i - mean of the other rewards of its group (arXiv 2402.14740); 0 for a group of one.
reinforce_pp: A'_i = r_i - mean of its group (0 baseline for a group of one), then
              (A' - mean A') / sqrt(unbiased var A' + eps) over the batch (arXiv 2501.03262, verl's
              reinforce_plus_plus_baseline).
"""

from __future__ import annotations

import inspect
import math

import gin
import pytest
import torch

from components.registry import ADVANTAGE_NORMS

from _helpers_losses_2026 import ref_reinforce_pp, ref_rloo
from test_advantages import GROUPS_PM1, GROUPS_REAL, REWARDS_PM1, REWARDS_REAL

torch.set_num_threads(1)

# unequal group sizes, one group of a single sample (id 8)
REWARDS_SINGLETON = [1.0, -1.0, 1.0, 0.5, 2.0, -0.3]
GROUPS_SINGLETON = [3, 3, 3, 8, 5, 5]
CASES = [(REWARDS_PM1, GROUPS_PM1), (REWARDS_REAL, GROUPS_REAL), (REWARDS_SINGLETON, GROUPS_SINGLETON)]
IDS = ["pm1", "real", "singleton"]


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _run(name, rewards, groups, **kw):
    return ADVANTAGE_NORMS.get(name)(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), **kw)


def test_registered_with_the_signature():
    for name in ("rloo", "reinforce_pp"):
        assert name in ADVANTAGE_NORMS.names()
        assert list(inspect.signature(ADVANTAGE_NORMS.original(name)).parameters)[:2] == ["rewards", "group_ids"]
        doc = inspect.getdoc(ADVANTAGE_NORMS.original(name))
        assert "arXiv" in doc and "verl" in doc


@pytest.mark.parametrize("rewards,groups", CASES, ids=IDS)
def test_rloo_against_reference(rewards, groups):
    out = _run("rloo", rewards, groups)
    assert out.shape == (len(rewards),) and out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor(ref_rloo(rewards, groups), dtype=torch.float64), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("rewards,groups", CASES, ids=IDS)
def test_reinforce_pp_against_reference(rewards, groups):
    out = _run("reinforce_pp", rewards, groups)
    torch.testing.assert_close(out, torch.tensor(ref_reinforce_pp(rewards, groups), dtype=torch.float64), rtol=1e-12, atol=1e-15)
    gin.parse_config("reinforce_pp.eps = 0.5")
    out = _run("reinforce_pp", rewards, groups)
    torch.testing.assert_close(out, torch.tensor(ref_reinforce_pp(rewards, groups, eps=0.5), dtype=torch.float64), rtol=1e-12,
                               atol=1e-15)


def test_rloo_is_the_leave_one_out_baseline_and_g_over_g_minus_1_times_centred():
    # group [1, -1, -1]: A_0 = 1 - (-1) = 2, A_1 = -1 - (1 - 1)/2 = -1
    out = _run("rloo", [1.0, -1.0, -1.0], [0, 0, 0])
    torch.testing.assert_close(out, torch.tensor([2.0, -1.0, -1.0], dtype=torch.float64))
    centred = _run("none", REWARDS_REAL, GROUPS_REAL)
    sizes = torch.tensor([GROUPS_REAL.count(g) for g in GROUPS_REAL], dtype=torch.float64)
    torch.testing.assert_close(_run("rloo", REWARDS_REAL, GROUPS_REAL), centred * sizes / (sizes - 1), rtol=1e-12, atol=1e-15)
    # a group of one has no other sample: no baseline, no advantage
    assert _run("rloo", REWARDS_SINGLETON, GROUPS_SINGLETON)[3].item() == 0.0


def test_reinforce_pp_whitens_over_the_batch():
    out = _run("reinforce_pp", REWARDS_PM1, GROUPS_PM1)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert out.std(correction=1).item() == pytest.approx(1.0, rel=1e-6)  # unbiased std 1 (up to eps)
    # the single sample keeps its raw reward as A' (baseline 0), so its group does not zero it
    out = _run("reinforce_pp", REWARDS_SINGLETON, GROUPS_SINGLETON)
    assert out[3].item() != 0.0
    # with every group of size >= 2 it is `batch` up to the variance's ddof and where eps goes
    batch = _run("batch", REWARDS_PM1, GROUPS_PM1)
    n = len(REWARDS_PM1)
    torch.testing.assert_close(_run("reinforce_pp", REWARDS_PM1, GROUPS_PM1), batch * math.sqrt((n - 1) / n), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp"])
def test_zero_variance_and_degenerate_batches_give_finite_advantages(name):
    out = _run(name, [1.0, 1.0, 1.0, -1.0, 1.0, -1.0], [0, 0, 0, 1, 1, 1])
    assert torch.isfinite(out).all() and (out[:3].abs() < 1e-12).all()
    assert (_run(name, [1.0] * 4, [0, 0, 1, 1]) == 0).all()
    assert (_run(name, [1.0], [0]) == 0).all()  # one sequence: no baseline, no variance
    assert _run(name, [], []).shape == (0,)


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp"])
def test_float32_and_bad_shapes(name):
    out = ADVANTAGE_NORMS.get(name)(torch.tensor(REWARDS_PM1, dtype=torch.float32), torch.tensor(GROUPS_PM1))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _run(name, REWARDS_PM1, GROUPS_PM1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="same length"):
        ADVANTAGE_NORMS.get(name)(torch.ones(4), torch.tensor([0, 0, 1]))
