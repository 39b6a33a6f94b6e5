"""One owner of a run's life (issue 42 item 2): components/trainer/run_owner.py.

- run.json and config.gin are written by the owner from the ResolvedRun (its settings, its resolved
  components, the user modules' files), and the lock is held while it owns the directory;
- a multi-task Slurm step is resolved once: task 0 parses the config (once), publishes the resolved
  run; another task loads it and takes its role without parsing gin; a refusal or a done run reaches
  the other tasks instead of leaving them waiting;
- an adaptive sweep's reopen goes through the owner.
The roles themselves (`worker.run_role`) are replaced by recorders: what is tested is who resolves,
who writes, and what each task is handed. Real multi-task Slurm runs: tests/test_slurm.py.
"""

from __future__ import annotations

import json
import os

import pytest

from _helpers_trainer import REPO, tiny_model, write_gin

CONFIG = str(REPO / "experiments" / "configs" / "tiny_cpu.gin")


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture
def gin_file(tmp_path) -> str:
    return write_gin(tmp_path / "run.gin", tiny_model(tmp_path))


def _slurm_env(monkeypatch, rank: int, tasks: int = 2, job: str = "4242") -> None:
    for key in list(os.environ):
        if key.startswith(("SCALERL_RANK", "SCALERL_WORLD_SIZE")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", str(rank))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", str(tasks))
    monkeypatch.setenv("SLURM_NTASKS", str(tasks))
    monkeypatch.setenv("SLURM_STEP_NODELIST", "localhost")
    monkeypatch.setenv("SCALERL_HUB_HOST", "127.0.0.1")
    monkeypatch.setenv("SCALERL_PORT_BASE", "29999")


def _record_roles(monkeypatch) -> list:
    """worker.run_role replaced: each call records (rank, setup) and the hub returns "done"."""
    from components.trainer import run_owner, worker

    calls = []
    monkeypatch.setattr(worker, "run_role", lambda rank, setup, endpoints, layout: calls.append((rank, setup)) or "done")
    monkeypatch.setattr(worker, "exit_after", lambda grace: None)
    monkeypatch.setattr(run_owner, "outlive_step_sigterm", lambda: None)
    return calls


def _count_parses(monkeypatch) -> list:
    from experiments import train

    parses = []
    real = train.parse_gin_files
    monkeypatch.setattr(train, "parse_gin_files", lambda *a, **k: parses.append(a) or real(*a, **k))
    return parses


def test_the_owner_writes_run_json_and_config_gin_from_the_resolved_run_and_holds_the_lock(tmp_path, gin_file):
    from components.trainer.run_owner import RunDirBusyError, RunOwner, lock_run_dir
    from experiments.train import resolve

    run = resolve([gin_file], ["train.seed = 7"])
    run_dir = tmp_path / "r"
    with RunOwner(run, run_dir, {"name": "r", "sweep": "s", "factor": None}) as owner:
        with pytest.raises(RunDirBusyError, match="being trained by another process"):
            lock_run_dir(run_dir)
        info = json.loads((run_dir / "run.json").read_text())
        assert info["status"] == "running" and info["seed"] == 7 and info["sweep"] == "s"
        assert info["settings"] == dict(run.settings) and info["settings"]["train.seed"] == "7"
        assert info["resolved"] == json.loads(json.dumps(run.to_dict()))
        assert info["hardware"]["processes"] == run.layout.world_size and owner.devices == info["hardware"]["count"]
        assert (run_dir / "config.gin").read_text() == run.config_text
        owner.finish("done")
    assert json.loads((run_dir / "run.json").read_text())["status"] == "done"
    lock_run_dir(run_dir).close()  # released


def test_a_rerun_with_changes_is_recorded_in_the_settings_history(tmp_path, gin_file):
    from components.trainer.run_owner import RunOwner
    from experiments.run_settings import Rerun
    from experiments.train import resolve

    run = resolve([gin_file])
    rerun = Rerun("done", None, 12, {"train.total_steps": ("20", "40")}, True)
    with RunOwner(run, tmp_path / "r", rerun=rerun):
        pass
    history = json.loads((tmp_path / "r" / "run.json").read_text())["settings_history"]
    assert history[0]["step"] == 12 and history[0]["extended"] is True
    assert history[0]["changes"] == {"train.total_steps": {"recorded": "20", "new": "40"}}


def test_slurm_task_0_parses_once_and_publishes_the_run_the_other_task_loads_it_without_parsing(
        tmp_path, gin_file, monkeypatch):
    import gin

    from experiments import train

    run_dir = tmp_path / "runs" / "r"
    calls, parses = _record_roles(monkeypatch), _count_parses(monkeypatch)
    _slurm_env(monkeypatch, rank=0)
    assert train.run_training([gin_file], ["train.seed = 3"], str(run_dir), progress=False) == "done"
    assert len(parses) == 1  # task 0: one parse, which also bound its GPUs and resolved the run
    assert json.loads((run_dir / "run.json").read_text())["status"] == "done"
    (hub_rank, hub_setup), = calls
    published = sorted(p.name for p in (run_dir / ".scalerl").iterdir())
    assert published == ["prepared-4242.0-0", "resolved-4242.0-0.pkl"], published

    gin.clear_config()
    _slurm_env(monkeypatch, rank=1)
    assert train.run_training([gin_file], ["train.seed = 3"], str(run_dir), progress=False) == "done"
    assert len(parses) == 1 and not gin.config._CONFIG  # task 1 parsed nothing; gin is empty
    (rank, setup) = calls[1]
    assert (hub_rank, rank) == (0, 1)
    assert setup.run.cfg == hub_setup.run.cfg and setup.run.settings == hub_setup.run.settings
    assert setup.run.cfg.seed == 3 and setup.progress is False
    assert setup.device == "cpu"


def test_a_refusal_on_task_0_reaches_the_other_tasks_by_name(tmp_path, gin_file, monkeypatch):
    from experiments import train

    run_dir = tmp_path / "runs" / "r"
    calls = _record_roles(monkeypatch)
    _slurm_env(monkeypatch, rank=0)
    with pytest.raises(Exception, match="no_such_loss"):
        train.run_training([gin_file], ['train.loss = "no_such_loss"'], str(run_dir), progress=False)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "failed" and "no_such_loss" in info["error"]
    _slurm_env(monkeypatch, rank=1)
    with pytest.raises(RuntimeError, match="learner-0 could not prepare the run .*no_such_loss"):
        train.run_training([gin_file], [], str(run_dir), progress=False)
    assert not calls


def test_a_step_of_the_wrong_size_is_refused_on_every_task(tmp_path, gin_file, monkeypatch):
    from components.trainer.config import ConfigError
    from experiments import train

    run_dir = tmp_path / "runs" / "r"
    calls = _record_roles(monkeypatch)
    _slurm_env(monkeypatch, rank=0, tasks=3)  # the run needs 2 processes (1 learner + 1 generator)
    with pytest.raises(ConfigError, match="has 3 tasks but the run needs 2"):
        train.run_training([gin_file], [], str(run_dir), progress=False)
    _slurm_env(monkeypatch, rank=2, tasks=3)
    with pytest.raises(RuntimeError, match="has 3 tasks but the run needs 2"):
        train.run_training([gin_file], [], str(run_dir), progress=False)
    assert not calls


def test_a_done_run_releases_the_other_tasks_at_once(tmp_path, gin_file, monkeypatch):
    import gin

    from components.trainer import run_owner
    from components.trainer.roles import process_env
    from experiments import train

    run_dir = tmp_path / "runs" / "r"
    calls = _record_roles(monkeypatch)
    _slurm_env(monkeypatch, rank=0)
    assert train.run_training([gin_file], [], str(run_dir), progress=False) == "done"
    gin.clear_config()
    _slurm_env(monkeypatch, rank=0, job="4243")  # the same step again (a re-run): done, nothing to do
    assert train.run_training([gin_file], [], str(run_dir), progress=False) == "done"
    assert (run_dir / ".scalerl" / "prepared-4243.0-0").read_text() == "done"
    _slurm_env(monkeypatch, rank=1, job="4243")
    assert run_owner.join_slurm_step(process_env(), run_dir, timeout_s=5.0) == "done"
    assert len(calls) == 1  # only the first attempt's hub ran


def test_a_task_waiting_for_task_0_names_the_missing_marker(tmp_path):
    from components.trainer.run_owner import wait_for_run

    with pytest.raises(TimeoutError, match="did not prepare the run within 1 s .*prepared-9.0-0"):
        wait_for_run(tmp_path, "9.0-0", timeout_s=1.0)


def test_reopen_marks_only_a_done_run_interrupted_with_why(tmp_path):
    from components.trainer.run_owner import reopen

    (tmp_path / "run.json").write_text(json.dumps({"status": "done", "trackers": {"wandb": {"id": "x"}}}))
    assert reopen(tmp_path, adaptive="continues to rung 0.5") is True
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["status"] == "interrupted" and info["adaptive"] == "continues to rung 0.5"
    assert info["trackers"] == {"wandb": {"id": "x"}}
    assert reopen(tmp_path, adaptive="again") is False  # not done: left as it is
    assert json.loads((tmp_path / "run.json").read_text())["adaptive"] == "continues to rung 0.5"


def test_experiments_writes_no_run_json_itself():
    """run.json is written through components/trainer/run_owner.py (and runlog's failure records): no module of
    experiments/ opens it for writing."""
    import re

    offenders = []
    for path in sorted((REPO / "experiments").glob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"write_json_atomic\(([^,]+),|\(([^)]*run\.json[^)]*)\)\.write_text", text):
            target = (m.group(1) or m.group(2) or "")
            if "run.json" in target or target.strip() in ("path",) and "run.json" in text[max(0, m.start() - 300):m.start()]:
                offenders.append(f"{path.name}: {m.group(0)}")
    allowed = {"study_runs.py"}  # copies collected runs into a study's results/ (not a run directory it runs)
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []
