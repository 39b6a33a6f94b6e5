"""Issue 33, item 9: small things a newcomer meets in the first hour.

- `scalerl status` of a directory with no runs is an error (exit 1), as `scalerl fit` is;
- `scalerl components` prints bracketed text of a description as text, not rich markup;
- `scalerl sweep --help` says the default executor is slurm;
- a sweep spec copied out of the repository still finds its overlays and recipes;
- a benchmark file with a broken JSON line names that line, counted from 1, in the error.
- `scalerl fit` writes its tables next to the runs (or into `--csv DIR`), never the working directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from experiments import recipes, sweep_spec

REPO = Path(__file__).resolve().parent.parent


def test_status_of_a_directory_without_runs_is_an_error(tmp_path, capsys):
    from experiments.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty"), "--no-slurm"]) == 1
    err = capsys.readouterr().err
    assert f"no runs under {tmp_path / 'empty'}" in err, err
    assert main(["status", str(tmp_path / "empty"), "--no-slurm", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out) == [] and "no runs under" in captured.err
    # a missing directory stays a usage error (2), a directory with a run is shown (0)
    assert main(["status", str(tmp_path / "missing"), "--no-slurm"]) == 2
    run = tmp_path / "sweep" / "r0"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": "r0", "status": "done"}))
    assert main(["status", str(tmp_path / "sweep"), "--no-slurm"]) == 0


def test_components_prints_bracketed_text_of_descriptions(monkeypatch, capsys):
    from experiments.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # one table row per line: the text is not wrapped
    assert main(["components", "--family", "losses"]) == 0
    out = capsys.readouterr().out
    assert "zero gradient where rho is outside [low, high]" in out, out


def test_sweep_help_names_the_default_executor(capsys):
    from experiments.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "slurm (the default)" in text, text


def _copy_spec(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(recipes.SWEEPS_DIR / "loss_type.gin", dest / "my_loss_type.gin"))


def test_a_copied_spec_finds_the_repository_overlays_and_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: nothing is found relative to the working directory
    spec = _copy_spec(tmp_path / "elsewhere")
    for scale, recipe in (("paper", "scalerl.gin"), ("tiny", "tiny_cpu.gin")):
        runs = sweep_spec.expand(sweep_spec.load_spec(spec), scale)
        assert runs
        for run in runs:
            assert run.config_files == (str((recipes.CONFIGS_DIR / recipe).resolve()),
                                        str((recipes.SWEEPS_DIR / "overlays" / "baseline.gin").resolve())), run


def test_a_spec_prefers_files_next_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _copy_spec(tmp_path / "mine")
    (tmp_path / "mine" / "overlays").mkdir()
    own = tmp_path / "mine" / "overlays" / "baseline.gin"
    own.write_text("train.seed = 0\n")
    (run, *_) = sweep_spec.expand(sweep_spec.load_spec(spec), "tiny")
    assert run.config_files[1] == str(own.resolve())


def test_an_unresolvable_config_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _copy_spec(tmp_path / "mine")
    spec.write_text(spec.read_text().replace("overlays/baseline.gin", "overlays/nope.gin"))
    with pytest.raises(recipes.SweepError) as err:
        sweep_spec.expand(sweep_spec.load_spec(spec), "tiny")
    msg = str(err.value)
    assert "'overlays/nope.gin' not found" in msg, msg
    for place in (tmp_path / "mine", recipes.SWEEPS_DIR, recipes.CONFIGS_DIR):
        assert str(place / "overlays" / "nope.gin") in msg, msg
    assert "overlays/baseline.gin" in msg  # what there is


BROKEN = '{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2", "answer": "4"}\n{"problem": "3+3", "answer": \n' \
         '{"problem": "4+4", "answer": "8"}\n'


def test_a_broken_json_line_of_a_benchmark_is_named_from_1(tmp_path):
    from components.benchmarks import json_syntax_error, load_benchmark

    bad = tmp_path / "bench.jsonl"
    bad.write_text(BROKEN)
    with pytest.raises(ValueError) as err:
        load_benchmark(str(bad))
    msg = str(err.value)
    assert "line 4 (column" in msg and "is not valid JSON" in msg and '"3+3"' in msg, msg
    # a single JSON document: the line and column of its error, from 1
    doc = tmp_path / "bench.json"
    doc.write_text('[\n  {"problem": "1+1", "answer": "2"},\n  {"problem": "2+2" "answer": "4"}\n]\n')
    assert json_syntax_error(doc).startswith("line 3 (column 21)"), json_syntax_error(doc)
    good = tmp_path / "good.jsonl"
    good.write_text(BROKEN.replace('"answer": \n', '"answer": "6"}\n'))
    assert json_syntax_error(good) is None
    assert len(load_benchmark(str(good)).problems) == 4


def test_scalerl_eval_reports_the_broken_line(tmp_path, capsys):
    from experiments.cli import main

    bad = tmp_path / "bench.jsonl"
    bad.write_text(BROKEN)
    assert main(["eval", str(tmp_path), "--benchmark", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "line 4 (column" in err and "bench.jsonl" in err, err


def test_fit_writes_its_tables_next_to_the_runs_or_into_the_csv_directory(tmp_path, monkeypatch, capsys):
    """`scalerl fit RUNS` writes fits*.csv into RUNS, never into the working directory; `--csv DIR`
    (an existing directory, or a path ending in /) writes DIR/fits*.csv, `--csv FILE` FILE and its siblings."""
    from analysis.synthetic import write_sweep
    from experiments.cli import main

    write_sweep(tmp_path / "r", "loss_type", "train.loss", {"cispo": (0.6, 1.8, 1.0), "gspo": (0.6, 1.8, 1.0)},
                seeds=(0,), noise=0.01, final_compute=10.0, steps=60, eval_every=3, device="cpu", count=2)
    sweep = tmp_path / "r" / "loss_type"
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    stems = ("fits", "fits_configs", "fits_claims", "fits_pairs")
    assert main(["fit", str(sweep)]) == 0
    assert not list(work.iterdir()) and all((sweep / f"{s}.csv").is_file() for s in stems)
    (tmp_path / "tables").mkdir()
    for target, where in ((str(tmp_path / "tables"), tmp_path / "tables"), (str(tmp_path / "new") + "/", tmp_path / "new")):
        assert main(["fit", str(sweep), "--csv", target]) == 0
        assert all((where / f"{s}.csv").is_file() for s in stems), sorted(where.iterdir())
    assert main(["fit", str(sweep), "--csv", str(tmp_path / "mine.csv")]) == 0
    assert (tmp_path / "mine.csv").is_file() and (tmp_path / "mine_pairs.csv").is_file()
    assert not list(work.iterdir())
    capsys.readouterr()
