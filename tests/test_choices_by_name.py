"""Every choice by name goes through a `Registry` (issue 31 item 6): trackers, weight-sync
backends and engines give the registry's unknown-name error (did-you-mean, the valid names),
and a user's loss reports its own diagnostics, registered with it, in the step's metrics."""

from __future__ import annotations

import uuid

import pytest
import torch

from components.registry import ENGINES, LOSSES, TRACKERS, WEIGHT_SYNC_BACKENDS, UnknownComponentError
from components.trainer.config import ConfigError, TrainConfig, engine_gpus, validate


def test_the_shipped_names_are_registered():
    assert set(TRACKERS.names()) == {"wandb", "tensorboard", "mlflow"}
    assert set(WEIGHT_SYNC_BACKENDS.names()) == {"gloo", "nccl", "ipc"}
    assert {"torch", "vllm"} <= set(ENGINES.names())


def test_unknown_tracker_is_the_registrys_error():
    with pytest.raises(ConfigError) as err:
        validate(TrainConfig(model_path="/x", trackers=("tensorbaord",)))
    msg = str(err.value)
    assert "Unknown tracker 'tensorbaord'" in msg and "Did you mean 'tensorboard'?" in msg
    assert all(n in msg for n in ("mlflow", "tensorboard", "wandb"))


def test_unknown_weight_sync_backend_is_the_registrys_error():
    with pytest.raises(ConfigError) as err:
        validate(TrainConfig(model_path="/x", weight_sync_backend="ncll"))
    msg = str(err.value)
    assert "Unknown weight-sync backend 'ncll'" in msg and "Did you mean 'nccl'?" in msg
    assert all(n in msg for n in ("gloo", "ipc", "nccl", "'auto'"))
    from components.trainer.weight_sync import WeightGroup

    with pytest.raises(ValueError, match="Unknown weight-sync backend 'mpi'.*Did you mean"):
        WeightGroup(master_addr="127.0.0.1", master_port=1, num_generators=1, backend="mpi")
    validate(TrainConfig(model_path="/x", weight_sync_backend="auto"))


def test_unknown_engine_is_the_registrys_error_everywhere_an_engine_is_chosen():
    with pytest.raises(UnknownComponentError) as err:
        engine_gpus(TrainConfig(model_path="/x", engine="vlm"))
    msg = str(err.value)
    assert "Unknown engine 'vlm'" in msg and "Did you mean 'vllm'?" in msg and "torch" in msg
    from experiments.memory_model import PlanError, engine_memory_model

    with pytest.raises(PlanError, match="Unknown engine 'torhc'.*Did you mean 'torch'"):
        engine_memory_model("torhc")
    assert engine_memory_model("vllm") == "paged" and engine_memory_model("torch") == "dense"


def test_engine_gpus_come_from_the_engine_class():
    import gin

    gin.clear_config()
    try:
        assert engine_gpus(TrainConfig(model_path="/x", engine="torch")) == 1
        assert engine_gpus(TrainConfig(model_path="/x", engine="vllm")) == 1
        gin.parse_config("vllm.tensor_parallel_size = 4")
        assert engine_gpus(TrainConfig(model_path="/x", engine="vllm")) == 4
        assert engine_gpus(TrainConfig(model_path="/x", engine="torch")) == 1
    finally:
        gin.clear_config()


def test_a_users_loss_reports_its_diagnostics_in_the_step_metrics():
    """A loss registered with a diagnostics hook: the hook gets the loss's hyper-parameters (the
    run's values: a gin binding, resolved with the config) and what it reports lands in the learner
    step's stats (metrics.jsonl)."""
    import gin

    from components.losses import loss_diagnostics
    from components.trainer.learner import finish_stats

    name = f"user_loss_{uuid.uuid4().hex[:8]}"
    seen = {}

    def diagnostics(logp, gen_logp, advantages, mask, *, scale=1.0):
        seen["scale"] = scale
        return {"clip_frac": 0.25, f"{name}_scale_seen": scale}

    @LOSSES.register(name, diagnostics=diagnostics)
    def user_loss(logp, gen_logp, advantages, mask, *, scale: float = 1.0):
        """A user's loss with its own diagnostics."""
        return torch.where(mask, -scale * advantages[:, None] * logp, torch.zeros_like(logp))

    try:
        assert LOSSES.diagnostics_of(name) is diagnostics
        logp = torch.zeros(2, 3)
        mask = torch.ones(2, 3, dtype=torch.bool)
        gin.clear_config()
        gin.parse_config(f"{name}.scale = 2.5")
        diag = loss_diagnostics(name, logp, logp, torch.ones(2), mask, scale=2.5)
        assert seen["scale"] == 2.5 and diag["clip_frac"] == 0.25 and diag[f"{name}_scale_seen"] == 2.5
        assert loss_diagnostics(name, logp, logp, torch.ones(2), mask)[f"{name}_scale_seen"] == 1.0  # gin unread
        assert diag["is_ratio_mean"] == 1.0
        assert loss_diagnostics(name, logp, logp, torch.ones(2), mask, scale=3.0)[f"{name}_scale_seen"] == 3.0
        assert loss_diagnostics("grpo", logp, logp, torch.ones(2), mask)["clip_frac"] == 0.0  # a built-in's hook
        stats = _finish_with(finish_stats, name)
        assert stats["clip_frac"] == 0.25 and stats[f"{name}_scale_seen"] == 2.5
    finally:
        gin.clear_config()
        LOSSES.unregister(name)


def _finish_with(finish_stats, loss_name: str) -> dict:
    """finish_stats (the learner's step statistics) for a one-shard step of 2 sequences."""
    import inspect

    from components.trainer import learner as L

    params = inspect.signature(finish_stats).parameters
    assert list(params)[:5] == ["plan", "parts", "version", "cfg", "time_train"], list(params)
    B, T = 2, 3
    batch = type("Batch", (), {})()
    batch.mask = torch.ones(B, T, dtype=torch.bool)
    batch.gen_logp = torch.zeros(B, T)
    batch.versions = torch.zeros(B, T, dtype=torch.long)
    batch.attention_mask = torch.ones(B, T + 1, dtype=torch.long)
    plan = type("Plan", (), {})()
    plan.batch, plan.advantages, plan.rows = batch, torch.ones(B), [torch.arange(B)]
    plan.stats = {}
    part = {"logp": [torch.zeros(B, T)], "entropy": [torch.zeros(B, T)], "loss": 0.5, "grad_norm": 1.0, "lr": 1e-3}
    cfg = TrainConfig(model_path="/x", loss=loss_name)
    return L.finish_stats(plan, [part], 1, cfg, 0.1)
