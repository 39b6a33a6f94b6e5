"""A run's recorded settings are the ones that ran (issue 44 item 4).

- run.json records the run's full resolved settings (every binding after includes, the defaults of the
  configured functions); re-invoking the run directory with any other setting is refused, naming each
  differing key with its recorded and new value, before any compute and without touching the run's
  files (no lock file, no log line, every mtime unchanged).
- `--extend` accepts a larger train.total_steps / compute budget and continues a finished run from its
  last checkpoint (metrics.jsonl steps continue without a gap or a repeat); other differences are still
  refused; the settings any re-run may change (`ALLOWED_CHANGES`) are allowed.
- Resume prints the step it resumes from; Ctrl-C of a local run prints one line (no traceback) and
  leaves a run that the same command resumes from its last checkpoint.
- A sweep re-run with identical settings resumes; a run whose recorded settings differ is reported by
  name (`skip-refused`) while the others go on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _helpers_trainer import REPO, read_jsonl, run_json

CONFIG = str(REPO / "experiments" / "configs" / "tiny_cpu.gin")
# tiny_cpu.gin at a few steps: a 30-step warm start (cached for the session), 4 prompts x 4 completions
TINY = ["warm_start.sft_steps = 30", "train.prompts_per_step = 4", "train.generations_per_prompt = 4",
        "train.micro_batch_size = 16", "train.checkpoint_every = 2", "train.eval_every = 2", "train.eval_prompts = 8",
        "train.eval_k = 2", "train.samples_every = 0"]


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


def _settings(*bindings: str, files=(CONFIG,)) -> dict:
    """The resolved settings of tiny_cpu.gin with `bindings` (parsed only)."""
    from experiments.run_settings import resolved_settings
    from experiments.train import check_config

    cfg, _files, _sys_path = check_config(list(files), list(bindings), read_data=False, on_this_machine=False)
    return resolved_settings(cfg)


def _recorded_run(tmp_path: Path, settings: dict, status: str = "done") -> Path:
    """A run directory as a finished run leaves it, as far as the settings check reads it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"status": status, "settings": settings}))
    return run_dir


def _snapshot(root: Path) -> dict:
    """{path: (mtime_ns, size)} of the run directory and everything in it."""
    paths = [root, *sorted(root.rglob("*"))]
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size if p.is_file() else None) for p in paths}


# ---------------------------------------------------------------------------------------------
# the settings and the rules (parsed only: seconds)
def test_settings_hold_every_binding_after_includes_and_the_defaults(tmp_path):
    settings = _settings('train.loss = "dapo"')
    assert settings["train.loss"] == "'dapo'"  # a --gin binding
    assert settings["train.lr"] == "5e-05"  # the recipe's
    assert settings["train.top_p"] == "1.0"  # a train default
    assert settings["dapo.eps_high"] == "0.28"  # the used loss's default
    assert settings["warm_start.sft_steps"] == "1200" and settings["warm_start.rebuild"] == "False"  # bound; a default
    assert settings["model.path"] == "@warm_start()"  # as bound, not resolved
    assert settings["%MODEL_KWARGS"].startswith("{'hidden_size': 128") and "import components.warm_start" in settings
    # spelled another way (an include and a file binding instead of --gin): the same settings
    mine = tmp_path / "mine.gin"
    mine.write_text(f"include '{CONFIG}'\ntrain.loss = \"dapo\"\n")
    assert _settings(files=(str(mine),)) == settings


def test_the_allowed_and_extending_settings_are_settings_of_the_trainer():
    from experiments.run_settings import ALLOWED_CHANGES, EXTEND_KEYS, default_text

    settings = _settings()
    for key in [*ALLOWED_CHANGES, *EXTEND_KEYS]:
        assert key in settings and default_text(key) is not None, key
    assert not set(ALLOWED_CHANGES) & set(EXTEND_KEYS)
    assert "train.loss" not in ALLOWED_CHANGES and "train.seed" not in ALLOWED_CHANGES


def test_a_changed_setting_is_refused_naming_it_with_both_values(tmp_path):
    from experiments.run_settings import SettingsChangedError, check_rerun

    run_dir = _recorded_run(tmp_path, _settings())
    assert check_rerun(run_dir, _settings()).done  # identical: a done run has nothing to do
    for extend in (False, True):
        with pytest.raises(SettingsChangedError) as caught:
            check_rerun(run_dir, _settings('train.loss = "dapo"', "train.lr = 1e-4"), extend=extend)
        msg = str(caught.value)
        assert "train.loss: recorded 'cispo', new 'dapo'" in msg and "train.lr: recorded 5e-05, new 0.0001" in msg, msg
        assert "2 differences" in msg and "cispo.eps_max" not in msg  # the loss's own defaults are no difference
        assert "train.total_steps" in msg  # the valid choices: what --extend accepts


def test_extend_accepts_only_a_larger_budget(tmp_path):
    from experiments.run_settings import SettingsChangedError, check_rerun

    run_dir = _recorded_run(tmp_path, _settings("train.total_steps = 4"))
    with pytest.raises(SettingsChangedError, match=r"train.total_steps: recorded 4, new 6.*with --extend"):
        check_rerun(run_dir, _settings("train.total_steps = 6"))
    rerun = check_rerun(run_dir, _settings("train.total_steps = 6"), extend=True)
    assert rerun.extended and not rerun.done and rerun.changes == {"train.total_steps": ("4", "6")}
    with pytest.raises(SettingsChangedError, match=r"compute_budget_flops: recorded None, new 1000000000000.0 .*None is no budget"):
        check_rerun(run_dir, _settings("train.compute_budget_flops = 1e12"), extend=True)  # a budget where none was
    budgeted = _recorded_run(tmp_path / "budget", _settings("train.compute_budget_flops = 1e11"))
    rerun = check_rerun(budgeted, _settings("train.compute_budget_flops = 1e12"), extend=True)
    assert rerun.changes == {"train.compute_budget_flops": ("100000000000.0", "1000000000000.0")}
    assert check_rerun(budgeted, _settings("train.compute_budget_flops = None"), extend=True).extended  # no budget
    with pytest.raises(SettingsChangedError, match=r"train.total_steps: recorded 4, new 3 \(--extend only extends"):
        check_rerun(run_dir, _settings("train.total_steps = 3"), extend=True)
    with pytest.raises(SettingsChangedError, match="these settings extend nothing"):
        check_rerun(run_dir, _settings("train.total_steps = 4"), extend=True)
    decaying = _recorded_run(tmp_path / "cosine", _settings("train.total_steps = 4", 'train.lr_schedule = "cosine"'))
    with pytest.raises(SettingsChangedError, match="decays to 0 at total_steps"):
        check_rerun(decaying, _settings("train.total_steps = 6", 'train.lr_schedule = "cosine"'), extend=True)


def test_settings_that_do_not_change_the_science_may_change(tmp_path):
    from experiments.run_settings import check_rerun

    run_dir = _recorded_run(tmp_path, _settings())
    rerun = check_rerun(run_dir, _settings('train.trackers = ["tensorboard"]', "train.checkpoint_every = 7",
                                           "train.learner_ranks = 2", "warm_start.progress = False"))
    assert set(rerun.changes) == {"train.trackers", "train.checkpoint_every", "train.learner_ranks", "warm_start.progress"}


def test_an_absent_setting_is_at_its_default_and_nothing_to_continue_is_not_compared(tmp_path):
    from experiments.run_settings import SettingsChangedError, check_rerun

    recorded = _settings()
    del recorded["train.top_k"]  # a setting this code added since the run started, at its default: no difference
    run_dir = _recorded_run(tmp_path, recorded)
    assert check_rerun(run_dir, _settings()).changes == {}
    with pytest.raises(SettingsChangedError, match=r"train.top_k: recorded 0, new 5"):  # not at its default
        check_rerun(run_dir, _settings("train.top_k = 5"))
    fresh = _recorded_run(tmp_path / "failed", _settings(), status="failed")  # no checkpoint: nothing to continue
    assert check_rerun(fresh, _settings('train.loss = "dapo"')).changes == {}
    legacy = tmp_path / "legacy"  # a run from before runs recorded settings: not compared, but not extended either
    legacy.mkdir()
    (legacy / "run.json").write_text(json.dumps({"status": "done"}))
    assert check_rerun(legacy, _settings('train.loss = "dapo"')).done
    with pytest.raises(SettingsChangedError, match="records no settings"):
        check_rerun(legacy, _settings("train.total_steps = 1000"), extend=True)


# ---------------------------------------------------------------------------------------------
# sweeps: a re-run resumes with the same settings; a run with others is reported by name
def test_a_sweep_rerun_reports_a_run_with_other_settings_by_name_and_runs_the_rest(tmp_path, capsys):
    from experiments.cli import main
    from experiments.sweep_spec import expand, load_spec
    from experiments.run_config import validate_runs
    from test_sweep import FAKE, write_fake_sweep

    spec = write_fake_sweep(tmp_path)
    root = tmp_path / "runs"
    args = ["sweep", str(spec), "--executor", "debug", "--runs", str(root), "--trainer", FAKE]
    assert main(args) == 0
    configs = validate_runs(expand(load_spec(spec), "paper"))  # the scale `scalerl sweep` runs by default
    for name, rc in configs.items():  # as the trainer records them (the stand-in trainer records none)
        info = run_json(root / "fake" / name)
        (root / "fake" / name / "run.json").write_text(json.dumps({**info, "settings": rc.settings}))
    capsys.readouterr()
    assert main(args) == 0  # identical settings: nothing refused
    out = capsys.readouterr().out
    assert out.count("skip-done") == 3 and "skip-refused" not in out and "refused:" not in out
    # dapo-s0 ran with another lr; gspo-s0 was interrupted: it resumes, dapo-s0 is reported and left alone
    dapo, gspo = root / "fake" / "dapo-s0", root / "fake" / "gspo-s0"
    info = run_json(dapo)
    info["settings"]["train.lr"] = "0.5"
    (dapo / "run.json").write_text(json.dumps(info))
    (gspo / "run.json").write_text(json.dumps({**run_json(gspo), "status": "interrupted"}))
    before = _snapshot(dapo)
    assert main(args) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "dapo-s0 refused:" in out and "train.lr: recorded 0.5, new" in out, out
    assert "1 done, 0 failed, 1 refused (ran with other settings: dapo-s0)" in out, out
    assert run_json(gspo)["status"] == "done" and run_json(gspo)["starts"] == 2
    assert _snapshot(dapo) == before


# ---------------------------------------------------------------------------------------------
# end to end: the real trainer on tiny_cpu.gin
def _train_cli(run_dir: Path, *bindings: str, extra=(), capsys=None) -> tuple[int, str, str]:
    import gin

    from experiments.cli import main

    args = ["train", CONFIG, "--run-dir", str(run_dir), "--no-progress", "--no-report"]
    for b in [*TINY, *bindings]:
        args += ["--gin", b]
    rc = main(args + list(extra))
    gin.clear_config()
    out = capsys.readouterr() if capsys is not None else None
    return rc, out.out if out else "", out.err if out else ""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 4-step tiny_cpu.gin run (checkpoints at steps 2 and 4)."""
    import gin

    from experiments.train import run_training

    run_dir = tmp_path_factory.mktemp("resume_settings") / "run"
    assert run_training([CONFIG], [*TINY, "train.total_steps = 4"], str(run_dir), progress=False) == "done"
    gin.clear_config()
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / ".lock").unlink(missing_ok=True)  # so that a lock file the refusal made would show
    return copy


@pytest.mark.slow
def test_resuming_with_a_changed_loss_is_refused_and_leaves_the_run_as_it_was(finished_run, tmp_path, capsys):
    run_dir = _copy(finished_run, tmp_path)
    before = _snapshot(run_dir)
    time.sleep(0.01)  # a write now would show in the mtimes
    for extra in ((), ("--extend",)):  # --extend with a larger total_steps and a changed loss: still refused
        rc, _out, err = _train_cli(run_dir, 'train.loss = "dapo"', "train.total_steps = 6", extra=extra, capsys=capsys)
        assert rc == 2, err
        assert "train.loss: recorded 'cispo', new 'dapo'" in err and "nothing was changed" in err, err
        assert ("train.total_steps: recorded 4, new 6" in err) == (not extra), err  # --extend accepts that one
        assert "Traceback" not in err
        assert _snapshot(run_dir) == before  # no lock file, no log line, no mtime changed
    assert run_json(run_dir)["status"] == "done"


@pytest.mark.slow
def test_extend_continues_a_finished_run_from_its_last_checkpoint(finished_run, tmp_path, capsys):
    run_dir = _copy(finished_run, tmp_path)
    rc, out, err = _train_cli(run_dir, "train.total_steps = 6", capsys=capsys, extra=("--extend",))
    assert rc == 0, err
    assert f"resuming {run_dir} from step 4 (checkpoint {run_dir / 'checkpoints' / 'step_00000004'})" in out, out
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]  # no gap, no repeat
    assert [r["step"] for r in read_jsonl(run_dir / "eval.jsonl")] == [0, 2, 4, 6]
    info = run_json(run_dir)
    assert info["status"] == "done" and info["resumes"] == 1 and info["settings"]["train.total_steps"] == "6"
    (change,) = info["settings_history"]
    assert change["step"] == 4 and change["extended"] and change["changes"] == {
        "train.total_steps": {"recorded": "4", "new": "6"}}
    # the run now records 6 steps: the same command again has nothing to do
    rc, out, err = _train_cli(run_dir, "train.total_steps = 6", capsys=capsys)
    assert rc == 0 and "resuming" not in out, err


def _scalerl_train(run_dir: Path, *bindings: str) -> subprocess.Popen:
    from test_main_job import _scalerl

    cmd = _scalerl() + ["train", CONFIG, "--run-dir", str(run_dir), "--no-progress", "--no-report"]
    for b in [*TINY, *bindings]:
        cmd += ["--gin", b]
    return subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # its own process group: the test's Ctrl-C reaches only it
                            preexec_fn=_as_a_foreground_job)


def _as_a_foreground_job() -> None:
    """SIGINT at its default, as in a terminal's foreground job. A pytest started in the background by a
    non-interactive shell (`pytest ... &`, nohup) ignores SIGINT, every child inherits that, and Python
    then installs no KeyboardInterrupt handler: the run would (rightly) ignore the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_the_same_command_resumes(tmp_path):
    from components.trainer.checkpoint import latest_checkpoint, read_checkpoint_info

    run_dir = tmp_path / "run"
    total = 12  # the Ctrl-C lands at the first checkpoint (step 2), far from the run's end even on a starved machine
    proc = _scalerl_train(run_dir, f"train.total_steps = {total}")
    try:
        deadline = time.time() + 240
        while (seen := latest_checkpoint(run_dir / "checkpoints")) is None:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        running = proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: every process of the foreground group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    seen_step = int(seen.name.rsplit("_", 1)[-1])  # (its directory may be gone by now: retention)
    assert running and seen_step < total, f"the run had reached step {seen_step} (running: {running}) before the Ctrl-C"
    assert proc.returncode == 130, f"Ctrl-C sent at checkpoint step {seen_step}; run.json: {run_json(run_dir)}\n{err}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("scalerl train: interrupted (Ctrl-C)"), err
    assert f"--run-dir {run_dir}" in lines[0]
    assert run_json(run_dir)["status"] == "interrupted"
    step = int(read_checkpoint_info(latest_checkpoint(run_dir / "checkpoints"))["step"])
    assert 2 <= step < total and f"step {step}" in lines[0]

    proc = _scalerl_train(run_dir, f"train.total_steps = {total}")  # the same command resumes
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"resuming {run_dir} from step {step} (checkpoint " in out, out
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, total + 1))  # no gap, no repeat
    assert run_json(run_dir)["status"] == "done" and run_json(run_dir)["resumes"] == 1
