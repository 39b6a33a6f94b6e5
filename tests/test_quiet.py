"""One progress bar per long task: library progress bars are off in the main job's processes
(components/quiet.py), and errors are not silenced."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "=== control ==="


def test_loading_the_tiny_model_prints_nothing_while_bars_and_errors_would_show(tmp_path):
    code = f"""
        import json, sys, torch
        torch.set_num_threads(1)
        from components.models import build_tiny_policy, load_causal_lm, load_tokenizer
        from components.tasks import make_task
        path = build_tiny_policy({str(tmp_path / 'm')!r}, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64)
        tok = load_tokenizer(path)
        model = load_causal_lm(path)
        model.save_pretrained({str(tmp_path / 'm2')!r})
        open({str(tmp_path / 'd.jsonl')!r}, "w").write("".join(json.dumps({{"prompt": f"{{i}}+1", "answer": str(i + 1)}}) + "\\n" for i in range(20)))
        task = make_task("hf_dataset", path={str(tmp_path / 'd.jsonl')!r}, eval_size=2, cache_dir={str(tmp_path / 'c')!r})
        assert len(task.train_problems()) == 18
        print({MARK!r}, file=sys.stderr, flush=True)
        # the control: the same loading with transformers' bar turned back on does print it,
        # so the empty stderr above is not an artefact of how the output is captured
        from transformers.utils import logging
        logging.enable_progress_bar()
        load_causal_lm(path)
        sys.stderr.flush()
        load_causal_lm({str(tmp_path / 'missing')!r})  # errors are not silenced: this one ends the process
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    for var in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.stdout == ""
    assert MARK in out.stderr, out.stderr[-3000:]
    quiet, control = out.stderr.split(MARK + "\n", 1)
    assert quiet == ""  # building, loading, saving the model and loading a dataset printed nothing
    assert "Loading weights" in control
    assert out.returncode == 1
    assert "Traceback (most recent call last):" in control and "FileNotFoundError: model path" in control


GIN_INCLUDE = """
    import logging, sys
    logging.basicConfig()
    from components.trainer.gin_config import parse_gin_files
    import gin
    parse_gin_files([{child!r}], [])
    assert gin.query_parameter("train.seed") == 7  # the include was read
    print({mark!r}, file=sys.stderr, flush=True)
    logging.error("an unrelated error %s", "still prints")
    import gin.resource_reader
    gin.resource_reader.system_path_file_exists("no_such_package_dir/x.gin")  # gin's own probe, direct
    gin.clear_config()
    gin.parse_config_files_and_bindings([{child!r}], [], finalize_config=False)  # gin alone
"""


def test_gin_search_path_probes_are_silent_and_other_errors_are_not(tmp_path):
    """`include 'base.gin'` through the project's parser prints nothing; gin's own probe of a
    missing package path is dropped wherever it happens once quiet_gin() ran, and an unrelated
    root-logger error still prints. The control: without the project's filter (a fresh process
    that parses with gin alone) the probe lines do appear."""
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "base.gin").write_text("train.seed = 7\n")
    child = tmp_path / "cfgs" / "child.gin"
    child.write_text("include 'base.gin'\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = textwrap.dedent(GIN_INCLUDE.format(child=str(child), mark=MARK))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    quiet, after = out.stderr.split(MARK + "\n", 1)
    assert quiet == ""
    assert "an unrelated error still prints" in after
    assert "Path not found" not in after
    control = textwrap.dedent(f"""
        import logging, gin
        logging.basicConfig()
        gin.add_config_file_search_path({str(tmp_path)!r})
        gin.add_config_file_search_path({str(tmp_path / 'cfgs')!r})
        gin.parse_config_files_and_bindings([{str(child)!r}], [], finalize_config=False, skip_unknown=True)
    """)
    out = subprocess.run([sys.executable, "-c", control], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Path not found: " in out.stderr
