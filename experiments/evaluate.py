"""`scalerl eval RUN_DIR` (the run's held-out set) or `scalerl eval MODEL_OR_RUN_DIR --benchmark FILE [...]`.

Without --benchmark, a run directory is evaluated on its own task's held-out set, exactly as the
trainer's held-out evaluation samples it: the run's task (train.task, train.task_kwargs, its
bindings and seed, so the same split), train.eval_prompts of its held-out prompts, train.eval_k
samples each, and the run's sampling settings (below, train.top_k / min_p / repetition_penalty
included); graded by the task's own verifier. The modules the run's gin imported (run.json
"user_modules": `import my_losses`) are imported from where the run found them, so this works
from any working directory while their files are where they were.

Evaluates a policy on downstream benchmarks (`components.benchmarks`: any `datasets` source,
math graded by math-verify after ``</think>``, code by its tests in the sandbox) and reports,
per benchmark, mean@k and the unbiased pass@k (Chen et al. 2021) for k = 1, 2, 4, ... K.

MODEL_OR_RUN_DIR is
- a model directory (``save_pretrained``: config.json, weights, tokenizer), or
- a run directory: its ``final/`` policy when there is one, else (or with ``--step N``) the
  newest (or step N) checkpoint, exported to a temporary directory by `components.trainer.export`.

A run directory is evaluated with the run's own settings, read from its config.gin (`eval_settings`):
the completion budget (train.max_tokens) and length control (train.length_control, e.g. forced
interruptions, with the run's bindings), the precision (train.precision), the sampling
temperature (train.eval_temperature, else train.temperature) and top_p, and the prompt format of
its task (its prompt_template with the problem in place of its placeholder, e.g. "{problem}=" for
arithmetic's "{expr}=", and its system_prompt); the chat template is the one stored with the
policy. A flag overrides each (``--length-control none`` turns the run's off); a model directory
gets `DEFAULTS`. The settings used are printed, each marked [run], [flag] or [default], and
stored in every record. ``--dump FILE`` writes every completion as a JSON line (`DUMP_FIELDS`).

The records are printed as a table and appended, one JSON line per benchmark, to
``RUN_DIR/downstream.jsonl`` (a run) or ``MODEL_DIR/downstream.jsonl`` (a model), or to
``--out FILE``. A line holds the `evaluate_benchmark` record (benchmark, k, prompts, mean@k,
pass@k, entropy, ...) plus model, step and compute_hours (when known), engine, sampling
settings and the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

__all__ = ["resolve_model", "run_eval", "eval_settings", "describe_settings", "format_table", "add_arguments", "main",
           "EvalInputError", "EvalSettings", "DEFAULTS", "HeldOut", "import_run_modules", "HELD_OUT"]

from experiments.eval_run_settings import (EvalInputError, HeldOut, build_held_out, import_run_modules,
                                          read_run_config)

log = logging.getLogger("scalerl.eval")

DOWNSTREAM_FILE = "downstream.jsonl"
FINAL_DIR = "final"


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file()


def _is_run_dir(p: Path) -> bool:
    return any((p / f).exists() for f in ("run.json", "checkpoints", "metrics.jsonl", FINAL_DIR))


@contextmanager
def resolve_model(path: str | Path, step: Optional[int] = None) -> Iterator[dict]:
    """Yields {"model": dir to load, "run_dir": run dir or None, "step": int or None, "checkpoint": str or None}.

    A run's checkpoint (no ``final/``, or ``step`` given) is exported to a temporary directory,
    removed when the context exits.
    """
    p = Path(path).expanduser()
    from components.models import ModelPathError, looks_local, resolve_model_path

    if not looks_local(str(path)):  # a Hugging Face hub id: its snapshot in the HF cache (downloaded unless cached)
        try:
            p = Path(resolve_model_path(str(path)))
        except ModelPathError as err:
            raise EvalInputError(str(err)) from None
    if not p.is_dir():
        raise EvalInputError(f"{str(path)!r} is not a directory: give a model directory (save_pretrained) or a run directory")
    if _is_model_dir(p):
        if step is not None:
            raise EvalInputError(f"--step applies to a run directory; {p} is a model directory")
        yield {"model": p.resolve(), "run_dir": None, "step": None, "checkpoint": None}
        return
    if not _is_run_dir(p):
        raise EvalInputError(f"{p} is neither a model directory (no config.json) nor a run directory "
                             f"(no run.json, checkpoints/ or {FINAL_DIR}/)")
    final = p / FINAL_DIR
    if step is None and _is_model_dir(final):
        yield {"model": final.resolve(), "run_dir": p.resolve(), "step": _final_step(p), "checkpoint": None}
        return
    from components.trainer.export import ExportError, export_policy, resolve_checkpoint

    try:
        ckpt = resolve_checkpoint(p, step)
    except ExportError as err:
        raise EvalInputError(f"{p} has no {FINAL_DIR}/ policy to evaluate and no usable checkpoint: {err}") from err
    tmp = Path(tempfile.mkdtemp(prefix=".scalerl-eval-", dir=p))
    try:
        out = export_policy(ckpt, tmp / "policy")
        yield {"model": out, "run_dir": p.resolve(), "step": _checkpoint_step(ckpt), "checkpoint": str(ckpt)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checkpoint_step(ckpt: Path) -> Optional[int]:
    try:
        from components.trainer.checkpoint import read_checkpoint_info

        return int(read_checkpoint_info(ckpt)["step"])
    except Exception:  # noqa: BLE001 - the step is informative only
        return None


def _final_step(run_dir: Path) -> Optional[int]:
    """The step final/ was written at: the newest checkpoint's step, else the last metrics step."""
    try:
        from components.trainer.export import resolve_checkpoint

        return _checkpoint_step(resolve_checkpoint(run_dir))
    except Exception:  # noqa: BLE001
        pass
    last = _metrics_rows(run_dir)
    return int(last[-1]["step"]) if last and "step" in last[-1] else None


def _metrics_rows(run_dir: Path) -> list[dict]:
    from components.trainer.runlog import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl")


def _compute_at(run_dir: Optional[Path], step: Optional[int]) -> dict:
    """compute_hours and flops logged at `step` in the run's metrics.jsonl (empty when unknown)."""
    if run_dir is None or step is None:
        return {}
    for row in reversed(_metrics_rows(run_dir)):
        if row.get("step") == step:
            return {k: row[k] for k in ("compute_hours", "flops") if k in row}
    return {}


# ---------------------------------------------------------------------------------------------
# the settings of an evaluation: a run's own unless a flag says otherwise

# What `scalerl eval` samples and prompts with, and each one's value for a model directory (and
# for a run directory without a config.gin). For a run directory each comes from the run's
# config.gin: train.engine, train.max_tokens, train.eval_temperature (else train.temperature),
# train.top_p, train.top_k, train.min_p, train.repetition_penalty, train.precision, train.length_control (built with the run's bindings, e.g.
# interruption.*) and the prompt format of train.task (its prompt_template and system_prompt).
DEFAULTS = {"engine": "torch", "max_tokens": 1024, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "repetition_penalty": 1.0, "precision": "fp32", "length_control": None, "prompt_template": None,
            "system_prompt": None}
HELD_OUT = "held_out"  # the benchmark name of a run's held-out set in downstream.jsonl
NO_LENGTH_CONTROL = "none"
# the placeholder of a task's prompt_template, in the order they are looked for (arithmetic: {expr},
# hf_dataset: {prompt}, math_file / code_file: {problem})


@dataclass
class EvalSettings:
    """The settings one evaluation uses, where each came from, and the built length control."""

    values: dict  # setting -> value (length_control: its registered name, or None)
    source: dict  # setting -> "flag", "run" or "default"
    length_control: Any = None  # the LENGTH_CONTROLS object (None: plain truncation at max_tokens)
    config: Optional[str] = None  # the run's config.gin the run's values were read from
    notes: list = dataclasses.field(default_factory=list)
    held_out: Any = None  # `HeldOut`: the run's task and held-out problems (an evaluation without --benchmark)

    def record(self) -> dict:
        """The fields each downstream.jsonl line carries (`describe_settings` prints them)."""
        cap = None
        if self.length_control is not None and hasattr(self.length_control, "max_tokens"):
            cap = int(self.length_control.max_tokens(int(self.values["max_tokens"])))
        return {**{k: v for k, v in self.values.items() if k != "length_control"},
                "length_control": repr(self.length_control) if self.length_control is not None else None,
                "sampled_token_cap": cap if cap is not None else int(self.values["max_tokens"]),
                "settings_from": dict(self.source), "run_config": self.config, "settings_notes": list(self.notes)}


def describe_settings(record: Mapping) -> str:
    """What an evaluation sampled and prompted with, one setting a line, each with where it came
    from: [run] (the run's config.gin), [flag] or [default]."""
    where = record.get("run_config")
    lines = [f"settings ({'from ' + where if where else 'defaults'}, unless a flag is given):"]
    for name in DEFAULTS:
        value = record.get(name)
        shown = value if name == "length_control" and value is not None else repr(value)
        lines.append(f"  {name:<15} {shown}  [{record.get('settings_from', {}).get(name, '?')}]")
    cap = record.get("sampled_token_cap")
    if cap is not None and record.get("max_tokens") is not None and cap != record["max_tokens"]:
        lines.append(f"  (the length control caps the sampled tokens at {cap})")
    lines += [f"note: {n}" for n in record.get("settings_notes") or ()]
    return "\n".join(lines)


def local_run_dir(path: str | Path) -> Optional[Path]:
    """`path` when it is a run directory on this machine (not a model directory), else None."""
    p = Path(path).expanduser()
    return p if p.is_dir() and not _is_model_dir(p) and _is_run_dir(p) else None


def _check_choice(registry: Any, name: str, flag: str) -> None:
    try:
        registry.check(name)
    except KeyError as err:  # UnknownComponentError: names the registered ones and the closest
        raise EvalInputError(f"{flag} {name!r}: {err.args[0] if err.args else err}") from None


def eval_settings(run_dir: Optional[Path], flags: Mapping[str, Any], *, held_out: bool = False,
                  k: Optional[int] = None, limit: Optional[int] = None) -> EvalSettings:
    """The settings of an evaluation: each flag that is not None, else the run's (its config.gin),
    else `DEFAULTS`. The length control is built here, with the run's bindings where there is a run.
    `held_out`: also build the run's task and its held-out problems (`HeldOut`: k = `k` or
    train.eval_k, the first `limit` or train.eval_prompts problems); the engine is then the one the
    run evaluated with (train.eval_engine, else train.engine)."""
    import gin

    from components.registry import LENGTH_CONTROLS, PRECISIONS

    flags = {k: v for k, v in flags.items() if v is not None}
    unknown = sorted(set(flags) - set(DEFAULTS))
    if unknown:
        raise EvalInputError(f"unknown evaluation setting(s) {unknown}; known: {list(DEFAULTS)}")
    if "precision" in flags:
        _check_choice(PRECISIONS, flags["precision"], "--precision")
    if flags.get("length_control") == NO_LENGTH_CONTROL:
        flags["length_control"] = ""
    elif "length_control" in flags:
        _check_choice(LENGTH_CONTROLS, flags["length_control"], "--length-control")
    config = run_dir.resolve() / "config.gin" if run_dir is not None else None
    notes = []
    parsed = config is not None and config.is_file()
    if held_out and not parsed:
        raise EvalInputError(f"{run_dir} has no config.gin: its held-out set cannot be rebuilt; give --benchmark FILE")
    held = None
    try:
        if parsed:
            notes += import_run_modules(run_dir.resolve())
            run_values, cfg = read_run_config(config)
            if "_note" in run_values:
                notes.append(run_values.pop("_note"))
            if held_out:
                held = build_held_out(cfg, k, limit)
                run_values["engine"] = cfg.eval_engine or cfg.engine  # what the run's own evaluations used
                notes.append(f"held-out set of train.task = {cfg.task!r}: {len(held.problems)} of its {held.total} "
                             f"prompts (train.eval_prompts = {cfg.eval_prompts}"
                             + (f", --limit {limit}" if limit is not None else "") + f"), k = {held.k} "
                             f"({'--k' if k is not None else 'train.eval_k'}), graded by the task's verifier")
        else:
            run_values = {}
            if run_dir is not None:
                notes.append(f"{run_dir} has no config.gin: the defaults of a model directory are used")
        values, source = {}, {}
        for name, default in DEFAULTS.items():
            if name in flags:
                values[name], source[name] = flags[name], "flag"
            elif name in run_values:
                values[name], source[name] = run_values[name], "run"
            else:
                values[name], source[name] = default, "default"
        values["length_control"] = values["length_control"] or None
        if held is not None:  # the task's own problems, rendered as in training (template, system prompt, chat)
            for key in ("prompt_template", "system_prompt"):
                values[key], source[key] = None, "task"
        control = None
        if values["length_control"]:
            try:  # under the run's bindings (interruption.thinking_min, ...), which are live here
                control = LENGTH_CONTROLS.get(values["length_control"])()
            except Exception as err:  # noqa: BLE001 - a component's own check
                raise EvalInputError(f"length control {values['length_control']!r}: {type(err).__name__}: {err}") from None
    finally:
        if parsed:
            gin.clear_config()
    return EvalSettings(values, source, control, str(config) if parsed else None, notes, held)


def benchmark_specs(args: argparse.Namespace) -> list:
    """One spec dict per --benchmark, with the shared column / split / grader options (the prompt
    format, --prompt-template and --system-prompt, is a setting of `run_eval`)."""
    shared = {
        "split": args.split, "grader": args.grader, "prompt_column": args.prompt_column,
        "answer_column": args.answer_column, "tests_column": args.tests_column,
        "limit": args.limit, "reward": args.reward, "pass_threshold": args.pass_threshold,
    }
    shared = {k: v for k, v in shared.items() if v is not None}
    specs = []
    for b in args.benchmark or ():
        spec = {"path": b, **shared}
        if args.allow_unsafe:
            spec["allow_unsafe"] = True
        specs.append(spec)
    return specs


def _check_eval_numbers(*, k, max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, step, limit,
                        benchmarks) -> None:
    """`run_eval`'s numeric arguments in range (None: not given), each refused naming its flag."""
    if k is not None and int(k) < 1:
        raise EvalInputError(f"--k must be >= 1, got {k}")
    if max_tokens is not None and int(max_tokens) < 1:
        raise EvalInputError(f"--max-tokens must be >= 1, got {max_tokens}")
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise EvalInputError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise EvalInputError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k is not None and int(top_k) < 0:
        raise EvalInputError(f"--top-k must be >= 0 (0: off), got {top_k}")
    if min_p is not None and not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise EvalInputError(f"--min-p must be in [0, 1] (0: off), got {min_p}")
    if repetition_penalty is not None and not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise EvalInputError(f"--repetition-penalty must be > 0 (1: off), got {repetition_penalty}")
    if step is not None and int(step) < 0:
        raise EvalInputError(f"--step must be >= 0, got {step}")
    if limit is not None and int(limit) < 1:
        raise EvalInputError(f"--limit must be >= 1, got {limit}")
    for spec in benchmarks:
        threshold = spec.get("pass_threshold") if isinstance(spec, Mapping) else None
        if threshold is not None and not math.isfinite(float(threshold)):
            raise EvalInputError(f"--pass-threshold must be a finite number, got {threshold}")


def _checked_engine(settings: EvalSettings) -> str:
    """The engine the settings name, once it is known to be installed (else EvalInputError)."""
    from components.engines import check_engine

    engine = settings.values["engine"]
    try:
        check_engine(engine)
    except (ImportError, KeyError) as err:
        why = str(err.args[0] if isinstance(err, KeyError) and err.args else err)
        if settings.source["engine"] == "run":
            why += f" (the run generated with train.engine = {engine!r}; --engine torch evaluates it with the torch engine)"
        raise EvalInputError(why) from None
    return engine


def _append_records(out_path: Path, records: Sequence[dict]) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a") as f:
        for rec in records:
            f.write(json.dumps(_finite(rec)) + "\n")


def run_eval(model_or_run: str | Path, benchmarks: Sequence = (), *, k: Optional[int] = None,
             engine: Optional[str] = None, max_tokens: Optional[int] = None, temperature: Optional[float] = None,
             top_p: Optional[float] = None, top_k: Optional[int] = None, min_p: Optional[float] = None,
             repetition_penalty: Optional[float] = None, seed: int = 0, device: str = "auto",
             precision: Optional[str] = None, step: Optional[int] = None, out: Optional[str | Path] = None,
             length_control: Optional[str] = None, prompt_template: Optional[str] = None,
             system_prompt: Optional[str] = None, dump: Optional[str | Path] = None,
             limit: Optional[int] = None) -> tuple[list[dict], Path]:
    """Evaluate; returns (records, the JSONL file they were appended to). Bad input raises before any sampling.

    `benchmarks` empty: a run directory's own held-out set (`HeldOut`: its task, train.eval_prompts
    prompts or `limit`, train.eval_k samples or `k`), one record named "held_out" with per-task pass
    rates. Else each benchmark, `k` samples per problem (default 16).
    A setting left None is the run's own (a run directory's config.gin, `eval_settings`), else
    `DEFAULTS`; `length_control="none"` turns a run's length control off. A benchmark spec's own
    prompt_template / system_prompt wins over both. `dump`: a JSONL file that gets one line per
    completion (`DUMP_FIELDS`). Each record carries the settings used and where each came from.
    """
    from components.benchmarks import Benchmark, load_benchmarks
    from components.engines import make_engine
    from components.models import load_tokenizer
    from components.trainer.evaluation import downstream_seed, evaluate_benchmark
    from components.trainer.runlog import now_iso

    _check_eval_numbers(k=k, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        repetition_penalty=repetition_penalty, step=step, limit=limit, benchmarks=benchmarks)
    run_dir = local_run_dir(model_or_run)
    held_out = not benchmarks
    if held_out and run_dir is None:
        raise EvalInputError(f"{model_or_run}: give --benchmark FILE (without it, a RUN directory is evaluated on its own "
                             "held-out set; this is not a run directory)")
    if held_out and (prompt_template is not None or system_prompt is not None):
        raise EvalInputError("--prompt-template and --system-prompt format benchmark problems; the run's held-out set is "
                             "rendered as the run rendered it (add --benchmark FILE to use them)")
    flags = {"engine": engine, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
             "min_p": min_p, "repetition_penalty": repetition_penalty, "precision": precision,
             "length_control": length_control, "prompt_template": prompt_template, "system_prompt": system_prompt}
    settings = eval_settings(run_dir, flags, held_out=held_out, k=k, limit=limit)
    engine = _checked_engine(settings)
    if run_dir is not None and step is not None:
        _check_step(run_dir, int(step))
    held = settings.held_out
    if held is not None:
        loaded = [Benchmark(name=HELD_OUT, problems=held.problems, task=held.task,
                            source=f"{run_dir / 'config.gin'}: train.task = {held.spec!r}", grader="task")]
        k = held.k
    else:
        fmt = {key: settings.values[key] for key in ("prompt_template", "system_prompt") if settings.values[key] is not None}
        specs = [{**fmt, **({"path": str(b)} if isinstance(b, (str, Path)) else dict(b))} for b in benchmarks]
        loaded = load_benchmarks(specs)  # file / column / grader errors before the model loads
        k = 16 if k is None else int(k)
    max_tokens, temperature, top_p, precision = (settings.values[key] for key in ("max_tokens", "temperature", "top_p",
                                                                                  "precision"))
    knobs = {"top_k": int(settings.values["top_k"]), "min_p": float(settings.values["min_p"]),
             "repetition_penalty": float(settings.values["repetition_penalty"])}
    if held is not None:
        knobs["max_prompt_length"] = held.max_prompt_length  # as the run's own evaluations refuse a longer prompt
    timeout = {"verifier_timeout_s": held.verifier_timeout_s} if held is not None else {}
    dump_path = _dump_path(dump)
    with resolve_model(model_or_run, step) as where:
        model_dir, run_dir = Path(where["model"]), where["run_dir"]
        out_path = Path(out) if out is not None else (run_dir or model_dir) / DOWNSTREAM_FILE
        dev = _device(device)
        tokenizer = load_tokenizer(model_dir)
        eng = make_engine(engine, str(model_dir), precision=precision, device=dev, seed=seed)
        records = []
        dump_file = None
        try:
            dump_file = open(dump_path, "w") if dump_path is not None else None
            for i, bench in enumerate(loaded):
                hooks = []
                if dump_file is not None:
                    hooks.append(_dump_writer(dump_file, bench, tokenizer, where["step"]))
                per_task: dict = {}
                if held is not None:
                    hooks.append(_per_task_counter(per_task, str(held.spec)))
                on_sample = _all_hooks(hooks) if hooks else None
                rec = evaluate_benchmark(eng, bench, tokenizer, k=k, seed=downstream_seed(seed, 0, i),
                                         temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                         length_control=settings.length_control, on_sample=on_sample, **timeout, **knobs)
                if held is not None:
                    rec["per_task"] = {name: c / n for name, (c, n) in sorted(per_task.items())}
                    rec["task"] = held.spec
                records.append({
                    **rec,
                    "model": str(model_dir) if where["checkpoint"] is None else None,  # a temporary export has no lasting path
                    "run_dir": str(run_dir) if run_dir is not None else None,
                    "checkpoint": where["checkpoint"],
                    "step": where["step"],
                    **_compute_at(run_dir, where["step"]),
                    **settings.record(), "seed": seed, "time": now_iso(),
                })
        finally:
            eng.close()
            if dump_file is not None:
                dump_file.close()
    _append_records(out_path, records)
    return records, out_path


def _per_task_counter(counts: dict, default: str):
    """An `on_sample` hook counting each problem's task's (passed, samples) into `counts` (a mixture's
    problems name their member in meta["task"])."""

    def on_sample(i, j, problem, prompt_ids, completion, text, verdict) -> None:
        name = str((problem.meta or {}).get("task", default))
        c, n = counts.get(name, (0, 0))
        counts[name] = (c + bool(verdict.passed), n + 1)

    return on_sample


def _all_hooks(hooks: Sequence):
    def on_sample(*args) -> None:
        for hook in hooks:
            hook(*args)

    return on_sample


def _check_step(run_dir: Path, step: int) -> None:
    """--step N of a run: its checkpoint of step N must exist; else the error names the steps there are."""
    from components.trainer.checkpoint import checkpoint_steps

    steps = list(checkpoint_steps(run_dir / "checkpoints"))
    if step in steps:
        return
    have = f"checkpoints of steps {', '.join(map(str, steps))}" if steps else "no complete checkpoint"
    final = ""
    if _is_model_dir(run_dir / FINAL_DIR):
        at = _final_step(run_dir)
        final = f"; its {FINAL_DIR}/ policy{f' (step {at})' if at is not None else ''} is evaluated without --step"
    raise EvalInputError(f"--step {step}: {run_dir} has no checkpoint of step {step}; it has {have}{final}")


# the fields of one --dump line
DUMP_FIELDS = ("benchmark", "problem_index", "sample_index", "problem_id", "prompt", "rendered_prompt", "completion",
               "answer", "passed", "reward", "error", "finish_reason", "completion_tokens", "forced_tokens", "step")


def _dump_path(dump: Optional[str | Path]) -> Optional[Path]:
    """The --dump file (its directory made), checked before the model loads."""
    if dump is None:
        return None
    path = Path(dump).expanduser()
    if path.is_dir():
        raise EvalInputError(f"--dump {dump}: is a directory; give a file (one JSON line per completion)")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _dump_writer(f, bench, tokenizer, step: Optional[int]):
    """The `on_sample` hook writing one JSON line (DUMP_FIELDS) per graded completion to `f`."""

    def on_sample(i, j, problem, prompt_ids, completion, text, verdict) -> None:
        forced = sum(bool(x) for x in completion.forced)
        row = {
            "benchmark": bench.name, "problem_index": int(i), "sample_index": int(j), "problem_id": problem.id,
            "prompt": problem.prompt, "rendered_prompt": tokenizer.decode(list(prompt_ids), skip_special_tokens=False),
            "completion": text, "answer": problem.answer, "passed": bool(verdict.passed),
            "reward": float(verdict.reward) if verdict.reward is not None else None, "error": verdict.error,
            "finish_reason": completion.finish_reason, "completion_tokens": len(completion.token_ids),
            "forced_tokens": forced, "step": step,
        }
        f.write(json.dumps(_finite(row), default=str) + "\n")

    return on_sample


def _finite(rec: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def _device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not str(device).startswith("cuda"):
        raise EvalInputError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device


def format_table(records: Sequence[dict]) -> str:
    """A fixed-width table: benchmark, prompts, k, mean@k, pass@1 .. pass@K."""
    ks = sorted({int(k) for r in records for k in r["pass@k"]})
    head = ["benchmark", "prompts", "k", "mean@k"] + [f"pass@{k}" for k in ks]
    rows = [[r["benchmark"], str(r["prompts"]), str(r["k"]), f"{r['mean@k']:.4f}"]
            + [f"{r['pass@k'][str(k)]:.4f}" if str(k) in r["pass@k"] else "" for k in ks] for r in records]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


# ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_or_run", metavar="MODEL_OR_RUN_DIR",
                        help="a model directory (save_pretrained) or a run directory (its final/ policy, else its newest "
                             "checkpoint); a run directory without --benchmark is evaluated on its own held-out set")
    parser.add_argument("--benchmark", action="append", default=[], metavar="FILE",
                        help="a benchmark: local jsonl / json / parquet / csv / arrow file or a datasets hub name "
                             "(repeatable); none: the run's own held-out set, with its train.eval_k and train.eval_prompts")
    parser.add_argument("--k", type=int, default=None, help="samples per problem; pass@k for k = 1, 2, 4, ... K (default: "
                        "16 for a benchmark, the run's train.eval_k for its held-out set)")
    parser.add_argument("--engine", default=None, help="generation engine: torch or vllm (default: a run's train.engine, "
                        "else torch)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="completion budget per sample (default: a run's train.max_tokens, else 1024)")
    parser.add_argument("--length-control", default=None, metavar="NAME|none",
                        help="length control, e.g. interruption (default: a run's train.length_control with its "
                             "bindings, else none); none turns a run's off")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature, 0: greedy (default: a run's train.eval_temperature, else its "
                             "train.temperature, else 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: a run's train.top_p, else 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens, 0: off (default: a "
                        "run's train.top_k, else 0)")
    parser.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the most likely one, 0: off "
                        "(default: a run's train.min_p, else 0)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeated tokens, 1: off "
                        "(default: a run's train.repetition_penalty, else 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument("--precision", default=None,
                        help="precision policy of the engine (default: a run's train.precision, else fp32)")
    parser.add_argument("--step", type=int, default=None, help="run directory: evaluate the checkpoint of this step instead of final/")
    parser.add_argument("--dump", default=None, metavar="FILE",
                        help="write every completion to FILE, one JSON line each: benchmark, problem_index, "
                             "sample_index, prompt, completion, answer, passed, reward, ...")
    parser.add_argument("--out", default=None, help=f"JSONL file to append to (default RUN_DIR/{DOWNSTREAM_FILE} or MODEL_DIR/{DOWNSTREAM_FILE})")
    parser.add_argument("--split", default=None, help="dataset split (default: train for files, test for hub datasets)")
    parser.add_argument("--grader", default=None, choices=["auto", "math", "code", "reward"],
                        help="auto (default): reward when --reward is given, code when a tests column exists, else math")
    parser.add_argument("--reward", default=None, metavar="NAME",
                        help="grade with a plain-function reward registered in REWARDS (see --import)")
    parser.add_argument("--pass-threshold", type=float, default=None, help="a float reward passes iff >= this (default 1.0)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import a module first (e.g. your file registering a reward), from the working directory")
    parser.add_argument("--prompt-column", default=None, help="column with the problem (default: problem, question or prompt)")
    parser.add_argument("--answer-column", default=None, help="column with the gold answer (math; default: answer)")
    parser.add_argument("--tests-column", default=None, help="column with the unit tests (code; default: tests, test or input_output)")
    parser.add_argument("--system-prompt", default=None,
                        help="system message put before every problem (default: a run's task's system_prompt, else none)")
    parser.add_argument("--prompt-template", default=None,
                        help="the user message, with {problem} (default: a run's own prompt format, e.g. '{problem}=' "
                             "for arithmetic's '{expr}='; else the problem + a \\boxed{} instruction for math)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N problems of each benchmark (or of "
                        "the run's held-out set, instead of its train.eval_prompts)")
    parser.add_argument("--allow-unsafe", action="store_true",
                        help="code: run programs as this user where the sandbox cannot drop privileges (see components/tasks/README.md)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON lines instead of a table")


def _import_user_modules(names: Sequence[str]) -> None:
    import importlib
    import os

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise EvalInputError(f"--import {name}: {err}") from err


# the flags that shape how a benchmark file is read and graded (not the run's held-out set)
BENCHMARK_ONLY_FLAGS = {"split": "--split", "grader": "--grader", "reward": "--reward", "pass_threshold": "--pass-threshold",
                        "prompt_column": "--prompt-column", "answer_column": "--answer-column",
                        "tests_column": "--tests-column", "allow_unsafe": "--allow-unsafe"}


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        held_out = not args.benchmark
        given = [flag for key, flag in BENCHMARK_ONLY_FLAGS.items() if getattr(args, key, None) not in (None, False)]
        if held_out and given:
            raise EvalInputError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --benchmark files; "
                                 "without --benchmark the run's held-out set is graded by its own task")
        _import_user_modules(args.imports)
        records, out = run_eval(
            args.model_or_run, benchmark_specs(args), k=args.k, engine=args.engine, max_tokens=args.max_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, seed=args.seed, device=args.device,
            precision=args.precision, step=args.step, out=args.out, length_control=args.length_control,
            prompt_template=args.prompt_template, system_prompt=args.system_prompt, dump=args.dump,
            limit=args.limit if held_out else None,
        )
    except (EvalInputError, ValueError, OSError, RuntimeError, KeyError) as err:
        # KeyError: a registry's unknown name (UnknownComponentError), e.g. --reward, with the names there are
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"scalerl eval: error: {type(err).__name__}: {msg}", file=sys.stderr)
        return 2
    if records:
        print(describe_settings(records[0]), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        for r in records:
            print(json.dumps(_finite(r)))
    else:
        print(format_table(records))
        for r in records:
            if len(r.get("per_task") or {}) > 1:
                print(f"{r['benchmark']} per task: " + ", ".join(f"{t} {v:.4f}" for t, v in r["per_task"].items()))
    if args.dump:
        print(f"wrote every completion to {args.dump}", file=sys.stderr if args.json else sys.stdout)
    print(f"appended {len(records)} record(s) to {out}", file=sys.stderr if args.json else sys.stdout)
    return 0
