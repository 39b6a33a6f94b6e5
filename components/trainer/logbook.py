"""learner-0's logbook: where a run's records go, and the progress bar.

Owns `metrics.jsonl` (one line per learner step) and `eval.jsonl` (held-out and downstream
evaluations) as `runlog.JsonlLog`s, the experiment trackers (`tracking.RunTracker`: W&B,
TensorBoard, MLflow, samples.jsonl), and the progress bar (tqdm, when asked for) with the last
held-out pass rate it shows. It writes what it is given: the records themselves are made by the
loop (`Trainer._train_step`) and by `EvaluationRounds`. `sync` flushes and fsyncs both logs
before a checkpoint that counts their records (`Checkpoints.save`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from components.trainer.evaluation import is_downstream_record
from components.trainer.runlog import JsonlLog, read_jsonl

__all__ = ["Logbook"]


class Logbook:
    """metrics.jsonl, eval.jsonl, the trackers and the progress bar of one run (learner-0)."""

    def __init__(self, cfg, run_dir: Path, progress: bool = True):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.tracker = None
        self.metrics_log: Optional[JsonlLog] = None
        self.eval_log: Optional[JsonlLog] = None
        self.bar = None
        self.last_eval_pass_rate = float("nan")  # shown in the progress bar
        self.evaluated = False  # eval.jsonl holds a held-out record (a resumed run)

    def open(self, step: int, flops: float, resumed: bool) -> None:
        """After resume (the logs were repaired to the checkpoint): open the logs and trackers, show the bar."""
        from components.trainer.tracking import RunTracker

        cfg = self.cfg
        self.tracker = RunTracker.from_config(cfg, self.run_dir, resume_step=step if resumed else None)
        self.metrics_log = JsonlLog(self.run_dir / "metrics.jsonl")
        self.eval_log = JsonlLog(self.run_dir / "eval.jsonl")
        if self.progress:
            from tqdm.auto import tqdm

            if cfg.compute_budget_flops is not None:  # the budget ends the run: show its share
                self.bar = tqdm(total=100, initial=min(100, int(100 * flops / cfg.compute_budget_flops)),
                                unit="% of budget", desc=f"train {self.run_dir.name}", mininterval=2.0)
            else:
                self.bar = tqdm(total=cfg.total_steps, initial=step, desc=f"train {self.run_dir.name}", mininterval=2.0)
        evals = [e for e in read_jsonl(self.run_dir / "eval.jsonl") if not is_downstream_record(e)]
        if evals:  # a resumed run: show its last held-out pass rate until the next evaluation
            self.evaluated = True
            self.last_eval_pass_rate = evals[-1].get("pass_rate", float("nan"))

    def log_step(self, record: dict, rollouts: Sequence, tokenizer) -> None:
        """One learner step's metrics.jsonl line, to the trackers too (with samples when due); the bar moves."""
        self.metrics_log.write(record)
        self.tracker.log_metrics(record)
        self.tracker.log_samples(record["step"], rollouts, tokenizer)
        if self.bar is None:
            return
        budget = self.cfg.compute_budget_flops
        if budget is not None:
            self.bar.update(min(100, int(100 * record["flops"] / budget)) - self.bar.n)
        else:
            self.bar.update(1)
        self.bar.set_postfix(
            train_pass=f"{record['pass_rate']:.2f}",
            held_out=f"{self.last_eval_pass_rate:.2f}",
            compute=f"{record['compute_hours']:.4f}h",
            lag=record.get("lag_max"),
        )

    def log_eval(self, line: dict, note: str) -> None:
        """One eval.jsonl line (held-out or one benchmark's), to the trackers too; `note` under the bar."""
        self.eval_log.write(line)
        self.tracker.log_eval(line)
        if not is_downstream_record(line):
            self.evaluated = True
            self.last_eval_pass_rate = line["pass_rate"]
        if self.bar is not None:
            self.bar.write(note)

    def sync(self) -> dict:
        """Every line so far on disk (fsync); {file name: its record count and last step} for the checkpoint."""
        return {log_.path.name: log_.sync() for log_ in (self.metrics_log, self.eval_log)}

    def close(self, status: str, operative_config: str) -> None:
        """The trackers told the run's end (`status`), the logs closed, the bar closed (what was opened)."""
        if self.tracker is not None:
            self.tracker.close(status, operative_config=operative_config)
        for log_ in (self.metrics_log, self.eval_log):
            if log_ is not None:
                log_.close()
        if self.bar is not None:
            self.bar.close()
