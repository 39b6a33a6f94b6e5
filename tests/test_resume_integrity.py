"""Resume integrity (issue 14 item 6): damaged checkpoints, logs that lost records, failures
that cannot be written.

- A corrupt newest checkpoint: the run resumes from the previous, intact one and a warning
  names the corrupt file; when none is intact the error names every bad file.
- A metrics log cut mid-line before the checkpoint's step: the resume is refused, naming the
  file and the lost steps (never resumed with steps silently missing). A torn line written
  after the checkpoint is dropped with a warning.
- Log lines are fsynced before the checkpoint that counts on them is committed.
- A run directory that cannot be written while a failure is recorded (a read-only file
  system): the original error still reaches stderr, the failure is recorded beside the run
  directory (RunInfo reads it), and `scalerl train` exits with its own code.

One tiny 4-step run (checkpoints at steps 2 and 4) is trained once; each test works on a copy.
"""

from __future__ import annotations

import argparse
import builtins
import errno
import io
import json
import logging
import os
import shutil
import types
from pathlib import Path

import pytest

from _helpers_trainer import read_jsonl, run_json, tiny_model, write_gin
from components.trainer.checkpoint import CheckpointError, NoIntactCheckpointError, load_checkpoint, select_resume_checkpoint
from components.trainer.runlog import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_FAILURE_UNRECORDED,
    JsonlLog,
    LogLossError,
    RunInfo,
    resume_log,
)


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are process-global: start and end every test with none."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def tiny_gin(tmp_path_factory) -> tuple[str, str]:
    """(gin file of a 4-step tiny run with checkpoints at steps 2 and 4, the tiny model's path)."""
    root = tmp_path_factory.mktemp("resume_integrity")
    model_path = tiny_model(root / "model")
    return write_gin(root / "tiny.gin", model_path, train__keep_checkpoints="5"), model_path


@pytest.fixture(scope="module")
def finished_run(tiny_gin):
    """(gin file, run directory) of the finished tiny run."""
    import gin

    from experiments.train import run_training

    gin_file = tiny_gin[0]
    run = Path(gin_file).parent / "run"
    assert run_training([gin_file], [], str(run), progress=False) == "done"
    gin.clear_config()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    return gin_file, run


def _crashed_copy(finished_run, tmp_path: Path) -> Path:
    """A copy of the finished run as a crash after step 4 leaves it (run.json not done)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run[1], run)
    info = json.loads((run / "run.json").read_text())
    info["status"] = "running"
    (run / "run.json").write_text(json.dumps(info))
    return run


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path: Path) -> None:
    """Same size, different bytes in the middle."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(finished_run, tmp_path, capfd):
    from experiments.train import run_training

    run = _crashed_copy(finished_run, tmp_path)
    _truncate(run / "checkpoints" / "step_00000004" / "trainer.pt")  # today: "failed finding central directory"
    status = run_training([finished_run[0]], ["train.total_steps = 6"], str(run), progress=False, extend=True)
    err = capfd.readouterr().err
    assert status == "done", run_json(run).get("error")
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]  # resumed at 2: no gap, no duplicate
    assert "step_00000004/trainer.pt" in err and "resuming from step_00000002" in err, err
    assert (run / "checkpoints" / "step_00000004.corrupt").is_dir()  # moved aside, kept for inspection
    assert run_json(run)["status"] == "done"


def _two_checkpoints(tiny_gin, tmp_path: Path):
    """(model, optimizer, checkpoints dir) with checkpoints of steps 2 and 4 of the tiny policy."""
    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.checkpoint import save_checkpoint
    from components.trainer.learner import make_optimizer

    model = load_causal_lm(tiny_gin[1])
    opt, sched = make_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, warmup_steps=1)
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        save_checkpoint(ckpts, step, model=model, optimizer=opt, scheduler_state=sched.state_dict(),
                        trainer_state={"step": step}, rank_state={"rng": 1}, keep=5, tokenizer=load_tokenizer(tiny_gin[1]))
    return model, opt, ckpts


def test_no_intact_checkpoint_names_every_bad_file(tiny_gin, tmp_path):
    model, opt, ckpts = _two_checkpoints(tiny_gin, tmp_path)
    _truncate(ckpts / "step_00000004" / "trainer.pt")
    _garble(ckpts / "step_00000002" / "ranks" / "rank_00000.pt")  # same size: caught by its crc32
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(ckpts / "step_00000004", model=model, optimizer=opt)  # today: no file named
    assert str(ckpts / "step_00000004" / "trainer.pt") in str(caught.value)
    with pytest.raises(NoIntactCheckpointError) as caught:
        select_resume_checkpoint(ckpts)
    msg = str(caught.value)
    assert "no intact checkpoint" in msg and "truncated" in msg and "crc32" in msg, msg
    assert str(ckpts / "step_00000004" / "trainer.pt") in msg and str(ckpts / "step_00000002" / "ranks" / "rank_00000.pt") in msg
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004"]  # nothing moved when none is intact
    from components.trainer.export import ExportError, resolve_checkpoint

    with pytest.raises(ExportError, match="no intact checkpoint"):
        resolve_checkpoint(tmp_path / "run")


def test_export_takes_the_newest_intact_checkpoint(tiny_gin, tmp_path):
    """`scalerl export RUN_DIR` skips a damaged newest checkpoint (named in a warning) and exports
    the newest intact one; it read the damaged one before."""
    from components.trainer.export import resolve_checkpoint

    _, _, ckpts = _two_checkpoints(tiny_gin, tmp_path)
    _truncate(ckpts / "step_00000004" / "trainer.pt")
    with pytest.warns(UserWarning, match="step_00000004"):
        assert resolve_checkpoint(tmp_path / "run") == ckpts / "step_00000002"


@pytest.mark.slow
def test_metrics_cut_mid_line_before_the_checkpoint_is_refused(finished_run, tmp_path):
    from experiments.train import run_training

    run = _crashed_copy(finished_run, tmp_path)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().split(b"\n")
    cut = b"\n".join(lines[:2]) + b"\n" + lines[2][:40]  # steps 1, 2 and a torn step 3; step 4 lost
    metrics.write_bytes(cut)
    status = run_training([finished_run[0]], ["train.total_steps = 6"], str(run), progress=False, extend=True)
    error = run_json(run).get("error", "")
    assert status == "failed", metrics.read_text()  # today: done, with steps 3 and 4 missing
    assert "LogLossError" in error and str(metrics) in error and "steps 3-4" in error and "torn line" in error, error
    assert metrics.read_bytes() == cut  # left as it was found, for the user to restore


def test_torn_line_after_the_checkpoint_is_dropped_with_a_warning(tmp_path, caplog):
    log = tmp_path / "eval.jsonl"
    log.write_text('{"step": 0}\n{"step": 2}\n{"step": 4, "pass_r')  # killed while writing the step-4 record
    with caplog.at_level(logging.WARNING):
        assert resume_log(log, 2, {"records": 2, "last_step": 2}) == 2
    assert "torn line" in caplog.text and str(log) in caplog.text
    assert [r["step"] for r in read_jsonl(log)] == [0, 2]
    log.write_text('{"step": 0}\n{"step": 2')  # the checkpoint at step 2 counted 2 records: one is torn
    with pytest.raises(LogLossError, match=r"1 records up to step 2.*had 2"):
        resume_log(log, 2, {"records": 2, "last_step": 2})
    log.write_text('{"step": 0}\n{"step": 2}\n{"step": 4, "pass_r')
    with pytest.raises(LogLossError, match="torn line"):
        JsonlLog(log)  # never appends a record onto a torn line


def test_logs_are_fsynced_before_the_checkpoint_is_committed(tiny_gin, tmp_path, monkeypatch):
    import components.trainer.checkpoint as ckpt
    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.checkpoint import read_checkpoint_info
    from components.trainer.accounting import TrainingClock
    from components.trainer.learner import make_optimizer
    from components.trainer.trainer_checkpoints import Checkpoints

    model_path = tiny_gin[1]
    model = load_causal_lm(model_path)
    opt, sched = make_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, warmup_steps=1)
    run = tmp_path / "run"
    run.mkdir()
    metrics, evals = JsonlLog(run / "metrics.jsonl"), JsonlLog(run / "eval.jsonl")
    evals.write({"step": 0, "pass_rate": 0.1})
    for step in (1, 2, 3):
        metrics.write({"step": step, "loss": 0.5})

    events = []
    real_fsync, real_publish = os.fsync, ckpt._publish

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def publish(tmp, final):
        events.append(("commit", final.name))
        return real_publish(tmp, final)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(ckpt, "_publish", publish)
    hub = types.SimpleNamespace(  # learner-0 as trainer_checkpoints.CheckpointedHub sees it
        followers=[], generators=["generator-0"], step=3, tokenizer=load_tokenizer(model_path),
        logs=types.SimpleNamespace(sync=lambda: {log_.path.name: log_.sync() for log_ in (metrics, evals)}),
        learner=types.SimpleNamespace(model=model, optimizer=opt, scheduler=sched, version=3),
        curriculum=types.SimpleNamespace(state_dict=lambda: {}), clock=TrainingClock(devices=1), next_order=12,
        next_generator=0, prompts_sampled=12, flops=0.0, pending=[], batches=[], totals={}, cpu_base_s=0.0,
        cpu_hours=lambda: 0.0,
    )
    cfg = types.SimpleNamespace(keep_checkpoints=2, to_dict=lambda: {})
    Checkpoints(cfg, run, hub).save()
    commit = events.index(("commit", "step_00000003"))
    assert ("fsync", "metrics.jsonl") in events[:commit] and ("fsync", "eval.jsonl") in events[:commit], events
    logs = read_checkpoint_info(run / "checkpoints" / "step_00000003")["logs"]
    assert logs == {"metrics.jsonl": {"records": 3, "last_step": 3}, "eval.jsonl": {"records": 1, "last_step": 0}}


# ---------------------------------------------------------------------------------------------
def _read_only(monkeypatch, root: Path) -> None:
    """From now on every write under `root` fails with EROFS, as on a file system remounted
    read-only. (The tests run as root, which permission bits do not stop; patching the calls
    that create or replace files works for root and in any CI container.)"""
    root = str(root.resolve())

    def inside(path) -> bool:
        try:
            full = os.path.abspath(os.fspath(path))
            return full == root or full.startswith(root + os.sep)
        except TypeError:  # a file descriptor
            return False

    def guard(real, writes):
        def wrapped(path, *args, **kw):
            if writes(args, kw) and inside(path):
                raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
            return real(path, *args, **kw)
        return wrapped

    def writing_mode(args, kw) -> bool:
        mode = args[0] if args else kw.get("mode", "r")
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    def writing_flags(args, kw) -> bool:
        flags = args[0] if args else kw.get("flags", 0)
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    monkeypatch.setattr(builtins, "open", guard(builtins.open, writing_mode))
    monkeypatch.setattr(io, "open", guard(io.open, writing_mode))
    monkeypatch.setattr(os, "open", guard(os.open, writing_flags))
    for name in ("replace", "rename", "mkdir", "unlink"):
        monkeypatch.setattr(os, name, guard(getattr(os, name), lambda a, k: True))


def test_a_failure_in_a_read_only_run_dir_is_still_reported(tiny_gin, tmp_path, monkeypatch, capfd):
    import components.trainer.launcher as launcher
    from experiments import train

    run = tmp_path / "run"

    def launch_local(setup, layout, run_dir, on_gpu, **kw):  # the run dir turns read-only, then learner-0 fails
        _read_only(monkeypatch, run)
        raise RuntimeError("generator-0 exploded: the original error")

    monkeypatch.setattr(launcher, "launch_local", launch_local)
    args = argparse.Namespace(configs=[tiny_gin[0]], gin=[], run_dir=str(run), name=None, no_progress=True,
                              no_report=True, executor="here")
    code = train.main(args)
    monkeypatch.undo()
    err = capfd.readouterr().err
    assert code == EXIT_FAILURE_UNRECORDED and code not in (0, EXIT_FAILED, EXIT_BAD_INPUT), (code, err)  # today: 2
    assert "generator-0 exploded: the original error" in err and "Read-only file system" in err, err
    assert json.loads((run / "run.json").read_text())["status"] == "running"  # the run dir could not be written ...
    fallback = run.with_name("run.failed.json")  # ... the failure is recorded beside it
    assert json.loads(fallback.read_text())["status"] == "failed"
    info = RunInfo(run)  # and RunInfo (scalerl train, sweeps) reads it
    assert info.status == "failed" and "generator-0 exploded" in info.data["error"]
    info.start(None, {"device": "cpu", "count": 1}, resumed=True)  # a new attempt clears it
    assert not fallback.exists() and RunInfo(run).status == "running"


def test_failure_recorded_in_the_spare_directory_when_the_parent_is_read_only_too(tmp_path, monkeypatch, capfd):
    from components.trainer.runlog import record_failure

    run = tmp_path / "sweep" / "run_a"
    run.mkdir(parents=True)
    RunInfo(run).start(None, {"device": "cpu", "count": 1}, resumed=False)
    monkeypatch.setenv("SCALERL_FAILURE_DIR", str(tmp_path / "spare"))
    _read_only(monkeypatch, tmp_path / "sweep")  # the run directory and the one beside it
    assert record_failure(run, "ValueError: the original error", "Traceback ...\nValueError: the original error") is False
    monkeypatch.undo()
    monkeypatch.setenv("SCALERL_FAILURE_DIR", str(tmp_path / "spare"))
    assert "ValueError: the original error" in capfd.readouterr().err
    (spare,) = (tmp_path / "spare").iterdir()
    assert spare.name.startswith("run_a-") and json.loads(spare.read_text())["error"] == "ValueError: the original error"
    assert RunInfo(run).status == "failed" and json.loads((run / "run.json").read_text())["status"] == "running"
