"""Shared helpers for the trainer tests (tiny model, gin files, log readers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# The tiniest policy: fast enough that an end-to-end run takes seconds on one core.
TINY_BUILD = dict(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=128, seed=0)

BASE_BINDINGS = {
    "train.task": '"arithmetic"',
    "train.task_kwargs": '{"num_train": 120, "num_eval": 8, "max_operand": 12, "operators": "+"}',
    "train.engine": '"torch"',
    "train.loss": '"cispo"',
    "train.aggregation": '"prompt_mean"',
    "train.advantage_norm": '"batch"',
    "train.curriculum": '["uniform"]',
    "train.off_policy": '"ppo_off_policy"',
    "ppo_off_policy.k": "1",
    "train.precision": '"fp32"',
    "train.prompts_per_step": "4",
    "train.generations_per_prompt": "4",
    "train.micro_batch_size": "8",
    "train.max_tokens": "6",
    "train.lr": "1e-3",
    "train.warmup_steps": "2",
    "train.total_steps": "4",
    "train.eval_every": "2",
    "train.eval_k": "2",
    "train.eval_prompts": "4",
    "train.checkpoint_every": "2",
    "train.device": '"cpu"',
    "train.seed": "0",
}


def tiny_model(root: Path) -> str:
    """Build (once per directory) the tiny policy; returns its path."""
    from components.models import build_tiny_policy

    path = Path(root) / "tiny_policy"
    if not (path / "config.json").is_file():
        build_tiny_policy(path, **TINY_BUILD)
    return str(path)


def write_gin(path: Path, model_path: str, imports: tuple = (), **overrides) -> str:
    """A gin file with BASE_BINDINGS, `overrides` (dots as '__': train__lr='1e-2') and import lines."""
    bindings = dict(BASE_BINDINGS)
    bindings["model.path"] = json.dumps(str(model_path))
    for key, value in overrides.items():
        bindings[key.replace("__", ".")] = value
    lines = [f"import {m}" for m in imports] + [f"{k} = {v}" for k, v in bindings.items() if v is not None]
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_json(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())


# A user task module (imported by a gin `import` line): arithmetic whose verifier is slow,
# raises, or hangs, depending on its constructor arguments.
USER_TASK_MODULE = textwrap.dedent(
    '''
    import time
    from components.registry import TASKS
    from components.tasks.arithmetic import ArithmeticTask


    @TASKS.register("trainer_test_arithmetic")
    class TrainerTestArithmetic(ArithmeticTask):
        """Arithmetic with a configurable misbehaving verifier (tests only)."""

        def __init__(self, seed=0, verify_sleep=0.0, raise_every=0, hang_every=0, **kw):
            super().__init__(seed=seed, **kw)
            self.verify_sleep = verify_sleep
            self.raise_every = raise_every
            self.hang_every = hang_every
            self.calls = 0

        def verify(self, problem, completion):
            self.calls += 1
            if self.verify_sleep:
                time.sleep(self.verify_sleep)
            if self.raise_every and self.calls % self.raise_every == 0:
                raise RuntimeError("verifier exploded")
            if self.hang_every and self.calls % self.hang_every == 0:
                time.sleep(3600)
            return super().verify(problem, completion)


    from components.registry import ENGINES
    from components.engines.torch_engine import TorchEngine


    @ENGINES.register("trainer_test_slow_torch")
    class SlowTorchEngine(TorchEngine):
        """The torch engine with a fixed delay per decode step: a generator slower than the learner."""

        def __init__(self, *args, step_delay=0.01, **kw):
            super().__init__(*args, **kw)
            self.step_delay = step_delay

        def step(self):
            time.sleep(self.step_delay)
            return super().step()


    @ENGINES.register("trainer_test_failing_torch")
    class FailingTorchEngine(TorchEngine):
        """The torch engine, raising on its `fail_after`-th decode step (a crashing generator)."""

        def __init__(self, *args, fail_after=3, **kw):
            super().__init__(*args, **kw)
            self.fail_after = fail_after
            self.steps = 0

        def step(self):
            self.steps += 1
            if self.steps >= self.fail_after:
                raise RuntimeError("engine blew up mid-generation")
            return super().step()
    '''
)


def write_user_task(directory: Path, module: str = "trainer_test_tasks") -> str:
    (Path(directory) / f"{module}.py").write_text(USER_TASK_MODULE)
    return module


def start_training_subprocess(gin_file: str, run_dir: str, log_path: Path) -> subprocess.Popen:
    """`run_training` in its own process group (so a test can kill -9 it with its children)."""
    code = (
        "import sys; from experiments.train import run_training; "
        f"sys.exit(0 if run_training([{gin_file!r}], [], {run_dir!r}, progress=False) == 'done' else 1)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [PYTHON, "-c", code], cwd=str(REPO), stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
