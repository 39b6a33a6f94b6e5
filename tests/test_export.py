"""`scalerl export` / write_final_policy: a DCP checkpoint becomes a Hugging Face policy.

Checkpoints are written by components.trainer.checkpoint.save_checkpoint from a tiny Llama
trained a few AdamW steps in this process (T = 1); the export of a checkpoint sharded over
2 ranks is tested in tests/test_checkpoint_dcp.py. References are the learner's own model
in fp32 (logits to 1e-6) and, for vLLM, transformers on the exported directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from components.models import build_tiny_policy, load_causal_lm, load_tokenizer
from components.precision import get_precision, untie_lm_head
from components.trainer.checkpoint import rng_state, save_checkpoint
from components.trainer.learner import make_optimizer
from experiments.cli import main as cli_main
from components.trainer.export import FINAL_DIR, ExportError, export_policy, write_final_policy

# head_dim 32: the smallest head size vLLM's CPU attention accepts
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=64, seed=0)
PROBE = torch.tensor([[9, 10, 11, 12, 13, 14, 15, 16], [20, 31, 42, 15, 9, 33, 60, 3]])  # [2, 8] token ids


def _batch(k: int) -> torch.Tensor:
    return torch.randint(8, 100, (4, 12), generator=torch.Generator().manual_seed(100 + k))  # [4, 12]


def _train_step(model, opt, sched, k: int) -> None:
    ids = _batch(k)  # [4, 12]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model.eval()(input_ids=PROBE, use_cache=False).logits.float()  # [2, 8, V]


def _save(run: Path, step: int, model, opt, sched, tok) -> None:
    save_checkpoint(run / "checkpoints", step, model=model, optimizer=opt, scheduler_state=sched.state_dict(),
                    trainer_state={"step": step}, rank_state={"rng": rng_state()}, keep=3, tokenizer=tok)


def _learner_run(root: Path, name: str, model, tok, steps: int = 2) -> dict:
    """Train `steps` AdamW steps, checkpointing after each; the learner's logits and weights per step."""
    run = root / name
    opt, sched = make_optimizer(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=0)
    out = {"run": run, "tok": tok, "logits": {}, "weights": {}}
    for step in range(1, steps + 1):
        model.train()
        _train_step(model, opt, sched, step)
        _save(run, step, model, opt, sched, tok)
        out["logits"][step] = _logits(model)
        out["weights"][step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["model"], out["opt"], out["sched"] = model, opt, sched
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("export")
    tied_path = build_tiny_policy(root / "tiny_tied", tie_word_embeddings=True, **TINY)
    tok = load_tokenizer(tied_path)
    initial = load_causal_lm(tied_path)
    tied_model = load_causal_lm(tied_path)
    assert tied_model.lm_head.weight is tied_model.model.embed_tokens.weight
    res = {"root": root, "tied_path": tied_path, "initial": {k: v.clone() for k, v in initial.state_dict().items()}}
    res["tied"] = _learner_run(root, "run_tied", tied_model, tok)
    # bf16_fp32_head with fp32 master weights: the learner unties the head and keeps every tensor in fp32
    untied = load_causal_lm(tied_path)
    assert untie_lm_head(untied)
    untied.config.scalerl_precision = "bf16_fp32_head"
    res["untied"] = _learner_run(root, "run_untied", untied, tok)
    return res


def _safetensors_dtypes(out: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k).dtype for k in f.keys()}


def _load_hf(out: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)


# ---------------------------------------------------------------------------------------------
def test_export_fp32_tied_same_logits_as_learner(runs, tmp_path):
    r = runs["tied"]
    out = export_policy(r["run"], tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    dtypes = _safetensors_dtypes(out)
    assert set(dtypes.values()) == {torch.float32}, dtypes
    assert "lm_head.weight" not in dtypes  # tied: stored once, as transformers does
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"

    hf = _load_hf(out)
    assert all(p.dtype == torch.float32 for p in hf.parameters())
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    err = (_logits(hf) - r["logits"][2]).abs().max().item()
    assert err <= 1e-6, err
    for k, v in hf.state_dict().items():
        assert torch.equal(v, r["weights"][2][k]), k
    # the export holds the trained weights, not the model the run started from
    moved = max((r["weights"][2][k] - v).abs().max().item() for k, v in runs["initial"].items())
    assert moved > 1e-3, moved

    from transformers import AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = "12+3=15"
    assert tok2.encode(text) == r["tok"].encode(text)
    chat = [{"role": "user", "content": "2+2?"}]
    assert tok2.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == r["tok"].apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


def test_export_picks_step_or_checkpoint_dir(runs, tmp_path):
    r = runs["tied"]
    out1 = export_policy(r["run"], tmp_path / "s1", step=1)
    assert (_logits(_load_hf(out1)) - r["logits"][1]).abs().max().item() <= 1e-6
    ckpt2 = r["run"] / "checkpoints" / "step_00000002"
    out2 = export_policy(ckpt2, tmp_path / "s2")
    assert (_logits(_load_hf(out2)) - r["logits"][2]).abs().max().item() <= 1e-6
    assert (r["logits"][1] - r["logits"][2]).abs().max().item() > 1e-4  # the two steps are distinguishable
    with pytest.raises(ExportError, match="step 2, not step 1"):
        export_policy(ckpt2, tmp_path / "s3", step=1)
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_policy(r["run"], out2)


def test_export_bf16_fp32_head_keeps_untied_embedding_and_head(runs, tmp_path):
    r = runs["untied"]
    out = export_policy(r["run"], tmp_path / "hf")
    dtypes = _safetensors_dtypes(out)
    assert "lm_head.weight" in dtypes and "model.embed_tokens.weight" in dtypes
    assert set(dtypes.values()) == {torch.float32}
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False

    hf = _load_hf(out)
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight
    w = r["weights"][2]
    assert torch.equal(hf.lm_head.weight, w["lm_head.weight"])
    assert torch.equal(hf.model.embed_tokens.weight, w["model.embed_tokens.weight"])
    # they started equal (untied copy) and trained apart
    assert not torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    err = (_logits(hf) - r["logits"][2]).abs().max().item()
    assert err <= 1e-6, err


def test_export_of_bf16_parameters_is_fp32_and_exact(runs, tmp_path):
    """A learner holding bf16 parameters (today's bf16_fp32_head: bf16 body, fp32 head) exports in fp32 losslessly."""
    model = load_causal_lm(runs["tied_path"])
    get_precision("bf16_fp32_head").prepare_model(model)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 5, model=model, optimizer=None, scheduler_state=None, trainer_state=None,
                    rank_state=None, keep=1, tokenizer=runs["tied"]["tok"])
    out = export_policy(run, tmp_path / "hf")
    assert set(_safetensors_dtypes(out).values()) == {torch.float32}
    hf = _load_hf(out)
    for k, v in model.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v.float()), k


def test_write_final_policy_is_atomic_and_follows_the_last_checkpoint(runs, tmp_path):
    import shutil

    r = runs["tied"]
    run = tmp_path / "run"
    shutil.copytree(r["run"], run)
    (run / f".{FINAL_DIR}.tmp").mkdir()  # left by a killed export
    (run / f".{FINAL_DIR}.tmp" / "model.safetensors").write_bytes(b"half")
    final = write_final_policy(run)
    assert final == run / FINAL_DIR
    assert (_logits(_load_hf(final)) - r["logits"][2]).abs().max().item() <= 1e-6
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no tmp/old left
    # one more step and checkpoint: final/ is replaced by the newer policy
    model, opt, sched = r["model"], r["opt"], r["sched"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _train_step(model.train(), opt, sched, 3)
    _save(run, 3, model, opt, sched, r["tok"])
    want = _logits(model)
    final = write_final_policy(run)
    assert (_logits(_load_hf(final)) - want).abs().max().item() <= 1e-6
    assert (want - r["logits"][2]).abs().max().item() > 1e-4
    with torch.no_grad():  # leave the shared learner as the fixture recorded it
        model.load_state_dict(state)


def test_cli_export_and_its_errors(runs, tmp_path, capsys):
    run = runs["tied"]["run"]
    out = tmp_path / "out"
    assert cli_main(["export", str(run), str(out)]) == 0
    assert "exported" in capsys.readouterr().out and (out / "model.safetensors").is_file()
    assert (_logits(_load_hf(out)) - runs["tied"]["logits"][2]).abs().max().item() <= 1e-6

    assert cli_main(["export", str(run), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli_main(["export", str(run), str(out), "--force", "--step", "1"]) == 0
    assert (_logits(_load_hf(out)) - runs["tied"]["logits"][1]).abs().max().item() <= 1e-6
    capsys.readouterr()

    assert cli_main(["export", str(run), "--step", "7", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint for step 7" in err and "available steps: 1, 2" in err, err
    assert not (tmp_path / "o2").exists()

    empty = tmp_path / "empty_run"
    (empty / "checkpoints" / ".step_00000004.tmp").mkdir(parents=True)  # only a killed save
    assert cli_main(["export", str(empty), str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert "has no complete checkpoint" in err, err
    assert not (tmp_path / "o3").exists()

    assert cli_main(["export", str(tmp_path / "nope"), str(tmp_path / "o4")]) == 2
    assert "no such run or checkpoint directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_the_exported_policy(runs, tmp_path):
    from _helpers_vllm import run_vllm_checks, vllm_python, vllm_result

    vllm_python("the vLLM export test")  # skips locally / fails under CI when vllm is missing, before exporting
    outs = {name: export_policy(runs[name]["run"], tmp_path / name) for name in ("tied", "untied")}
    result = vllm_result(run_vllm_checks("_vllm_export_check.py", {"export": 420}, outs.values(), what="the vLLM export test"),
                         "export")
    from _vllm_export_check import PROMPTS  # tests/ is on sys.path (pytest's rootdir-relative imports)

    for name, out in outs.items():
        got = result[str(out)]
        hf = _load_hf(out)
        worst = 0.0
        for prompt, vllm_lp, greedy in zip(PROMPTS, got["prompt_logprobs"], got["greedy"]):
            seq = torch.tensor([prompt + greedy])  # [1, L]
            with torch.no_grad():
                lp = torch.log_softmax(hf(input_ids=seq, use_cache=False).logits.double(), -1)[0]  # [L, V]
            ref = [lp[t - 1, prompt[t]].item() for t in range(1, len(prompt))]
            gap = max(abs(a - b) for a, b in zip(vllm_lp, ref))
            assert gap < 1e-4, (name, gap)
            worst = max(worst, gap)
            for j, tok in enumerate(greedy):  # each greedy token is transformers' argmax (up to round-off ties)
                row = lp[len(prompt) - 1 + j]  # [V]
                assert row[tok].item() >= row.max().item() - 1e-4, (name, j, tok)
        print(name, "max prompt log-prob gap vLLM vs transformers", worst, file=sys.stderr)
