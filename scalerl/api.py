"""The `scalerl` verbs from Python: train, sweep, fit, compare, evaluate, load_runs.

Each function calls what its CLI verb calls (`experiments.train.run_training`, `experiments.sweep_cli`,
`analysis.study.summarize`, `experiments.evaluate.run_eval`, `analysis.runs.load_runs`), with the CLI's
own defaults (read from the verb's argparse parser), and returns Python objects (a run directory, a
pandas DataFrame) instead of printing tables.

Python objects reach a run's processes by name. A run's generators are separate processes that parse
the run's gin config, so:
- a reward function is passed as its import path ``module:qualname`` (`callable_spec`): a lambda or a
  function defined inside another function is refused; a function of the script being run (module
  ``__main__``) is named by the script's file, whose directory goes on the generators' PYTHONPATH (keep the
  script's work under ``if __name__ == "__main__":``, since the generators import it);
- a `datasets.Dataset` of training prompts is saved into the run directory (``save_to_disk``, with the
  held-out Dataset beside it as split "test") and read there by the `hf_dataset` task in every process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import pandas as pd

__all__ = ["train", "sweep", "fit", "compare", "evaluate", "load_runs", "RunFailedError", "gin_literal",
           "bindings_of", "callable_spec", "resolve_config", "run_settings"]

REPO = Path(__file__).resolve().parents[1]
CONFIGS_DIR = REPO / "experiments" / "configs"
DATASET_DIR = "dataset"  # <run_dir>/dataset: the training (and held-out) Dataset, saved with save_to_disk
PathLike = Union[str, os.PathLike]


class RunFailedError(RuntimeError):
    """A run ended with status "failed" (its run.json's error is the message)."""


# ---------------------------------------------------------------------------------------
# values and bindings
def gin_literal(value: Any) -> str:
    """`value` written as a gin literal: strings quoted, numbers as Python writes them, lists, tuples and
    dicts element by element. A value gin cannot read back (an object, NaN, inf) is a ValueError naming it."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number; a setting takes a finite one")
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value))
    if isinstance(value, (list, tuple)):
        inner = ", ".join(gin_literal(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{gin_literal(k)}: {gin_literal(v)}" for k, v in value.items()) + "}"
    if hasattr(value, "item") and callable(value.item):  # a numpy / torch scalar
        return gin_literal(value.item())
    raise ValueError(f"{value!r} ({type(value).__name__}) cannot be written as a gin setting; give a string, a number, "
                     "a bool, None, or a list / tuple / dict of them")


def bindings_of(overrides: Optional[Mapping[str, Any]]) -> list[str]:
    """`{"train.lr": 1e-3, "cispo.eps_max": 5}` -> ["train.lr = 0.001", "cispo.eps_max = 5"]; a key without a dot
    is a train.* setting ("lr" -> "train.lr"). A key that is not a name is a ValueError naming it."""
    out = []
    for key, value in dict(overrides or {}).items():
        if not isinstance(key, str) or not key.strip() or any(c in key for c in " =\n"):
            raise ValueError(f"overrides: {key!r} is not a setting name; give 'train.lr', 'cispo.eps_max', or 'lr' "
                             "(a train.* setting)")
        name = key.strip() if "." in key else f"train.{key.strip()}"
        try:
            out.append(f"{name} = {gin_literal(value)}")
        except ValueError as err:
            raise ValueError(f"overrides[{key!r}]: {err}") from None
    return out


def resolve_config(config: Union[PathLike, Sequence[PathLike]]) -> list[str]:
    """The gin file(s) of `config`: paths as given, or a recipe's name ("tiny_cpu") from experiments/configs/."""
    items = [config] if isinstance(config, (str, os.PathLike)) else list(config)
    if not items:
        raise ValueError("config: give a gin file (or several), e.g. 'experiments/configs/tiny_cpu.gin' or 'tiny_cpu'")
    out = []
    for item in items:
        p = Path(item).expanduser()
        if not p.is_file() and not p.suffix and (CONFIGS_DIR / f"{p.name}.gin").is_file():
            p = CONFIGS_DIR / f"{p.name}.gin"
        if not p.is_file():
            recipes = sorted(q.stem for q in CONFIGS_DIR.glob("*.gin"))
            raise FileNotFoundError(f"config {os.fspath(item)!r} is not a file; give a gin file's path or a recipe "
                                    f"of experiments/configs/: {recipes}")
        out.append(str(p.resolve()))
    return out


# ---------------------------------------------------------------------------------------
# Python objects -> names the run's processes import
def _add_import_path(directory: str) -> None:
    """Make `directory` importable here and in the processes this one starts (PYTHONPATH is inherited)."""
    if directory not in sys.path:
        sys.path.insert(0, directory)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if directory not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([directory, *paths])


def callable_spec(fn: Any) -> str:
    """The import path ``module:qualname`` a run's processes reach callable `fn` by (a string as it is).

    A lambda or a function defined inside another function has no such path: refused, naming it. A function
    of the script being run (``__main__``) is named by the script's file (`python my_script.py` ->
    ``my_script:fn``), and the script's directory is put on the path of this process and its children."""
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise TypeError(f"{fn!r} is not callable; give a function (or its 'module:function' path)")
    qualname = getattr(fn, "__qualname__", None) or ""
    name = getattr(fn, "__name__", None) or repr(fn)
    if "<lambda>" in qualname or name == "<lambda>":
        raise ValueError(f"reward function {fn!r} is a lambda: the run's generator processes import each reward "
                         "function by its 'module:function' path, which a lambda has not; define it with `def` at "
                         "the top level of a module")
    if "<locals>" in qualname:
        raise ValueError(f"reward function {qualname!r} is defined inside another function: the run's generator "
                         "processes import each reward function by its 'module:function' path; define it at the top "
                         "level of a module")
    module = getattr(fn, "__module__", None)
    if module == "__main__":
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if not main_file:
            raise ValueError(f"reward function {qualname!r} is defined in an interactive session (module __main__ "
                             "without a file): the run's generator processes cannot import it; define it in a .py "
                             "file and import it from there")
        path = Path(main_file).resolve()
        _add_import_path(str(path.parent))
        spec = f"{path.stem}:{qualname}"
    else:
        from components.rewards import reward_spec_of

        spec = reward_spec_of(fn)  # a registered reward's name, or module:qualname checked to import back
        file = getattr(sys.modules.get(module or ""), "__file__", None)
        if file and ":" in spec:
            root = Path(file).resolve().parent
            for _ in range(module.count(".") + (Path(file).name == "__init__.py")):
                root = root.parent
            _add_import_path(str(root))
    return spec


def _reward_overrides(reward_funcs, reward_weights) -> dict:
    """train.reward_funcs / train.reward_weights from Python: callables become import paths."""
    out: dict = {}
    if reward_funcs is not None:
        funcs = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)
        out["train.reward_funcs"] = [callable_spec(f) for f in funcs]
    if reward_weights is not None:
        weights = [reward_weights] if isinstance(reward_weights, (int, float)) else list(reward_weights)
        if reward_funcs is not None and len(weights) != len(out["train.reward_funcs"]):
            raise ValueError(f"reward_weights {weights!r} has {len(weights)} weights for "
                             f"{len(out['train.reward_funcs'])} reward_funcs; give one per function")
        out["train.reward_weights"] = [float(w) for w in weights]
    return out


def save_datasets(run_dir: Path, train_dataset, eval_dataset=None) -> Path:
    """`train_dataset` (and `eval_dataset`, as split "test") saved as one DatasetDict in <run_dir>/dataset; a run
    directory that already holds the same data (a resumed run) is kept, a different one refused. Returns the path."""
    import datasets

    for label, ds in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if ds is not None and not isinstance(ds, datasets.Dataset):
            raise TypeError(f"{label} must be a datasets.Dataset, got {type(ds).__name__}")
    splits = {"train": train_dataset, **({"test": eval_dataset} if eval_dataset is not None else {})}
    fingerprints = {k: ds._fingerprint for k, ds in splits.items()}
    target = Path(run_dir) / DATASET_DIR
    stamp = target / "fingerprints.json"
    if target.exists():
        if stamp.is_file() and json.loads(stamp.read_text()) == fingerprints:
            return target
        raise ValueError(f"{target} already holds another dataset (a run directory trains on one dataset); give "
                         "another run_dir")
    datasets.DatasetDict(splits).save_to_disk(str(target))
    stamp.write_text(json.dumps(fingerprints))
    return target


def _dataset_overrides(path: Path, has_eval: bool, dataset_kwargs: Optional[Mapping]) -> dict:
    """The `hf_dataset` task on a saved DatasetDict: split "train", held out "test" (else eval_size from kwargs)."""
    kwargs = {"path": str(path), "split": "train", **({"eval_split": "test"} if has_eval else {})}
    extra = dict(dataset_kwargs or {})
    clash = sorted(set(extra) & {"path", "split", "eval_split", "data_files"})
    if clash:
        raise ValueError(f"dataset_kwargs {clash} are set by the Python API (the saved dataset's path and splits); "
                         "drop them")
    return {"train.task": "hf_dataset", "train.task_kwargs": {**kwargs, **extra}}


# ---------------------------------------------------------------------------------------
# the verbs
def train(config: Union[PathLike, Sequence[PathLike]], overrides: Optional[Mapping[str, Any]] = None,
          run_dir: Optional[PathLike] = None, *, reward_funcs: Optional[Sequence[Union[str, Callable]]] = None,
          reward_weights: Optional[Sequence[float]] = None, train_dataset=None, eval_dataset=None,
          dataset_kwargs: Optional[Mapping[str, Any]] = None, gin: Sequence[str] = (), name: Optional[str] = None,
          progress: bool = False) -> Path:
    """`scalerl train CONFIG --gin ... --run-dir DIR` from Python; returns the run directory.

    config: gin file(s) or a recipe name ("tiny_cpu"); overrides: {"train.lr": 1e-3, ...} (a key without a
    dot is train.*), applied after `gin` (bindings as text); reward_funcs: callables or specs ("verifier", a
    registered name, "module:function") with reward_weights, as TRL's GRPOTrainer takes them; train_dataset:
    a `datasets.Dataset` of prompts (a "prompt" column of text or of conversations, "answer", ...; other
    column names through dataset_kwargs={"columns": {...}}), trained on by the `hf_dataset` task,
    eval_dataset its held-out set (else dataset_kwargs={"eval_size": N} splits one off). A run directory
    that exists is resumed (a done one returns at once). Bad settings raise before anything runs; a run
    that fails raises RunFailedError with its error."""
    from experiments.train import check_config, default_run_dir, run_training

    files = resolve_config(config)
    settings = dict(_reward_overrides(reward_funcs, reward_weights))
    if eval_dataset is not None and train_dataset is None:
        raise ValueError("eval_dataset needs a train_dataset (the held-out set of the same task)")
    if dataset_kwargs is not None and train_dataset is None:
        raise ValueError("dataset_kwargs configure the train_dataset's task; give a train_dataset")
    path = Path(run_dir) if run_dir is not None else default_run_dir(files)
    if train_dataset is not None:  # check the rest first: a refused config leaves no dataset behind
        settings.update(_dataset_overrides(path / DATASET_DIR, eval_dataset is not None, dataset_kwargs))
    bindings = [*gin, *bindings_of(settings), *bindings_of(overrides)]
    if train_dataset is not None:
        save_datasets(path, train_dataset, eval_dataset)
    check_config(files, bindings, read_data=False)  # the CLI's early refusal: no model, no data touched
    status = run_training(files, bindings, str(path), run_info={"name": name} if name else None, progress=progress,
                          record_invalid=False)
    if status != "done":
        error = _run_json(path).get("error") or f"see {path / 'error.txt'}"
        raise RunFailedError(f"run {path} failed: {error}")
    return path


def _run_json(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def _namespace(add_arguments: Callable, positional: Sequence[str], options: Mapping[str, Any], verb: str) -> argparse.Namespace:
    """The verb's arguments as its CLI parses them (its defaults), with `options` set by name; an unknown
    option is a TypeError naming the valid ones."""
    parser = argparse.ArgumentParser(prog=f"scalerl {verb}")
    add_arguments(parser)
    args = parser.parse_args([str(p) for p in positional])
    known = sorted(k for k in vars(args) if k not in ("runs", "spec", "model_or_run"))
    for key, value in options.items():
        if key not in vars(args):
            raise TypeError(f"scalerl.{verb}() got an unknown option {key!r}; valid: {known}")
        setattr(args, key, value)
    return args


def sweep(spec: PathLike, *, scale: str = "paper", executor: str = "local", runs: PathLike = "runs",
          dry_run: bool = False, **options) -> pd.DataFrame:
    """`scalerl sweep SPEC` from Python (executor "local" by default: runs here); returns its runs as
    `load_runs` does, or with dry_run=True the planned runs (name, action, reason, bindings). Other options
    are the CLI's (seeds=[0, 1], gin=[...], only=[...], retry_failed=True, partition="gpu", ...)."""
    from experiments import sweep_cli
    from experiments.run_state import plan

    args = _namespace(sweep_cli.add_arguments, [spec], {"scale": scale, "executor": executor, "runs": str(runs),
                                                        "dry_run": dry_run, **options}, "sweep")
    spec_obj, run_specs, _opts = sweep_cli.prepare(args)  # a bad spec raises its SweepError here, in words
    if dry_run:
        planned = plan(run_specs, Path(args.runs), retry_failed=args.retry_failed)
        return pd.DataFrame([{"sweep": spec_obj.name, "run": p.run.name, "action": p.action, "reason": p.reason,
                              "bindings": list(p.run.bindings)} for p in planned])
    rc = sweep_cli.main(args)
    if rc == 2:
        raise ValueError(f"scalerl sweep {spec}: refused (the reason is printed above)")
    frame = load_runs(Path(args.runs) / spec_obj.name)
    if rc != 0:
        failed = frame.loc[frame["status"] != "done", "run"].tolist() if len(frame) else []
        raise RunFailedError(f"sweep {spec_obj.name}: run(s) failed: {failed}")
    return frame


def _summaries(runs_dir: PathLike, add_arguments: Callable, options: Mapping[str, Any], verb: str):
    from analysis.cli import fit_kwargs
    from analysis.study import summarize

    args = _namespace(add_arguments, [runs_dir], options, verb)
    if getattr(args, "predict_boot", 0) is None:
        from analysis.scaling_law import PREDICT_BOOT

        args.predict_boot = PREDICT_BOOT
    if not Path(runs_dir).exists():
        raise FileNotFoundError(f"no such runs directory {os.fspath(runs_dir)!r}")
    return args, summarize(str(runs_dir), **fit_kwargs(args))


FIT_TABLES = ("runs", "configs", "claims", "pairs")


def fit(runs_dir: PathLike, *, what: str = "runs", **options) -> pd.DataFrame:
    """`scalerl fit RUNS` from Python: the sigmoid fits by the paper's protocol. what="runs" (default): one
    row per run (A, B, C_mid, A's profile interval, tail, rank, ...); "configs": per configuration over
    seeds; "claims": the paper's findings judged; "pairs": every pair compared. Options are the CLI's
    (compute="flops", min_compute="none", fraction=0.5, bootstrap=200, ...)."""
    from analysis.cli import add_fit_arguments, fit_tables, pairs_frame

    if what not in FIT_TABLES:
        raise ValueError(f"what = {what!r}; valid: {list(FIT_TABLES)}")
    _args, summaries = _summaries(runs_dir, add_fit_arguments, options, "fit")
    if what == "pairs":
        return pairs_frame(summaries, metric="all")
    runs, configs, claims = fit_tables(summaries) if summaries else (pd.DataFrame(),) * 3
    table = {"runs": runs, "configs": configs, "claims": claims}[what]
    return table.drop(columns=["fit"], errors="ignore")


def compare(runs_dir: PathLike, *, metric: str = "all", **options) -> pd.DataFrame:
    """`scalerl compare RUNS --json` from Python: one row per pair of configurations and metric (sweep, a, b,
    metric, delta = a - b, low, high, n, paired, identified, verdict: better | worse | equivalent |
    inconclusive, relative to a). metric: "A", "tail", "auc", "all" (default) or "both" (A and tail)."""
    from analysis.cli import add_compare_arguments, pairs_frame

    args, summaries = _summaries(runs_dir, add_compare_arguments, {"metric": metric, **options}, "compare")
    return pairs_frame(summaries, metric=args.metric)


def evaluate(model_or_run: PathLike, benchmarks: Sequence[Any] = (), *, imports: Sequence[str] = (),
             **options) -> pd.DataFrame:
    """`scalerl eval RUN_DIR [--benchmark ...]` from Python: one row per benchmark (mean@k, pass@k, the settings
    used), also appended to downstream.jsonl as the CLI does. With no benchmarks, the run's own held-out set.
    benchmarks: files / hub names or dicts ({"path": ..., "name": ...}); options are `run_eval`'s (k=4,
    limit=20, max_tokens=..., temperature=..., engine=..., step=..., out=..., dump=...)."""
    from experiments.evaluate import _import_user_modules, run_eval

    _import_user_modules(list(imports))  # --import: modules that register rewards / tasks
    records, _out = run_eval(os.fspath(model_or_run), list(benchmarks), **options)
    return pd.DataFrame.from_records(records)


def run_settings(run_dir: PathLike) -> dict:
    """Every binding of a run's config.gin (the operative config: train.* defaults included) as
    {"train.lr": 0.002, "cispo.eps_max": 4.0, ...}; references and macros as their text ("@warm_start()")."""
    from components.trainer.gin_config import text_bindings

    path = Path(run_dir) / "config.gin"
    return text_bindings(path.read_text()) if path.is_file() else {}


def load_runs(runs_dir: PathLike) -> pd.DataFrame:
    """One row per run under `runs_dir` (a run, a sweep or a directory of sweeps): run.json's fields, the
    summary metrics of `analysis.load_runs(what="runs")` (status, n_steps, step, flops, compute_hours,
    last_pass_rate, ...), best_pass_rate (the highest held-out pass rate), and every resolved setting of its
    config.gin as a column ("train.lr", "train.loss", ...)."""
    from analysis.runs import load_runs as analysis_load_runs

    if not Path(runs_dir).exists():
        raise FileNotFoundError(f"no such runs directory {os.fspath(runs_dir)!r}")
    table = analysis_load_runs(runs_dir, what="runs")
    if table.empty:
        return table
    evals = analysis_load_runs(runs_dir, what="eval")
    best = evals.groupby("path")["pass_rate"].max() if len(evals) else pd.Series(dtype=float)
    table["best_pass_rate"] = [best.get(p, float("nan")) for p in table["path"]]
    settings = [run_settings(p) for p in table["path"]]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    columns = {k: [s.get(k) for s in settings] for k in keys if k not in table}
    return pd.concat([table, pd.DataFrame(columns, index=table.index)], axis=1)

