"""Issue 43 item 7: small things a TRL or verl user meets on the second day.

- `train.adam_betas = 0.9` is a clear error naming the setting and the valid form (it was
  `TypeError: 'float' object is not iterable`);
- `train.device = "cuda"` where torch sees no CUDA device is refused before any process starts or any
  run directory is made, naming the setting (it used to start the processes and fail in each);
- `scalerl plan` says when the length control, not train.max_tokens, sets the generation cap
  (train.max_tokens = 32768 was silently planned at interruption's 14336), naming both settings;
- the torch engine and the warm start's sampler pass the KV cache by the name transformers takes it
  (no `past_key_values` FutureWarning at every train and eval).
(LoRA's `train.lora_dropout` is tested in tests/test_lora.py, the report's A interval in
tests/test_main_job_report.py.)
"""

from __future__ import annotations

import json
import warnings

import gin
import pytest
import torch

from _helpers_trainer import REPO, tiny_model, write_gin


@pytest.fixture()
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.mark.parametrize("value, says", [
    ("0.9", "train.adam_betas = 0.9 is not a pair: give two numbers (beta1, beta2) in [0, 1), e.g. train.adam_betas = (0.9, 0.999)"),
    ('"0.9, 0.99"', "train.adam_betas = '0.9, 0.99' is not a pair"),
    ("(0.9, 0.99, 0.5)", "train.adam_betas = (0.9, 0.99, 0.5): give two numbers (beta1, beta2)"),
    ("(0.9, None)", "train.adam_betas = (0.9, None): give two numbers"),
    ("(0.9, 1.5)", "train.adam_betas must be two numbers in [0, 1), got (0.9, 1.5)"),
])
def test_adam_betas_of_the_wrong_form_name_the_setting(tmp_path, capsys, clean_gin, value, says):
    from experiments.cli import main

    gin_file = write_gin(tmp_path / "run.gin", str(tmp_path / "model"), train__adam_betas=value)
    run_dir = tmp_path / "runs" / "r"
    assert main(["train", gin_file, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "TypeError" not in err, err
    assert not run_dir.exists()


def test_adam_betas_as_a_list_or_tuple_are_accepted(clean_gin):
    from components.trainer.config import train_config

    assert train_config(model_path="m", adam_betas=[0.9, 0.95]).adam_betas == (0.9, 0.95)
    assert train_config(model_path="m", adam_betas=(0, 0.5)).adam_betas == (0.0, 0.5)


def test_cuda_without_a_cuda_device_is_refused_before_anything_starts(tmp_path, capsys, clean_gin, monkeypatch):
    """As on a CPU-only machine (torch.cuda.is_available() False here, whatever the machine): exit 2,
    the setting named, no run directory, so no process was started either (the launcher starts them
    in the run directory it made)."""
    from experiments.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gin_file = write_gin(tmp_path / "run.gin", tiny_model(tmp_path), train__device='"cuda"')
    run_dir = tmp_path / "runs" / "r"
    started = []
    import components.trainer.launcher as launcher

    monkeypatch.setattr(launcher, "launch_local", lambda *a, **k: started.append(a))
    assert main(["train", gin_file, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "train.device = 'cuda' but" in err and 'train.device = "auto"' in err and "Traceback" not in err, err
    assert not run_dir.exists() and not started
    # the same refusal from the Python entry point (a sweep's executor calls it), still before a directory
    from components.trainer.config import ConfigError
    from experiments.train import run_training

    with pytest.raises(ConfigError, match="train.device = 'cuda' but"):
        run_training([gin_file], [], str(run_dir), progress=False)
    assert not run_dir.exists() and not started
    # a run submitted to another machine (--executor slurm) is not judged by this machine's devices
    from experiments.train import check_config

    check_config([gin_file], [], read_data=False, on_this_machine=False)


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": False}


def test_plan_says_when_the_length_control_caps_max_tokens(tmp_path, capsys, clean_gin):
    from experiments.cli import main

    model = tmp_path / "shapes"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    base = ["plan", str(REPO / "experiments" / "configs" / "scalerl.gin"), "--gin", f'model.path = "{model}"']
    main(base + ["--gin", "train.max_tokens = 32768"])
    out = capsys.readouterr().out
    assert ("WARNING: train.max_tokens = 32768 is not the generation cap: train.length_control = 'interruption' lowers "
            "it to interruption.thinking_max + interruption.answer_budget = 12288 + 2048 = 14336 tokens") in out, out
    assert "generation cap 14336 tokens" in out
    main(base + ["--gin", "train.max_tokens = 32768", "--json"])
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("train.max_tokens = 32768 is not the generation cap" in n for n in notes)
    main(base)  # scalerl.gin's own max_tokens (14336) is the interruption's cap: nothing to say
    assert "is not the generation cap" not in capsys.readouterr().out
    main(base + ["--gin", "train.max_tokens = 4096", "--gin", 'train.length_control = "length_penalty"'])
    assert "raises it to length_penalty.l_max = 14336 tokens" in capsys.readouterr().out


def test_no_past_key_values_future_warning_in_generation(tmp_path):
    """The torch engine's prefill and decode, and the warm start's sampler, under every warning shown:
    none about `past_key_values` (transformers 5.2x renamed the cache argument to `cache`)."""
    from components.engines.base import GenerationRequest, SamplingParams
    from components.engines.torch_engine import TorchEngine, kv_cache_name
    from components.models import load_causal_lm, load_tokenizer
    from components.tasks import make_task
    from components.warm_start import sampled_pass_rate

    path = tiny_model(tmp_path)
    engine = TorchEngine(path, device="cpu")
    tok = load_tokenizer(path)
    task = make_task("arithmetic", num_train=4, num_eval=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(engine.generate([GenerationRequest(group_id=0, prompt_ids=tok.encode("1+2="), n=2)],
                                   SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4, seed=0)))
        sampled_pass_rate(load_causal_lm(path), tok, task, task.eval_problems(), temperature=1.0, max_tokens=3)
    assert out and all(len(c.token_ids) >= 1 for c in out[0].completions)
    about_cache = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not about_cache, about_cache
    # the name the engine passes is one the installed transformers' forward accepts
    import inspect

    assert kv_cache_name(engine.model) in inspect.signature(type(engine.model).forward).parameters
