"""The tool task's comparison (issue 45, item 4): tiny_tool with its calculator against no tool.

    python benchmarks/tool_use.py RUNS/tool_use     # after `scalerl sweep experiments/sweeps/tool_use.gin --scale tiny --seeds 0 1 2 3`

Prints, per run, the held-out pass rate (mean@k) at the first and the last evaluation and the tool
meters of metrics.jsonl (`tool_calls_per_sample`, `malformed_call_frac`) averaged over the first and
the last tenth of the run's steps; then the verdicts of `scalerl compare RUNS --metric all` (the
paired-seed comparison) follow from that command itself.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a partial last line
    return out


def _mean(xs: list) -> float:
    xs = [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def run_summary(run_dir: Path) -> dict:
    """First and last held-out pass rate, and the tool meters over the first and last tenth of the steps."""
    evals = [e for e in _rows(run_dir / "eval.jsonl") if "benchmark" not in e and "pass_rate" in e]
    steps = [m for m in _rows(run_dir / "metrics.jsonl") if "step" in m and m.get("step", 0) > 0]
    tenth = max(1, len(steps) // 10)
    head, tail = steps[:tenth], steps[-tenth:]
    out = {"run": run_dir.name, "steps": steps[-1]["step"] if steps else 0,
           "eval_first": evals[0]["pass_rate"] if evals else math.nan,
           "eval_last": evals[-1]["pass_rate"] if evals else math.nan}
    for key in ("tool_calls_per_sample", "malformed_call_frac"):
        out[f"{key}_first"] = _mean([m.get(key) for m in head])
        out[f"{key}_last"] = _mean([m.get(key) for m in tail])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", help="the sweep's run directory (RUNS/tool_use)")
    args = parser.parse_args(argv)
    runs = sorted(p.parent for p in Path(args.runs).glob("*/run.json"))
    if not runs:
        raise SystemExit(f"no runs under {args.runs} (expected RUN/run.json)")
    print("| run | steps | held-out first | held-out last | tool calls / sample (first -> last tenth) "
          "| malformed calls (first -> last tenth) |")
    print("|---|---:|---:|---:|---:|---:|")
    for d in runs:
        s = run_summary(d)
        print(f"| {s['run']} | {s['steps']} | {s['eval_first']:.3f} | {s['eval_last']:.3f} | "
              f"{s['tool_calls_per_sample_first']:.2f} -> {s['tool_calls_per_sample_last']:.2f} | "
              f"{s['malformed_call_frac_first']:.2f} -> {s['malformed_call_frac_last']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
