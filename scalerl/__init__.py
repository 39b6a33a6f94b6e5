"""scalerl: the `scalerl` command's verbs as Python functions, for notebooks and scripts.

    import scalerl
    run = scalerl.train("tiny_cpu", overrides={"train.loss": "dapo"}, run_dir="runs/demo/dapo")
    scalerl.load_runs("runs/demo")          # one row per run: settings and summary metrics
    scalerl.compare("runs/demo")            # every pair of configurations: interval and verdict
    scalerl.fit("runs/demo")                # the sigmoid law per run
    scalerl.evaluate(run, ["bench.jsonl"], k=4)
    scalerl.sweep("loss_type", scale="tiny", dry_run=True)

Each verb calls what its CLI verb calls, with the CLI's defaults (scalerl/api.py); nothing heavy
is imported until a verb runs.
"""

from __future__ import annotations

__all__ = ["train", "sweep", "fit", "compare", "evaluate", "load_runs", "RunFailedError", "callable_spec",
           "run_settings"]


def __getattr__(name: str):
    if name in __all__:
        from scalerl import api

        return getattr(api, name)
    raise AttributeError(f"module 'scalerl' has no attribute {name!r}; it has {__all__}")


def __dir__() -> list[str]:
    return sorted(__all__)
