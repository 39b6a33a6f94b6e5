"""LoRA (issue 33 item 5): `train.lora_rank` > 0 trains peft adapters on a frozen base.

What is checked: after learner steps only the adapters have changed (the base bit for bit) and
only they are in the optimizer; the weights the generators receive, and `final/` / `scalerl
export`, are the merged W + (alpha / r) B A, checked against an independent float64 product;
the exported adapter loads with peft and gives the merged model's logits; 2 FSDP2 learner ranks
give the one-process gradients and merged weights (and the two-rank test double bit for bit);
a DCP checkpoint resumes adapters and AdamW state bit for bit; `scalerl plan` counts adapter
parameters as peft creates them; `lora_rank = 0` leaves the learner as it was; bad values are
refused before anything runs. The slow test trains the tiny recipe with LoRA end to end.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers_trainer import REPO, tiny_model, write_gin  # noqa: E402
from test_learner_ranks import config, make_rollouts  # noqa: E402

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0


def lora_cfg(model_path: str, **kw):
    return config(model_path, "cispo", "prompt_mean", "batch", lora_rank=RANK, lora_alpha=ALPHA, **kw)


def make_learner(model_path: str, cfg, seed: int = 0):
    from components.models import load_causal_lm, load_tokenizer
    from components.trainer.learner import Learner

    torch.manual_seed(seed)
    tok = load_tokenizer(model_path)
    return Learner(load_causal_lm(model_path), cfg, tok.pad_token_id, torch.device("cpu")), tok


def merged_float64(state: dict, scaling: float) -> dict:
    """{base name: W + scaling B A} in float64 for every adapted layer of a LoRA state dict."""
    out = {}
    for name, w in state.items():
        if name.endswith(".base_layer.weight"):
            module = name[: -len(".base_layer.weight")]
            a = state[f"{module}.lora_A.default.weight"].double()
            b = state[f"{module}.lora_B.default.weight"].double()
            out[f"{module}.weight"] = w.double() + scaling * (b @ a)
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from components.registry import load_builtin_components

    load_builtin_components()
    return tiny_model(tmp_path_factory.mktemp("lora_model"))


@pytest.fixture(scope="module")
def trained(model_path):
    """A LoRA learner after two steps (the second one with lora_B != 0, so lora_A moves too)."""
    learner, tok = make_learner(model_path, lora_cfg(model_path))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    rollouts = make_rollouts(tok)
    stats = [learner.step(rollouts, [True] * len(rollouts)) for _ in range(2)]
    return learner, before, stats, rollouts


def test_a_step_changes_only_the_adapters(trained):
    learner, before, stats, _ = trained
    assert learner.version == 2 and all(s["grad_norm"] > 0 for s in stats)
    names = [n for n, _ in learner.model.named_parameters()]
    adapters = [n for n in names if ".lora_A." in n or ".lora_B." in n]
    # "all-linear": q, k, v, o, gate, up, down of the one block, never the LM head
    assert len(adapters) == 2 * 7 and not any("lm_head" in n for n in adapters)
    for name, p in learner.model.named_parameters():
        if name in adapters:
            assert p.requires_grad and not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert not p.requires_grad and torch.equal(p, before[name]), f"{name} (base) changed"
        assert p.dtype == torch.float32  # fp32 master weights, base and adapters
    optimized = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in learner.model.named_parameters() if n in adapters}
    assert all(id(p) in optimized for p in learner.optimizer.state) or not learner.optimizer.state
    assert learner.num_trainable_parameters == sum(p.numel() for n, p in learner.model.named_parameters() if n in adapters)


def test_generators_get_merged_weights_under_the_base_names(trained, model_path):
    from components.models import load_causal_lm
    from components.trainer.weight_sync import generator_state_meta, iter_full_parameters

    learner, _, _, rollouts = trained
    plain = load_causal_lm(model_path)
    meta = generator_state_meta(learner.model, "fp32")
    assert [m.name for m in meta] == [n for n, _ in plain.named_parameters()]
    assert [m.shape for m in meta] == [tuple(p.shape) for _, p in plain.named_parameters()]
    state = {n: p.detach() for n, p in learner.model.state_dict().items()}
    sent = {n: t.clone() for n, t in iter_full_parameters(learner.model, "fp32")}
    expected = merged_float64(state, ALPHA / RANK)
    assert len(expected) == 7
    for name, t in sent.items():
        assert t.dtype == torch.float32
        if name in expected:
            err = (t.double() - expected[name]).abs().max() / expected[name].abs().max()
            assert err < 1e-6, f"{name}: merged weight off by {float(err):.1e}"
            delta = expected[name] - state[name.replace(".weight", ".base_layer.weight")].double()
            assert delta.abs().max() > 1e-4, f"{name}: the adapter's update is missing"
        else:
            assert torch.equal(t, state[name]), name
    # the trained tensors were not touched by the merge
    for name, p in learner.model.named_parameters():
        assert torch.equal(p.detach(), state[name])
    # a generator holding the merged weights computes the learner's policy
    plain.load_state_dict(sent)
    batch = rollouts[0]
    ids = torch.tensor([batch.completions[0].prompt_ids + batch.completions[0].token_ids])
    with torch.no_grad():
        got = plain(input_ids=ids).logits
        want = learner.model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # a bf16 policy sends the merged weights in bf16 (the fp32 head in fp32)
    bf16 = dict(iter_full_parameters(learner.model, "bf16"))
    name = next(iter(expected))
    assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], sent[name].to(torch.bfloat16))


def test_checkpoint_resumes_adapters_and_adam_bit_for_bit_and_exports_merged(trained, model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from components.trainer.checkpoint import load_checkpoint, save_checkpoint
    from components.trainer.export import export_policy
    from components.trainer.weight_sync import iter_full_parameters

    from components.models import load_tokenizer

    learner, _, _, rollouts = trained
    ckpt = save_checkpoint(tmp_path / "checkpoints", learner.version, model=learner.model, optimizer=learner.optimizer,
                           scheduler_state=learner.scheduler.state_dict(), trainer_state={"version": learner.version},
                           tokenizer=load_tokenizer(model_path))
    adapter_cfg = json.loads((ckpt / "hf" / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == RANK and adapter_cfg["lora_alpha"] == ALPHA

    # a fresh learner (another lora_A draw) resumed from the checkpoint continues exactly as the original
    other, tok = make_learner(model_path, lora_cfg(model_path), seed=123)
    loaded = load_checkpoint(ckpt, model=other.model, optimizer=other.optimizer)
    other.scheduler.load_state_dict(loaded["scheduler_state"])
    other.version = loaded["trainer_state"]["version"]
    for (n, p), (m, q) in zip(learner.model.named_parameters(), other.model.named_parameters()):
        assert n == m and torch.equal(p, q), n
    # the export (before the original trains on): merged model + adapter
    out = export_policy(ckpt.parent.parent, tmp_path / "final", overwrite=True)
    sent = {n: t.clone() for n, t in iter_full_parameters(learner.model, "fp32")}
    a = learner.step(rollouts, [True] * len(rollouts))
    b = other.step(rollouts, [True] * len(rollouts))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (n, p), (_, q) in zip(learner.model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(p, q), f"{n} differs after the resumed step"
    for p, q in zip(learner.optimizer.param_groups[0]["params"], other.optimizer.param_groups[0]["params"]):
        sa, sb = learner.optimizer.state[p], other.optimizer.state[q]
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))

    assert not (out / "adapter_config.json").exists(), "a top-level adapter_config.json makes from_pretrained load peft"
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    for name, p in merged.named_parameters():
        assert torch.equal(p.detach(), sent[name]), f"exported {name} is not the weight the generators got"
    # the adapter in peft's format, on the base model, is the same policy
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True)
    with_adapter = PeftModel.from_pretrained(base, str(out / "adapter"))
    ids = torch.tensor([[5, 9, 12, 7, 30, 4, 11]])
    with torch.no_grad():
        assert torch.allclose(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_rank_zero_is_full_fine_tuning(model_path):
    from components.trainer.config import TrainConfig
    from components.trainer.lora import is_lora
    from components.trainer.weight_sync import generator_state_names, iter_full_parameters

    assert TrainConfig().lora_rank == 0
    learner, _ = make_learner(model_path, config(model_path, "cispo", "prompt_mean", "batch"))
    assert not is_lora(learner.model) and not hasattr(learner.model, "peft_config")
    params = list(learner.model.parameters())
    assert learner.num_trainable_parameters == learner.num_parameters == sum(p.numel() for p in params)
    assert [id(p) for p in learner.optimizer.param_groups[0]["params"]] == [id(p) for p in params]
    assert generator_state_names(learner.model, "fp32") == [n for n, _ in learner.model.named_parameters()]
    for (_, t), p in zip(iter_full_parameters(learner.model, "fp32"), params):
        assert t.data_ptr() == p.data_ptr()  # the parameter's own storage, as before: no merge, no copy


def test_plan_counts_adapter_parameters(model_path, tmp_path):
    from experiments import memory_model as M
    from experiments import plan as P

    shape = M.ModelShape.from_config(json.loads((Path(model_path) / "config.json").read_text()))
    for targets in ("all-linear", ("q_proj", "v_proj"), ("mlp.down_proj",)):
        learner, _ = make_learner(model_path, lora_cfg(model_path, lora_targets=targets))
        counts = M.lora_parameter_counts(shape, RANK, targets)
        assert counts["total"] == learner.num_trainable_parameters, targets
    full = M.learner_memory(shape, M.LearnerLayout(ranks=2, device="cpu", precision="fp32"))
    lora = M.learner_memory(shape, M.LearnerLayout(ranks=2, device="cpu", precision="fp32", lora_rank=RANK))
    Pa = M.lora_parameter_counts(shape, RANK)["total"]
    P_total = M.parameter_counts(shape)["total"]
    assert lora["trainable_parameters"] == Pa and full["trainable_parameters"] == P_total
    assert lora["gradients"] == math.ceil(4 * Pa / 2) and lora["optimizer"] == math.ceil(8 * Pa / 2)
    assert lora["parameters"] == math.ceil(4 * (P_total + Pa) / 2)
    assert lora["total"] < full["total"]
    with pytest.raises(M.PlanError, match="not a linear layer"):
        M.lora_parameter_counts(shape, RANK, ("qkv",))
    # `scalerl plan` with the binding
    gin_file = write_gin(tmp_path / "run.gin", model_path, train__lora_rank=str(RANK))
    plan = P.plan_config([gin_file])
    assert plan.learner["trainable_parameters"] == Pa
    assert f"LoRA rank {RANK}" in P.render(plan) and "adapters only" in P.render(plan)


@pytest.mark.parametrize("binding, message", [
    ("train.lora_rank = -1", r"train.lora_rank = -1 is out of range"),
    ("train.lora_alpha = 0.0", r"train.lora_alpha = 0.0 is out of range"),
    ("train.lora_targets = []", r"train.lora_targets is empty"),
    ("train.lora_targets = 7", r"train.lora_targets must be"),
    ('train.lora_targets = ["all-linear", "q_proj"]', r"is not a module name"),
    ('train.lora_targets = ["q_proj", "qproj"]', r"'qproj' matches no module of LlamaForCausalLM; its linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    ('train.lora_targets = ["lm_head"]', r"is the LM head"),
    ('train.lora_targets = ["embed_tokens"]', r"matches model.embed_tokens \(Embedding\); LoRA here adapts nn.Linear layers only"),
    ("train.lora_dropout = 1.0", r"train.lora_dropout = 1.0 is out of range: must be in \[0, 1\)"),
    ("train.lora_dropout = -0.1", r"train.lora_dropout = -0.1 is out of range"),
])
def test_bad_lora_settings_are_refused_before_anything_runs(model_path, tmp_path, binding, message):
    from components.trainer.config import ConfigError
    from experiments.train import prepare

    gin_file = write_gin(tmp_path / "run.gin", model_path)
    rank = [] if "lora_rank" in binding else ["train.lora_rank = 8"]
    with pytest.raises(ConfigError, match=message):
        prepare([gin_file], rank + [binding])
    assert not (tmp_path / "runs").exists()


def test_lora_dropout_reaches_peft_and_acts_only_while_the_learner_trains(model_path, tmp_path):
    """train.lora_dropout (default 0: no dropout module at all, as before) is peft's lora_dropout on each
    adapter's input: two train-mode forwards of the same batch differ, eval-mode ones (the KL reference,
    the export) do not; the base path is untouched; it is recorded in the adapter config."""
    from components.trainer.config import TrainConfig
    from components.trainer.lora import lora_layers, write_adapter_config

    assert TrainConfig().lora_dropout == 0.0
    plain, _ = make_learner(model_path, lora_cfg(model_path))
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in lora_layers(plain.model).values())
    learner, tok = make_learner(model_path, lora_cfg(model_path, lora_dropout=0.25))
    layers = lora_layers(learner.model)
    drops = [m.lora_dropout["default"] for m in layers.values()]
    assert drops and all(isinstance(d, torch.nn.Dropout) and d.p == 0.25 for d in drops)
    with torch.no_grad():
        for m in layers.values():  # lora_B starts at 0 (the adapter adds nothing): give it a value
            m.lora_B["default"].weight.fill_(0.05)
    ids = torch.tensor([tok.encode("12+7=19", add_special_tokens=False)])
    model = learner.model
    with torch.no_grad():
        model.train()
        a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
        model.eval()
        c, d = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.equal(a, b) and torch.equal(c, d)
    write_adapter_config(learner.model, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["lora_dropout"] == 0.25


def test_the_learner_refuses_unknown_targets_too(model_path):
    from components.trainer.config import ConfigError

    with pytest.raises(ConfigError, match="matches no module"):
        make_learner(model_path, lora_cfg(model_path, lora_targets=("q_prj",)))


# ---------------------------------------------------------------------------------------------
# 2 FSDP2 learner ranks (gloo) = 1 process
def _step_results(learner, rollouts, ranks: int, rank: int) -> dict:
    """Step 1 (whole), then step 2's gradients of the adapters and grad norm, then its update's merged weights."""
    from components.trainer.weight_sync import iter_full_parameters

    plan = learner.plan(rollouts, [True] * len(rollouts))
    if ranks > 1:
        learner.train_shard(plan.shards[rank])  # both ranks in the same collectives
    else:
        learner.train(plan)
    plan = learner.plan(rollouts, [True] * len(rollouts))
    learner.accumulate(plan.shards[rank])
    grads = {}
    for name, p in learner.model.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()
        else:
            assert p.grad is None, f"frozen {name} got a gradient"
    norm = learner.grad_norm()
    learner.optimizer.step()
    merged = {n: t.clone() for n, t in iter_full_parameters(learner.model, "fp32")}
    return {"grads": grads, "norm": norm, "merged": merged}


def _rank_main(rank: int, world: int, init_file: str, model_path: str, out: str) -> None:
    import torch.distributed as dist

    from components.models import empty_causal_lm, load_causal_lm, load_tokenizer
    from components.registry import load_builtin_components
    from components.trainer.learner import Learner

    torch.set_num_threads(1)
    load_builtin_components()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        tok = load_tokenizer(model_path)
        # as in a run: rank 0 reads the checkpoint, rank 1 starts from an empty skeleton and gets rank 0's weights
        model = load_causal_lm(model_path) if rank == 0 else empty_causal_lm(model_path)
        learner = Learner(model, lora_cfg(model_path), tok.pad_token_id, torch.device("cpu"))
        result = _step_results(learner, make_rollouts(tok), world, rank)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
        # both ranks done before either tears its gloo pairs down: a rank that closed them while the
        # other was still inside its last collective once aborted it ("terminate called without an
        # active exception", SIGABRT; CI, 2026-11-27)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_learner_ranks_give_the_one_process_step(tmp_path, model_path):
    import torch.multiprocessing as mp

    from components.trainer.learner import Learner  # noqa: F401 (imported before spawning: faster children)

    out = tmp_path / "two.pkl"
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), model_path, str(out)), nprocs=2, start_method="spawn")
    two = pickle.loads(out.read_bytes())

    learner, tok = make_learner(model_path, lora_cfg(model_path))
    one = _step_results(learner, make_rollouts(tok), 1, 0)
    assert set(two["grads"]) == set(one["grads"]) and all(".lora_" in n for n in one["grads"])
    assert two["norm"] == pytest.approx(one["norm"], rel=1e-6) and one["norm"] > 0
    for name, g in one["grads"].items():
        err = (two["grads"][name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err < 1e-6, f"{name}: relative gradient error {float(err):.2e}"
    assert list(two["merged"]) == list(one["merged"])
    for name, w in one["merged"].items():
        err = (two["merged"][name] - w).abs().max() / w.abs().max()
        assert err < 1e-6, f"{name}: merged weights of 2 ranks differ by {float(err):.2e}"

    # one process in the arithmetic of two ranks (the test double tests/_emulated_ranks.py): bit for bit
    from _emulated_ranks import accumulate_as_ranks, clip_as_ranks, step_as_ranks
    from components.trainer.learner import plan_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        emu, tok = make_learner(model_path, lora_cfg(model_path))
        rollouts = make_rollouts(tok)
        step_as_ranks(emu, rollouts, 2)
        accumulate_as_ranks(emu, plan_step(rollouts, [True] * len(rollouts), emu.cfg, emu.pad_id, 2).shards)
        assert clip_as_ranks(emu, 2) == two["norm"]
        for name, p in emu.model.named_parameters():
            if p.requires_grad:
                assert torch.equal(p.grad, two["grads"][name]), f"{name}: emulated 2-rank gradient is not bit-equal"
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_tiny_lora_run_learns(tmp_path):
    """`scalerl train experiments/configs/tiny_cpu.gin --gin 'train.lora_rank = 8'` (a shorter run, LoRA's higher lr):
    the held-out pass rate rises, and final/ holds the merged model and the adapter."""
    from test_main_job import _scalerl

    run_dir = tmp_path / "run"
    bindings = ["train.lora_rank = 8", "train.lr = 1e-3", "train.total_steps = 80", "train.eval_every = 40",
                "train.checkpoint_every = 80"]  # BENCHMARKS.md "LoRA": 0.17 -> 0.40-0.43 by step 50
    cmd = _scalerl() + ["train", str(REPO / "experiments" / "configs" / "tiny_cpu.gin"), "--run-dir", str(run_dir),
                        "--no-progress"]
    for b in bindings:
        cmd += ["--gin", b]
    proc = subprocess.run(cmd, cwd=str(REPO), env=dict(os.environ), capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    start, end = evals[0]["pass_rate"], evals[-1]["pass_rate"]
    print(f"LoRA tiny run: held-out pass rate {start:.3f} -> {end:.3f}")
    assert end >= start + 0.1, f"LoRA did not raise the held-out pass rate: {start:.3f} -> {end:.3f}"
    final = run_dir / "final"
    assert (final / "model.safetensors").is_file() and (final / "adapter" / "adapter_model.safetensors").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    assert not any("lora" in n for n, _ in model.named_parameters())
