"""One resolution of a run, everywhere it is shown or compared (issue 42 item 1, with issue 44's settings).

- `scalerl train --print-config` prints every component of the run's resolved table (`TrainConfig.components`,
  what `ResolvedRun` carries to every process) with its defaults: a mismatch correction, a KL estimator, a
  user environment included, not only the families a hand-kept list names.
- run.json's settings (what a re-invoked run directory is compared against) are made from the same table,
  so a changed hyper-parameter of any resolved component is refused naming it.
- a re-invoked run directory parses its gin config once: the comparison and the run read one parse.
- an environment is built with the values the run resolved for it, gin unread.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _helpers_trainer import REPO

CONFIG = str(REPO / "experiments" / "configs" / "tiny_cpu.gin")
# a user environment with hyper-parameters (as docs/examples/retry_env.py), under a name no other test uses;
# unregistered after this module's tests, so the registry's listing elsewhere is the built-in one
ENV_MODULE = '''
from components.environments import Environment, Reward
from components.registry import ENVIRONMENTS


@ENVIRONMENTS.register("rs_retry", ranges={"tries": ">= 1"})
class RsRetry(Environment):
    def __init__(self, task, problem, *, tries: int = 3, retry_cost: float = 0.5):
        super().__init__(task, problem)
        self.tries, self.retry_cost = int(tries), float(retry_cost)

    def step(self, turn):
        return Reward(0.0, False, {})
'''
ENV_GIN = '''import rs_env
train.environment = "rs_retry"
train.length_control = None
train.max_turns = 2
train.max_tokens = 24
train.max_tokens_per_turn = 12
train.max_observation_tokens = 24
'''


@pytest.fixture(scope="module")
def env_gin(tmp_path_factory):
    import sys

    from components.registry import ENVIRONMENTS

    root = tmp_path_factory.mktemp("rs_env")
    (root / "rs_env.py").write_text(ENV_MODULE)
    (root / "rs_env.gin").write_text(ENV_GIN)
    yield str(root / "rs_env.gin")
    if "rs_retry" in ENVIRONMENTS:
        ENVIRONMENTS.unregister("rs_retry")
    sys.modules.pop("rs_env", None)


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


def _parsed(*bindings: str, files=(CONFIG,)):
    from experiments.train import check_config

    cfg, _files, _sys_path = check_config(list(files), list(bindings), read_data=False, on_this_machine=False)
    return cfg


def test_print_config_prints_every_resolved_component_with_its_defaults(capsys, env_gin):
    from experiments.cli import main

    bindings = ['train.mismatch_correction = "tis"', "train.kl_coef = 0.01", "rs_retry.tries = 4"]
    assert main(["train", CONFIG, env_gin, *sum((["--gin", b] for b in bindings), []), "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tis.cap = 2.0" in lines  # the mismatch correction's default (no hand-kept list names that family)
    assert "rs_retry.tries = 4" in lines and "rs_retry.retry_cost = 0.5" in lines  # a user environment: binding, default
    import gin

    gin.clear_config()
    cfg = _parsed(*bindings, files=(CONFIG, env_gin))
    families = {family for family, _name, _params in cfg.components}
    assert {"mismatch_corrections", "environments", "kl_estimators", "losses", "tasks"} <= families
    for family, name, params in cfg.components:  # every resolved value is printed
        for key, value in params:
            assert any(line.endswith(f"{name}.{key} = {value!r}") for line in lines) or isinstance(value, (dict, list)), \
                (family, name, key, value)


def test_run_json_settings_come_from_the_resolved_table_and_a_changed_value_is_refused(tmp_path, env_gin):
    from experiments.run_settings import SettingsChangedError, check_rerun, resolved_settings

    cfg = _parsed('train.mismatch_correction = "tis"', files=(CONFIG, env_gin))
    settings = resolved_settings(cfg)
    for family, name, params in cfg.components:
        for key, _value in params:
            assert any(k.endswith(f"{name}.{key}") for k in settings), (family, name, key)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"status": "done", "settings": settings}))
    import gin

    gin.clear_config()
    changed = resolved_settings(_parsed('train.mismatch_correction = "tis"', "tis.cap = 3.0", "rs_retry.retry_cost = 0.25",
                                        files=(CONFIG, env_gin)))
    with pytest.raises(SettingsChangedError) as caught:
        check_rerun(run_dir, changed)
    msg = str(caught.value)
    assert "tis.cap: recorded 2.0, new 3.0" in msg and "rs_retry.retry_cost: recorded 0.5, new 0.25" in msg, msg


def test_a_rerun_parses_its_config_once(tmp_path, monkeypatch):
    """The comparison with run.json's settings and the ResolvedRun the processes get come from one parse."""
    import experiments.train as train
    from _helpers_trainer import tiny_model, write_gin
    from experiments.run_settings import resolved_settings

    gin_file = write_gin(tmp_path / "run.gin", tiny_model(tmp_path))
    recorded = resolved_settings(_parsed(files=(gin_file,)))
    done = tmp_path / "done"
    done.mkdir()
    (done / "run.json").write_text(json.dumps({"status": "done", "settings": recorded}))
    again = tmp_path / "again"  # nothing to continue (no checkpoint): it starts, with these settings
    again.mkdir()
    (again / "run.json").write_text(json.dumps({"status": "failed", "settings": recorded}))
    import gin

    gin.clear_config()
    parses, started = [], []
    real = train.parse_gin_files
    monkeypatch.setattr(train, "parse_gin_files", lambda *a, **k: parses.append(a) or real(*a, **k))
    from components.trainer import run_owner

    monkeypatch.setattr(run_owner, "run_here", lambda run, *a, **k: started.append(run) or "done")
    assert train.run_training([gin_file], [], str(done), progress=False) == "done"  # compared: nothing to do
    assert len(parses) == 1 and not started
    gin.clear_config()
    assert train.run_training([gin_file], [], str(again), progress=False) == "done"
    assert len(parses) == 2 and len(started) == 1  # one more parse: compared, then resolved from it
    assert dict(started[0].settings) == recorded  # what run.json will record: the same resolution


def test_an_environment_is_built_with_its_resolved_values_gin_unread(tmp_path, env_gin):
    import gin

    from components.environments import make_episode_runners
    from components.models import build_tiny_policy, load_tokenizer
    from components.registry import TASKS

    cfg = _parsed("rs_retry.tries = 5", files=(CONFIG, env_gin))
    assert cfg.params_of("environments", "rs_retry") == {"tries": 5, "retry_cost": 0.5}
    gin.clear_config()  # what a run's process sees: no gin
    task = TASKS.get("arithmetic")(seed=0, num_train=4, num_eval=2)
    tokenizer = load_tokenizer(str(build_tiny_policy(tmp_path / "tiny")))
    runners = make_episode_runners(cfg, task, task.train_problems()[0], tokenizer, 2)
    assert [r.environment.tries for r in runners] == [5, 5] and runners[0].environment.retry_cost == 0.5
    gin.parse_config("rs_retry.tries = 9")  # a binding made afterwards is not read: the run's values are
    assert make_episode_runners(cfg, task, task.train_problems()[0], tokenizer, 1)[0].environment.tries == 5
