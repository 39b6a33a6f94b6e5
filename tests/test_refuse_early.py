"""Issue 33, item 3: every mistake in a config is refused before any compute, without a run directory.

With an EMPTY warm-start cache (so that resolving tiny_cpu.gin's `model.path = @warm_start()` would
train a model for a minute or more), `scalerl train` refuses an unknown component name, a bare word
where a string belongs, a malformed binding, an unknown parameter of `train` or of a component and a
number out of range: exit code 2, one clean line naming the binding or value at fault and what was
probably meant, nothing built in the cache and no run directory. `--print-config` prints the
operative configuration and builds and creates nothing. `scalerl sweep` refuses the same bindings in
the same words before anything is submitted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "experiments" / "configs" / "tiny_cpu.gin"

# (--gin binding, what the one-line error must say)
REFUSED = [
    ('train.loss = "cipso"', ["train.loss = 'cipso'", "Unknown loss 'cipso'", "Did you mean 'cispo'?"]),
    ("train.loss = cispo", ["--gin binding 'train.loss = cispo' does not parse",
                            'did you mean train.loss = "cispo"?']),
    ('train.curriculum = ["uniform", zero_variance_filter]',
     ['did you mean train.curriculum = ["uniform", "zero_variance_filter"]?']),
    ("train.lr = = 3", ["--gin binding 'train.lr = = 3' does not parse"]),
    ("train.lrr = 1e-4", ["--gin binding 'train.lrr = 1e-4'", "train has no parameter 'lrr'", "did you mean train.lr?"]),
    ("cispo.eps_maxx = 3.0", ["--gin binding 'cispo.eps_maxx = 3.0'", "cispo has no parameter 'eps_maxx'",
                              "did you mean cispo.eps_max?"]),
    ("trian.lr = 1e-4", ["no gin configurable named 'trian'", "did you mean train?"]),
    ("train.lr = -1.0", ["train.lr = -1.0 is out of range: must be > 0"]),
    ("cispo.eps_max = -1.0", ["cispo.eps_max = -1.0 is out of range: must be > 0"]),
]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty warm-start cache: any warm start would have to be built (and would land here)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("SCALERL_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)  # the default run directory, runs/..., would be made here
    return cache


def _nothing_made(tmp_path: Path, cache: Path) -> None:
    assert list(cache.iterdir()) == [], "a warm start was built (the config was resolved before it was checked)"
    assert not (tmp_path / "runs").exists(), "a refused run left a run directory"


@pytest.mark.parametrize("binding, says", REFUSED, ids=[b for b, _ in REFUSED])
def test_a_mistake_is_refused_before_the_warm_start_and_leaves_no_run_directory(tmp_path, empty_cache, capsys,
                                                                                 binding, says):
    from experiments.cli import main

    for run_dir in ([], ["--run-dir", str(tmp_path / "runs" / "mine")]):  # default and explicit run directory
        rc = main(["train", str(CONFIG), "--gin", binding, "--no-progress", *run_dir])
        err = capsys.readouterr().err
        assert rc == 2, err
        line = next((x for x in err.splitlines() if x.startswith("scalerl train: error: ")), "")
        assert all(s in line for s in says), err
        assert "Traceback" not in err and " at 0x" not in err and "In call to configurable" not in err, err
        _nothing_made(tmp_path, empty_cache)


def test_the_real_entry_point_refuses_with_exit_code_2_and_one_clean_line(tmp_path, empty_cache):
    proc = subprocess.run([sys.executable, "-m", "experiments.cli", "train", str(CONFIG), "--gin", "train.loss = cispo"],
                          cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert 'did you mean train.loss = "cispo"?' in proc.stderr
    assert "Traceback" not in proc.stderr and "ast.Name" not in proc.stderr, proc.stderr
    assert "run directory:" not in proc.stdout  # no run directory was named, none was made
    _nothing_made(tmp_path, empty_cache)


def test_a_mistake_in_a_recipe_file_names_the_file_and_line(tmp_path, empty_cache, capsys):
    from experiments.cli import main

    recipe = tmp_path / "mine.gin"
    recipe.write_text(f"include '{CONFIG}'\ntrain.lrr = 1e-4\n")
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"{recipe} line 2: train has no parameter 'lrr'; did you mean train.lr?" in err, err
    _nothing_made(tmp_path, empty_cache)


def test_print_config_prints_the_operative_config_and_makes_nothing(tmp_path, empty_cache, capsys):
    from experiments.cli import main

    assert main(["train", str(CONFIG), "--gin", 'train.loss = "dapo"', "--print-config"]) == 0
    out = capsys.readouterr().out
    for line in ["train.loss = 'dapo'",  # the binding
                 "train.lr = 5e-05",  # the recipe
                 "train.top_p = 1.0",  # a default
                 "model.path = @warm_start()",  # not resolved
                 "dapo.eps_high = 0.28",  # the loss's default
                 "pipeline_rl.k = 2"]:  # a component's binding
        assert line in out.splitlines(), (line, out)
    _nothing_made(tmp_path, empty_cache)
    # what it prints is a gin config: read back, it is the same configuration
    from components.trainer.config import UNRESOLVED_MODEL_PATH, train_config
    from components.trainer.gin_config import parse_gin_files

    printed = tmp_path / "printed.gin"
    printed.write_text(out)
    parse_gin_files([str(CONFIG)], ['train.loss = "dapo"'])
    want = train_config(model_path=UNRESOLVED_MODEL_PATH)
    parse_gin_files([str(printed)], [])
    assert train_config(model_path=UNRESOLVED_MODEL_PATH) == want
    # a refused config is refused there too
    assert main(["train", str(CONFIG), "--gin", "train.lrr = 1", "--print-config"]) == 2
    assert "did you mean train.lr?" in capsys.readouterr().err
    _nothing_made(tmp_path, empty_cache)


@pytest.mark.parametrize("binding, says", [
    ("train.loss = cispo", 'did you mean train.loss = "cispo"?'),
    ("train.lrr = 1e-4", "train has no parameter 'lrr'; did you mean train.lr?"),
    ("cispo.eps_maxx = 3.0", "cispo has no parameter 'eps_maxx'; did you mean cispo.eps_max?"),
    ('train.loss = "cipso"', "Unknown loss 'cipso'"),
    ("train.lr = -1.0", "train.lr = -1.0 is out of range: must be > 0"),
])
def test_sweep_refuses_the_same_bindings_in_the_same_words_before_submitting(tmp_path, empty_cache, monkeypatch,
                                                                            capsys, binding, says):
    from experiments.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # one line per message: rich does not wrap it
    rc = main(["sweep", "loss_type", "--scale", "tiny", "--executor", "debug", "--runs", str(tmp_path / "runs"),
               "--gin", binding])
    out = capsys.readouterr().out
    assert rc == 2 and says in out, out
    _nothing_made(tmp_path, empty_cache)
