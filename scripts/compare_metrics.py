"""Diff two metrics.jsonl files (or two run directories) field by field, timing fields aside.

    python scripts/compare_metrics.py REF_RUN_OR_FILE NEW_RUN_OR_FILE [--rel 0]

A refactoring that keeps behaviour must give the same records for the same seed: the same steps,
the same keys, and equal values for every field that does not measure time or the machine's load
(wall_s, compute_hours, time_*, cpu_hours, contention, procs, ...). `--rel` allows a relative
tolerance on numbers (0, the default: exactly equal). `--structure` compares the steps and the
keys only: for pipeline_rl, whose samples depend on process timing (which weights a token is
sampled under), two runs of the same code part after a few steps. Exit code 0: the same; 1: they
differ (every difference listed, at most `--show` of them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# fields that measure time, the machine's load or the processes' CPU use: they differ between
# two runs of the same code
TIMING_FIELDS = frozenset({
    "wall_s", "compute_hours", "cpu_hours", "contention", "contention_run", "runq_frac", "runq_run", "procs",
    "startup_s", "eval_wall_s", "eval_compute_hours", "drain_s",
})
TIMING_PREFIXES = ("time_",)


def is_timing(key: str) -> bool:
    return key in TIMING_FIELDS or key.startswith(TIMING_PREFIXES)


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (a run directory: its metrics.jsonl)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"compare_metrics: no metrics file at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _equal(a, b, rel: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y, rel) for x, y in zip(a, b))
    return a == b


def differences(ref: list[dict], new: list[dict], rel: float = 0.0, structure: bool = False) -> list[str]:
    """Every difference between two lists of records, timing fields aside, one line each (with
    `structure`: only the steps and the keys)."""
    out = []
    if len(ref) != len(new):
        out.append(f"record count: {len(ref)} vs {len(new)}")
    for i, (a, b) in enumerate(zip(ref, new)):
        step = a.get("step", i)
        keys_a = {k for k in a if not is_timing(k)}
        keys_b = {k for k in b if not is_timing(k)}
        if keys_a != keys_b:
            out.append(f"step {step}: keys only in the reference {sorted(keys_a - keys_b)}, only in the new "
                       f"{sorted(keys_b - keys_a)}")
        if structure:
            if a.get("step") != b.get("step"):
                out.append(f"record {i}: step {a.get('step')!r} vs {b.get('step')!r}")
            continue
        for key in sorted(keys_a & keys_b):
            if not _equal(a[key], b[key], rel):
                out.append(f"step {step}: {key}: {a[key]!r} vs {b[key]!r}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("new")
    parser.add_argument("--rel", type=float, default=0.0, help="relative tolerance on numbers (default 0: equal)")
    parser.add_argument("--structure", action="store_true", help="compare the steps and keys only")
    parser.add_argument("--show", type=int, default=20, help="differences to print at most")
    args = parser.parse_args(argv)
    ref, new = read_records(Path(args.reference)), read_records(Path(args.new))
    diffs = differences(ref, new, args.rel, args.structure)
    if not diffs:
        what = "the same steps and keys" if args.structure else "every non-timing field equal"
        print(f"same: {len(ref)} records, {what}" + (f" (rel {args.rel})" if args.rel else ""))
        return 0
    print(f"{len(diffs)} difference(s):")
    for line in diffs[: args.show]:
        print("  " + line)
    return 1


if __name__ == "__main__":
    sys.exit(main())
