"""The shared async trainer: generator worker(s), rollout queue, learner, weight sync,
checkpoints and run logging (DESIGN.md "The shared async trainer").

Entry points: `experiments.train.run_training` (Python) and `scalerl train` (CLI).
"""

from components.trainer.config import ConfigError, TrainConfig, train_config  # noqa: F401

__all__ = ["ConfigError", "TrainConfig", "train_config"]
