"""`scalerl train CONFIG [CONFIG...] [--gin BINDING]... [--run-dir DIR] [--print-config]`: train one run.

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
from pathlib import Path
from typing import Optional, Sequence

from components.trainer.config import check_settings, on_gpu
from components.trainer.gin_config import parse_gin_files
from components.trainer.runlog import (
    EXIT_BAD_INPUT,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_FAILURE_UNRECORDED,
    RunInfo,
    failure_in_run_dir,
)

__all__ = ["run_training", "resolve", "prepare", "check_config", "config_text", "add_arguments", "main", "user_modules"]

log = logging.getLogger("scalerl.train")


def check_data(cfg) -> None:
    """The engines can be loaded here, and the task's dataset and the benchmark files read (both splits),
    now rather than in a generator process later; no model is touched."""
    from components.curricula import build_curriculum
    from components.engines import check_engine
    from components.trainer.config import ConfigError

    for engine in {cfg.engine, cfg.eval_engine or cfg.engine}:
        try:
            check_engine(engine)  # unknown name: the registry's error; vllm not installed: ImportError
        except ImportError as err:
            raise ConfigError(f"{err} Or use train.engine = \"torch\".") from None
    from components.tasks import make_task

    try:
        task = make_task(cfg.task, seed=cfg.seed, **cfg.task_kwargs)
        train, held_out = list(task.train_problems()), list(task.eval_problems())
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        raise ConfigError(f"task {cfg.task!r} (task_kwargs={cfg.task_kwargs!r}) could not be loaded: {type(err).__name__}: {err}") from err
    from components.tasks import sandbox  # a code task built a sandbox: name its memory risk, if any, at start

    if sandbox.sandbox_used() and sandbox.residual_memory_risk():
        print(sandbox.residual_memory_risk(), file=sys.stderr, flush=True)
    if not train:
        raise ConfigError(f"task {cfg.task!r} has no training problems")
    if not held_out:
        raise ConfigError(f"task {cfg.task!r} has no held-out problems to evaluate on")
    build_curriculum(cfg.curriculum, train, cfg.seed)  # composition errors (two samplers, ...)
    if cfg.downstream_benchmarks:  # read and check the benchmark files now, not on a generator later
        from components.benchmarks import load_benchmarks

        try:
            load_benchmarks(cfg.downstream_benchmarks)
        except (OSError, ValueError, TypeError, ImportError, RuntimeError) as err:  # RuntimeError: no sandbox
            raise ConfigError(f"train.downstream_benchmarks: {type(err).__name__}: {err}") from err


def validate_components(cfg) -> None:
    """Unknown component names, a missing model, an unreadable dataset: fail before anything runs."""
    from components.models import check_model_path

    from components.trainer.lora import check_targets_of_model

    check_settings(cfg)
    check_data(cfg)
    check_model_path(cfg.model_path)
    check_targets_of_model(cfg)  # train.lora_targets against the model's modules (meta skeleton)


def check_config(config_files: Sequence[str], bindings: Sequence[str] = (), *, read_data: bool = True,
                 on_this_machine: bool = True):
    """Parse the run's config and refuse every mistake that can be found without its model: gin syntax
    (the binding at fault named), unknown configurables and parameters (did-you-mean), unknown component
    names, numbers out of range, inconsistent settings and, with `read_data`, the task's dataset
    (`on_this_machine`: see `check_settings`).
    model.path is NOT resolved (resolving it may build a warm start). Returns (TrainConfig with
    model_path unresolved, absolute config files, sys_path)."""
    parsed = parse_config(config_files, bindings)
    check_parsed(parsed[0], read_data=read_data, on_this_machine=on_this_machine)
    return parsed


def parse_config(config_files: Sequence[str], bindings: Sequence[str] = ()):
    """The run's gin files parsed (once) and its TrainConfig built from them, every component's values in
    its table, model.path unresolved; nothing checked yet (`check_parsed`). Returns (TrainConfig,
    absolute config files, sys_path); gin holds the parsed config."""
    from components.trainer.config import UNRESOLVED_MODEL_PATH, train_config

    files, sys_path = parse_gin_files(config_files, bindings)
    return train_config(model_path=UNRESOLVED_MODEL_PATH), files, sys_path


def check_parsed(cfg, *, read_data: bool = True, on_this_machine: bool = True) -> None:
    """`check_config`'s checks of a parsed config (`parse_config`; gin holds it)."""
    from components.trainer.config import ConfigError
    from components.trainer.gin_config import bound_parameter

    check_settings(cfg, on_this_machine)
    try:  # bound (to a path, an id or a builder): what it names is resolved after these checks
        bound_parameter("model.path")
    except ValueError:
        raise ConfigError("model.path is not set: bind it in the gin file or with --gin 'model.path = \"/path\"' "
                          "(a local checkpoint directory or a Hugging Face hub id)") from None
    if read_data:
        check_data(cfg)


def prepare(config_files: Sequence[str], bindings: Sequence[str] = (), parsed=None):
    """Parse and validate; returns (TrainConfig, absolute config files, sys_path). Raises on bad input.

    Everything that can be checked without the model is checked (`check_config`) before model.path
    is resolved, since resolving it may build a model (a warm start). `parsed`: what `parse_config`
    returned for these files and bindings (gin still holding it), not parsed again."""
    from components.models import check_model_path
    from components.trainer.config import ConfigError, model_config

    if parsed is None:
        unresolved, files, sys_path = check_config(config_files, bindings)  # parsed and validated, once
    else:
        unresolved, files, sys_path = parsed
        check_parsed(unresolved)
    try:
        cfg = unresolved.replace(model_path=model_config())  # model.path resolved (a warm start may train here)
    except (ValueError, TypeError, RuntimeError) as err:
        if "model.path" in str(err) or "REQUIRED" in str(err) or "required" in str(err).lower():
            raise ConfigError(f"model.path is not set: bind it in the gin file or with --gin 'model.path=\"/path\"' ({err})") from err
        raise
    check_model_path(cfg.model_path)
    from components.trainer.lora import check_targets_of_model

    check_targets_of_model(cfg)  # train.lora_targets against the model's modules (meta skeleton)
    return cfg, files, sys_path


def default_run_dir(config_files: Sequence[str], environ: Optional[dict] = None) -> Path:
    """runs/CONFIG_STEM/TIMESTAMP; in a Slurm step of several tasks (`srun ... scalerl train`),
    runs/CONFIG_STEM/slurm-JOBID.STEPID, the same in every task (their clocks and start times
    differ) and again after a requeue, which then resumes the run."""
    from components.trainer.roles import slurm_step_tasks

    stem = Path(config_files[-1]).stem if config_files else "run"
    env = os.environ if environ is None else environ
    if "SCALERL_RANK" not in env and slurm_step_tasks(env) > 1:
        return Path("runs") / stem / f"slurm-{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / stem / stamp


def run_training(
    config_files: Sequence[str],
    bindings: Sequence[str] = (),
    run_dir: Optional[str] = None,
    *,
    run_info: Optional[dict] = None,
    progress: bool = True,
    record_invalid: bool = True,
    extend: bool = False,
) -> str:
    """Train (or resume, or skip if done) one run. Returns "done" or "failed"; bad input raises early.

    A run directory that exists is re-invoked: its recorded settings are compared with these first
    (`experiments.run_settings`), and any difference is refused (SettingsChangedError) before anything
    is computed or written; `extend` accepts a larger budget (train.total_steps, train.compute_budget_*),
    which continues a finished run from its last checkpoint.

    On one machine this process starts the run's T learner ranks and G generators itself
    (components/trainer/launcher.py) and watches them. Inside a Slurm job step with several
    tasks (`srun`, or a submitit job with tasks_per_node / nodes), every task calls this
    function and takes the role of its rank (components/trainer/roles.py).
    """
    from components.trainer import run_owner
    from components.trainer.roles import process_env

    run_path = Path(run_dir) if run_dir is not None else default_run_dir(config_files)
    penv = process_env()
    slurm = penv is not None and penv.source == "slurm"
    if slurm and penv.rank != 0:  # task 0 resolves the run once; this task waits for it and takes its role
        return run_owner.join_slurm_step(penv, run_path, run_info=run_info, progress=False)
    attempt = run_owner.slurm_attempt() if slurm else None
    rerun, parsed = None, None
    try:
        if slurm or (run_path / "run.json").exists():
            parsed = parse_config(config_files, bindings)  # the one parse, also what resolves the run below
        if slurm:
            _bind_task_gpus(parsed[0], penv)  # before anything starts CUDA (resolving may build a warm start)
        if (run_path / "run.json").exists():
            rerun = _check_rerun(parsed[0], run_path, extend)
        if rerun is not None and rerun.done:
            log.info("run %s is already done", run_path)
            if slurm:
                run_owner.publish_run(run_path, attempt, None)
            return "done"
        run = resolve(config_files, bindings, parsed)
    except Exception as err:
        if slurm:  # task 0 records why the run never started, and releases the other tasks
            _refused_slurm_step(run_path, run_info, attempt, err)
        else:
            _refused_input(run_path, run_dir, run_info, record_invalid, err)
        raise
    _say_resuming(run_path, rerun)
    if slurm:
        return run_owner.lead_slurm_step(penv, run, run_path, run_info=run_info, progress=progress, rerun=rerun)
    return run_owner.run_here(run, run_path, run_info, progress, rerun)


def _bind_task_gpus(cfg, penv) -> None:
    """A task of a multi-task Slurm step on GPUs: only its own device(s) visible, from the parsed layout."""
    from components.trainer.resolve import layout_of
    from components.trainer.run_owner import bind_gpus

    if on_gpu(cfg):
        bind_gpus(layout_of(cfg), penv)


def resolve(config_files: Sequence[str], bindings: Sequence[str] = (), parsed=None):
    """The run's `ResolvedRun`: gin parsed once (`parsed`: already, by `parse_config`), the config validated,
    model.path resolved (`prepare`), and what the run's processes and run.json need from gin captured (its
    settings, the user modules' files); the run's processes read no gin."""
    from components.trainer.resolve import resolved_run
    from experiments.run_settings import resolved_settings

    cfg, files, sys_path = prepare(config_files, bindings, parsed)
    return resolved_run(cfg, files, bindings, sys_path, settings=resolved_settings(cfg),
                        module_files=user_modules(cfg))


def _check_rerun(cfg, run_path: Path, extend: bool):
    """A re-invoked run directory: its recorded settings against these (`cfg` parsed, with its resolved
    component table; nothing built or written): the same `run_settings.resolved_settings` that run.json
    records when the run starts. Returns the `Rerun`; raises SettingsChangedError naming every refused
    difference."""
    from experiments.run_settings import check_rerun, resolved_settings, stored_settings

    check_parsed(cfg, read_data=False, on_this_machine=False)
    rerun = check_rerun(run_path, resolved_settings(cfg), extend)
    if stored_settings(run_path) is None and (rerun.checkpoint is not None or rerun.status == "done"):
        log.warning("run %s records no settings (it started before runs recorded them): its settings cannot be "
                    "compared with these; they are recorded from now on", run_path)
    return rerun


def _refused_input(run_path: Path, run_dir, run_info, record_invalid: bool, err: BaseException) -> None:
    """A sweep's run (its directory made at submission) refused before it started: record why in its
    run.json. A refused `scalerl train` leaves no run directory behind (it would show up in `scalerl status`
    and `fit`); a changed-settings refusal and a done run are left exactly as they were."""
    from experiments.run_settings import SettingsChangedError

    from components.trainer.run_owner import record_refused

    if isinstance(err, SettingsChangedError) or run_dir is None or not record_invalid or not run_path.is_dir():
        return
    if (run_path / "run.json").exists() and RunInfo(run_path).status == "done":
        return
    record_refused(run_path, run_info, err)


def _refused_slurm_step(run_path: Path, run_info, attempt: str, err: BaseException) -> None:
    """Task 0 of a Slurm step could not resolve the run: run.json failed with why (a changed-settings refusal
    leaves it as it was), and the other tasks stop, naming why."""
    from components.trainer.run_owner import publish_refusal, record_refused
    from experiments.run_settings import SettingsChangedError

    if not isinstance(err, SettingsChangedError):
        record_refused(run_path, run_info, err)
    publish_refusal(run_path, attempt, err)


def _say_resuming(run_path: Path, rerun) -> None:
    """'resuming <run_dir> from step N (checkpoint ...)' on stdout, before the processes start."""
    from experiments.run_settings import resume_line

    line = resume_line(run_path, rerun) if rerun is not None else None
    if line:
        print(line, flush=True)


def user_modules(cfg=None) -> list[dict]:
    """The modules the run's gin files import (`import my_losses`) and those its train.reward_funcs name
    by import path, each with the file it was imported from and the sys.path entry that finds it:
    [{"module": "my_losses", "file": "/home/me/exp/my_losses.py", "path": "/home/me/exp"}]. Recorded in
    run.json, so that `scalerl eval RUN_DIR` can import them again from any working directory (call
    while gin holds the run's parsed config)."""
    from components.trainer.gin_config import imported_modules

    names = imported_modules()
    for spec in getattr(cfg, "reward_funcs", ()) or ():
        if ":" in spec or ("." in spec and spec not in _registered_rewards()):
            names.append(spec.partition(":")[0] if ":" in spec else spec.rpartition(".")[0])
    out = []
    for name in dict.fromkeys(names):
        module = sys.modules.get(name) or sys.modules.get(name.rpartition(".")[0])  # `from pkg import mod` / attr
        if module is None:
            continue
        file = getattr(module, "__file__", None)
        entry = None
        if file:
            root = Path(file).resolve().parent
            depth = module.__name__.count(".") + (Path(file).name == "__init__.py")
            for _ in range(depth):
                root = root.parent
            entry = str(root)
        out.append({"module": module.__name__, "file": str(Path(file).resolve()) if file else None, "path": entry})
    return out


def _registered_rewards() -> list:
    from components.registry import REWARDS

    return REWARDS.names()


# ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="+", metavar="CONFIG", help="gin config file(s), e.g. experiments/configs/tiny_cpu.gin")
    parser.add_argument("--gin", action="append", default=[], metavar="BINDING", help="extra gin binding, e.g. 'train.lr = 1e-5' (repeatable)")
    parser.add_argument("--run-dir", default=None,
                        help="run directory (default: runs/<config stem>/<timestamp>); an existing one is resumed from its "
                             "last checkpoint, with the settings it recorded (any other setting is refused, naming it)")
    parser.add_argument("--extend", action="store_true",
                        help="with --run-dir: accept a larger train.total_steps / train.compute_budget_flops / "
                             "train.compute_budget_hours, continuing a finished run from its last checkpoint "
                             "(other changed settings are still refused)")
    parser.add_argument("--name", default=None, help="run name recorded in run.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-report", action="store_true", help="skip the end-of-run fit and figure")
    parser.add_argument("--executor", choices=("here", "slurm"), default="here",
                        help="here (default): run on this machine; slurm: submit this one run as a Slurm job")
    parser.add_argument("--wait", action="store_true", help="slurm: wait for the job and report")
    parser.add_argument("--print-config", action="store_true",
                        help="check the config and print it as gin bindings, defaults included (model.path unresolved); "
                             "nothing is built, trained or created")
    from experiments.sweep_cli import add_slurm_arguments

    add_slurm_arguments(parser.add_argument_group("Slurm (with --executor slurm)"))


def submit_run(args: argparse.Namespace) -> int:
    """`scalerl train CONFIG --executor slurm`: one run as one Slurm job (no sweep spec needed)."""
    from experiments.recipes import SweepError
    from experiments.run_config import validate_runs
    from experiments.run_state import plan
    from experiments.slurm import check_partition
    from experiments.submission import submit, wait
    from experiments.sweep_cli import options_from_args
    from experiments.sweep_spec import RunSpec

    if args.run_dir is None and args.name:  # the name names the directory: runs/<config stem>/<name>
        args.run_dir = str(Path("runs") / Path(args.configs[-1]).stem / args.name)
    run_dir = Path(args.run_dir or default_run_dir(args.configs, environ={})).absolute()  # submitted: a timestamp
    if args.name and args.name != run_dir.name:
        print(f"scalerl train: error: with --executor slurm the run's name is its directory's name; got --name {args.name!r} "
              f"and --run-dir {str(run_dir)!r}", file=sys.stderr)
        return 2
    files = [str(Path(f).resolve()) for f in args.configs]
    run = RunSpec(name=run_dir.name, sweep=run_dir.parent.name, factor=None, value=None,
                  recipe=Path(files[0]).stem if files else None, seed=None, config_files=tuple(files), bindings=tuple(args.gin))
    try:
        opts = options_from_args(args)
        configs = validate_runs([run], opts.target)
        check_partition(opts.partition)
        from experiments.run_settings import check_planned

        planned = check_planned(plan([run], run_dir.parent.parent), configs, extend=getattr(args, "extend", False))
        if planned[0].action == "skip-refused":
            print(f"scalerl train: error: {planned[0].reason}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if planned[0].action.startswith("skip"):
            print(f"nothing to submit: {run_dir} is {planned[0].action[5:]} ({planned[0].reason})")
            return 0
        submitted = submit(planned, opts, run_dir.parent.parent, run_dir.parent.name, folder=run_dir / ".submitit",
                           configs=configs)
    except SweepError as err:
        print(f"scalerl train: error: {err}", file=sys.stderr)
        return 2
    job = submitted[0][1]
    print(f"submitted run {run_dir} as Slurm job {job.job_id}; follow with: scalerl status {run_dir.parent}", flush=True)
    if not args.wait:
        return 0
    outcomes = wait(submitted, poll_s=5.0)
    state, err = outcomes[run.name]
    print(f"run {state}: {run_dir}" + (f" ({err})" if err else ""), flush=True)
    return 0 if state == "done" else 1


def refusal_message(err: BaseException) -> str:
    """One clean line for a refused config: the message of a config error as it is (gin's context lines
    dropped), other errors with their type ("FileNotFoundError: ...")."""
    from components.registry import ParamRangeError, UnknownComponentError
    from components.trainer.config import ConfigError
    from components.trainer.gin_config import gin_error_message

    msg = gin_error_message(err)
    return msg if isinstance(err, (ConfigError, UnknownComponentError, ParamRangeError)) else f"{type(err).__name__}: {msg}"


def _binding_line(key: str, value) -> str:
    """`key = value` as gin writes it (a long value continued on indented lines); references as @name() / %MACRO."""
    import pprint

    lines = pprint.pformat(value, width=96).split("\n")
    if len(lines) == 1 and len(key) + len(lines[0]) <= 100:
        return f"{key} = {lines[0]}"
    return f"{key} = \\\n" + "\n".join("    " + line for line in lines)


def config_text(cfg, config_files: Sequence[str], bindings: Sequence[str]) -> str:
    """The run's operative configuration as gin bindings: every train.* setting as the trainer reads it
    (defaults included), model.* and data.* as bound (model.path NOT resolved: resolving it may build a
    model), the parameters of every component the run uses (defaults and bindings), then every other binding
    (`run_settings.operative_sections`). Call after `check_config` (gin holds the parsed config)."""
    from components.trainer.gin_config import import_lines, parsed_macros
    from experiments.run_settings import operative_sections

    out = ["# operative configuration of " + " + ".join(str(f) for f in config_files)
           + "".join(f"\n#   --gin {b!r}" for b in bindings),
           "# (defaults included; model.path is shown as bound, not resolved: nothing is built, trained or created;",
           "#  a component's seed, device and precision come from train.*)"]

    imports = import_lines()
    if imports:
        out.append("")
        out.extend(imports)
    macros = parsed_macros()
    if macros:
        out.append("\n# macros")
        out.extend(_binding_line(name, value) for name, value in macros.items())
    for title, values in operative_sections(cfg):
        if values:
            out.append(f"\n# {title}")
            out.extend(_binding_line(key, value) for key, value in values.items())
    return "\n".join(out) + "\n"


def print_config(args: argparse.Namespace) -> int:
    """`scalerl train CONFIG --print-config`: check the config, print it, build and create nothing."""
    try:
        cfg, files, _sys_path = check_config(args.configs, args.gin, read_data=False, on_this_machine=False)
        text = config_text(cfg, args.configs, args.gin)
    except Exception as err:  # a refused config: one clean line
        print(f"scalerl train: error: {refusal_message(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(text, end="", flush=True)
    return 0


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def interrupted_line(run_dir) -> str:
    """The one line a Ctrl-C'd `scalerl train` prints: where the run stopped and how it resumes."""
    from components.trainer.checkpoint import latest_checkpoint, read_checkpoint_info

    try:
        ckpt = latest_checkpoint(Path(run_dir) / "checkpoints")
        step = int(read_checkpoint_info(ckpt)["step"]) if ckpt is not None else None
    except Exception:  # noqa: BLE001 - an unreadable checkpoint: the resume names it
        ckpt, step = None, None
    where = (f"its last checkpoint is step {step} ({ckpt})" if step is not None
             else "it has no checkpoint yet (a re-run starts it over)")
    return (f"interrupted (Ctrl-C): {run_dir} stopped; {where}; the same command with --run-dir {run_dir} "
            "resumes it")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if getattr(args, "print_config", False):
        return print_config(args)
    from components.trainer.roles import process_env

    # every mistake that needs no data and no model, refused before a run directory, a warm start or a
    # Slurm job exists (a task of a multi-task Slurm step checks in run_training, after binding its GPUs)
    if process_env() is None:
        try:
            check_config(args.configs, args.gin, read_data=False,
                         on_this_machine=getattr(args, "executor", "here") != "slurm")
        except Exception as err:
            print(f"scalerl train: error: {refusal_message(err)}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if getattr(args, "extend", False) and not args.run_dir:
        print("scalerl train: error: --extend continues an existing run: give its directory with --run-dir DIR",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if getattr(args, "executor", "here") == "slurm":
        return submit_run(args)
    run_dir = args.run_dir or str(default_run_dir(args.configs))
    print(f"run directory: {run_dir}", flush=True)
    run_info = {"name": args.name} if args.name else None
    try:
        status = run_training(
            args.configs, args.gin, run_dir, run_info=run_info, progress=not args.no_progress,
            record_invalid=args.run_dir is not None, extend=getattr(args, "extend", False),
        )
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback wall; the run resumes from its last checkpoint
        print(f"scalerl train: {interrupted_line(run_dir)}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as err:  # bad input: a clear one-line error, no traceback wall
        print(f"scalerl train: error: {refusal_message(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"run {status}: {run_dir}", flush=True)
    if status == "failed" and not failure_in_run_dir(run_dir):  # the error is on stderr and in a fallback file
        print(f"scalerl train: run.json in {run_dir} could not be marked failed; see the error above "
              f"(exit code {EXIT_FAILURE_UNRECORDED})", file=sys.stderr)
        return EXIT_FAILURE_UNRECORDED
    if status == "done" and not args.no_report:
        # start / end pass rate, the fitted sigmoid law and a figure of pass rate vs compute
        from experiments.report import finish_report

        try:
            finish_report(run_dir)
        except Exception as err:  # the run itself is done and logged; say why there is no report
            print(f"scalerl train: no end-of-run report: {type(err).__name__}: {err}", file=sys.stderr)
    return EXIT_DONE if status == "done" else EXIT_FAILED
