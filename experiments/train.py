"""`scalerl train CONFIG [CONFIG...] [--gin BINDING]... [--run-dir DIR]`: train one run.

`run_training` is also what a sweep executor (submitit) calls in a fresh process. It is
safe to call twice on the same run directory: it resumes from the latest checkpoint, and
returns "done" at once for a run that already finished.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["run_training", "prepare", "add_arguments", "main"]

log = logging.getLogger("scalerl.train")


_GIN_SEARCH_PATHS: set[str] = set()  # directories already given to gin.add_config_file_search_path


def _parse_gin(config_files: Sequence[str], bindings: Sequence[str]):
    """Import paths + built-in components, then parse the gin files and bindings."""
    import gin

    from components.registry import load_builtin_components

    files = []
    for f in config_files:
        p = Path(f).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"gin config file {str(f)!r} does not exist")
        files.append(str(p.resolve()))
    sys_path = []
    for d in [str(Path(f).parent) for f in files] + [os.getcwd()]:
        if d not in sys_path:
            sys_path.append(d)
    for d in reversed(sys_path):
        if d not in sys.path:
            sys.path.insert(0, d)
    failures = load_builtin_components()
    for mod, err in failures.items():
        log.debug("built-in component module %s not loaded: %s", mod, err)
    gin.clear_config()
    for d in sys_path:  # `include 'base.gin'` resolves next to the including file
        if d not in _GIN_SEARCH_PATHS:  # gin appends on every call; a sweep parses many runs
            gin.add_config_file_search_path(d)
            _GIN_SEARCH_PATHS.add(d)
    gin.parse_config_files_and_bindings(files, list(bindings), finalize_config=False, skip_unknown=False)
    return files, sys_path


def validate_components(cfg) -> None:
    """Unknown component names, a missing model, an unreadable dataset: fail before anything runs."""
    from components.curricula import build_curriculum
    from components.models import check_model_path
    from components.registry import (
        ADVANTAGE_NORMS,
        AGGREGATIONS,
        CURRICULA,
        LENGTH_CONTROLS,
        LOSSES,
        OFF_POLICY,
        PRECISIONS,
        TASKS,
    )
    from components.trainer.config import ConfigError, validate

    validate(cfg)
    LOSSES.check(cfg.loss)
    AGGREGATIONS.check(cfg.aggregation)
    ADVANTAGE_NORMS.check(cfg.advantage_norm)
    for name in cfg.curriculum:
        CURRICULA.check(name)
    OFF_POLICY.get(cfg.off_policy)()  # also validates k
    PRECISIONS.check(cfg.precision)
    if cfg.length_control:
        LENGTH_CONTROLS.check(cfg.length_control)
    from components.engines import check_engine

    for engine in {cfg.engine, cfg.eval_engine or cfg.engine}:
        try:
            check_engine(engine)  # unknown name: the registry's error; vllm not installed: ImportError
        except ImportError as err:
            raise ConfigError(f"{err} Or use train.engine = \"torch\".") from None
    task_name = "reasoning_gym" if str(cfg.task).startswith("reasoning_gym:") else cfg.task
    TASKS.check(task_name)
    check_model_path(cfg.model_path)
    # the dataset: build the task and read both splits now, not in a generator process later
    from components.tasks import make_task

    try:
        task = make_task(cfg.task, seed=cfg.seed, **cfg.task_kwargs)
        train, held_out = list(task.train_problems()), list(task.eval_problems())
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        raise ConfigError(f"task {cfg.task!r} (task_kwargs={cfg.task_kwargs!r}) could not be loaded: {type(err).__name__}: {err}") from err
    if not train:
        raise ConfigError(f"task {cfg.task!r} has no training problems")
    if not held_out:
        raise ConfigError(f"task {cfg.task!r} has no held-out problems to evaluate on")
    build_curriculum(cfg.curriculum, train, cfg.seed)  # composition errors (two samplers, ...)


def prepare(config_files: Sequence[str], bindings: Sequence[str] = ()):
    """Parse and validate; returns (TrainConfig, absolute config files, sys_path). Raises on bad input."""

    from components.trainer.config import ConfigError, train_config

    files, sys_path = _parse_gin(config_files, bindings)
    try:
        cfg = train_config()
    except (ValueError, TypeError, RuntimeError) as err:
        if "model.path" in str(err) or "REQUIRED" in str(err) or "required" in str(err).lower():
            raise ConfigError(f"model.path is not set: bind it in the gin file or with --gin 'model.path=\"/path\"' ({err})") from err
        raise
    validate_components(cfg)
    return cfg, files, sys_path


def default_run_dir(config_files: Sequence[str]) -> Path:
    stem = Path(config_files[-1]).stem if config_files else "run"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / stem / stamp


def _hardware(cfg) -> dict:
    import torch

    from components.trainer.generator import resolve_device

    device = resolve_device(cfg.device, "learner")
    if device == "cpu":
        return {"device": "cpu", "count": 1 + cfg.num_generators}
    return {"device": torch.cuda.get_device_name(0), "count": 1 + cfg.num_generators}


def run_training(
    config_files: Sequence[str],
    bindings: Sequence[str] = (),
    run_dir: Optional[str] = None,
    *,
    run_info: Optional[dict] = None,
    progress: bool = True,
    record_invalid: bool = True,
) -> str:
    """Train (or resume, or skip if done) one run. Returns "done" or "failed"; bad input raises early."""
    import gin

    from components.trainer.generator import WorkerSetup
    from components.trainer.loop import Trainer
    from components.trainer.runlog import RunInfo

    run_path = Path(run_dir) if run_dir is not None else default_run_dir(config_files)
    info = RunInfo(run_path) if (run_path / "run.json").exists() else None
    if info is not None and info.status == "done":
        log.info("run %s is already done", run_path)
        return "done"
    try:
        cfg, files, sys_path = prepare(config_files, bindings)
    except Exception as err:
        if run_dir is not None and record_invalid:  # a sweep's run: record why it never started
            run_path.mkdir(parents=True, exist_ok=True)
            ri = RunInfo(run_path)
            ri.start(run_info, {"device": "unknown", "count": 0}, resumed=False)
            _record_failure(ri, run_path, err)
        raise
    run_path.mkdir(parents=True, exist_ok=True)
    lock = _lock_run_dir(run_path)  # one trainer per run directory (a requeued job may overlap)
    (run_path / "config.gin").write_text(gin.config_str())
    info = RunInfo(run_path)
    resumed = (run_path / "checkpoints").is_dir() and any((run_path / "checkpoints").glob("step_*.pt"))
    merged = dict(run_info or {})
    merged.setdefault("seed", cfg.seed)
    merged.setdefault("recipe", Path(files[0]).stem if files else None)
    info.start(merged, _hardware(cfg), resumed=resumed)
    setup = WorkerSetup(config_files=files, bindings=list(bindings), sys_path=sys_path, cfg=cfg)
    try:
        try:
            status = Trainer(cfg, run_path, setup, run_info=merged, progress=progress).run()
        except SystemExit:
            # submitit's preemption / time-limit handler exits the job after checkpointing:
            # the run is not failed, it resumes from its last checkpoint when requeued.
            info.finish("interrupted", error="stopped by SystemExit (preempted or timed out); resumes from its last checkpoint")
            raise
        except BaseException as err:  # noqa: BLE001 - record every failure, KeyboardInterrupt included
            _record_failure(info, run_path, err)
            if isinstance(err, KeyboardInterrupt):
                raise
            log.error("run %s failed: %s (traceback in %s)", run_path, err, run_path / "error.txt")
            return "failed"
        (run_path / "config.gin").write_text(gin.operative_config_str())
        info.finish(status)
        return status
    finally:
        lock.close()


class RunDirBusyError(RuntimeError):
    """Another process is training in this run directory."""


def _lock_run_dir(run_path: Path):
    """An exclusive advisory lock on <run>/.lock, released when the process exits (even on kill -9)."""
    import fcntl

    f = open(run_path / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RunDirBusyError(f"run directory {str(run_path)!r} is being trained by another process") from None
    return f


def _record_failure(info, run_path: Path, err: BaseException) -> None:
    (run_path / "error.txt").write_text("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    info.finish("failed", error=f"{type(err).__name__}: {err}")


# ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="gin config file(s), e.g. experiments/configs/tiny_cpu.gin")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING", help="extra gin binding, e.g. 'train.lr = 1e-5' (repeatable)")
    parser.add_argument("--run-dir", default=None, help="run directory (default: runs/<config stem>/<timestamp>); an existing one is resumed")
    parser.add_argument("--name", default=None, help="run name recorded in run.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-report", action="store_true", help="skip the end-of-run fit and figure")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = args.run_dir or str(default_run_dir(args.configs))
    print(f"run directory: {run_dir}", flush=True)
    run_info = {"name": args.name} if args.name else None
    try:
        status = run_training(
            args.configs, args.gin, run_dir, run_info=run_info, progress=not args.no_progress,
            record_invalid=args.run_dir is not None,
        )
    except Exception as err:  # bad input: a clear one-line error, no traceback wall
        print(f"scalerl train: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(f"run {status}: {run_dir}", flush=True)
    if status == "done" and not args.no_report:
        # start / end pass rate, the fitted sigmoid law and a figure of pass rate vs compute
        from experiments.report import finish_report

        try:
            finish_report(run_dir)
        except Exception as err:  # the run itself is done and logged; say why there is no report
            print(f"scalerl train: no end-of-run report: {type(err).__name__}: {err}", file=sys.stderr)
    return 0 if status == "done" else 1
