"""`scalerl eval MODEL_OR_RUN_DIR --benchmark FILE [--benchmark FILE2 ...] [--k 16] [--engine torch|vllm]`.

Evaluates a policy on downstream benchmarks (`components.benchmarks`: any `datasets` source,
math graded by math-verify after ``</think>``, code by its tests in the sandbox) and reports,
per benchmark, mean@k and the unbiased pass@k (Chen et al. 2021) for k = 1, 2, 4, ... K.

MODEL_OR_RUN_DIR is
- a model directory (``save_pretrained``: config.json, weights, tokenizer), or
- a run directory: its ``final/`` policy when there is one, else (or with ``--step N``) the
  newest (or step N) checkpoint, exported to a temporary directory by `components.trainer.export`.

The records are printed as a table and appended, one JSON line per benchmark, to
``RUN_DIR/downstream.jsonl`` (a run) or ``MODEL_DIR/downstream.jsonl`` (a model), or to
``--out FILE``. A line holds the `evaluate_benchmark` record (benchmark, k, prompts, mean@k,
pass@k, entropy, ...) plus model, step and compute_hours (when known), engine, sampling
settings and the time.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

__all__ = ["resolve_model", "run_eval", "format_table", "add_arguments", "main", "EvalInputError"]

log = logging.getLogger("scalerl.eval")

DOWNSTREAM_FILE = "downstream.jsonl"
FINAL_DIR = "final"


class EvalInputError(ValueError):
    """Bad input to `scalerl eval` (no such model, nothing to evaluate in a run, bad option)."""


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


def benchmark_specs(args: argparse.Namespace) -> list:
    """One spec dict per --benchmark, with the shared column / split / grader options."""
    shared = {
        "split": args.split, "grader": args.grader, "prompt_column": args.prompt_column,
        "answer_column": args.answer_column, "tests_column": args.tests_column,
        "system_prompt": args.system_prompt, "limit": args.limit, "reward": args.reward,
        "pass_threshold": args.pass_threshold, "prompt_template": args.prompt_template,
    }
    shared = {k: v for k, v in shared.items() if v is not None}
    specs = []
    for b in args.benchmark:
        spec = {"path": b, **shared}
        if args.allow_unsafe:
            spec["allow_unsafe"] = True
        specs.append(spec)
    return specs


def run_eval(model_or_run: str | Path, benchmarks: Sequence, *, k: int = 16, engine: str = "torch",
             max_tokens: int = 1024, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, device: str = "auto",
             precision: str = "fp32", step: Optional[int] = None, out: Optional[str | Path] = None) -> tuple[list[dict], Path]:
    """Evaluate; returns (records, the JSONL file they were appended to). Bad input raises before any sampling."""
    from components.benchmarks import load_benchmarks
    from components.engines import check_engine, make_engine
    from components.models import load_tokenizer
    from components.trainer.evaluation import downstream_seed, evaluate_benchmark
    from components.trainer.runlog import now_iso

    if int(k) < 1:
        raise EvalInputError(f"--k must be >= 1, got {k}")
    if int(max_tokens) < 1:
        raise EvalInputError(f"--max-tokens must be >= 1, got {max_tokens}")
    if temperature <= 0 or not 0 < top_p <= 1:
        raise EvalInputError(f"need --temperature > 0 and 0 < --top-p <= 1, got {temperature} and {top_p}")
    if not benchmarks:
        raise EvalInputError("give at least one --benchmark")
    try:
        check_engine(engine)
    except (ImportError, KeyError) as err:
        raise EvalInputError(str(err)) from None
    loaded = load_benchmarks(benchmarks)  # file / column / grader errors before the model loads
    with resolve_model(model_or_run, step) as where:
        model_dir, run_dir = Path(where["model"]), where["run_dir"]
        out_path = Path(out) if out is not None else (run_dir or model_dir) / DOWNSTREAM_FILE
        dev = _device(device)
        tokenizer = load_tokenizer(model_dir)
        eng = make_engine(engine, str(model_dir), precision=precision, device=dev, seed=seed)
        records = []
        try:
            for i, bench in enumerate(loaded):
                rec = evaluate_benchmark(eng, bench, tokenizer, k=k, seed=downstream_seed(seed, 0, i),
                                         temperature=temperature, top_p=top_p, max_tokens=max_tokens)
                records.append({
                    **rec,
                    "model": str(model_dir) if where["checkpoint"] is None else None,  # a temporary export has no lasting path
                    "run_dir": str(run_dir) if run_dir is not None else None,
                    "checkpoint": where["checkpoint"],
                    "step": where["step"],
                    **_compute_at(run_dir, where["step"]),
                    "engine": engine, "precision": precision, "temperature": temperature, "top_p": top_p,
                    "max_tokens": max_tokens, "seed": seed, "time": now_iso(),
                })
        finally:
            eng.close()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a") as f:
        for rec in records:
            f.write(json.dumps(_finite(rec)) + "\n")
    return records, out_path


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
                        help="a model directory (save_pretrained) or a run directory (its final/ policy, else its newest checkpoint)")
    parser.add_argument("--benchmark", action="append", required=True, metavar="FILE",
                        help="a benchmark: local jsonl / json / parquet / csv / arrow file or a datasets hub name (repeatable)")
    parser.add_argument("--k", type=int, default=16, help="samples per problem; pass@k for k = 1, 2, 4, ... K (default 16)")
    parser.add_argument("--engine", default="torch", help="generation engine: torch or vllm (default torch)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="completion budget per sample (default 1024)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument("--precision", default="fp32", help="precision policy of the engine (default fp32)")
    parser.add_argument("--step", type=int, default=None, help="run directory: evaluate the checkpoint of this step instead of final/")
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
    parser.add_argument("--system-prompt", default=None, help="system message put before every problem")
    parser.add_argument("--prompt-template", default=None,
                        help="the user message, with {problem} (default: the problem + a \\boxed{} instruction for math)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N problems of each benchmark")
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


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        _import_user_modules(args.imports)
        records, out = run_eval(
            args.model_or_run, benchmark_specs(args), k=args.k, engine=args.engine, max_tokens=args.max_tokens,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed, device=args.device,
            precision=args.precision, step=args.step, out=args.out,
        )
    except (EvalInputError, ValueError, OSError, RuntimeError) as err:
        print(f"scalerl eval: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.json:
        for r in records:
            print(json.dumps(_finite(r)))
    else:
        print(format_table(records))
    print(f"appended {len(records)} record(s) to {out}", file=sys.stderr if args.json else sys.stdout)
    return 0
