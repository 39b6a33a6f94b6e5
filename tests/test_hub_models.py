"""`model.path` as a Hugging Face hub id (issue 33 item 2): resolved to its snapshot in the HF cache.

Nothing is downloaded: a tiny policy is laid out as huggingface_hub caches a repository
(``$HF_HOME/hub/models--org--name/{blobs, snapshots/<commit>, refs/<branch>}``, snapshot files
symlinked to blobs) under a temporary HF_HOME, with HF_HUB_OFFLINE=1, and every consumer
(model_config, plan, the learner's loaders, the torch engine, eval, run.json) is pointed at the id.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gin
import pytest

from _helpers_trainer import REPO, write_gin
from components.models import (
    ModelPathError,
    build_tiny_policy,
    hub_model_info,
    looks_local,
    resolve_model_path,
)

REPO_ID = "tiny-org/tiny-model"
MAIN = "a" * 40  # commit of refs/main
V2 = "b" * 40  # commit of refs/v2 (another model: 2 layers)
TINY = dict(hidden_size=16, num_heads=2, max_position_embeddings=128)


def _cache_repo(hub: Path, repo_id: str, refs: dict, models: dict) -> None:
    """Lay `models` ({commit: local model dir}) out as huggingface_hub caches them, `refs` {name: commit}."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, src in models.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in sorted(Path(src).iterdir()):
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for name, commit in refs.items():
        (repo / "refs" / name).write_text(commit)  # no newline, as huggingface_hub writes it


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_models")
    one = build_tiny_policy(root / "one_layer", num_layers=1, **TINY)
    two = build_tiny_policy(root / "two_layers", num_layers=2, **TINY)
    home = root / "hf_home"
    _cache_repo(home / "hub", REPO_ID, {"main": MAIN, "v2": V2}, {MAIN: one, V2: two})
    return home


@pytest.fixture()
def offline(hf_home, monkeypatch):
    """HF_HOME = the fake cache, HF_HUB_OFFLINE=1: in the environment (subprocesses) and in
    huggingface_hub's constants (read once at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    gin.clear_config()
    yield hf_home
    gin.clear_config()


def _snapshot(home: Path, commit: str) -> str:
    return str(home / "hub" / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / commit)


def test_a_hub_id_resolves_to_its_cached_snapshot_at_a_revision(offline):
    assert resolve_model_path(REPO_ID) == _snapshot(offline, MAIN)
    assert hub_model_info(_snapshot(offline, MAIN)) == {"model_id": REPO_ID, "model_revision": None, "model_commit": MAIN}
    assert resolve_model_path(REPO_ID, "v2") == _snapshot(offline, V2)  # a branch
    assert resolve_model_path(REPO_ID, V2) == _snapshot(offline, V2)  # a commit hash
    assert json.loads(Path(_snapshot(offline, V2), "config.json").read_text())["num_hidden_layers"] == 2
    assert hub_model_info("/some/local/model") == {}


def test_unresolvable_ids_and_missing_local_paths_say_why(offline, tmp_path, monkeypatch):
    with pytest.raises(ModelPathError) as err:
        resolve_model_path("tiny-org/not-cached")
    msg = str(err.value)
    assert "'tiny-org/not-cached'" in msg and "revision 'main'" in msg and f"HF_HOME={offline}" in msg
    assert "HF_HUB_OFFLINE" in msg and "hf download tiny-org/not-cached" in msg
    with pytest.raises(ModelPathError, match=r"revision 'no-such-branch'.*HF_HUB_OFFLINE"):
        resolve_model_path(REPO_ID, "no-such-branch")
    with pytest.raises(ModelPathError, match=r"not a valid Hugging Face hub id|nor a valid Hugging Face hub id"):
        resolve_model_path("tiny-org/bad name")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for local in (str(tmp_path / "missing"), "./missing", "../missing", "~/no-such-scalerl-model", "a/b/c", "runs/missing"):
        assert looks_local(local), local
        with pytest.raises(ModelPathError, match=rf"model\.path '{local}' does not exist \(a local path\)"):
            resolve_model_path(local)
    assert not looks_local(REPO_ID) and not looks_local("gpt2")
    with pytest.raises(ModelPathError, match="model.revision = 'v2' selects a revision of a Hugging Face hub id"):
        resolve_model_path(str(tmp_path), "v2")


def test_model_config_resolves_a_hub_id_and_still_builds_a_new_local_model(offline, tmp_path, monkeypatch):
    from components.trainer.config import ConfigError, model_config

    gin.parse_config(f'model.path = "{REPO_ID}"\nmodel.revision = "v2"')
    assert model_config() == _snapshot(offline, V2)
    gin.clear_config()
    monkeypatch.chdir(tmp_path)  # a relative path with model.new_model: built here, never looked up on the hub
    gin.parse_config(f'model.path = "built/new"\nmodel.new_model = True\nmodel.build_kwargs = {json.dumps(dict(num_layers=1, **TINY))}')
    assert model_config() == str(tmp_path / "built" / "new")
    assert (tmp_path / "built" / "new" / "config.json").is_file()
    gin.bind_parameter("model.revision", "v2")
    with pytest.raises(ConfigError, match="model.revision"):
        model_config()


def test_a_run_records_the_hub_id_it_ran(offline, tmp_path):
    from components.trainer.run_owner import RunOwner
    from experiments.train import resolve

    gin_file = write_gin(tmp_path / "run.gin", REPO_ID, model__revision='"v2"')
    run = resolve([gin_file])
    assert run.cfg.model_path == _snapshot(offline, V2)
    with RunOwner(run, tmp_path / "run"):
        pass
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (run["model_id"], run["model_revision"], run["model_commit"]) == (REPO_ID, "v2", V2)
    config = (tmp_path / "run" / "config.gin").read_text()
    assert f"model.path = '{REPO_ID}'" in config and "model.revision = 'v2'" in config


def test_scalerl_train_refuses_an_uncached_id_before_anything_runs(offline, tmp_path, monkeypatch, capsys):
    from experiments.cli import main

    monkeypatch.chdir(tmp_path)
    gin_file = write_gin(tmp_path / "run.gin", "tiny-org/not-cached")
    assert main(["train", gin_file, "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "scalerl train: error: ModelPathError" in err and "HF_HUB_OFFLINE" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_plan_reads_config_json_of_a_hub_id(offline, capsys):
    from experiments.cli import main

    base = [str(REPO / "experiments/configs/tiny_cpu.gin"), "--gin", f'model.path = "{REPO_ID}"']
    assert main(["plan", *base, "--gin", 'model.revision = "v2"']) == 0
    assert f"{REPO_ID} (revision v2)" in capsys.readouterr().out
    assert main(["plan", str(REPO / "experiments/configs/tiny_cpu.gin"), "--gin", 'model.path = "tiny-org/not-cached"']) != 0
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err


def test_learner_torch_engine_and_eval_load_a_hub_id(offline, tmp_path):
    import torch

    from components.engines import make_engine
    from components.models import load_causal_lm, load_tokenizer
    from experiments.evaluate import run_eval

    path = resolve_model_path(REPO_ID)
    tok = load_tokenizer(path)
    model = load_causal_lm(path)
    assert model.config.num_hidden_layers == 1 and tok.pad_token_id is not None
    make_engine("torch", path, device="cpu", seed=0).close()  # it samples in the eval below
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == len(tok)

    bench = tmp_path / "mini.jsonl"
    bench.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    records, out_file = run_eval(REPO_ID, [str(bench)], k=1, max_tokens=2, device="cpu", out=tmp_path / "eval.jsonl")
    assert records[0]["prompts"] == 1 and out_file == tmp_path / "eval.jsonl"
    assert records[0]["model"] == _snapshot(offline, MAIN)


def test_a_submission_refuses_a_hub_id_the_job_could_not_load(offline, tmp_path, monkeypatch, capsys):
    """`scalerl train ... --executor slurm` and a sweep validate each run before any job is queued: a hub
    id that is not in the cache (offline) is refused by run name, nothing submitted, no run directory;
    a cached id passes, at a revision too, with its shapes read from config.json alone."""
    from experiments.cli import main
    from experiments.recipes import SweepError
    from experiments.run_config import validate_runs
    from experiments.sweep_spec import RunSpec

    recipe = str(REPO / "experiments/configs/tiny_cpu.gin")

    def run(model_id: str, *extra: str) -> RunSpec:
        return RunSpec(name="r0", sweep="s", factor=None, value=None, recipe="tiny_cpu", seed=0,
                       config_files=(recipe,), bindings=(f'model.path = "{model_id}"', *extra))

    configs = validate_runs([run(REPO_ID, 'model.revision = "v2"')])
    assert configs["r0"].plan_inputs is not None and configs["r0"].plan_inputs.model_config["num_hidden_layers"] == 2
    with pytest.raises(SweepError, match=r"run r0: model.path: .*'tiny-org/not-cached'.*HF_HUB_OFFLINE"):
        validate_runs([run("tiny-org/not-cached")])
    with pytest.raises(SweepError, match=r"run r0: .*no such revision|run r0: .*'tiny-org/tiny-model' \(revision 'v9'\)"):
        validate_runs([run(REPO_ID, 'model.revision = "v9"')])

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "tiny_cpu" / "job"
    code = main(["train", recipe, "--gin", 'model.path = "tiny-org/not-cached"', "--executor", "slurm",
                 "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and "tiny-org/not-cached" in err and "HF_HUB_OFFLINE" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()
