"""`scalerl components`: every family, its entries, each entry's parameters and defaults.

Only the families of issue 2 (losses, aggregations, advantage norms) are asserted on; the
other families' modules belong to other people and are recorded as import errors, not crashes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "tests" / "user_components"
MY_MODULES = ("components.losses", "components.aggregation", "components.advantages")
EXPECTED = {
    "losses": {
        "grpo": {"eps": 0.2},
        "dapo": {"eps_low": 0.2, "eps_high": 0.28},
        "cispo": {"eps_max": 4.0},
        "gspo": {"eps_low": 3e-3, "eps_high": 5e-3},
    },
    "aggregations": {"token_mean": {}, "sample_mean": {}, "prompt_mean": {}},
    "advantage_norms": {"none": {"eps": 1e-6}, "prompt": {"eps": 1e-6}, "batch": {"eps": 1e-6}},
    "mismatch_corrections": {"none": {}, "tis": {"cap": 2.0}, "mis": {"low": 0.5, "high": 2.0},
                             "seq_tis": {"cap": 2.0}, "seq_mis": {"low": 0.5, "high": 2.0}},
    "environments": {"single_turn": {}, "calculator": {}},
}
ALL_FAMILIES = {"losses", "aggregations", "advantage_norms", "curricula", "precisions", "length_controls",
                "off_policy", "tasks", "engines", "rewards", "trackers", "weight_sync_backends",
                "kl_estimators", "lr_schedules", "mismatch_corrections", "environments"}


def _scalerl(*args, cwd=REPO):
    exe = Path(sys.executable).with_name("scalerl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "experiments.cli"]
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}
    return subprocess.run(cmd + list(args), cwd=cwd, capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def listing():
    """`scalerl components --import my_losses --json`, run next to a user's module (one process
    for both the built-ins and the user's loss: starting python + torch is the slow part)."""
    out = _scalerl("components", "--import", "my_losses", "--json", cwd=USER_DIR)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_json_lists_every_family(listing):
    assert set(listing["families"]) == ALL_FAMILIES
    for mod in MY_MODULES:
        assert mod not in listing["import_errors"], listing["import_errors"][mod]


@pytest.mark.parametrize("family", list(EXPECTED))
def test_json_entries_and_parameter_defaults(listing, family):
    entries = listing["families"][family]
    assert set(EXPECTED[family]) <= set(entries)
    for name, params in EXPECTED[family].items():
        assert entries[name]["params"] == params, (family, name)
        assert entries[name]["doc"], f"{family}/{name} has no one-line description"


def test_json_lists_the_extra_losses(listing):
    losses = listing["families"]["losses"]
    assert losses["ppo_dual_clip"]["params"] == {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0}
    assert losses["icepop"]["params"] == {"low": 0.5, "high": 2.0}


def test_json_lists_the_trackers_weight_sync_backends_and_engines(listing):
    """Every choice by name is a registry family: `scalerl components` lists them with a description."""
    families = listing["families"]
    assert {"wandb", "tensorboard", "mlflow"} == set(families["trackers"])
    assert {"gloo", "nccl", "ipc"} == set(families["weight_sync_backends"])
    assert {"torch", "vllm"} <= set(families["engines"])
    for family in ("trackers", "weight_sync_backends"):
        for name, entry in families[family].items():
            assert entry["doc"], f"{family}/{name} has no one-line description"
    for mod in ("components.trainer.tracking", "components.trainer.weight_sync"):
        assert mod not in listing["import_errors"], listing["import_errors"][mod]


def test_plain_output_shows_families_entries_and_defaults():
    out = _scalerl("components")
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    for family, entries in EXPECTED.items():
        assert family in text
        for name in entries:
            assert name in text, name
    for fragment in ("eps=0.2", "eps_low=0.2", "eps_high=0.28", "eps_max=4.0", "eps_low=0.003", "eps_high=0.005"):
        assert fragment in text, fragment
    for family, name in (("trackers", "tensorboard"), ("weight_sync_backends", "gloo")):
        assert family in text and name in text, (family, name)


def test_json_lists_a_users_loss_imported_with_import(listing):
    """tests/user_components/my_losses.py, a file outside the package, via --import."""
    entry = listing["families"]["losses"]["my_reinforce"]
    assert entry["params"] == {"scale": 1.0}
    assert entry["where"] == "my_losses.my_reinforce"
    assert entry["doc"].startswith("Plain REINFORCE")


def test_unknown_family_is_a_clear_error(monkeypatch):
    from experiments.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts "." on sys.path

    with pytest.raises(SystemExit) as err:
        main(["components", "--family", "lossez"])
    msg = str(err.value.code)
    assert "lossez" in msg and "losses" in msg and "aggregations" in msg
