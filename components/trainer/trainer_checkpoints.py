"""learner-0's checkpoints: what a run's checkpoint holds of the hub, saving it, resuming from it.

Owns the trainer state of a checkpoint (`trainer.pt`: the curriculum, the loop's counters,
compute so far, the groups received and not trained on, the run's config; both directions,
`trainer_state` and `restore`, side by side), and the order of a save and of a resume across
the learner ranks: the logs fsynced before the checkpoint that counts their records is
committed, the follower ranks told to join (`SaveCheckpoint` / `LoadCheckpoint`), DCP's
collective save or load (checkpoint.py: the format, the manifest, the integrity checks), each
rank's RNG state. On resume the logs are checked against the checkpoint before anything loads.

It sees learner-0 through `CheckpointedHub`: the state a checkpoint holds and a way to reach
the follower ranks; the Trainer is one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol, Sequence

from components.trainer import messages as M
from components.trainer.accounting import TrainingClock
from components.trainer.runlog import repair_jsonl, resume_log

log = logging.getLogger(__name__)

__all__ = ["CheckpointLogs", "CheckpointedHub", "Checkpoints"]


class CheckpointLogs(Protocol):
    """The run's logs as a checkpoint counts on them (`logbook.Logbook`)."""

    def sync(self) -> dict:
        """Every line on disk (fsync); {file name: {"records", "last_step"}}."""


class CheckpointedHub(Protocol):
    """What a checkpoint holds of learner-0, and how it reaches the follower ranks (`loop.Trainer` is one).

    The counters are read at a save and set on resume."""

    followers: Sequence[str]  # learner-1 .. learner-(T-1)
    generators: Sequence[str]
    learner: Any  # components.trainer.learner.Learner: model, optimizer, scheduler, version
    tokenizer: Any  # saved with the checkpoint (hf/), so it is self-contained for export
    curriculum: Any  # state_dict() / load_state_dict()
    clock: TrainingClock  # base_s, eval_base_s, startup_base_s on resume
    logs: CheckpointLogs
    step: int
    next_order: int
    next_generator: int
    prompts_sampled: int
    flops: float
    pending: list  # groups received and not yet in a batch
    batches: list  # batches the scheme formed, not trained on yet
    totals: dict
    cpu_base_s: float  # CPU seconds of the sessions before this one

    def broadcast(self, msg: M.Message, peers: Sequence[str]) -> None:
        """One message to each of `peers`."""

    def cpu_hours(self) -> float:
        """CPU hours of the run's processes since training started (resumes included)."""


class Checkpoints:
    """Save and resume learner-0's run: `save()`, `resume_or_start()`; `last_step` is the step of
    the last checkpoint this session saved or resumed from (-1: none)."""

    def __init__(self, cfg, run_dir: Path, hub: CheckpointedHub):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.hub = hub
        self.last_step = -1

    @property
    def directory(self) -> Path:
        return self.run_dir / "checkpoints"

    def trainer_state(self) -> dict:
        """trainer.pt: learner-0's state beside the model and optimizer (`restore` reads it back)."""
        hub = self.hub
        return {
            "step": hub.step,
            "version": hub.learner.version,
            "curriculum": hub.curriculum.state_dict(),
            "next_order": hub.next_order,
            "next_generator": hub.next_generator,
            "prompts_sampled": hub.prompts_sampled,
            "wall_s": hub.clock.wall_s(),
            "eval_wall_s": hub.clock.eval_base_s,
            "startup_s": hub.clock.startup_s(),
            "cpu_s": hub.cpu_hours() * 3600.0,
            "flops": hub.flops,
            "pending": hub.pending,
            "pending_batches": hub.batches,
            "totals": dict(hub.totals),
            "config": self.cfg.to_dict(),
            "learner_ranks": 1 + len(hub.followers),  # learner-0 and its followers
        }

    def restore(self, state: dict) -> None:
        """Set learner-0's state from a checkpoint's trainer.pt (older checkpoints lack some fields)."""
        hub = self.hub
        hub.learner.version = int(state["version"])
        hub.curriculum.load_state_dict(state["curriculum"])
        hub.step = int(state["step"])
        hub.next_order = int(state["next_order"])
        hub.next_generator = int(state.get("next_generator", 0)) % max(len(hub.generators), 1)
        hub.prompts_sampled = int(state.get("prompts_sampled", hub.next_order))
        hub.clock.base_s = float(state["wall_s"])
        hub.clock.eval_base_s = float(state.get("eval_wall_s", 0.0))
        hub.clock.startup_base_s = float(state.get("startup_s", 0.0))
        hub.cpu_base_s = float(state.get("cpu_s", 0.0))
        hub.flops = float(state["flops"])
        hub.pending = list(state.get("pending", []))
        hub.batches = [list(b) for b in state.get("pending_batches", [])]
        hub.totals.update(state.get("totals", {}))

    def save(self) -> Path:
        """A checkpoint at the current step, collective over the learner ranks; returns its directory."""
        from components.trainer.checkpoint import rng_state, save_checkpoint

        hub = self.hub
        # every log line so far on disk (fsync) before the checkpoint that counts on them is committed
        logs = hub.logs.sync()
        if hub.followers:
            hub.broadcast(M.SaveCheckpoint(hub.step), peers=hub.followers)
        learner = hub.learner
        path = save_checkpoint(self.directory, hub.step, model=learner.model, optimizer=learner.optimizer,
                               scheduler_state=learner.scheduler.state_dict(), trainer_state=self.trainer_state(),
                               rank_state=rng_state(), keep=self.cfg.keep_checkpoints, tokenizer=hub.tokenizer, logs=logs)
        self.last_step = hub.step
        return path

    def resume_or_start(self) -> bool:
        """Resume from the newest intact checkpoint (True), or start (False); every learner rank joins."""
        from components.trainer.checkpoint import load_checkpoint, read_checkpoint_info, select_resume_checkpoint, set_rng_state

        hub = self.hub
        # the newest intact checkpoint (damaged newer ones are named in a warning and moved aside)
        ckpt_path = select_resume_checkpoint(self.directory)
        metrics_path, eval_path = self.run_dir / "metrics.jsonl", self.run_dir / "eval.jsonl"
        if ckpt_path is not None:  # before any loading: refuse logs that lost records the checkpoint counts on
            info = read_checkpoint_info(ckpt_path)
            counted = info.get("logs") or {}
            resume_log(metrics_path, int(info["step"]), counted.get(metrics_path.name), every_step=True)
            resume_log(eval_path, int(info["step"]), counted.get(eval_path.name))
        if hub.followers:
            hub.broadcast(M.LoadCheckpoint(None if ckpt_path is None else str(ckpt_path)), peers=hub.followers)
        hub.cpu_base_s = 0.0
        if ckpt_path is None:
            # nothing to resume from: any log lines belong to a run that never checkpointed
            repair_jsonl(metrics_path, None)
            repair_jsonl(eval_path, None)
            return False
        loaded = load_checkpoint(ckpt_path, model=hub.learner.model, optimizer=hub.learner.optimizer)
        hub.learner.scheduler.load_state_dict(loaded["scheduler_state"])
        self.restore(loaded["trainer_state"])
        if loaded.get("rank_state") is not None:
            set_rng_state(loaded["rank_state"])
        self.last_step = hub.step
        log.info("resumed %s from %s (step %d, version %d)", self.run_dir, ckpt_path.name, hub.step, hub.learner.version)
        return True
