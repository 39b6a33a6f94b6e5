"""How the compute axis moves when a run shares its cores (issue 12, item 1).

The tiny run (experiments/configs/tiny_cpu.gin, shortened) is trained alone and beside 1 and 2
CPU hogs (busy Python loops), under the main recipe's pipeline_rl and under ppo_off_policy(1).
Printed per case: training wall time, compute_hours (devices x training wall), cpu_hours (the
processes' CPU time), contention (other work on the run's CPUs, /proc/stat) and runq_frac (the
run's threads waiting for a CPU, schedstat), each as measured and as a ratio to the run alone.

    .venv/bin/python benchmarks/compute_axis.py --steps 100 [--hogs 0 1 2] [--schemes pipeline_rl ppo_off_policy]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = str(REPO / "experiments" / "configs" / "tiny_cpu.gin")


def run(run_dir: Path, steps: int, scheme: str) -> dict:
    cmd = [sys.executable, "-m", "experiments.cli", "train", CONFIG, "--run-dir", str(run_dir), "--no-progress", "--no-report",
           "--gin", f"train.total_steps = {steps}", "--gin", f"train.eval_every = {steps}",
           "--gin", f"train.checkpoint_every = {steps}", "--gin", f'train.off_policy = "{scheme}"']
    if scheme == "ppo_off_policy":
        cmd += ["--gin", "ppo_off_policy.k = 1"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = rows[-1]
    return {k: last[k] for k in ("wall_s", "compute_hours", "cpu_hours", "contention_run")} | {
        "runq_frac": sum(r["runq_frac"] for r in rows if r.get("runq_frac") is not None) / len(rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--schemes", nargs="+", default=["pipeline_rl", "ppo_off_policy"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="compute_axis_"))
    # build (or find) the warm-started model once, outside the timing
    run(tmp / "warmup", 2, "ppo_off_policy")
    print("| scheme | hogs | wall s | compute_hours | x alone | cpu_hours | x alone | contention | runq_frac |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for scheme in args.schemes:
        alone = None
        for n in args.hogs:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
            try:
                time.sleep(0.5)
                r = run(tmp / f"{scheme}-{n}", args.steps, scheme)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            alone = alone or r
            print(f"| {scheme} | {n} | {r['wall_s']:.1f} | {r['compute_hours']:.5f} | {r['compute_hours'] / alone['compute_hours']:.2f} "
                  f"| {r['cpu_hours']:.5f} | {r['cpu_hours'] / alone['cpu_hours']:.2f} | {r['contention_run']:.2f} | {r['runq_frac']:.2f} |",
                  flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
