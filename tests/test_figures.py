"""Every paper figure renders from small synthetic run directories, in the paper's conventions."""

from __future__ import annotations

import importlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from analysis.synthetic import SYNTHETIC_SWEEPS, write_paper_sweeps  # noqa: E402
from analysis.synthetic_tasks import DOWNSTREAM_SWEEPS, TASK_LAWS, write_task_sweeps  # noqa: E402
from experiments.cli import main as scalerl  # noqa: E402
from paper_figures.common import MissingRuns, Options, RunData, draw_curves_on, select  # noqa: E402
from paper_figures.render import render_all  # noqa: E402
from analysis.figure_specs import FIGURES  # noqa: E402

OPTS = Options(dpi=30)
# The figures and tables the issue lists (arXiv v1 numbering).
LISTED = ["fig1a", "fig2", "fig3", "fig12", "fig13", "fig4a", "fig4b", "fig5a", "fig5b", "fig6a", "fig6b", "fig7",
          "fig8a", "fig9a", "fig10a", "fig14a", "fig14b", "fig15", "fig16", "fig17a", "fig19a", "fig19b", "fig20",
          "table1", "fig1b", "fig9b", "fig10b", "fig17b", "fig11", "fig18"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # CPU-sized runs: C_mid of the paper's GPU-hours scaled down to minutes of CPU time.
    write_paper_sweeps(root, scale=1e-4, steps=30, eval_every=2, device="cpu", count=2, k=4, prompts=64)
    # the math + code mixture run and downstream benchmark records (Figs 1b, 9b, 10b, 11, 17b, 18)
    write_task_sweeps(root, scale=1e-4, steps=30, eval_every=2, device="cpu", count=2, k=4, prompts=64)
    return root


def test_every_listed_figure_is_in_the_table_and_every_sweep_is_synthesised():
    assert set(LISTED) <= set(FIGURES)  # other modules (downstream, per-task figures) add their own
    for fig_id in LISTED:
        spec = FIGURES[fig_id]
        assert spec.synthetic or set(spec.sweeps) & (set(SYNTHETIC_SWEEPS) | set(DOWNSTREAM_SWEEPS)), spec.id


@pytest.mark.parametrize("fig_id", ["fig3", "fig5a", "fig7", "fig16", "table1"])
def test_figures_are_written_as_png_and_pdf(fig_id, runs, tmp_path):
    paths = importlib.import_module(f"paper_figures.{fig_id}").draw(RunData(runs), tmp_path, OPTS)
    for ext in ("png", "pdf"):
        p = tmp_path / f"{fig_id}.{ext}"
        assert p in paths and p.stat().st_size > 1000
    assert p.read_bytes()[:4] == b"%PDF"
    assert plt.get_fignums() == []


def test_curve_figure_follows_the_paper_conventions(runs):
    data = RunData(runs)
    spec = FIGURES["fig5a"]
    ev = select(data.eval, spec)
    fig, ax = plt.subplots()
    fits = draw_curves_on(ax, spec, ev, Options(fit_fraction=0.5))
    assert ax.get_xscale() == "log"
    assert "pass rate (mean@4)" in ax.get_ylabel() and "CPU" in ax.get_xlabel()
    assert set(fits) == {"dapo", "gspo", "cispo"} and all(f is not None for f in fits.values())
    markers = {c.get_paths()[0].vertices.shape[0] for c in ax.collections}
    # per run: stars (fitted), hollow circles (before the fit starts, excluded), × (held out)
    assert len(ax.collections) == 9 and len(markers) == 3
    hollow = [c for c in ax.collections if len(c.get_facecolors()) == 0 or c.get_facecolors()[0][3] == 0]
    assert len(hollow) == 3
    # the subtitle says how the runs were fitted, whether A is identified, and the tail window
    # (a prefix fit starts at the paper's fraction of the fitted range)
    assert "first 50% of the run" in ax.get_title() and "from 0.4 of the fitted range (3)" in ax.get_title()
    assert "tail over the last 20% of the common window" in ax.get_title()
    styles = [line.get_linestyle() for line in ax.lines]
    assert styles.count("-") >= 3 and styles.count("--") == 3  # solid fit, dashed extrapolation
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert all("A=" in t and "B=" in t for t in labels)
    # the solid line ends at the cutoff, the dashed one starts there
    solid = [ln for ln in ax.lines if ln.get_linestyle() == "-" and len(ln.get_xdata())]
    dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    for s, d in zip(solid, dashed):
        assert s.get_xdata()[-1] == pytest.approx(d.get_xdata()[0])
    # the fitted curves lie over the points, not under them
    assert min(ln.get_zorder() for ln in solid + dashed) > max(c.get_zorder() for c in ax.collections)
    plt.close(fig)


def test_a_step_0_evaluation_with_almost_no_compute_does_not_stretch_the_log_axis():
    from paper_figures.common import _left_limit

    fig, ax = plt.subplots()
    runs = [np.array([4e-7, 0.004, 0.01, 0.05]), np.array([9e-7, 0.003, 0.012, 0.06])]  # [evals] per run
    for c in runs:
        ax.scatter(c, np.linspace(0.2, 0.7, c.size))
    ax.set_xscale("log")
    _left_limit(ax, runs)
    assert ax.get_xlim()[0] == pytest.approx(0.0015)  # half the earliest second evaluation
    # a first evaluation already among the others leaves the axis alone
    fig2, ax2 = plt.subplots()
    spread = [np.array([0.002, 0.004, 0.01]), np.array([0.001, 0.003, 0.02])]
    for c in spread:
        ax2.scatter(c, np.linspace(0.2, 0.7, c.size))
    ax2.set_xscale("log")
    before = ax2.get_xlim()
    _left_limit(ax2, spread)
    assert ax2.get_xlim() == before
    plt.close(fig)
    plt.close(fig2)


def test_fig3_matches_eq1_numerically(tmp_path):
    from paper_figures import fig3
    from paper_figures.illustrations import COMPUTE

    (title, curves), = fig3.PANELS
    c = curves[0]
    expected = c.R0 + (c.A - c.R0) / (1.0 + (c.C_mid / COMPUTE) ** c.B)  # Eq. 1 written out
    np.testing.assert_allclose(c.values(), expected, rtol=1e-12)
    # and the drawn line carries exactly those values
    fig, ax = plt.subplots()
    from paper_figures.illustrations import draw_curve_panel

    draw_curve_panel(ax, title, curves)
    np.testing.assert_allclose(ax.lines[0].get_ydata(), expected, rtol=1e-12)
    half = np.interp(np.log(c.C_mid), np.log(COMPUTE), expected)
    assert half == pytest.approx(c.R0 + (c.A - c.R0) / 2, abs=1e-3)  # C_mid = half the gain
    plt.close(fig)


def test_fig13_crossover_crosses():
    from paper_figures import fig13
    from paper_figures.illustrations import COMPUTE

    fast, slow = fig13.PANELS[1][1]
    diff = fast.values() - slow.values()
    assert diff[COMPUTE.searchsorted(1000.0)] > 0 and diff[-1] < 0


def test_fig7_table_slope_is_b(runs, tmp_path):
    from paper_figures import fig7

    table, transformed, common_a = fig7.loo_table(RunData(runs), Options(fit_fraction=1.0))
    assert set(table["run"]) == set(SYNTHETIC_SWEEPS["leave_one_out"][1])
    assert np.allclose(table["common_A"], common_a) and common_a == pytest.approx(table["A"].mean())
    # the least-squares slope of log F vs log C is close to the refit B
    np.testing.assert_allclose(table["slope_logF_logC"], table["B_at_common_A"], rtol=0.15)


def test_missing_figures_are_listed_with_reasons(tmp_path):
    write_paper_sweeps(tmp_path / "runs", sweeps=["loss_type"], steps=20, eval_every=2)
    written, missing, failed = render_all(tmp_path / "runs", tmp_path / "out", OPTS,
                                          only=["fig5a", "fig3", "fig10a", "fig16", "table1"])
    assert set(written) == {"fig5a", "fig3"} and not failed
    assert "batch_size" in missing["fig10a"] and "batch_size" in missing["fig16"]
    with pytest.raises(KeyError, match="unknown figure"):
        render_all(tmp_path / "runs", tmp_path / "out", OPTS, only=["fig99"])


def test_runs_without_evaluations_are_missing_not_failed(tmp_path):
    write_paper_sweeps(tmp_path / "runs", sweeps=["batch_size"], steps=10, with_evals=False)
    written, missing, failed = render_all(tmp_path / "runs", tmp_path / "out", OPTS, only=["fig10a", "fig16"])
    assert "none has evaluations" in missing["fig10a"] and "fig16" in written and not failed


def test_factor_match_selects_runs_from_other_sweep_names(tmp_path):
    from analysis.synthetic import write_sweep

    write_sweep(tmp_path, "my_loss_ablation", "train.loss", {"dapo": (0.52, 1.8, 1.0), "cispo": (0.6, 1.7, 1.0)},
                steps=10, eval_every=2)
    ev = select(RunData(tmp_path).eval, FIGURES["fig5a"])
    assert set(ev["value"]) == {"dapo", "cispo"}


def test_scalerl_figures_cli_writes_every_figure(runs, tmp_path, capsys):
    """`scalerl figures` draws every listed figure from the synthetic sweeps (PNG here; PDF in
    test_figures_are_written_as_png_and_pdf, to keep the suite fast)."""
    out = tmp_path / "figs"
    rc = scalerl(["figures", str(runs), "--out", str(out), "--dpi", "30", "--formats", "png"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert " 0 failed" in text, text
    for fig_id in LISTED:
        assert (out / f"{fig_id}.png").stat().st_size > 1000, fig_id
    assert plt.get_fignums() == []  # every figure was closed
    assert pd.read_csv(out / "table1.csv").shape[0] == sum(
        len(SYNTHETIC_SWEEPS[s][1]) for s in FIGURES["table1"].sweeps if s in SYNTHETIC_SWEEPS) + len(TASK_LAWS)
    assert (out / "fig7.csv").is_file() and (out / "table1.md").is_file()
    assert scalerl(["figures", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert scalerl(["figures", str(runs), "--out", str(out), "--only", "fig99"]) == 2


def test_sweeps_sharing_a_factor_do_not_mix(runs):
    """zero_variance_filtering and no_positive_resampling both vary train.curriculum; DAPO's and
    GSPO's clip sweeps both end in eps_high: each figure gets only its own sweep."""
    ev = RunData(runs).eval
    assert set(select(ev, FIGURES["fig6a"])["sweep"]) == {"zero_variance_filtering"}
    assert set(select(ev, FIGURES["fig6b"])["sweep"]) == {"no_positive_resampling"}
    assert set(select(ev, FIGURES["fig8a"])["sweep"]) == {"scalerl_seeds"}
    only_dapo = ev[ev["sweep"] == "dapo_clip"].assign(sweep="renamed")
    assert select(only_dapo, FIGURES["fig19a"]).shape[0] == only_dapo.shape[0]  # by factor
    assert select(only_dapo, FIGURES["fig20"]).empty


def test_values_are_ordered_naturally():
    from paper_figures.common import _sort_key

    assert sorted(["bs2048", "bs512", "bs768"], key=_sort_key) == ["bs512", "bs768", "bs2048"]
    assert sorted([8.0, 4.0, 5.0], key=_sort_key) == [4.0, 5.0, 8.0]


def test_a_figure_without_its_runs_raises_missing_runs(tmp_path):
    from paper_figures import fig5a

    with pytest.raises(MissingRuns, match="loss_type"):
        fig5a.draw(RunData(tmp_path), tmp_path / "out", OPTS)


def test_factor_matching_rule():
    from paper_figures.common import factor_matches

    assert factor_matches("train.loss", ["train.loss"]) and factor_matches("loss", ["train.loss"])
    assert factor_matches("losses.dapo.eps_high", ["dapo.eps_high"])
    assert not factor_matches("losses.gspo.eps_high", ["dapo.eps_high"])
    assert not factor_matches("train.lossy", ["train.loss"]) and not factor_matches(None, ["loss"])


def test_figures_mark_contended_runs_and_say_how_they_fitted(tmp_path):
    """Runs above 10% CPU contention stay in the figure, faded and labelled; every curve figure
    writes its protocol, fit start and margin in the subtitle and in <figure>_fits.csv."""
    from analysis.synthetic import write_run

    kw = dict(B=1.8, C_mid=1.0, steps=30, eval_every=2, device="cpu", count=2, factor="train.loss")
    write_run(tmp_path / "runs", "loss_type", "cispo-s0", A=0.6, value="cispo", contention=0.02, **kw)
    write_run(tmp_path / "runs", "loss_type", "dapo-s0", A=0.52, value="dapo", contention=0.31, **kw)
    from paper_figures import fig5a

    data = RunData(tmp_path / "runs")
    fig, ax = plt.subplots()
    draw_curves_on(ax, FIGURES["fig5a"], select(data.eval, FIGURES["fig5a"]), OPTS, data)
    labels = {t.get_text().split(":")[0]: t for t in ax.get_legend().get_texts()}
    assert "dapo [contention 31%]" in labels and "cispo" in labels
    alphas = {ln.get_label().split(":")[0]: ln.get_alpha() for ln in ax.lines if ln.get_label()[:1] != "_"}
    assert alphas["dapo [contention 31%]"] < 1 and alphas["cispo"] in (None, 1.0)
    assert "whole run (whole protocol), from 0.4 of the fitted range (2)" in ax.get_title()
    plt.close(fig)
    paths = fig5a.draw(data, tmp_path / "out", Options(dpi=30, formats=("png",)))
    csv = pd.read_csv(tmp_path / "out" / "fig5a_fits.csv").set_index("run")
    assert tmp_path / "out" / "fig5a_fits.csv" in paths
    assert set(csv["protocol"]) == {"whole"} and set(csv["margin"]) == {0.02}
    assert bool(csv.loc["dapo-s0", "contended"]) and not bool(csv.loc["cispo-s0", "contended"])


def test_prefix_figures_fit_the_first_half(runs):
    """Fig 7 / 15 (leave-one-out) and Table 1 fit the first half of each run, forward ablations the whole."""
    from paper_figures import fig7, table1

    table, _, _ = fig7.loo_table(RunData(runs), Options())
    assert set(table["protocol"]) == {"loo"} and set(table["fit_fraction"]) == {0.5}
    t1 = table1.table(RunData(runs), Options())
    final = RunData(runs).eval.groupby("sweep")["compute_hours"].max()
    assert set(t1["protocol"]) == {"scaling"} and (t1["fit_to"] <= 0.5 * t1["sweep"].map(final) + 1e-12).all()


def test_fig16_draws_held_out_entropy_else_the_training_entropy(runs, tmp_path, monkeypatch):
    from paper_figures import fig16

    labels = []
    monkeypatch.setattr(fig16, "save", lambda fig, out, stem, opts: labels.append(fig.axes[0].get_ylabel()) or [])
    fig16.draw(RunData(runs), tmp_path, OPTS)
    data = RunData(runs)
    data.eval  # noqa: B018  (loaded, then the held-out entropy removed: a run logging only training entropy)
    data.__dict__["eval"] = data.eval.drop(columns=["entropy"])
    fig16.draw(data, tmp_path, OPTS)
    assert labels[0].startswith("held-out entropy") and labels[1].startswith("policy entropy on training batches")
    plt.close("all")


def test_a_configuration_keeps_its_legend_entry_when_its_first_seed_is_contended_and_an_exhausted_run_says_so(
        tmp_path):
    """Seeds share one legend entry per configuration; a contended seed has its own. When the first
    seed drawn was the contended one, the configuration's entry went missing (the tiny-long bs64)."""
    from analysis.synthetic import write_run

    kw = dict(B=1.8, C_mid=1.0, steps=30, eval_every=2, device="cpu", count=2, factor="train.loss")
    write_run(tmp_path, "loss_type", "cispo-s0", A=0.6, value="cispo", seed=0, contention=0.3, status="failed",
              error="CurriculumExhausted: no_positive_resampling: all 200 training prompts have been dropped", **kw)
    write_run(tmp_path, "loss_type", "cispo-s1", A=0.6, value="cispo", seed=1, **kw)
    write_run(tmp_path, "loss_type", "dapo-s0", A=0.52, value="dapo", seed=0, **kw)
    write_run(tmp_path, "loss_type", "dapo-s1", A=0.52, value="dapo", seed=1, status="failed", error="boom", **kw)
    data = RunData(tmp_path)
    fig, ax = plt.subplots()
    draw_curves_on(ax, FIGURES["fig5a"], select(data.eval, FIGURES["fig5a"]), OPTS, data)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    assert any(t.startswith("cispo (2/2 seeds): A=") for t in labels), labels
    assert any(t.startswith("cispo (seed 0) [pool ran out] [contention 30%]") for t in labels), labels
    assert any(t.startswith("dapo (2/2 seeds): A=") for t in labels), labels
    assert len(labels) == 3, labels


def test_the_same_figure_saves_to_the_same_pdf_bytes(tmp_path):
    """No creation date in the PDF: regenerating a study's figures from the same runs leaves git clean."""
    from paper_figures.common import save

    paths = []
    for i in range(2):
        fig, ax = plt.subplots()
        ax.plot([1, 2, 3], [0.2, 0.5, 0.6])
        paths += save(fig, tmp_path / str(i), "fig", Options(dpi=30, formats=("pdf", "png")))
    pdfs = [p.read_bytes() for p in paths if p.suffix == ".pdf"]
    assert pdfs[0][:5] == b"%PDF-" and pdfs[0] == pdfs[1]
    assert b"CreationDate" not in pdfs[0]
