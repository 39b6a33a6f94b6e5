"""scripts/compare_metrics.py: two metrics.jsonl are the same when every non-timing field is equal."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compare_metrics", REPO / "scripts" / "compare_metrics.py")
compare_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_metrics)


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_timing_fields_are_ignored_and_everything_else_is_compared(tmp_path):
    ref = [{"step": 1, "loss": 0.5, "wall_s": 1.0, "time_train": 0.3, "procs": {"a": {"cpu_s": 1}}, "lag": [0, 1]}]
    same = [{"step": 1, "loss": 0.5, "wall_s": 9.0, "time_train": 0.1, "procs": {"a": {"cpu_s": 2}}, "lag": [0, 1]}]
    other = [{"step": 1, "loss": 0.5000001, "wall_s": 1.0, "time_train": 0.3, "procs": {}, "lag": [0, 2]}]
    a, b, c = (_write(tmp_path / f"{n}.jsonl", r) for n, r in (("a", ref), ("b", same), ("c", other)))
    assert compare_metrics.main([str(a), str(b)]) == 0
    assert compare_metrics.main([str(a), str(c)]) == 1
    diffs = compare_metrics.differences(ref, other)
    assert diffs == ["step 1: lag: [0, 1] vs [0, 2]", "step 1: loss: 0.5 vs 0.5000001"]
    assert compare_metrics.differences(ref, other, rel=1e-3) == ["step 1: lag: [0, 1] vs [0, 2]"]


def test_missing_records_and_keys_are_differences():
    ref = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
    assert compare_metrics.differences(ref, ref[:1]) == ["record count: 2 vs 1"]
    diffs = compare_metrics.differences(ref[:1], [{"step": 1, "loss": 0.5, "new": 1}])
    assert diffs == ["step 1: keys only in the reference [], only in the new ['new']"]


def test_structure_compares_steps_and_keys_only():
    ref = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
    assert compare_metrics.differences(ref, [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}], structure=True) == []
    assert compare_metrics.differences(ref, [{"step": 1, "loss": 0.1}, {"step": 3, "loss": 0.2}],
                                       structure=True) == ["record 1: step 2 vs 3"]
