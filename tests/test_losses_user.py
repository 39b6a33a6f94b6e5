"""A user's own loss, in a file OUTSIDE the package, selected from a gin file (docs/adding_a_loss.md).

tests/user_components/my_losses.py registers `my_reinforce` (-scale * A * log pi) with
`@LOSSES.register`; tests/user_components/my_recipe.gin imports it, selects it with
`train.loss = "my_reinforce"` and binds `my_reinforce.scale = 0.5`. Each check runs in a
subprocess so the global registration does not leak into the other tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _helpers_losses import make_batch, ref_aggregate, ref_weights, times

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "tests" / "user_components"
RECIPE = USER_DIR / "my_recipe.gin"

# Runs in a fresh interpreter: what `scalerl train my_recipe.gin` does up to the loss.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import gin, torch
    sys.path.insert(0, {user_dir!r})              # the user's module is importable, not installed
    import components.trainer.config              # defines `train.*`, as `scalerl train` does
    import components.aggregation                 # built-ins are imported before the parse,
    import components.losses                      # as `scalerl train` does
    from components.aggregation import token_weights, weighted_sum
    from components.losses import loss_diagnostics
    from components.registry import AGGREGATIONS, LOSSES

    assert {module!r} not in sys.modules
    gin.parse_config_files_and_bindings([{recipe!r}], [])
    assert {module!r} in sys.modules, "the gin file's `import {module}` did not import it"

    loss_name = gin.query_parameter("train.loss")
    agg_name = {agg!r} or gin.query_parameter("train.aggregation")
    batch = json.loads({batch!r})
    logp = torch.tensor(batch["logp"], dtype=torch.float64, requires_grad=True)
    gen_logp = torch.tensor(batch["gen_logp"], dtype=torch.float64)
    adv = torch.tensor(batch["advantages"], dtype=torch.float64)
    mask = torch.tensor(batch["mask"])
    gids = torch.tensor(batch["group_ids"])

    loss_fn = LOSSES.get(loss_name)
    per_token = loss_fn(logp, gen_logp, adv, mask)                  # [B, T]
    value = AGGREGATIONS.get(agg_name)(per_token, mask, gids)        # []
    (grad,) = torch.autograd.grad(value, logp)

    # the learner's micro-batched path: whole-batch weights, per-micro-batch weighted sums
    w = token_weights(agg_name, mask, gids, torch.float64)
    logp_mb = logp.detach().clone().requires_grad_(True)
    for lo, hi in [(0, 3), (3, len(mask))]:
        weighted_sum(loss_fn(logp_mb[lo:hi], gen_logp[lo:hi], adv[lo:hi], mask[lo:hi]), w[lo:hi]).backward()

    diag = loss_diagnostics(loss_name, logp, gen_logp, adv, mask)   # a user loss declares no clip rule
    info = LOSSES.describe()[loss_name]
    print(json.dumps({{
        "loss": loss_name, "aggregation": agg_name, "value": value.item(),
        "grad": grad.tolist(), "grad_micro": logp_mb.grad.tolist(),
        "per_token": per_token.tolist(), "params": info["params"], "where": info["where"],
        "bound": gin.query_parameter({param!r}), "diagnostics": diag,
    }}))
    """
)


def _batch_json(batch) -> str:
    return json.dumps({
        "logp": batch["logp"].tolist(),
        "gen_logp": batch["gen_logp"].tolist(),
        "advantages": batch["advantages"].tolist(),
        "mask": batch["mask"].tolist(),
        "group_ids": batch["group_ids"].tolist(),
    })


def _run(args, cwd, timeout=180):
    env = {**os.environ, "PYTHONPATH": ""}  # only what an installed scalerl-zoo sees
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_user_loss_from_own_file_selected_by_gin_runs_through_registry_and_aggregation(tmp_path):
    batch = make_batch("wide")
    code = SCRIPT.format(user_dir=str(USER_DIR), recipe=str(RECIPE), module="my_losses", agg=None,
                         param="my_reinforce.scale", batch=_batch_json(batch))
    out = _run([sys.executable, "-c", code], cwd=tmp_path)  # cwd outside the repo and the user dir
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])

    assert got["loss"] == "my_reinforce" and got["aggregation"] == "prompt_mean"
    assert got["where"] == "my_losses.my_reinforce"
    assert got["params"] == {"scale": 1.0}  # the default, as written in the user's file
    assert got["bound"] == 0.5
    assert math.isnan(got["diagnostics"]["clip_frac"])  # docs: NaN for a loss the zoo did not write
    ratios = [math.exp(x - y) for rl, rg, rm in zip(batch["logp"].tolist(), batch["gen_logp"].tolist(), batch["mask"].tolist())
              for x, y, keep in zip(rl, rg, rm) if keep]
    assert got["diagnostics"]["is_ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)

    # reference: loss = -scale * A * log pi per token, scale = 0.5 from the gin file
    lp, adv, m = batch["logp"].tolist(), batch["advantages"].tolist(), batch["mask"].tolist()
    scale = 0.5
    ref_loss = [[-scale * adv[b] * lp[b][t] if m[b][t] else 0.0 for t in range(len(m[0]))] for b in range(len(m))]
    ref_dloss = [[-scale * adv[b] if m[b][t] else 0.0 for t in range(len(m[0]))] for b in range(len(m))]
    torch.testing.assert_close(torch.tensor(got["per_token"], dtype=torch.float64), torch.tensor(ref_loss, dtype=torch.float64))
    assert got["value"] == pytest.approx(ref_aggregate("prompt_mean", ref_loss, batch["mask"], batch["group_ids"]), rel=1e-12)
    expected_grad = times(ref_weights("prompt_mean", batch["mask"], batch["group_ids"]), ref_dloss)
    torch.testing.assert_close(torch.tensor(got["grad"], dtype=torch.float64), expected_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.tensor(got["grad_micro"], dtype=torch.float64), expected_grad, rtol=1e-12, atol=1e-15)


# `scalerl components --import my_losses` is tested in tests/test_registry_cli.py.


def test_the_guide_example_works_as_written(tmp_path):
    """docs/adding_a_loss.md: its Python file and gin file, copied verbatim, register and run."""
    text = (REPO / "docs" / "adding_a_loss.md").read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    (py,) = [b for b in blocks if "@LOSSES.register(" in b]
    (gin_text,) = [b for b in blocks if b.startswith("# my_experiment/my_loss.gin")]
    user_dir = tmp_path / "my_experiment"
    user_dir.mkdir()
    (user_dir / "my_losses.py").write_text(py)
    (user_dir / "my_loss.gin").write_text(gin_text)
    batch = make_batch("wide")
    code = SCRIPT.format(user_dir=str(user_dir), recipe=str(user_dir / "my_loss.gin"), module="my_losses",
                         agg="token_mean", param="my_loss.eps", batch=_batch_json(batch))
    out = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loss"] == "my_loss" and got["params"] == {"eps": 0.2} and got["bound"] == 0.1

    # the guide's formula: loss = -sg(clip(rho, 1 - eps, 1 + eps)) * A * log pi, eps = 0.1 from gin
    lp, glp = batch["logp"].tolist(), batch["gen_logp"].tolist()
    adv, m = batch["advantages"].tolist(), batch["mask"].tolist()
    w = [[min(max(math.exp(lp[b][t] - glp[b][t]), 0.9), 1.1) for t in range(len(m[0]))] for b in range(len(m))]
    ref_loss = [[-w[b][t] * adv[b] * lp[b][t] if m[b][t] else 0.0 for t in range(len(m[0]))] for b in range(len(m))]
    ref_dloss = [[-w[b][t] * adv[b] if m[b][t] else 0.0 for t in range(len(m[0]))] for b in range(len(m))]
    assert got["value"] == pytest.approx(ref_aggregate("token_mean", ref_loss, batch["mask"], batch["group_ids"]), rel=1e-12)
    expected_grad = times(ref_weights("token_mean", batch["mask"], batch["group_ids"]), ref_dloss)
    torch.testing.assert_close(torch.tensor(got["grad"], dtype=torch.float64), expected_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.tensor(got["grad_micro"], dtype=torch.float64), expected_grad, rtol=1e-12, atol=1e-15)
