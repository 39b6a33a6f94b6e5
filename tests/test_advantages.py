"""Advantage normalizations (DESIGN.md "Math contracts") against float64 references.

centred A_hat = r - mean of r within its group (prompt), then
none:   A_hat
prompt: A_hat / (population std of r within the group + 1e-6)
batch:  A_hat / (population std of all A_hat in the batch + 1e-6)
"""

from __future__ import annotations

import inspect
import math

import gin
import pytest
import torch

from components.advantages import batch as batch_norm
from components.registry import ADVANTAGE_NORMS

from _helpers_losses import ref_advantages

torch.set_num_threads(1)

NORMS = ("none", "prompt", "batch")

# +/-1 rewards, 4 prompts x 4 generations, interleaved non-contiguous ids; prompt 9 has zero variance
REWARDS_PM1 = [1, -1, -1, 1, 1, 1, -1, -1, -1, 1, 1, 1, 1, -1, 1, 1]
GROUPS_PM1 = [3, 3, 9, 3, 9, 0, 0, 9, 9, 0, 5, 5, 0, 5, 3, 5]
# non-binary rewards, unequal group sizes
REWARDS_REAL = [0.3, 1.7, -0.2, 0.9, 0.0, 2.5, -1.25, 0.4, 0.4]
GROUPS_REAL = [1, 1, 1, 2, 2, 4, 4, 4, 4]


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_registered_with_signature():
    assert set(NORMS) <= set(ADVANTAGE_NORMS.names())
    for name in NORMS:
        assert list(inspect.signature(ADVANTAGE_NORMS.original(name)).parameters)[:2] == ["rewards", "group_ids"]


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("rewards,groups", [(REWARDS_PM1, GROUPS_PM1), (REWARDS_REAL, GROUPS_REAL)], ids=["pm1", "real"])
def test_against_reference(name, rewards, groups):
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups)
    out = ADVANTAGE_NORMS.get(name)(r, g)
    assert out.shape == r.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor(ref_advantages(name, rewards, groups), dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_population_std_not_sample_std():
    # group [1, -1]: population std 1 (sample std would be sqrt(2))
    r = torch.tensor([1.0, -1.0], dtype=torch.float64)
    g = torch.tensor([0, 0])
    out = ADVANTAGE_NORMS.get("prompt")(r, g)
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0], dtype=torch.float64) / (1.0 + 1e-6))
    # group of 3 with one success: centred (2*2/3... ) population std sqrt(8/9)
    r = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    out = ADVANTAGE_NORMS.get("prompt")(r, torch.tensor([4, 4, 4]))
    centred = torch.tensor([4 / 3, -2 / 3, -2 / 3], dtype=torch.float64)
    torch.testing.assert_close(out, centred / (math.sqrt(8 / 9) + 1e-6))


@pytest.mark.parametrize("name", NORMS)
def test_zero_variance_prompt_gives_zero_advantage_and_no_nan(name):
    r = torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    out = ADVANTAGE_NORMS.get(name)(r, g)
    assert torch.isfinite(out).all()
    assert (out[:3] == 0).all()
    # a batch where every prompt has zero variance
    out = ADVANTAGE_NORMS.get(name)(torch.ones(4, dtype=torch.float64), torch.tensor([0, 0, 1, 1]))
    assert (out == 0).all()


def test_none_is_group_centred_and_sums_to_zero_per_group():
    r = torch.tensor(REWARDS_REAL, dtype=torch.float64)
    g = torch.tensor(GROUPS_REAL)
    out = ADVANTAGE_NORMS.get("none")(r, g)
    for gid in set(GROUPS_REAL):
        assert out[g == gid].sum().item() == pytest.approx(0.0, abs=1e-14)


def test_batch_normalisation_has_unit_population_std():
    r = torch.tensor(REWARDS_PM1, dtype=torch.float64)
    out = ADVANTAGE_NORMS.get("batch")(r, torch.tensor(GROUPS_PM1))
    assert out.std(correction=0).item() == pytest.approx(1.0, rel=1e-5)
    # it does not rescale per prompt: ratios between prompts are those of the centred values
    centred = ADVANTAGE_NORMS.get("none")(r, torch.tensor(GROUPS_PM1))
    nz = centred != 0
    ratio = out[nz] / centred[nz]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio))


def test_prompt_and_batch_differ():
    r = torch.tensor(REWARDS_REAL, dtype=torch.float64)
    g = torch.tensor(GROUPS_REAL)
    assert not torch.allclose(ADVANTAGE_NORMS.get("prompt")(r, g), ADVANTAGE_NORMS.get("batch")(r, g))


@pytest.mark.parametrize("name", ["prompt", "batch"])
def test_gin_binds_eps(name):
    r = torch.tensor(REWARDS_REAL, dtype=torch.float64)
    g = torch.tensor(GROUPS_REAL)
    gin.parse_config(f"{name}.eps = 0.5")
    out = ADVANTAGE_NORMS.get(name)(r, g)
    torch.testing.assert_close(out, torch.tensor(ref_advantages(name, REWARDS_REAL, GROUPS_REAL, eps=0.5), dtype=torch.float64))


def test_float32_and_bad_shapes():
    r = torch.tensor(REWARDS_PM1, dtype=torch.float32)
    out = ADVANTAGE_NORMS.get("batch")(r, torch.tensor(GROUPS_PM1))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), torch.tensor(ref_advantages("batch", REWARDS_PM1, GROUPS_PM1), dtype=torch.float64), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="same length"):
        batch_norm(torch.ones(4), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError):
        ADVANTAGE_NORMS.get("prompt")(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))
