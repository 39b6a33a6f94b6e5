"""Per-task and downstream figures (Figs 1b, 9b, 10b, 11, 17b, 18; Table 1's math / code rows)
from synthetic run directories (analysis/synthetic_tasks.py), and what they say when runs are missing."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from analysis.synthetic import write_run, write_sweep  # noqa: E402
from analysis.synthetic_tasks import TASK_LAWS, add_downstream, write_mixture_run  # noqa: E402
from paper_figures.common import MissingRuns, Options, RunData  # noqa: E402

OPTS = Options(dpi=30, formats=("png",))
RUN = dict(steps=24, eval_every=2, device="cpu", count=2, k=4, prompts=64)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("task_runs")
    write_mixture_run(root, "math_code", scale=1e-4, **RUN)
    ref = write_run(root, "math_code", "math-only-seed0", A=0.61, B=1.9, C_mid=0.25, factor="train.task", value="math",
                    final_compute=4 * 0.2896, **RUN)
    add_downstream(root / "math_code" / "math+code-seed0", {"aime24": 0.5, "livecodebench": 0.4}, k=8)
    add_downstream(ref, {"aime24": 0.5}, k=8)
    runs = write_sweep(root, "batch_size", "train.prompts_per_step",
                       {"bs512": (0.605, 1.77, 0.28), "bs2048": (0.645, 1.70, 1.09)}, **RUN)
    for r in runs:
        add_downstream(r, {"aime24": 0.55}, k=8)
    return root


def _draw(fig_id, data, tmp_path, opts=OPTS):
    import importlib

    return importlib.import_module(f"paper_figures.{fig_id}").draw(data, tmp_path, opts)


def test_fig11_draws_one_fitted_curve_per_task_and_the_reference(root, tmp_path, monkeypatch):
    seen = {}
    real_save = plt.Figure.savefig

    def spy(fig, *a, **k):  # look at the axes as they are written
        ax = fig.axes[0]
        seen["labels"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["xscale"] = ax.get_xscale()
        seen["styles"] = [ln.get_linestyle() for ln in ax.lines]
        return real_save(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    paths = _draw("fig11", RunData(root), tmp_path)
    assert (tmp_path / "fig11.png").stat().st_size > 1000 and tmp_path / "fig11.png" in paths
    assert seen["xscale"] == "log"
    labels = seen["labels"]
    assert any(x.startswith("math: A=") for x in labels) and any(x.startswith("code: A=") for x in labels)
    assert any(x.startswith("math (single task): A=") for x in labels)
    assert seen["styles"].count("--") == 3  # each fitted curve extrapolated beyond its fit cutoff
    assert plt.get_fignums() == []


def test_per_task_fits_recover_each_tasks_law(root):
    from paper_figures.task_curves import mixture_table_rows

    rows = {r["experiment"]: r for r in mixture_table_rows(RunData(root), Options(fit_fraction=1.0, min_compute="none"))}
    assert set(rows) == {"ScaleRL-mixture (math)", "ScaleRL-mixture (code)"}
    for task, (A, B, _) in TASK_LAWS.items():
        r = rows[f"ScaleRL-mixture ({task})"]
        assert r["A"] == pytest.approx(A, abs=0.02) and r["B"] == pytest.approx(B, abs=0.2), (task, r)
    assert rows["ScaleRL-mixture (code)"]["C_mid"] < rows["ScaleRL-mixture (math)"]["C_mid"]  # Table 1: 1675 < 2896


def test_table1_has_the_math_and_code_rows(root, tmp_path):
    from paper_figures import table1

    df = table1.table(RunData(root), OPTS)
    assert df["experiment"].str.startswith("ScaleRL-mixture").sum() == 2
    assert (df["factor"] == "train.prompts_per_step").sum() == 2
    assert not df["experiment"].str.contains("train.prompts_per_step").any()  # rows named as the paper names them
    only_mixture = tmp_path / "only"
    write_mixture_run(only_mixture, "math_code", scale=1e-4, **RUN)
    assert list(table1.table(RunData(only_mixture), OPTS)["experiment"]) == ["ScaleRL-mixture (math)",
                                                                             "ScaleRL-mixture (code)"]


def test_a_mixture_run_in_any_sweep_is_found(tmp_path):
    from paper_figures.task_curves import mixture_eval
    from analysis.figure_specs import FIGURES

    write_mixture_run(tmp_path, "my_experiment", name="mix-seed0", scale=1e-4, **RUN)
    write_run(tmp_path, "other", "single-seed0", A=0.6, B=1.8, C_mid=0.3, **RUN)
    mix, ref = mixture_eval(FIGURES["fig11"], RunData(tmp_path), "compute_hours")
    assert set(mix["sweep"]) == {"my_experiment"} and ref.empty
    assert _draw("fig11", RunData(tmp_path), tmp_path / "out")


def test_missing_mixture_and_downstream_runs_are_explained(tmp_path):
    write_run(tmp_path, "batch_size", "bs512-seed0", A=0.6, B=1.8, C_mid=0.3, factor="train.prompts_per_step",
              value="bs512", **RUN)
    data = RunData(tmp_path)
    with pytest.raises(MissingRuns, match="task mixture"):
        _draw("fig11", data, tmp_path / "out")
    with pytest.raises(MissingRuns, match="none logged downstream benchmarks"):
        _draw("fig10b", data, tmp_path / "out")
    with pytest.raises(MissingRuns, match="generation_length"):
        _draw("fig9b", data, tmp_path / "out")
    with pytest.raises(MissingRuns, match="task mixture"):
        _draw("fig18", data, tmp_path / "out")


def test_downstream_figure_draws_mean_at_k_per_benchmark(root, tmp_path, monkeypatch):
    seen = {}
    real_save = plt.Figure.savefig

    def spy(fig, *a, **k):
        seen["axes"] = [(ax.get_title(), ax.get_xscale(), ax.get_ylabel(),
                         {ln.get_label(): (np.asarray(ln.get_xdata()), np.asarray(ln.get_ydata())) for ln in ax.lines})
                        for ax in fig.axes if ax.lines]
        return real_save(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    _draw("fig10b", RunData(root), tmp_path)
    (title, xscale, ylab, lines), = seen["axes"]
    assert title == "aime24" and xscale == "log" and ylab == "aime24 pass rate (mean@8)"
    assert set(lines) == {"bs512", "bs2048"}
    recs = [json.loads(x) for x in (root / "batch_size" / "bs512-seed0" / "eval.jsonl").read_text().splitlines()]
    down = [r for r in recs if r.get("benchmark") == "aime24" and r["compute_hours"] > 0]
    np.testing.assert_allclose(lines["bs512"][0], [r["compute_hours"] for r in down])
    np.testing.assert_allclose(lines["bs512"][1], [r["mean@k"] for r in down])
    _draw("fig18", RunData(root), tmp_path)
    assert sorted(t for t, *_ in seen["axes"]) == ["aime24", "livecodebench"]
    assert set(dict((t, ls) for t, _, _, ls in seen["axes"])["aime24"]) == {"math", "math+code"}


def test_downstream_records_never_enter_the_held_out_curve(root):
    from analysis.runs import load_runs

    ev = load_runs(root / "batch_size", what="eval")
    assert "benchmark" not in ev or ev["benchmark"].isna().all()
    bench = load_runs(root / "batch_size", what="benchmarks")
    assert set(bench["benchmark"]) == {"aime24"} and "pass@k.8" in bench
    # the held-out pass rate at each step is the held-out record's, not a benchmark's
    held = [json.loads(x) for x in (root / "batch_size" / "bs512-seed0" / "eval.jsonl").read_text().splitlines()
            if "benchmark" not in json.loads(x)]
    got = ev[ev["run"] == "bs512-seed0"].sort_values("step")["pass_rate"].to_numpy()
    np.testing.assert_allclose(got, [h["pass_rate"] for h in held])


def test_legacy_downstream_records_with_pass_rate_are_drawn(tmp_path, monkeypatch):
    """Benchmark records written with a pass_rate field (no mean@k) are drawn from it."""
    write_run(tmp_path, "model_size", "8B-seed0", A=0.6, B=1.8, C_mid=0.3, factor="model.path", value="8B", **RUN)
    path = tmp_path / "model_size" / "8B-seed0" / "eval.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows += [{"step": r["step"], "compute_hours": r["compute_hours"], "benchmark": "aime24", "pass_rate": 0.5 * r["pass_rate"],
              "k": 4} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _draw("fig1b", RunData(tmp_path), tmp_path / "out")[0].stat().st_size > 1000
