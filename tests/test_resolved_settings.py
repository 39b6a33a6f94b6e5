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
RETRY_GIN = str(REPO / "docs" / "examples" / "retry_env.gin")


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


def test_print_config_prints_every_resolved_component_with_its_defaults(capsys):
    from experiments.cli import main

    bindings = ['train.mismatch_correction = "tis"', "train.kl_coef = 0.01", "retry.tries = 4"]
    assert main(["train", CONFIG, RETRY_GIN, *sum((["--gin", b] for b in bindings), []), "--print-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tis.cap = 2.0" in lines  # the mismatch correction's default (no hand-kept list names that family)
    assert "retry.tries = 4" in lines and "retry.retry_cost = 0.5" in lines  # a user environment: binding, default
    import gin

    gin.clear_config()
    cfg = _parsed(*bindings, files=(CONFIG, RETRY_GIN))
    families = {family for family, _name, _params in cfg.components}
    assert {"mismatch_corrections", "environments", "kl_estimators", "losses", "tasks"} <= families
    for family, name, params in cfg.components:  # every resolved value is printed
        for key, value in params:
            assert any(line.endswith(f"{name}.{key} = {value!r}") for line in lines) or isinstance(value, (dict, list)), \
                (family, name, key, value)


def test_run_json_settings_come_from_the_resolved_table_and_a_changed_value_is_refused(tmp_path):
    from experiments.run_settings import SettingsChangedError, check_rerun, resolved_settings

    cfg = _parsed('train.mismatch_correction = "tis"', files=(CONFIG, RETRY_GIN))
    settings = resolved_settings(cfg)
    for family, name, params in cfg.components:
        for key, _value in params:
            assert any(k.endswith(f"{name}.{key}") for k in settings), (family, name, key)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"status": "done", "settings": settings}))
    import gin

    gin.clear_config()
    changed = resolved_settings(_parsed('train.mismatch_correction = "tis"', "tis.cap = 3.0", "retry.retry_cost = 0.25",
                                        files=(CONFIG, RETRY_GIN)))
    with pytest.raises(SettingsChangedError) as caught:
        check_rerun(run_dir, changed)
    msg = str(caught.value)
    assert "tis.cap: recorded 2.0, new 3.0" in msg and "retry.retry_cost: recorded 0.5, new 0.25" in msg, msg


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
    monkeypatch.setattr(train, "_supervise_local", lambda run, *a, **k: started.append(run) or "done")
    assert train.run_training([gin_file], [], str(done), progress=False) == "done"  # compared: nothing to do
    assert len(parses) == 1 and not started
    gin.clear_config()
    assert train.run_training([gin_file], [], str(again), progress=False) == "done"
    assert len(parses) == 2 and len(started) == 1  # one more parse: compared, then resolved from it
    assert resolved_settings(started[0].cfg) == recorded  # what run.json will record: the same resolution


def test_an_environment_is_built_with_its_resolved_values_gin_unread(tmp_path):
    import gin

    from components.environments import make_episode_runners
    from components.models import build_tiny_policy, load_tokenizer
    from components.registry import TASKS

    cfg = _parsed("retry.tries = 5", files=(CONFIG, RETRY_GIN))
    assert cfg.params_of("environments", "retry") == {"tries": 5, "retry_cost": 0.5}
    gin.clear_config()  # what a run's process sees: no gin
    task = TASKS.get("arithmetic")(seed=0, num_train=4, num_eval=2)
    tokenizer = load_tokenizer(str(build_tiny_policy(tmp_path / "tiny")))
    runners = make_episode_runners(cfg, task, task.train_problems()[0], tokenizer, 2)
    assert [r.environment.tries for r in runners] == [5, 5] and runners[0].environment.retry_cost == 0.5
    gin.parse_config("retry.tries = 9")  # a binding made afterwards is not read: the run's values are
    assert make_episode_runners(cfg, task, task.train_problems()[0], tokenizer, 1)[0].environment.tries == 5
