"""A run is resolved once (issue 42, item 1): gin is parsed in the launching process only, into one
frozen, picklable `ResolvedRun` that every learner rank and generator gets; no process of the run
parses gin or reads its state, and run.json records the resolution.

The parse count is taken from outside the code under test: a `sitecustomize` module on PYTHONPATH
(imported by every Python process the run starts, the launcher's children included) wraps gin's
parse functions and appends one line per call, with the process id, to a file.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers_trainer import read_jsonl, run_json, tiny_model, write_gin  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

COUNTING_SITECUSTOMIZE = textwrap.dedent(
    '''
    import os

    def _count_gin_parses():
        log = os.environ.get("GIN_PARSE_LOG")
        if not log:
            return
        import gin

        def counted(name, fn):
            def call(*args, **kwargs):
                with open(log, "a") as f:
                    f.write(f"{os.getpid()} {name} {os.environ.get('SCALERL_RANK', 'launcher')}\\n")
                return fn(*args, **kwargs)
            return call

        for name in ("parse_config_files_and_bindings", "parse_config_file", "parse_config"):
            setattr(gin, name, counted(name, getattr(gin, name)))

    _count_gin_parses()
    '''
)


def _parses(log: Path) -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def test_the_counting_hook_sees_a_parse_in_a_child_process(tmp_path):
    """Control: the hook counts what a child process parses (so a zero below means none)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE)
    log = tmp_path / "parses.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]), GIN_PARSE_LOG=str(log))
    subprocess.run([sys.executable, "-c", "import gin; gin.parse_config('a = 1', skip_unknown=True)"], env=env,
                   check=True, timeout=120)
    assert [p[1] for p in _parses(log)] == ["parse_config"]


@pytest.mark.timeout(900)
def test_a_run_of_one_learner_and_two_generators_parses_gin_once(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE)
    log = tmp_path / "parses.log"
    gin_file = write_gin(tmp_path / "run.gin", tiny_model(tmp_path), train__total_steps="2", train__eval_every="100",
                         train__checkpoint_every="2", train__num_generators="2", cispo__eps_max="3.0")
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]), GIN_PARSE_LOG=str(log))
    code = ("import sys; from experiments.train import run_training; "
            f"sys.exit(0 if run_training([{gin_file!r}], [], {str(run_dir)!r}, progress=False) == 'done' else 1)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    parses = _parses(log)
    assert [(name, who) for _, name, who in parses] == [("parse_config_files_and_bindings", "launcher")], parses
    # the resolution, as run.json records it: every component with its values, defaults included
    resolved = run_json(run_dir)["resolved"]
    assert resolved["layout"] == {"learner_ranks": 1, "num_generators": 2, "gpus_per_generator": 1}
    assert resolved["components"]["losses/cispo"] == {"eps_max": 3.0}
    assert resolved["components"]["off_policy/ppo_off_policy"]["k"] == 1
    assert "cispo.eps_max = 3.0" in (run_dir / "config.gin").read_text()


def test_a_resolved_run_is_frozen_picklable_and_carries_every_components_values(tmp_path):
    import dataclasses

    from experiments.train import resolve

    gin_file = write_gin(tmp_path / "run.gin", tiny_model(tmp_path), cispo__eps_max="3.0",
                         train__length_control='"interruption"', interruption__thinking_min="2",
                         interruption__thinking_max="3", interruption__answer_budget="3")
    run = resolve([gin_file])
    again = pickle.loads(pickle.dumps(run))
    assert again == run
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.cfg = None
    assert run.cfg.params_of("losses", "cispo") == {"eps_max": 3.0}
    from components.registry import LENGTH_CONTROLS

    interruption = run.cfg.params_of("length_controls", "interruption")
    assert interruption["thinking_min"] == 2
    assert interruption["phrase"] == LENGTH_CONTROLS.defaults("interruption")["phrase"]  # a default included
    assert run.cfg.params_of("off_policy", "ppo_off_policy")["k"] == 1
    assert run.layout.world_size == 2 and run.config_files == (str(Path(gin_file).resolve()),)
    json.dumps(run.to_dict())  # run.json can hold it


def test_components_built_in_a_run_never_read_gin(tmp_path):
    """The values travel with the run: after gin is cleared (as in a run's process, which never parses
    it) the learner builds its loss with the run's values, not the defaults."""
    import gin
    import torch

    from components.trainer.config import build_component
    from components.registry import LOSSES
    from experiments.train import resolve

    run = resolve([write_gin(tmp_path / "run.gin", tiny_model(tmp_path), cispo__eps_max="1.5")])
    gin.clear_config()
    loss = build_component(run.cfg, LOSSES, "cispo")
    logp = torch.zeros(1, 3, requires_grad=True)
    gen_logp = torch.full((1, 3), -2.0)  # ratio e^2 = 7.4: capped at eps_max
    out = loss(logp, gen_logp, torch.ones(1), torch.ones(1, 3, dtype=torch.bool))
    out.sum().backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -1.5)), logp.grad  # -A x min(ratio, eps_max) = -1.5
