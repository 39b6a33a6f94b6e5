"""The run directory (DESIGN.md): config.gin, run.json, metrics.jsonl, eval.jsonl, checkpoints/.

Logs are append-only JSON lines, flushed per line. On resume, `repair_jsonl` truncates a
partial last line and drops records whose step is beyond the checkpoint, so the resumed
logs continue with no gap and no duplicated step.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Optional

__all__ = ["JsonlLog", "repair_jsonl", "read_jsonl", "RunInfo", "write_json_atomic", "git_sha", "now_iso"]


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


def write_json_atomic(path: Path, data: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(_clean(data), f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


class JsonlLog:
    """Append-only JSON lines, one flushed line per record."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(_clean(record), sort_keys=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def git_sha() -> Optional[str]:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


class RunInfo:
    """run.json, kept true: running | done | failed (+ error)."""

    FIELDS = ("name", "sweep", "factor", "value", "recipe", "seed")

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "run.json"
        self.data: dict = json.loads(self.path.read_text()) if self.path.exists() else {}

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
        self.data["status"] = "running"
        self.data.pop("error", None)
        self.data.setdefault("started", now_iso())
        self.data["finished"] = None
        if resumed:
            self.data["resumes"] = int(self.data.get("resumes", 0)) + 1
            self.data["last_resumed"] = now_iso()
        self.save()

    def finish(self, status: str, error: Optional[str] = None, **extra) -> None:
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
