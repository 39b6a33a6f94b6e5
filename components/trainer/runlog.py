"""The run directory (DESIGN.md): config.gin, run.json, metrics.jsonl, eval.jsonl, checkpoints/.

Logs are append-only JSON lines, flushed per line and fsynced at every checkpoint before the
checkpoint is committed (`JsonlLog.sync`); the checkpoint records how many records each log
held. On resume, `resume_log` keeps the records up to the checkpoint's step and refuses a
log that lost any of them (`LogLossError`, naming the file and the steps), so the resumed
logs continue with no gap and no duplicated step, and a torn last line is reported, never
dropped in silence.

A failure is recorded by `record_failure`, which never raises: error.txt and run.json in the
run directory, or, when the run directory cannot be written, a fallback file (see
`failure_fallback_paths`); the error always goes to stderr as well in that case.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Optional

__all__ = ["JsonlLog", "repair_jsonl", "resume_log", "LogLossError", "read_jsonl", "RunInfo", "write_json_atomic",
           "write_text_atomic", "merge_operative_configs",
           "git_sha", "now_iso", "record_failure", "record_exception", "read_failure_fallback", "failure_fallback_paths", "failure_in_run_dir",
           "EXIT_DONE", "EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_FAILURE_UNRECORDED"]

log = logging.getLogger(__name__)


# exit codes of `scalerl train` (1 and 4 also of a stuck learner-0 that its heartbeat thread ends)
EXIT_DONE = 0
EXIT_FAILED = 1  # the run failed; run.json says so and error.txt has the traceback
EXIT_BAD_INPUT = 2  # bad input, refused before the run started
EXIT_FAILURE_UNRECORDED = 4  # the run failed and its run directory could not record it (stderr, fallback file)


class LogLossError(RuntimeError):
    """A run log lost records a checkpoint counts on (or ends with a torn line a record would be appended to)."""


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, tensors/numpy scalars become numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (fsynced; a kill leaves the old file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(_clean(data), indent=2, sort_keys=False) + "\n")


_SECTION = ("# Parameters for ", "# Macros:")


def _gin_sections(text: str) -> tuple[list[str], dict[str, str]]:
    """A gin operative config string as (import lines, {section header: section text}).

    gin writes its import lines first, then one section per configurable (and one for the
    macros), each a header line (`# Parameters for NAME:` or `# Macros:`), a rule line and the
    bindings, separated by blank lines.
    """
    imports: list[str] = []
    sections: dict[str, list[str]] = {}
    current: Optional[list[str]] = None
    for line in text.splitlines():
        if line.startswith(_SECTION):
            current = sections.setdefault(line, [])
            current.append(line)
        elif current is not None:
            current.append(line)
        elif line.strip():
            imports.append(line)
    return imports, {head: "\n".join(lines).rstrip() for head, lines in sections.items()}


def _macro_entries(section: str) -> tuple[list[str], dict[str, str]]:
    """A gin "# Macros:" section as (its header lines, {macro name: its binding text}); a binding
    goes on over the indented lines that follow it (gin breaks long values that way)."""
    head: list[str] = []
    entries: dict[str, list[str]] = {}
    current: Optional[list[str]] = None
    for line in section.splitlines():
        if line.startswith("#") and current is None:
            head.append(line)
        elif line[:1].strip() and "=" in line:
            current = entries.setdefault(line.split("=", 1)[0].strip(), [])
            current.append(line)
        elif current is not None and line.strip():
            current.append(line)
    return head, {name: "\n".join(lines) for name, lines in entries.items()}


def _merge_macros(first: str, second: str) -> str:
    """The union of two "# Macros:" sections by macro name (`first`'s value wins), sorted as gin sorts them."""
    head, entries = _macro_entries(first)
    for name, text in _macro_entries(second)[1].items():
        entries.setdefault(name, text)
    return "\n".join(head + [entries[name] for name in sorted(entries)])


def merge_operative_configs(primary: str, others: "list[str] | tuple[str, ...]") -> str:
    """One operative config for a run of several processes: `primary` (learner rank 0's) plus
    every section only `others` (the generators') have, e.g. the engine's bindings, which only a
    generator reads. A section in several keeps `primary`'s (or the first other's) text. Sections
    come in gin's order: the macros first, then the configurables by name."""
    imports, sections = _gin_sections(primary)
    for text in others:
        if not text:
            continue
        more_imports, more = _gin_sections(text)
        imports += [line for line in more_imports if line not in imports]
        for head, body in more.items():
            if head == "# Macros:" and head in sections:  # one macro at a time: a generator's own macros too
                sections[head] = _merge_macros(sections[head], body)
            else:
                sections.setdefault(head, body)
    order = sorted(sections, key=lambda head: (head != "# Macros:", head))
    parts = (["\n".join(imports)] if imports else []) + [sections[head] for head in order]
    return "\n\n".join(parts) + "\n"


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def repair_jsonl(path: Path, max_step: Optional[int]) -> int:
    """Keep only complete lines with step <= max_step (None: keep none). Returns lines kept."""
    path = Path(path)
    if not path.exists():
        return 0
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    if not raw.endswith(b"\n"):
        lines = lines[:-1]  # a partial last line (killed mid-write)
    kept = []
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if max_step is not None and int(rec.get("step", -1)) <= max_step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(b"".join(l + b"\n" for l in kept))
    os.replace(tmp, path)
    return len(kept)


def _split_log(raw: bytes) -> tuple[list[tuple[bytes, Optional[dict]]], bytes]:
    """([(complete line, its record or None if not a JSON object with a step)], torn last line)."""
    lines = raw.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            rec = None
        out.append((line, rec))
    return out, torn


def _ranges(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(parts)


def resume_log(path: Path, step: int, expected: Optional[dict] = None, *, every_step: bool = False) -> int:
    """Cut log `path` back to checkpoint step `step`; LogLossError if it lost records up to it.

    Kept: the complete lines whose record has step <= `step`. The log is refused when it holds
    fewer of them than `expected["records"]` (what the log held when the checkpoint was
    committed, after an fsync), or, with `every_step` (metrics.jsonl: one record per step),
    when a step in 1..`step` has no record; the message names the file, the missing steps and
    a torn or unreadable line if that is where the records went. A torn last line after
    complete records for every step the checkpoint covers was written after the checkpoint:
    it is dropped with a warning naming it. Returns the records kept.
    """
    path = Path(path)
    raw = path.read_bytes() if path.exists() else b""
    lines, torn = _split_log(raw)
    kept = [(line, rec) for line, rec in lines if rec is not None and rec["step"] <= step]
    problems = []
    if expected is not None and len(kept) < int(expected.get("records", 0)):
        problems.append(f"it has {len(kept)} records up to step {step}, but the checkpoint was committed when it had "
                        f"{int(expected['records'])} (the last at step {expected.get('last_step')})")
    if every_step:
        have = {rec["step"] for _line, rec in kept}
        missing = [s for s in range(1, step + 1) if s not in have]
        if missing:
            problems.append(f"steps {_ranges(missing)} of 1-{step} have no record")
    if problems:
        last = max((rec["step"] for _line, rec in kept), default=None)
        where = []
        bad = sum(1 for _line, rec in lines if rec is None)
        if bad:
            where.append(f"{bad} complete line(s) are not JSON records with a step")
        if torn:
            where.append(f"it ends with a torn line of {len(torn)} bytes after step {last}")
        raise LogLossError(
            f"{path} lost records the checkpoint at step {step} counts on: {'; '.join(problems)}"
            + (f" ({'; '.join(where)})" if where else "")
            + ". Restore the file, or resume from an older checkpoint by moving the newer ones out of checkpoints/.")
    if torn:
        log.warning("%s ends with a torn line (%d bytes, written after the checkpoint at step %d): dropped",
                    path, len(torn), step)
    if path.exists():
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line, _rec in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(kept)


class JsonlLog:
    """Append-only JSON lines, one flushed line per record; `sync` fsyncs them (at checkpoints)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        raw = self.path.read_bytes() if self.path.exists() else b""
        lines, torn = _split_log(raw)
        if torn:  # resume_log / repair_jsonl leave none; a record appended to it would be lost
            raise LogLossError(f"{self.path} ends with a torn line ({len(torn)} bytes); repair it before appending")
        self.records = len(lines)  # complete lines: what a checkpoint counts on
        self.last_step = next((rec["step"] for _line, rec in reversed(lines) if rec is not None), None)
        self._f = open(self.path, "a", buffering=1)
        if not raw:
            fsync_path(self.path.parent)  # the new file's directory entry

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(_clean(record), sort_keys=False) + "\n")
        self._f.flush()
        self.records += 1
        if isinstance(record.get("step"), int):
            self.last_step = record["step"]

    def sync(self) -> dict:
        """Flush and fsync every line written so far; {"records", "last_step"} for the checkpoint."""
        self._f.flush()
        os.fsync(self._f.fileno())
        return {"records": self.records, "last_step": self.last_step}

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (best effort: an error is ignored)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def git_sha() -> Optional[str]:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def slurm_job_id() -> Optional[str]:
    """The Slurm job this process runs in, spelled as `scalerl sweep` records it in slurm.json
    ("<array job>_<task>" for an array task, else the job id); None outside Slurm."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


class RunInfo:
    """run.json, kept true: running | done | failed (+ error)."""

    FIELDS = ("name", "sweep", "factor", "value", "recipe", "seed")

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "run.json"
        self.data: dict = json.loads(self.path.read_text()) if self.path.exists() else {}
        if self.data.get("status") in (None, "running"):  # a failure the run directory could not hold
            failed = read_failure_fallback(run_dir)
            started = max(str(self.data.get("started") or ""), str(self.data.get("last_resumed") or ""))
            if failed is not None and str(failed.get("finished", "")) >= started:
                self.data.update(status="failed", error=failed.get("error"), finished=failed.get("finished"),
                                 failure_recorded_in=failed["recorded_in"])

    @property
    def status(self) -> Optional[str]:
        return self.data.get("status")

    def start(self, run_info: Optional[dict], hardware: dict, resumed: bool) -> None:
        info = dict(run_info or {})
        run_dir = self.path.parent
        defaults = {"name": run_dir.name, "sweep": run_dir.parent.name, "factor": None, "value": None, "recipe": None, "seed": None}
        for key in self.FIELDS:
            if key in info:
                self.data[key] = info[key]
            else:
                self.data.setdefault(key, defaults[key])
        for key, value in info.items():
            if key not in self.FIELDS:
                self.data.setdefault(key, value)
        self.data["git_sha"] = git_sha()
        self.data["hardware"] = hardware
        self.data["host"] = socket.gethostname()
        self.data["slurm_job"] = slurm_job_id()  # None: this attempt runs outside Slurm (scalerl status)
        self.data["status"] = "running"
        self.data.pop("error", None)
        self.data.pop("failure_recorded_in", None)
        for stale in failure_fallback_paths(run_dir):  # an earlier attempt's failure: this one is running
            try:
                stale.unlink(missing_ok=True)
            except OSError:
                pass
        self.data.setdefault("started", now_iso())
        self.data["finished"] = None
        if resumed:
            self.data["resumes"] = int(self.data.get("resumes", 0)) + 1
            self.data["last_resumed"] = now_iso()
        self.save()

    def finish(self, status: str, error: Optional[str] = None, **extra) -> None:
        self.data.pop("failure_recorded_in", None)
        self.data["status"] = status
        if error is not None:
            self.data["error"] = error
        self.data["finished"] = now_iso()
        self.data.update(extra)
        self.save()

    def save(self) -> None:
        # "trackers" (W&B / MLflow run ids) is written by components.trainer.tracking while this
        # object is held: merge the file's entries rather than overwrite them with an older copy.
        if self.path.exists():
            try:
                on_disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                on_disk = {}
            if isinstance(on_disk, dict) and isinstance(on_disk.get("trackers"), dict):
                self.data["trackers"] = {**dict(self.data.get("trackers") or {}), **on_disk["trackers"]}
        write_json_atomic(self.path, self.data)


# ---------------------------------------------------------------------------------------------
# failures
def failure_fallback_paths(run_dir: Path) -> list[Path]:
    """Where `record_failure` writes when the run directory cannot be written, in order:
    RUN_DIR.failed.json beside the run directory, then
    $SCALERL_FAILURE_DIR (default: <tmp>/scalerl-failures)/<name>-<hash of the path>.json."""
    run_dir = Path(run_dir).absolute()
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
    spare = Path(os.environ.get("SCALERL_FAILURE_DIR") or Path(tempfile.gettempdir()) / "scalerl-failures")
    return [run_dir.with_name(run_dir.name + ".failed.json"), spare / f"{run_dir.name}-{digest}.json"]


def read_failure_fallback(run_dir: Path) -> Optional[dict]:
    """The newest failure record `record_failure` left outside `run_dir`, or None."""
    found = []
    for p in failure_fallback_paths(run_dir):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("run_dir") == str(Path(run_dir).absolute()):
            found.append({**rec, "recorded_in": str(p)})
    return max(found, key=lambda r: str(r.get("finished", ""))) if found else None


def failure_in_run_dir(run_dir: Path) -> bool:
    """True when run.json itself (not a fallback file) says failed."""
    try:
        return json.loads((Path(run_dir) / "run.json").read_text()).get("status") == "failed"
    except (OSError, ValueError, AttributeError):
        return False


def record_failure(run_dir: Path, message: str, details: Optional[str] = None, *, only_if_running: bool = False) -> bool:
    """Mark the run failed with `message` (error.txt: `details`, e.g. the traceback, or the message).

    Never raises (it runs inside failure handlers). True when run.json in the run directory says
    failed. When the run directory cannot be written (read-only, full, gone), the original
    error and the write error go to stderr, the failure is written to the first writable
    `failure_fallback_paths` file (RunInfo and `scalerl train` read it), and it returns False.
    `only_if_running`: do nothing when run.json already holds an outcome (another process
    recorded the failure first).
    """
    run_dir = Path(run_dir)
    try:
        info = RunInfo(run_dir)
        if only_if_running and info.status not in (None, "running"):
            return info.status == "failed" and failure_in_run_dir(run_dir)
        (run_dir / "error.txt").write_text((details or message).rstrip("\n") + "\n")
        info.finish("failed", error=message)
        return True
    except Exception as err:  # noqa: BLE001 - a failure handler must not fail
        write_error = f"{type(err).__name__}: {err}"
    record = {"run_dir": str(run_dir.absolute()), "status": "failed", "error": message, "details": details,
              "finished": now_iso(), "write_error": write_error}
    where = None
    for path in failure_fallback_paths(run_dir):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, record)
            where = path
            break
        except Exception:  # noqa: BLE001 - try the next place
            continue
    try:
        print(f"scalerl: the failure could not be recorded in {run_dir} ({write_error}); "
              f"{f'recorded in {where}' if where else 'nor in any fallback file'}. The run failed with:\n"
              f"{(details or message).rstrip()}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - stderr closed: nothing left to tell
        pass
    return False


def record_exception(run_dir: Path, err: BaseException) -> bool:
    """`record_failure` of an exception: run.json failed with `err`, error.txt its traceback
    (learner rank 0's end of a failed run). Never raises; False when the run directory could
    not record it."""
    return record_failure(Path(run_dir), f"{type(err).__name__}: {err}",
                          "".join(traceback.format_exception(type(err), err, err.__traceback__)))
