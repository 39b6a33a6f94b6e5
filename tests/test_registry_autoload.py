"""Registry lookups load the built-in components on first use, in any fresh process
(issue 13 item 6), and an unknown name's error lists the real choices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _fresh(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, outside the repo (only what an installed scalerl-zoo sees)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env=env)


def test_first_lookup_of_any_kind_fills_every_family(tmp_path):
    code = """
        import json, sys, threading
        import components.registry as r
        before = sorted(m for m in r.BUILTIN_MODULES if m in sys.modules)
        # two threads race to the first lookup: both see the built-ins
        got = {}
        def look(key, reg, name):
            got[key] = reg.get(name).__name__
        threads = [threading.Thread(target=look, args=("loss", r.LOSSES, "cispo")),
                   threading.Thread(target=look, args=("task", r.TASKS, "hf_dataset"))]
        [t.start() for t in threads]; [t.join(60) for t in threads]
        print(json.dumps({
            "before": before, "got": got,
            "contains": "dapo" in r.LOSSES, "len_engines": len(r.ENGINES),
            "names": {fam: reg.names() for fam, reg in r.ALL_REGISTRIES.items()},
        }))
    """
    out = _fresh(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == []  # importing the registry module loads nothing by itself
    assert got["got"] == {"loss": "cispo", "task": "HFDatasetTask"}
    assert got["contains"] is True and got["len_engines"] >= 1
    names = got["names"]
    assert {"grpo", "dapo", "cispo", "gspo"} <= set(names["losses"])
    assert {"arithmetic", "math_file", "code_file", "hf_dataset"} <= set(names["tasks"])
    assert {"math_verify", "exact_match"} <= set(names["rewards"])
    assert "torch" in names["engines"] and names["aggregations"] and names["curricula"] and names["off_policy"]


def test_documented_call_and_unknown_names_in_a_fresh_interpreter(tmp_path):
    code = """
        from components.registry import LOSSES; print(LOSSES.get("grpo"))
        from components.registry import REWARDS
        for reg, bad in ((LOSSES, "grpoo"), (REWARDS, "math_verfy")):
            try:
                reg.get(bad)
            except KeyError as err:
                print(str(err))
    """
    out = _fresh(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    found, loss_msg, reward_msg = out.stdout.strip().splitlines()
    assert "grpo" in found  # DESIGN.md's public call, as the first line of a fresh interpreter
    assert loss_msg.startswith("Unknown loss 'grpoo'. Registered loss names: ")
    for name in ("cispo", "dapo", "grpo", "gspo"):
        assert name in loss_msg
    assert "(none registered)" not in loss_msg and "Did you mean 'grpo'?" in loss_msg
    assert "math_verify" in reward_msg and "Did you mean 'math_verify'?" in reward_msg
