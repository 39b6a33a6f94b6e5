"""`scalerl plan` (issue 11, item 5): the memory estimator against independent references, the
Done-when check on the paper's 8B shapes, and the refusal of a sweep that cannot fit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gin
import pytest
import torch

from experiments import memory_model as M
from experiments import plan as P

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"

LLAMA3_8B = {  # Llama-3-8B-like shapes (PAPER.md: "8B dense"); no weights
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}


@pytest.fixture()
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture()
def dir_8b(tmp_path):
    d = tmp_path / "llama-8b-shapes"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    return d


def _meta_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


# --------------------------------------------------------------------------- formulas vs references
@pytest.mark.parametrize("config", [
    LLAMA3_8B,
    dict(model_type="qwen2", hidden_size=896, num_hidden_layers=3, num_attention_heads=14, num_key_value_heads=2,
         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    dict(model_type="qwen3", hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
         intermediate_size=768, vocab_size=1000, tie_word_embeddings=False, max_position_embeddings=4096),
    dict(model_type="mistral", hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
         intermediate_size=1536, vocab_size=3200, tie_word_embeddings=False, max_position_embeddings=4096),
    dict(model_type="llama", hidden_size=192, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
         intermediate_size=512, vocab_size=777, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
], ids=["llama3-8b", "qwen2-tied", "qwen3", "mistral", "llama-biases-tied"])
def test_parameter_counts_match_transformers(config):
    """The plan's parameter formula = the parameters of the model transformers builds (meta device, no memory)."""
    model = _meta_model(config)
    shape = M.ModelShape.from_config(config)
    counts = M.parameter_counts(shape)
    assert counts["total"] == sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert counts["block"] == sum(p.numel() for p in model.model.layers[0].parameters())
    untied = M.parameter_counts(shape, untie_head=True)  # bf16_fp32_head unties a tied head
    assert untied["total"] - counts["total"] == (config["vocab_size"] * config["hidden_size"] if config.get("tie_word_embeddings") else 0)


def _saved_bytes(num_layers: int, precision: str, checkpointing: bool, tokens_per_seq: int, seqs: int, kv_heads: int) -> int:
    """Bytes autograd saves (non-parameter storages, each once) in the learner's packed forward."""
    import tempfile

    from components.models import load_causal_lm
    from components.precision import get_precision
    from components.trainer import forward as F
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=104, hidden_size=128, intermediate_size=384, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(cfg).save_pretrained(tmp)
        model = get_precision(precision).prepare_model(load_causal_lm(tmp)).train()
    if checkpointing:
        F.enable_activation_checkpointing(model)
    rng = torch.Generator().manual_seed(1)
    seq = [(torch.randint(8, 100, (8,), generator=rng), torch.randint(8, 100, (tokens_per_seq - 8,), generator=rng))
           for _ in range(seqs)]
    row = F.pack(seq)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack_hook(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        F.sequence_logprobs_packed(model, row, temperature=1.0, chunk_size=64, with_entropy=True)
    return sum(seen.values())


@pytest.mark.parametrize("precision, checkpointing, kv_heads", [
    ("fp32", False, 4), ("bf16_fp32_head", False, 4), ("fp32", False, 2), ("fp32", True, 2), ("bf16_fp32_head", True, 4),
])
def test_activation_bytes_per_layer_equal_what_autograd_saves(precision, checkpointing, kv_heads):
    """One more decoder layer adds exactly the plan's per-layer activation bytes (sdpa, packed row of N tokens)."""
    N = 4 * 48
    one = _saved_bytes(1, precision, checkpointing, 48, 4, kv_heads)
    two = _saved_bytes(2, precision, checkpointing, 48, 4, kv_heads)
    shape = M.ModelShape.from_config(dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=kv_heads, intermediate_size=384, vocab_size=104))
    c = 4 if precision == "fp32" else 2
    if checkpointing:
        expected = N * shape.hidden_size * c  # only the block's input
    else:
        expected = N * M.activation_bytes_per_token_layer(shape, c, "sdpa") + N * N * c  # + the float mask copy
    assert two - one == expected


def test_kv_bytes_per_token_with_gqa_and_tensor_parallelism():
    shape = M.ModelShape.from_config(LLAMA3_8B)
    assert M.kv_bytes_per_token(shape, 2, 1) == 2 * 32 * 8 * 128 * 2 == 131072  # 128 KiB per token
    assert M.kv_bytes_per_token(shape, 2, 2) == 65536
    assert M.kv_bytes_per_token(shape, 2, 16) == 2 * 32 * 1 * 128 * 2  # 8 KV heads over 16 GPUs: replicated


def test_learner_terms_scale_with_ranks_checkpointing_and_kernel():
    shape = M.ModelShape.from_config(LLAMA3_8B)
    base = dict(rows=1, row_length=32768, activation_checkpointing=True, logprob_chunk_size=1024, precision="bf16_fp32_head")
    one = M.learner_memory(shape, M.LearnerLayout(ranks=1, **base))
    sixteen = M.learner_memory(shape, M.LearnerLayout(ranks=16, **base))
    n = M.parameter_counts(shape, untie_head=True)["total"]
    assert (one["parameters"], one["gradients"], one["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert sixteen["optimizer"] == -(-8 * n // 16) and sixteen["activations"] == one["activations"]
    plain = M.learner_memory(shape, M.LearnerLayout(ranks=16, **{**base, "activation_checkpointing": False}))
    assert plain["activations"] > 10 * sixteen["activations"]  # checkpointing is what makes 32k tokens fit
    flash = M.learner_memory(shape, M.LearnerLayout(ranks=16, attn_implementation="flash_attention_2", **base))
    assert flash["activations"] < sixteen["activations"]  # no N x N mask, no repeated KV heads
    assert one["total"] == sum(one[k] for k in ("parameters", "reference", "gradients", "optimizer", "compute_copies",
                                                "activations", "logits_chunk", "overhead"))
    # a KL penalty (train.kl_coef > 0) keeps a frozen fp32 copy of the policy, sharded like it
    kl = M.learner_memory(shape, M.LearnerLayout(ranks=16, kl_reference=True, **base))
    assert one["reference"] == 0 and kl["reference"] == -(-4 * n // 16)
    assert kl["total"] - sixteen["total"] == kl["reference"]


def test_tiny_policy_config_is_what_the_builder_writes(tmp_path):
    from components.models import build_tiny_policy

    for kw in ({}, {"hidden_size": 64, "num_layers": 3, "num_heads": 2, "max_position_embeddings": 96, "tie_word_embeddings": True},
               {"intermediate_size": 100, "alphabet": "0123456789+"}):
        built = json.loads((build_tiny_policy(tmp_path / f"m{len(list(tmp_path.iterdir()))}", **kw) / "config.json").read_text())
        derived = P.tiny_policy_config(**kw)
        assert {k: built[k] for k in derived} == derived
    with pytest.raises(P.PlanError, match="no parameter"):
        P.tiny_policy_config(hidden=3)


# --------------------------------------------------------------------------- the CLI
def _plan(argv, capsys):
    from experiments.cli import main

    rc = main(["plan", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_done_when_8b_fits_on_16_plus_64_and_not_on_one_learner(dir_8b, capsys, clean_gin):
    """Issue 11 "Done when": the 8B shapes fit 16 learner + 64 generator GPUs of 80 GiB; one learner GPU does not."""
    args = ["experiments/configs/scalerl.gin", "--gin", f'model.path = "{dir_8b}"', "--gin", "train.num_generators = 64",
            "--gpu-memory-gb", "80"]
    rc, out, err = _plan(args + ["--gin", "train.learner_ranks = 16"], capsys)
    assert rc == 0, out + err
    assert "16 learner GPU(s)" in out and "64 generator(s) x 1 GPU" in out and "= 80 GPUs" in out
    assert "8.030B parameters" in out and out.rstrip().endswith("fits")
    rc, out, err = _plan(args + ["--gin", "train.learner_ranks = 1"], capsys)
    assert rc == 1
    assert "DOES NOT FIT" in out and "learner GPU needs" in out and "train.learner_ranks = 1" in out
    assert "generator" not in out.split("DOES NOT FIT")[1]  # the generators still fit
    rc, out, _ = _plan(args + ["--gin", "train.learner_ranks = 16", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["fits"] and data["gpus"] == 80
    assert data["learner"]["optimizer"] == -(-8 * M.parameter_counts(M.ModelShape.from_config(LLAMA3_8B), untie_head=True)["total"] // 16)


def test_plan_names_what_does_not_fit(dir_8b, capsys, clean_gin):
    base = ["experiments/configs/scalerl.gin", "--gin", f'model.path = "{dir_8b}"']
    rc, out, _ = _plan(base + ["--gin", "vllm.max_num_seqs = 64"], capsys)
    assert rc == 1 and "vllm.max_num_seqs (64)" in out and "at most 25 sequences of that length fit" in out
    rc, out, _ = _plan(base + ["--gin", "interruption.thinking_max = 32768"], capsys)  # the 32k run needs longer contexts
    assert rc == 1 and "vllm.max_model_len (16448) leaves no room" in out
    rc, out, _ = _plan(base + ["--gin", "train.max_tokens_per_micro_batch = 8192"], capsys)
    assert rc == 1 and "train.max_tokens_per_micro_batch (8192) is shorter than the longest sequence" in out
    rc, out, _ = _plan(base + ["--gin", "vllm.tensor_parallel_size = 3"], capsys)
    assert rc == 1 and "does not divide the 32 attention heads" in out
    rc, out, _ = _plan(base + ["--gpu-memory-gb", "40"], capsys)  # a smaller GPU
    assert rc == 1 and "40.0 GiB" in out


def test_plan_reads_only_config_json_and_says_when_it_cannot(tmp_path, capsys, clean_gin):
    # tiny_cpu.gin: model.path is built by the warm-start builder; the plan derives its shapes without building it
    cache = tmp_path / "warm_cache"
    rc, out, err = _plan(["experiments/configs/tiny_cpu.gin", "--gin", f'warm_start.cache_dir = "{cache}"'], capsys)
    assert rc == 0, err
    assert "warm-start builder's tiny policy" in out and "vocab 104" in out and "CPU run" in out
    assert not cache.exists()  # nothing was built
    # a missing path with model.new_model = True: the tiny builder's keywords
    missing = tmp_path / "not_built"
    rc, out, _ = _plan(["experiments/configs/tiny_cpu.gin", "--gin", f'model.path = "{missing}"', "--gin", "model.new_model = True"], capsys)
    assert rc == 0 and "build_tiny_policy" in out and not missing.exists()
    # a path with no config.json and nothing to derive it from: exit 2, a clear message
    rc, out, err = _plan(["experiments/configs/scalerl.gin", "--gin", f'model.path = "{missing}"'], capsys)
    assert rc == 2 and "has no config.json" in err and "config.json alone is enough" in err
    rc, _, err = _plan(["experiments/configs/scalerl.gin"], capsys)
    assert rc == 2 and "model.path is not set" in err
    # a CPU run is checked when a GPU size is given
    rc, out, _ = _plan(["experiments/configs/tiny_cpu.gin", "--gin", f'warm_start.cache_dir = "{cache}"', "--gpu-memory-gb", "0.01"], capsys)
    assert rc == 1 and "learner GPU needs" in out


# --------------------------------------------------------------------------- sweeps
def test_sweep_dry_run_shows_memory_and_a_sweep_that_cannot_fit_is_refused(tmp_path, dir_8b, capsys, clean_gin):
    from experiments.cli import main

    spec = tmp_path / "ranks.gin"
    spec.write_text('sweep.name = "ranks"\nsweep.base = "scalerl.gin"\nsweep.factor = "train.learner_ranks"\n'
                    "sweep.values = [16, 1]\nsweep.seeds = [0]\n")
    runs = tmp_path / "runs"
    common = [str(spec), "--executor", "debug", "--runs", str(runs), "--gin", f'model.path = "{dir_8b}"']
    rc = main(["sweep", *common, "--dry-run", "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    assert rc == 2
    assert "memory plan per run" in out and "learner_ranks16-s0" in out and "fits (GPU 80.0 GiB" in out
    assert "DOES NOT FIT" in out and "learner_ranks1-s0" in out.split("do not fit the memory plan")[1]
    # without --dry-run: refused before anything is submitted
    rc = main(["sweep", *common])
    out = capsys.readouterr().out
    assert rc == 2 and "nothing submitted" in out and not runs.exists()
    # only the run that fits: accepted by the plan (dry run)
    rc = main(["sweep", *common, "--dry-run", "--only", "learner_ranks16-s0"])
    assert rc == 0, capsys.readouterr().out


# --------------------------------------------------------------------------- measured vs estimated (CPU)
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_within_30_percent_of_measured_cpu_peak(checkpointing):
    """A learner step's peak RSS increase (fresh process, tiny policy, 2048-token packed micro-batches)
    against learner_memory's GPU-free estimate. glibc's mmap threshold is pinned so that freed tensor
    memory goes back to the OS and the RSS peak is the peak of live memory (BENCHMARKS.md has both)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import memory_plan
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    res = memory_plan.run_fresh(2048, checkpointing, steps=2, pin_malloc=True)
    assert res["trained_tokens"] == 64 * 112 and res["measured_bytes"] > 20 * 2**20
    assert 0.7 <= res["ratio"] <= 1.3, res


def test_paper_recipes_plan_torch_varlen_where_the_learner_resolves_auto_to_it(dir_8b, tmp_path, capsys, clean_gin):
    """base.gin's train.attn_implementation = "auto" is planned as the learner resolves it: torch_varlen on
    a GPU in bf16 (no [N, N] mask of the 32k-token packed rows), sdpa for a sliding-window model; and
    torch_varlen itself is planned like flash-attention (it used to be refused)."""
    def learner(extra, model=dir_8b):
        rc, out, err = _plan(["experiments/configs/scalerl.gin", "--gin", f'model.path = "{model}"', *extra, "--json"], capsys)
        assert rc in (0, 1), err
        gin.clear_config()
        return json.loads(out)["learner"]

    auto, varlen, sdpa = (learner(x) for x in ([], ["--gin", 'train.attn_implementation = "torch_varlen"'],
                                               ["--gin", 'train.attn_implementation = "sdpa"']))
    assert auto == varlen and auto["activations"] < sdpa["activations"]
    rc, out, _ = _plan(["experiments/configs/scalerl.gin", "--gin", f'model.path = "{dir_8b}"'], capsys)
    assert "attention torch_varlen" in out
    windowed = tmp_path / "windowed"
    windowed.mkdir()
    (windowed / "config.json").write_text(json.dumps({**LLAMA3_8B, "sliding_window": 4096}))
    gin.clear_config()
    assert learner([], windowed)["activations"] == learner(["--gin", 'train.attn_implementation = "sdpa"'], windowed)["activations"]


def test_an_unknown_precision_is_a_plan_error_naming_the_policies(dir_8b, capsys, clean_gin):
    rc, out, err = _plan(["experiments/configs/scalerl.gin", "--gin", f'model.path = "{dir_8b}"', "--gin",
                          'train.precision = "bf17"'], capsys)
    assert rc == 2 and "bf17" in out + err and "bf16_fp32_head" in out + err
