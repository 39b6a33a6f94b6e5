"""Experiment trackers (W&B, TensorBoard, MLflow) mirroring the run directory's JSONL logs.

The run directory stays the source of truth (metrics.jsonl, eval.jsonl, samples.jsonl,
config.gin, run.json); a `RunTracker` copies what is written there to the trackers selected by
``train.trackers = ["wandb", "tensorboard", "mlflow"]`` (any subset; none by default):

- every metrics line under ``train/<key>`` and every eval line under ``eval/<key>``, with the
  same values (nested dicts flattened with "/": ``eval/per_task/math``), against the line's
  ``step``;
- the operative gin config and run.json (W&B config + files, MLflow params + artifacts,
  TensorBoard text);
- every ``samples_every`` steps, ``samples_per_log`` completions (prompt, completion, reward,
  passed, version span), appended to ``RUN_DIR/samples.jsonl`` and shown as a table (W&B Table,
  MLflow ``samples.json`` table artifact, TensorBoard text).

Runs of one sweep are grouped: W&B group = sweep name, MLflow experiment = sweep name,
TensorBoard: one log directory per sweep, ``<sweep dir>/tensorboard/<run name>/`` (run
``tensorboard --logdir <sweep dir>/tensorboard``). A resumed run continues the same W&B run and
MLflow run (their ids are kept in run.json under "trackers"); TensorBoard hides the events past
the checkpoint the run resumed from. W&B project / entity come from ``WANDB_PROJECT`` (default
``scalerl-zoo``) / ``WANDB_ENTITY``, W&B mode from ``WANDB_MODE``; MLflow's store from
``MLFLOW_TRACKING_URI`` (default: a file store at ``<sweep dir>/mlruns``).

A tracker never stops a run: its first error is logged once and that tracker is disabled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from components.registry import TRACKERS, UnknownComponentError
from components.trainer.runlog import JsonlLog, read_jsonl, repair_jsonl, write_json_atomic

log = logging.getLogger(__name__)

__all__ = [
    "TRACKERS",
    "check_trackers",
    "flatten_record",
    "pick_samples",
    "RunTracker",
    "tensorboard_dir",
    "SAMPLE_COLUMNS",
]

EXTRA = "scalerl-zoo[track]"
SAMPLES_FILE = "samples.jsonl"
SAMPLE_COLUMNS = (
    "step", "problem_id", "order_id", "sample", "prompt", "completion", "reward", "passed",
    "version_min", "version_max", "num_tokens", "finish_reason",
)


# ---------------------------------------------------------------------------------------------
# pure helpers
def check_trackers(trackers: Any) -> tuple[str, ...]:
    """Normalise ``train.trackers`` to a tuple of names; raise ValueError on a name that is not a
    registered tracker (the registry's error: the valid ones, the closest) or whose package is not
    installed (naming the pip extra)."""
    if trackers is None:
        return ()
    if isinstance(trackers, str):
        trackers = (trackers,)
    try:
        names = [t for t in trackers]
    except TypeError:
        raise ValueError(f"train.trackers must be a list of tracker names from {TRACKERS.names()}, got {trackers!r}") from None
    out: list[str] = []
    for name in names:
        try:
            TRACKERS.get(name)
        except UnknownComponentError as err:
            raise ValueError(f"train.trackers: {err}") from None
        if name not in out:
            out.append(name)
    packages = {n: TRACKERS.original(n).package for n in out}
    missing = [n for n in out if packages[n] and importlib.util.find_spec(packages[n]) is None]
    if missing:
        raise ValueError(
            f"train.trackers = {out}: the package(s) {', '.join(packages[n] for n in missing)} are not installed; "
            f"install the trackers with: pip install '{EXTRA}'"
        )
    return tuple(out)


def flatten_record(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a log line, nested dicts flattened with "/" and `prefix` prepended.

    bools become 0 / 1. What the JSONL line holds as null is left out: None, NaN and inf (the
    run log writes non-finite numbers as null), as are strings and lists. So the raw record the
    trainer writes and the line read back from the file give the same values.
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_record(value, f"{name}/"))
            continue
        if hasattr(value, "item") and callable(value.item) and not isinstance(value, (int, float)):
            try:  # numpy / torch scalars
                value = value.item()
            except (TypeError, ValueError, RuntimeError):
                continue
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


def pick_samples(rollouts: Sequence[Any], tokenizer: Any, *, step: int, n: int) -> list[dict]:
    """`n` completions of a step's rollout groups, chosen by a seed of `step`, as sample records.

    Pure: the same rollouts and step give the same samples. Texts are decoded as the verifier
    saw them (special tokens kept). The version span is that of the sampled (not forced) tokens.
    """
    if n <= 0:
        return []
    pairs = [(r, j) for r in sorted(rollouts, key=lambda r: r.order_id) for j in range(len(r.completions))]
    if not pairs:
        return []
    chosen = random.Random(int(step)).sample(range(len(pairs)), min(int(n), len(pairs)))
    from components.environments import turn_versions

    out = []
    for idx in sorted(chosen):
        r, j = pairs[idx]
        c = r.completions[j]
        sampled = [v for v, f in zip(c.versions, c.forced) if not f]
        out.append({
            "step": int(step),
            "problem_id": str(r.problem_id),
            "order_id": int(r.order_id),
            "sample": int(j),
            "prompt": tokenizer.decode(list(c.prompt_ids), skip_special_tokens=False),
            "completion": tokenizer.decode(list(c.token_ids), skip_special_tokens=False),
            "reward": float(r.rewards[j]),
            "passed": bool(r.passed[j]),
            "version_min": int(min(sampled)) if sampled else int(r.engine_version),
            "version_max": int(max(sampled)) if sampled else int(r.engine_version),
            "num_tokens": len(c.token_ids),
            "finish_reason": str(c.finish_reason),
            **({"turn_versions": turn_versions(c)} if getattr(c, "observed", None) is not None else {}),
        })
    return out


def tensorboard_dir(run_dir: Path) -> Path:
    """``<sweep dir>/tensorboard/<run name>``: one TensorBoard log directory per sweep."""
    run_dir = Path(run_dir).absolute()
    return run_dir.parent / "tensorboard" / run_dir.name


def _markdown_table(samples: Sequence[Mapping[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(s.get(c)) for c in SAMPLE_COLUMNS) + " |" for s in samples]
    return "\n".join(lines)


def _indent(text: str) -> str:  # a markdown code block (TensorBoard's text plugin renders markdown)
    return "\n".join("    " + line for line in text.splitlines())


# ---------------------------------------------------------------------------------------------
# backends: one small class per tracker, the same five methods, registered in TRACKERS
class _Backend:
    """A tracker: built once per run (process of learner rank 0) by `RunTracker`.

    Constructed as ``cls(run_dir, ident, stored, cfg, resume_step)``: the run directory, the run's
    identity (name, sweep, run.json, a stable id), the ids this tracker stored in run.json at an
    earlier attempt, the TrainConfig as a dict, the step a resumed run continues from. Sets
    ``self.ids`` (kept in run.json under "trackers"). `package` is the import its backend needs.
    """

    name = "?"
    package = ""

    def log(self, scalars: dict[str, float], step: int, kind: str) -> None: ...

    def config(self, gin_text: str, run_json: dict, cfg: Optional[dict]) -> None: ...

    def samples(self, new: list[dict], all_samples: list[dict], step: int) -> None: ...

    def finish(self, status: str) -> None: ...


@TRACKERS.register("wandb", gin_configurable=False)
class _WandbBackend(_Backend):
    """Weights & Biases: one W&B run per run (group = sweep), resumed by id."""

    name = package = "wandb"

    def __init__(self, run_dir: Path, ident: dict, stored: dict, cfg: Optional[dict], resume_step: Optional[int]):
        import wandb

        self._wandb = wandb
        run_id = stored.get("id") or ident["stable_id"]
        self.run = wandb.init(
            project=stored.get("project") or os.environ.get("WANDB_PROJECT") or "scalerl-zoo",
            entity=stored.get("entity") or os.environ.get("WANDB_ENTITY") or None,
            group=ident["sweep"],
            name=ident["name"],
            id=run_id,
            resume="allow",
            # read per run, not once per process (wandb caches its environment at first use)
            dir=os.environ.get("WANDB_DIR") or None,
            mode=os.environ.get("WANDB_MODE") or None,
            config={"train": cfg or {}, "run": ident["run_json"]},
            reinit="create_new",
        )
        for kind in ("train", "eval", "samples"):
            self.run.define_metric(f"{kind}/step")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
        self.ids = {"id": self.run.id, "project": self.run.project, "entity": self.run.entity, "group": ident["sweep"]}

    def log(self, scalars, step, kind):
        self.run.log({**scalars, f"{kind}/step": step})

    def config(self, gin_text, run_json, cfg):
        self.run.config.update({"run": run_json, **({"train": cfg} if cfg else {})}, allow_val_change=True)
        files = Path(self.run.dir)
        (files / "config.gin").write_text(gin_text)
        (files / "scalerl_run.json").write_text(json.dumps(run_json, indent=2, default=str))

    def samples(self, new, all_samples, step):
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[s.get(c) for c in SAMPLE_COLUMNS] for s in new])
        self.run.log({"samples/table": table, "samples/step": step})

    def finish(self, status):
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status == "done" else 1)


@TRACKERS.register("tensorboard", gin_configurable=False)
class _TensorBoardBackend(_Backend):
    """TensorBoard event files under <sweep dir>/tensorboard/<run name>/."""

    name = package = "tensorboard"

    def __init__(self, run_dir: Path, ident: dict, stored: dict, cfg: Optional[dict], resume_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = tensorboard_dir(run_dir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # A restart hides the events past the checkpoint it resumed from (all of them for a fresh
        # start in a directory an earlier attempt wrote to): TensorBoard's purge_step.
        purge = 0 if resume_step is None else int(resume_step) + 1
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=purge, flush_secs=30)
        self.ids = {"logdir": str(self.logdir)}

    def log(self, scalars, step, kind):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def config(self, gin_text, run_json, cfg):
        self.writer.add_text("config/gin", _indent(gin_text))
        self.writer.add_text("config/run_json", _indent(json.dumps(run_json, indent=2, default=str)))
        self.writer.flush()

    def samples(self, new, all_samples, step):
        self.writer.add_text("samples", _markdown_table(new), global_step=step)
        self.writer.flush()

    def finish(self, status):
        self.writer.add_text("status", status)
        self.writer.close()


@TRACKERS.register("mlflow", gin_configurable=False)
class _MlflowBackend(_Backend):
    """MLflow: one MLflow run per run (experiment = sweep), resumed by id."""

    name = package = "mlflow"
    MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value

    def __init__(self, run_dir: Path, ident: dict, stored: dict, cfg: Optional[dict], resume_step: Optional[int]):
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or stored.get("tracking_uri")
        if not uri:
            # mlflow-skinny has no database backend; its file store must be opted into.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(run_dir).absolute().parent / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(ident["sweep"])
        if exp is None:
            try:
                exp_id = self.client.create_experiment(ident["sweep"])
            except Exception:  # noqa: BLE001 - another run of the sweep created it first
                exp = self.client.get_experiment_by_name(ident["sweep"])
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        run_id = stored.get("run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")  # raises if the run is gone
        else:
            run = self.client.create_run(exp_id, run_name=ident["name"],
                                         tags={"scalerl.run_dir": str(Path(run_dir).absolute()), "scalerl.sweep": ident["sweep"]})
            run_id = run.info.run_id
        self.run_id = run_id
        self.ids = {"run_id": run_id, "experiment": ident["sweep"], "experiment_id": exp_id, "tracking_uri": uri}
        if cfg:
            self._params(cfg)

    def _params(self, cfg: dict) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params  # params are write-once: a resume adds only new keys
        flat = _flatten_any(cfg)
        params = [Param(k, str(v)[: self.MAX_PARAM_CHARS]) for k, v in flat.items() if k not in have]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, scalars, step, kind):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, int(step)) for k, v in scalars.items()]
        for i in range(0, len(metrics), 500):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 500])

    def config(self, gin_text, run_json, cfg):
        self.client.log_text(self.run_id, gin_text, "config.gin")
        self.client.log_dict(self.run_id, run_json, "scalerl_run.json")

    def samples(self, new, all_samples, step):
        # the table artifact in MLflow's table layout, rebuilt from samples.jsonl (the source of truth)
        table = {"columns": list(SAMPLE_COLUMNS), "data": [[s.get(c) for c in SAMPLE_COLUMNS] for s in all_samples]}
        self.client.log_dict(self.run_id, table, "samples.json")

    def finish(self, status):
        self.client.set_terminated(self.run_id, status={"done": "FINISHED", "failed": "FAILED"}.get(status, "KILLED"))


def _flatten_any(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten_any(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------------------
class RunTracker:
    """Mirrors one run directory's logs to the selected trackers (learner rank 0 builds it).

    Args:
        run_dir: the run directory (run.json and config.gin are read from it when present).
        trackers: names registered in TRACKERS (``cfg.trackers``); () for none (samples.jsonl is
            still written).
        samples_every / samples_per_log: samples are logged at steps divisible by
            samples_every (0: never), samples_per_log of them.
        resume_step: the step of the checkpoint the run resumed from; None for a fresh start.
            samples.jsonl is repaired to it, as metrics.jsonl is.
        cfg: the run's config as a dict (``TrainConfig.to_dict()``), sent as W&B config /
            MLflow params.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        trackers: Iterable[str] = (),
        *,
        samples_every: int = 50,
        samples_per_log: int = 4,
        resume_step: Optional[int] = None,
        cfg: Optional[dict] = None,
    ):
        self.run_dir = Path(run_dir)
        self.trackers = check_trackers(tuple(trackers))
        if int(samples_every) < 0 or int(samples_per_log) < 0:
            raise ValueError(f"samples_every ({samples_every}) and samples_per_log ({samples_per_log}) must be >= 0")
        self.samples_every = int(samples_every)
        self.samples_per_log = int(samples_per_log)
        self.cfg = cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        samples_path = self.run_dir / SAMPLES_FILE
        repair_jsonl(samples_path, resume_step)
        self._samples: list[dict] = read_jsonl(samples_path)
        self._samples_log = JsonlLog(samples_path)
        self._failed: dict[str, str] = {}
        self._closed = False
        ident = self._identity()
        stored = dict((ident["run_json"].get("trackers") or {}))
        self.backends: list[_Backend] = []
        for name in self.trackers:
            backend = self._guard(name, "start", lambda n=name: self._start(n, ident, stored.get(n) or {}, resume_step))
            if backend is not None:
                self.backends.append(backend)
        ids = {b.name: b.ids for b in self.backends}
        if ids:
            self._store_ids(ids)
        self._send_config(ident["run_json"])

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Any, run_dir: str | os.PathLike, resume_step: Optional[int] = None) -> "RunTracker":
        """From a TrainConfig: ``cfg.trackers``, ``cfg.samples_every``, ``cfg.samples_per_log``."""
        as_dict = cfg.to_dict() if hasattr(cfg, "to_dict") else (dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None)
        return cls(run_dir, getattr(cfg, "trackers", ()), samples_every=getattr(cfg, "samples_every", 50),
                   samples_per_log=getattr(cfg, "samples_per_log", 4), resume_step=resume_step, cfg=as_dict)

    def _identity(self) -> dict:
        path = self.run_dir / "run.json"
        try:
            run_json = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            run_json = {}
        absdir = self.run_dir.absolute()
        name = str(run_json.get("name") or absdir.name)
        sweep = str(run_json.get("sweep") or absdir.parent.name)
        key = f"{absdir}|{run_json.get('started', '')}"
        return {"name": name, "sweep": sweep, "run_json": run_json,
                "stable_id": f"{_slug(name)[:40]}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"}

    def _start(self, name: str, ident: dict, stored: dict, resume_step: Optional[int]) -> _Backend:
        params = ((self.cfg or {}).get("components") or {}).get(f"trackers/{name}")  # a resolved run's values
        tracker = TRACKERS.get(name) if params is None else TRACKERS.build(name, params)
        return tracker(self.run_dir, ident, stored, self.cfg, resume_step)

    def _store_ids(self, ids: dict) -> None:
        """run.json["trackers"][name] = ids (RunInfo.save keeps this key)."""
        path = self.run_dir / "run.json"
        try:
            data = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            data = {}
        data["trackers"] = {**dict(data.get("trackers") or {}), **ids}
        write_json_atomic(path, data)

    # -- failure isolation -----------------------------------------------------------------
    def _guard(self, name: str, what: str, fn):
        """fn() or None; the tracker's first error is logged once and the tracker disabled."""
        if name in self._failed:
            return None
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - a tracker never stops a run
            self._failed[name] = f"{what}: {type(err).__name__}: {err}"
            log.warning("tracker %s failed in %s (%s: %s); it is disabled for the rest of this run "
                        "(the run directory's JSONL logs are unaffected)", name, what, type(err).__name__, err)
            self.backends = [b for b in self.backends if b.name != name]
            return None

    def _each(self, what: str, call) -> None:
        for backend in list(self.backends):
            self._guard(backend.name, what, lambda b=backend: call(b))

    @property
    def failed(self) -> dict[str, str]:
        """{tracker: its error} for the trackers disabled by an error."""
        return dict(self._failed)

    # -- what the loop calls -----------------------------------------------------------------
    def log_metrics(self, record: Mapping[str, Any]) -> None:
        """One metrics.jsonl line (as written), under ``train/``, at ``record["step"]``."""
        if self.backends:
            scalars, step = flatten_record(record, "train/"), int(record["step"])
            self._each("log_metrics", lambda b: b.log(scalars, step, "train"))

    def log_eval(self, record: Mapping[str, Any]) -> None:
        """One eval.jsonl line (as written), under ``eval/``, at ``record["step"]``."""
        if self.backends:
            scalars, step = flatten_record(record, "eval/"), int(record["step"])
            self._each("log_eval", lambda b: b.log(scalars, step, "eval"))

    def samples_due(self, step: int) -> bool:
        return self.samples_every > 0 and self.samples_per_log > 0 and int(step) % self.samples_every == 0

    def log_samples(self, step: int, rollouts: Sequence[Any], tokenizer: Any) -> list[dict]:
        """When `step` is due: pick samples of the step's rollouts, append them to samples.jsonl,
        send the table to the trackers. Returns the samples written ([] when not due)."""
        if not self.samples_due(step):
            return []
        new = pick_samples(rollouts, tokenizer, step=step, n=self.samples_per_log)
        for s in new:
            self._samples_log.write(s)
        self._samples.extend(new)
        if new and self.backends:
            self._each("log_samples", lambda b: b.samples(new, self._samples, int(step)))
        return new

    def _send_config(self, run_json: Optional[dict] = None, gin_text: Optional[str] = None) -> None:
        if not self.backends:
            return
        if gin_text is None:
            path = self.run_dir / "config.gin"
            gin_text = path.read_text() if path.exists() else ""
        if run_json is None:
            run_json = self._identity()["run_json"]
        self._each("log_config", lambda b: b.config(gin_text, run_json, self.cfg))

    def close(self, status: str = "done", operative_config: Optional[str] = None) -> None:
        """End the tracker runs: the run's configuration (`operative_config`, the resolved run's text;
        default: config.gin) and run.json with `status` ("done", "failed", "interrupted") sent once more."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.backends:
                run_json = dict(self._identity()["run_json"], status=status)
                self._send_config(run_json, operative_config)
                self._each("finish", lambda b: b.finish(status))
        finally:
            self._samples_log.close()

    def __enter__(self) -> "RunTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("done" if exc_type is None else "failed")


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in text) or "run"
