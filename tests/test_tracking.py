"""Experiment tracking (components/trainer/tracking.py): W&B offline, TensorBoard, MLflow file store.

The tracker is driven directly with log lines shaped like the trainer's (metrics.jsonl and
eval.jsonl lines, written through the run directory's JsonlLog first, then read back), and
what each tracker stored is read back with the tracker's own reader:

- W&B: the offline run's .wandb file (LevelDB-log framing of wandb's protobuf Records; wandb
  ships no Python reader, so `read_wandb_records` below parses the framing and wandb's own
  `wandb_internal_pb2.Record` parses each record);
- TensorBoard: tensorboard's EventAccumulator on the sweep's log directory;
- MLflow: MlflowClient on a local file store.
"""

from __future__ import annotations

import glob
import json
import logging
import random
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from components.engines.base import Completion
from components.models import make_char_tokenizer
from components.trainer.config import ConfigError, TrainConfig, validate
from components.trainer.rollout import Rollout
from components.trainer.runlog import JsonlLog, RunInfo, read_jsonl
from components.trainer.tracking import (
    SAMPLE_COLUMNS,
    RunTracker,
    check_trackers,
    flatten_record,
    pick_samples,
    tensorboard_dir,
)


# ---------------------------------------------------------------------------------------------
# records shaped like components/trainer/loop.py's metrics and eval lines
def metrics_line(step: int, rng: random.Random) -> dict:
    return {
        "step": step, "version": step, "compute_hours": 0.001 * step + rng.random() * 1e-5,
        "wall_s": 1.7 * step, "flops": 1.234567891e12 * step, "prompts": 4, "generations": 16,
        "tokens": 80 + step, "reward_mean": rng.uniform(-1, 1), "pass_rate": rng.random(),
        "zero_variance_frac": 0.25, "filtered_frac": 0.0, "truncation_rate": rng.random(),
        "completion_len_mean": 5.5, "verifier_errors": 0, "multi_version_frac": 0.0,
        "forced_tokens": 0, "interrupted_frac": 0.0, "loss": rng.gauss(0, 1),
        "grad_norm": rng.random() * 3, "lr": 1e-3 * min(1.0, step / 2), "entropy": 2.0 + rng.random(),
        "clip_frac": float("nan"), "is_ratio_mean": 1.0 + 1e-7 * step, "lag_max": 0,
        "time_generate": 0.5, "time_sync": 0.01, "time_wait": 0.2, "generated_tokens": 90,
        "stale_dropped": 0, "refill_dropped": 0, "skipped_update": False,
    }


def eval_line(step: int, rng: random.Random) -> dict:
    return {
        "step": step, "version": step, "compute_hours": 0.001 * step, "flops": 2.5e12 * step,
        "wall_s": 2.0 * step, "pass_rate": rng.random(), "k": 2, "prompts": 4,
        "per_task": {"arithmetic": rng.random(), "reasoning_gym:countdown": rng.random()},
        "eval_tokens": 40, "eval_truncation_rate": 0.1, "eval_verifier_errors": 0, "time_eval": 0.3,
    }


def write_logs(run_dir: Path, steps, eval_steps, seed: int = 0):
    """Write lines as the trainer does (JsonlLog). Returns (records as the trainer holds them,
    for the tracker) and (the lines as read back from metrics.jsonl / eval.jsonl, the reference)."""
    rng = random.Random(seed)
    m_log, e_log = JsonlLog(run_dir / "metrics.jsonl"), JsonlLog(run_dir / "eval.jsonl")
    raw_m = [metrics_line(s, rng) for s in steps]
    raw_e = [eval_line(s, rng) for s in eval_steps]
    for r in raw_m:
        m_log.write(r)
    for r in raw_e:
        e_log.write(r)
    m_log.close(), e_log.close()
    return (raw_m, raw_e), (read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl"))


def numeric_items(line: dict, prefix: str) -> dict:
    """Independent flattening of a JSONL line: every number (bools as 0/1), nested dicts with '/'."""
    out = {}
    for k, v in line.items():
        if isinstance(v, dict):
            out.update(numeric_items(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and v is not None:
            out[f"{prefix}{k}"] = float(v)
    return out


def make_run(tmp_path: Path, sweep: str = "my_sweep", run: str = "lr_1e-3") -> Path:
    run_dir = tmp_path / "runs" / sweep / run
    run_dir.mkdir(parents=True)
    info = RunInfo(run_dir)
    info.start({"name": run, "sweep": sweep, "factor": "lr", "value": 1e-3}, {"device": "cpu", "count": 2}, resumed=False)
    (run_dir / "config.gin").write_text("train.lr = 0.001\ntrain.loss = 'cispo'\n")
    return run_dir


def tiny_rollouts(tokenizer, n_groups: int = 3, G: int = 4, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = list(tokenizer.encode(f"{g}+{g}=", add_special_tokens=False))
        comps, rewards, passed = [], [], []
        for j in range(G):
            text = rng.choice(["12", "x7", "4", "9 9"])
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            versions = [g + (t % 2) for t in range(len(ids))]
            forced = [t == 0 and j == 1 for t in range(len(ids))]
            if forced[0]:
                versions[0] = 99  # a forced token's version is not part of the span
            comps.append(Completion(group_id=g, sample_index=j, prompt_ids=prompt, token_ids=ids,
                                    gen_logp=[-0.1] * len(ids), versions=versions, forced=forced, finish_reason="stop"))
            ok = rng.random() < 0.5
            rewards.append(1.0 if ok else -1.0)
            passed.append(ok)
        out.append(Rollout(order_id=10 + g, problem_id=f"p{g}", completions=comps, rewards=rewards, passed=passed, engine_version=g))
    return out


@pytest.fixture
def tokenizer():
    return make_char_tokenizer()


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    """W&B offline in tmp, MLflow file store in tmp (mlflow-skinny: opt into its file store)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "scalerl-tests")
    (tmp_path / "wandb_dir").mkdir()
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return {"wandb_dir": tmp_path / "wandb_dir", "mlflow_uri": uri}


# ---------------------------------------------------------------------------------------------
# readers
def read_wandb_records(path: Path) -> list:
    """wandb Records of a .wandb file: ':W&B' + magic + version (7 bytes), then LevelDB-log
    framing (32 KiB blocks; each chunk: crc32c u32, length u16, type u8; FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks, out = 32768, 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # FULL, FIRST
            chunks = [payload]
        else:  # MIDDLE, LAST
            chunks.append(payload)
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(chunks))
            out.append(rec)
            chunks = []
    return out


def wandb_runs(wandb_dir: Path, timeout_s: float = 60.0) -> list[dict]:
    """Every offline run under wandb_dir: id, group, name, config, history rows.

    wandb-core writes the .wandb file asynchronously and may finish it shortly after
    run.finish() returns: wait (bounded) until every file ends with its "exit" record.
    """
    files = sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    deadline = time.monotonic() + timeout_s
    records = {}
    for f in files:
        while True:
            records[f] = read_wandb_records(Path(f))
            if any(r.WhichOneof("record_type") == "exit" for r in records[f]):
                break
            assert time.monotonic() < deadline, f"{f} has no exit record {timeout_s}s after run.finish()"
            time.sleep(0.2)
    runs = []
    for f in files:
        info = {"file": f, "history": [], "config": {}, "summary": {}}
        for rec in records[f]:
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                info.update(id=rec.run.run_id, group=rec.run.run_group, name=rec.run.display_name, project=rec.run.project)
                for item in rec.run.config.update:
                    info["config"][item.key] = json.loads(item.value_json)
            elif kind == "config":
                for item in rec.config.update:
                    info["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                info["history"].append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item})
            elif kind == "summary":
                for it in rec.summary.update:
                    info["summary"][it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
        info["dir"] = Path(f).parent
        runs.append(info)
    return runs


def tb_events(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def assert_mirrors(lines: list[dict], prefix: str, got: dict) -> int:
    """got[tag][step] == the line's value for every numeric field (exactly); returns the count."""
    checked = 0
    for line in lines:
        for tag, value in numeric_items(line, prefix).items():
            assert tag in got, (tag, sorted(got)[:10])
            assert got[tag][line["step"]] == value, (tag, line["step"], got[tag][line["step"]], value)
            checked += 1
    return checked


# ---------------------------------------------------------------------------------------------
def test_check_trackers_and_config_validation(monkeypatch):
    assert check_trackers(None) == () and check_trackers([]) == ()
    assert check_trackers("wandb") == ("wandb",)
    assert check_trackers(["tensorboard", "mlflow", "tensorboard"]) == ("tensorboard", "mlflow")
    with pytest.raises(ValueError) as err:
        check_trackers(["wandb", "neptune"])
    # the registry's error: the name, every registered tracker, the closest
    assert "Unknown tracker 'neptune'" in str(err.value) and "mlflow, tensorboard, wandb" in str(err.value)
    assert "Did you mean" in str(err.value)

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError) as err:
        check_trackers(["wandb", "mlflow"])
    assert "mlflow" in str(err.value) and "scalerl-zoo[track]" in str(err.value)
    monkeypatch.setattr(importlib.util, "find_spec", real)

    cfg = TrainConfig(model_path="/x", trackers=("tensorboard", "comet"))
    with pytest.raises(ConfigError, match="Unknown tracker 'comet'.*tracker names: mlflow, tensorboard, wandb.*Did you mean"):
        validate(cfg)
    with pytest.raises(ConfigError, match="samples_every"):
        validate(TrainConfig(model_path="/x", samples_every=-1))
    validate(TrainConfig(model_path="/x", trackers=("wandb", "tensorboard", "mlflow")))
    assert TrainConfig(model_path="/x").trackers == ()  # none by default


def test_train_config_binds_tracking_fields_from_gin():
    import gin

    from components.trainer.config import train_config

    gin.clear_config()
    try:
        gin.parse_config('train.trackers = ["tensorboard", "mlflow"]\ntrain.samples_every = 5\ntrain.samples_per_log = 2\n'
                         'train.model_path = "/m"')
        cfg = train_config()
        assert cfg.trackers == ("tensorboard", "mlflow") and cfg.samples_every == 5 and cfg.samples_per_log == 2
        assert cfg.to_dict()["trackers"] == ["tensorboard", "mlflow"]
        gin.clear_config()
        gin.parse_config('train.trackers = "wandb"\ntrain.model_path = "/m"')
        assert train_config().trackers == ("wandb",)
    finally:
        gin.clear_config()


def test_flatten_record():
    rec = {"step": 3, "a": 1.5, "ok": True, "none": None, "name": "x", "nested": {"b": 2, "c": {"d": 0.25}}, "l": [1]}
    assert flatten_record(rec, "eval/") == {"eval/step": 3.0, "eval/a": 1.5, "eval/ok": 1.0, "eval/nested/b": 2.0, "eval/nested/c/d": 0.25}
    assert flatten_record({"x": np.float32(0.5), "t": np.int64(3)}) == {"x": 0.5, "t": 3.0}
    # null in the JSONL line: left out, whether the record holds None or the NaN / inf it was written from
    assert flatten_record({"nan": float("nan"), "inf": float("inf"), "n": np.float64("nan"), "ok": 1}) == {"ok": 1.0}


def test_pick_samples_is_deterministic_decodes_and_spans_sampled_versions(tokenizer):
    rollouts = tiny_rollouts(tokenizer)
    a = pick_samples(rollouts, tokenizer, step=7, n=5)
    shuffled = list(reversed(rollouts))
    assert pick_samples(shuffled, tokenizer, step=7, n=5) == a  # independent of arrival order
    assert len(a) == 5 and all(set(s) == set(SAMPLE_COLUMNS) for s in a)
    assert pick_samples(rollouts, tokenizer, step=8, n=5) != a  # another step, another draw (fixed seeds)
    assert len(pick_samples(rollouts, tokenizer, step=1, n=100)) == 12  # at most every completion
    assert pick_samples(rollouts, tokenizer, step=1, n=0) == []
    by_order = {r.order_id: r for r in rollouts}
    for s in a:
        r = by_order[s["order_id"]]
        c = r.completions[s["sample"]]
        assert s["problem_id"] == r.problem_id and s["step"] == 7
        assert s["prompt"] == f"{s['order_id'] - 10}+{s['order_id'] - 10}="
        assert s["completion"] == tokenizer.decode(c.token_ids, skip_special_tokens=False)
        assert s["reward"] == r.rewards[s["sample"]] and s["passed"] == r.passed[s["sample"]]
        sampled = [v for v, f in zip(c.versions, c.forced) if not f]
        assert (s["version_min"], s["version_max"]) == (min(sampled), max(sampled))
        assert s["version_max"] != 99
    assert [(s["order_id"], s["sample"]) for s in a] == sorted((s["order_id"], s["sample"]) for s in a)


def test_no_tracker_still_writes_samples_jsonl(tmp_path, tokenizer):
    run_dir = make_run(tmp_path)
    rollouts = tiny_rollouts(tokenizer)
    tr = RunTracker(run_dir, [], samples_every=2, samples_per_log=3)
    assert tr.backends == []
    for step in range(1, 6):
        tr.log_metrics({"step": step, "pass_rate": 0.5})
        got = tr.log_samples(step, rollouts, tokenizer)
        assert len(got) == (3 if step % 2 == 0 else 0)
    tr.close()
    lines = read_jsonl(run_dir / "samples.jsonl")
    assert [l["step"] for l in lines] == [2, 2, 2, 4, 4, 4]
    assert lines[:3] == pick_samples(rollouts, tokenizer, step=2, n=3)


def test_tensorboard_values_equal_metrics_jsonl(tmp_path, tokenizer):
    run_dir = make_run(tmp_path)
    (raw_m, raw_e), (metrics, evals) = write_logs(run_dir, steps=range(1, 7), eval_steps=[0, 3, 6])
    tr = RunTracker(run_dir, ["tensorboard"], samples_every=3, samples_per_log=2)
    tr.log_eval(raw_e[0])
    for line in raw_m:  # the records the trainer wrote (NaN included), not the lines read back
        tr.log_metrics(line)
        tr.log_samples(line["step"], tiny_rollouts(tokenizer, seed=line["step"]), tokenizer)
        for e in raw_e[1:]:
            if e["step"] == line["step"]:
                tr.log_eval(e)
    tr.close("done")
    assert tr.failed == {}

    logdir = tensorboard_dir(run_dir)
    assert logdir == tmp_path / "runs" / "my_sweep" / "tensorboard" / "lr_1e-3"  # one dir per sweep
    acc = tb_events(logdir)
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    # TensorBoard stores scalars as float32: each value is the JSONL value rounded to float32
    as32 = {tag: {s: float(np.float32(v)) for s, v in d.items()} for tag, d in got.items()}
    want = {tag: {line["step"]: float(np.float32(v)) for line in metrics for t, v in numeric_items(line, "train/").items() if t == tag}
            for tag in {t for line in metrics for t in numeric_items(line, "train/")}}
    n = 0
    for tag, steps in want.items():
        assert as32[tag] == steps, tag
        n += len(steps)
    for line in evals:
        for tag, value in numeric_items(line, "eval/").items():
            assert got[tag][line["step"]] == float(np.float32(value)), tag
            n += 1
    assert n > 150
    assert "train/clip_frac" not in got  # NaN is null in metrics.jsonl: not a value to mirror
    assert "eval/per_task/reasoning_gym:countdown" in got
    texts = acc.Tags()["tensors"]
    assert any(t.startswith("samples") for t in texts) and any(t.startswith("config/gin") for t in texts)
    sample_steps = sorted(e.step for t in texts if t.startswith("samples") for e in acc.Tensors(t))
    assert sample_steps == [3, 6]
    gin_text = [e for t in texts if t.startswith("config/gin") for e in acc.Tensors(t)][-1].tensor_proto.string_val[0].decode()
    assert "train.lr = 0.001" in gin_text


def test_wandb_offline_history_equals_jsonl_and_groups_by_sweep(tmp_path, tokenizer, offline_env):
    run_dir = make_run(tmp_path)
    (raw_m, raw_e), (metrics, evals) = write_logs(run_dir, steps=range(1, 5), eval_steps=[0, 4])
    cfg = TrainConfig(model_path="/m", trackers=("wandb",), samples_every=2, samples_per_log=2)
    tr = RunTracker.from_config(cfg, run_dir)
    tr.log_eval(raw_e[0])
    for line in raw_m:
        tr.log_metrics(line)
        tr.log_samples(line["step"], tiny_rollouts(tokenizer), tokenizer)
    tr.log_eval(raw_e[1])
    tr.close("done", operative_config="# operative\ntrain.lr = 0.001\n")
    assert tr.failed == {}

    (run,) = wandb_runs(offline_env["wandb_dir"])
    stored = json.loads((run_dir / "run.json").read_text())["trackers"]["wandb"]
    assert run["id"] == stored["id"] and run["group"] == "my_sweep" and run["name"] == "lr_1e-3"
    assert run["project"] == "scalerl-tests"
    assert run["config"]["train"]["trackers"] == ["wandb"] and run["config"]["run"]["factor"] == "lr"
    got: dict = {}
    for row in run["history"]:
        for kind in ("train", "eval"):
            if f"{kind}/step" in row:
                for k, v in row.items():
                    if k.startswith(f"{kind}/"):
                        got.setdefault(k, {})[row[f"{kind}/step"]] = v
    n = assert_mirrors(metrics, "train/", got) + assert_mirrors(evals, "eval/", got)
    assert n > 100
    assert run["summary"]["status"] == "done"
    tables = sorted(glob.glob(str(run["dir"] / "files" / "media" / "table" / "samples" / "*.table.json")))
    assert len(tables) == 2
    table = json.loads(Path(tables[0]).read_text())
    want = pick_samples(tiny_rollouts(tokenizer), tokenizer, step=2, n=2)
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"] == [[s[c] for c in SAMPLE_COLUMNS] for s in want]
    assert (run["dir"] / "files" / "config.gin").read_text() == "# operative\ntrain.lr = 0.001\n"


def test_mlflow_file_store_metrics_params_config_and_samples(tmp_path, tokenizer, offline_env):
    from mlflow import MlflowClient

    run_dir = make_run(tmp_path)
    _, (metrics, evals) = write_logs(run_dir, steps=range(1, 5), eval_steps=[0, 2, 4])
    cfg = TrainConfig(model_path="/m", trackers=("mlflow",), samples_every=2, samples_per_log=3, task_kwargs={"num_train": 12})
    tr = RunTracker.from_config(cfg, run_dir)
    for line in metrics:  # here the lines read back from the files
        tr.log_metrics(line)
        tr.log_samples(line["step"], tiny_rollouts(tokenizer), tokenizer)
    for line in evals:
        tr.log_eval(line)
    tr.close("done")
    assert tr.failed == {}

    client = MlflowClient(tracking_uri=offline_env["mlflow_uri"])
    exp = client.get_experiment_by_name("my_sweep")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == json.loads((run_dir / "run.json").read_text())["trackers"]["mlflow"]["run_id"]
    assert run.info.run_name == "lr_1e-3" and run.info.status == "FINISHED"
    assert run.data.params["lr"] == str(cfg.lr) and run.data.params["task_kwargs/num_train"] == "12"
    got = {}
    for key in run.data.metrics:
        got[key] = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
    assert assert_mirrors(metrics, "train/", got) + assert_mirrors(evals, "eval/", got) > 100
    art = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "art")))
    assert "train.loss = 'cispo'" in (art / "config.gin").read_text()
    assert json.loads((art / "scalerl_run.json").read_text())["status"] == "done"
    table = json.loads((art / "samples.json").read_text())
    assert table["data"] == [[s[c] for c in SAMPLE_COLUMNS] for s in read_jsonl(run_dir / "samples.jsonl")]
    assert len(table["data"]) == 6


def test_resume_continues_the_same_tracker_runs(tmp_path, tokenizer, offline_env):
    """Killed after step 4 with a checkpoint at step 2: the resumed tracker continues the same
    W&B and MLflow runs; TensorBoard and samples.jsonl drop what lay past the checkpoint."""
    from mlflow import MlflowClient

    run_dir = make_run(tmp_path)
    trackers = ["wandb", "tensorboard", "mlflow"]
    first = [metrics_line(s, random.Random(s)) for s in range(1, 5)]
    tr = RunTracker(run_dir, trackers, samples_every=1, samples_per_log=1)
    for line in first:
        tr.log_metrics(line)
        tr.log_samples(line["step"], tiny_rollouts(tokenizer), tokenizer)
    tr.close("interrupted")
    ids = json.loads((run_dir / "run.json").read_text())["trackers"]

    info = RunInfo(run_dir)  # what `scalerl train` does on resume: run.json restarted, then finished
    info.start(None, {"device": "cpu", "count": 2}, resumed=True)
    second = [metrics_line(s, random.Random(100 + s)) for s in range(3, 7)]
    tr = RunTracker(run_dir, trackers, samples_every=1, samples_per_log=1, resume_step=2)
    for line in second:
        tr.log_metrics(line)
        tr.log_samples(line["step"], tiny_rollouts(tokenizer), tokenizer)
    tr.close("done")
    info.finish("done")
    assert tr.failed == {}
    assert json.loads((run_dir / "run.json").read_text())["trackers"] == ids  # kept through RunInfo.finish

    runs = wandb_runs(offline_env["wandb_dir"])
    assert len(runs) == 2 and {r["id"] for r in runs} == {ids["wandb"]["id"]}

    client = MlflowClient(tracking_uri=offline_env["mlflow_uri"])
    hist = client.get_metric_history(ids["mlflow"]["run_id"], "train/loss")
    assert sorted(m.step for m in hist) == [1, 2, 3, 3, 4, 4, 5, 6]  # the same run, both attempts
    assert len(client.search_runs([ids["mlflow"]["experiment_id"]])) == 1

    acc = tb_events(tensorboard_dir(run_dir))
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(e.step for e in acc.Scalars("train/loss")) == [1, 2, 3, 4, 5, 6]  # 3, 4 of attempt 1 purged
    want = {l["step"]: l["loss"] for l in first[:2] + second}
    assert loss == {s: float(np.float32(v)) for s, v in want.items()}

    assert [l["step"] for l in read_jsonl(run_dir / "samples.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_failing_tracker_is_disabled_once_and_the_others_go_on(tmp_path, tokenizer, offline_env, monkeypatch, caplog):
    from components.trainer import tracking

    calls = {"n": 0}

    def broken_log(self, scalars, step, kind):
        calls["n"] += 1
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(tracking._TensorBoardBackend, "log", broken_log)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens: mlflow fails to start
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    run_dir = make_run(tmp_path)
    caplog.set_level(logging.WARNING, logger="components.trainer.tracking")
    tr = RunTracker(run_dir, ["tensorboard", "mlflow", "wandb"], samples_every=1, samples_per_log=1)
    for step in range(1, 4):
        tr.log_metrics({"step": step, "pass_rate": step / 10})
        tr.log_samples(step, tiny_rollouts(tokenizer), tokenizer)
    tr.close("done")
    assert calls["n"] == 1  # disabled after its first error
    assert set(tr.failed) == {"tensorboard", "mlflow"}
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("tracker tensorboard failed" in w for w in warnings) == 1
    assert sum("tracker mlflow failed" in w for w in warnings) == 1
    (run,) = wandb_runs(offline_env["wandb_dir"])
    assert [r["train/pass_rate"] for r in run["history"] if "train/pass_rate" in r] == [0.1, 0.2, 0.3]
    assert len(read_jsonl(run_dir / "samples.jsonl")) == 3
