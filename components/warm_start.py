"""Warm-started tiny policies for the CPU demo: a short supervised phase before RL, cached.

RL can only sharpen what a policy already does sometimes; a random tiny Llama never answers
an arithmetic prompt correctly, so the main job starts from a policy that has seen a short
supervised phase (SFT: cross-entropy on prompt -> answer, answer tokens only).

The regime is chosen so that RL has something to do and a clear rise to show: the warm
policy KNOWS the answers (its greedy held-out pass rate is ~0.8) but SAMPLES them badly.
Two knobs make it so:

- `label_smoothing` (the default, 0.4): the SFT target mixes the gold token with the uniform
  distribution over the vocabulary, so at temperature 1 every answer token (and EOS) is
  right with probability ~0.6: a sampled held-out pass rate around 0.2 whose mode is the
  correct answer. RL (reward +1/-1) sharpens the policy onto its mode, and the held-out pass
  rate climbs towards the greedy accuracy (tiny_cpu.gin: 0.24 -> 0.84 in ~500 steps).
- `label_noise`: with this probability a target answer is replaced by a near miss (gold
  plus one of `noise_offsets`, e.g. ±1, ±2); the policy then learns a mixture of right and
  near-miss answers. Measured slower to learn than smoothing; kept as an option.

This mirrors the paper's setting in miniature: an SFT'd model whose sampled pass rate RL
raises. Use one torch thread per process on a shared or small machine: two threads on two
busy cores spin and slow the build many times over.

`ensure_warm_policy(...)` builds such a policy once and caches it under a directory keyed
by a hash of every setting (model size, task, SFT hyper-parameters, seed, library
versions); the directory is written under a temporary name and renamed into place, so a
crashed or concurrent build never leaves a half-written cache entry. A second call with the
same settings returns at once. It is gin-configurable (``warm_start.*``), so a recipe binds
``model.path = @warm_start()`` and gets the cached path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import gin

__all__ = ["ensure_warm_policy", "default_cache_dir", "settings_key", "noisy_answer", "WARM_START_VERSION"]

log = logging.getLogger("scalerl.warm_start")

# Bump when the build procedure changes in a way that changes the weights it produces.
WARM_START_VERSION = 1
META_FILE = "warm_start.json"


def default_cache_dir() -> Path:
    """`$SCALERL_CACHE_DIR`, else `$XDG_CACHE_HOME/scalerl-zoo`, else `~/.cache/scalerl-zoo`."""
    env = os.environ.get("SCALERL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "scalerl-zoo"


def settings_key(settings: dict) -> str:
    """A short stable hash of the settings (JSON with sorted keys) and the library versions."""
    import torch
    import transformers

    payload = {
        "settings": settings,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "warm_start_version": WARM_START_VERSION,
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def noisy_answer(answer: Any, rng: random.Random, offsets: Sequence[int]) -> str:
    """A near miss of an integer answer: answer + one of `offsets` (kept >= 0 for a >= 0 answer)."""
    try:
        value = int(answer)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"label noise needs integer answers (a near miss is answer + offset); got {answer!r}. "
            "Set warm_start.label_noise = 0.0 for this task."
        ) from err
    wrong = value + int(rng.choice(list(offsets)))
    if value >= 0 and wrong < 0:
        wrong = value - (wrong - value)  # mirror the offset so the near miss stays non-negative
    if wrong == value:
        raise ValueError(f"noise_offsets must not contain 0, got {list(offsets)}")
    return str(wrong)


@contextmanager
def _torch_threads(n: Optional[int]) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _pad_right(rows: Sequence[Sequence[int]], pad_id: int):
    """rows of ids -> (ids [N, L] long, lengths [N] long), right-padded with `pad_id`."""
    import torch

    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)  # [N, L]
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


def sft_examples(task, tokenizer, problems, *, label_noise: float, noise_offsets: Sequence[int], rng: random.Random):
    """One SFT sequence per call: (prompt ids + answer ids + EOS, number of prompt tokens).

    Returns a function `draw(batch_size) -> (ids [B, L], loss_mask [B, L-1] float, attention [B, L])`
    where `loss_mask[b, t]` marks that token t+1 (an answer token or EOS) is a target.
    """
    import torch

    from components.tasks import render_prompt

    prompts = [list(render_prompt(p, tokenizer)) for p in problems]
    if hasattr(task, "tool_transcript"):  # a multi-turn gold episode (components/tasks/tool_arithmetic.py)
        return _transcript_examples(task, tokenizer, problems, prompts, rng)
    solve = getattr(task, "solution_text", None)
    if solve is None:
        raise TypeError(f"task {type(task).__name__} has no solution_text(problem); the warm start needs gold answers")
    gold = [solve(p) for p in problems]
    eos = tokenizer.eos_token_id
    cache: dict[str, list[int]] = {}

    def encode(text: str) -> list[int]:
        if text not in cache:
            cache[text] = list(tokenizer.encode(text, add_special_tokens=False))
        return cache[text]

    def draw(batch_size: int):
        rows, starts = [], []
        for _ in range(batch_size):
            i = rng.randrange(len(problems))
            target = gold[i]
            if label_noise > 0 and rng.random() < label_noise:
                target = noisy_answer(problems[i].answer, rng, noise_offsets)
            rows.append(prompts[i] + encode(target) + [eos])
            starts.append(len(prompts[i]))
        ids, lengths = _pad_right(rows, tokenizer.pad_token_id)  # [B, L], [B]
        pos = torch.arange(ids.shape[1])  # [L]
        attention = (pos[None, :] < lengths[:, None]).long()  # [B, L]
        target_pos = pos[None, 1:]  # [1, L-1]: position of the predicted token
        loss_mask = ((target_pos >= torch.tensor(starts)[:, None]) & (target_pos < lengths[:, None])).float()  # [B, L-1]
        return ids, loss_mask, attention

    return draw


def transcript_ids(turns, tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of a multi-turn gold episode after its prompt, and which of them are trained on.

    `turns`: (role, text) pairs. An assistant turn is its text then EOS (trained); any other turn is an
    observation, framed as the trainer's episode runner frames it (`environments.observation_framing`)
    and not trained on, as in RL (observation tokens carry no loss).
    """
    from components.environments import observation_framing

    ids: list[int] = []
    trained: list[bool] = []
    for role, text in turns:
        if role == "assistant":
            part = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
        else:
            prefix, suffix = observation_framing(tokenizer, role)
            part = [t for chunk in (prefix, text, suffix) if chunk
                    for t in tokenizer.encode(chunk, add_special_tokens=False)]
        ids += part
        trained += [role == "assistant"] * len(part)
    return ids, trained


def _transcript_examples(task, tokenizer, problems, prompts, rng: random.Random):
    """`sft_examples` for a task with gold episodes (`task.tool_transcript(problem)`): the loss is on the
    assistant turns (and their EOS) only."""
    import torch

    episodes = [transcript_ids(task.tool_transcript(p), tokenizer) for p in problems]

    def draw(batch_size: int):
        rows, flags = [], []
        for _ in range(batch_size):
            i = rng.randrange(len(problems))
            ids, trained = episodes[i]
            rows.append(prompts[i] + ids)
            flags.append([False] * len(prompts[i]) + trained)
        ids, lengths = _pad_right(rows, tokenizer.pad_token_id)  # [B, L], [B]
        pos = torch.arange(ids.shape[1])  # [L]
        attention = (pos[None, :] < lengths[:, None]).long()  # [B, L]
        target = torch.zeros(ids.shape, dtype=torch.bool)  # [B, L]: token t is a target
        for b, f in enumerate(flags):
            target[b, : len(f)] = torch.tensor(f)
        return ids, target[:, 1:].float(), attention  # loss_mask [B, L-1]: token t+1 is a target

    return draw


def sft_loss(model, ids, loss_mask, attention, label_smoothing: float = 0.0):
    """Mean cross-entropy over target tokens. ids [B, L], loss_mask [B, L-1], attention [B, L].

    `label_smoothing` mixes the one-hot target with the uniform distribution over the vocabulary.
    """
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()  # [B, L-1, V]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none",
                          label_smoothing=label_smoothing)
    nll = nll.view(ids.shape[0], -1)  # [B, L-1]
    return (nll * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def sampled_pass_rate(model, tokenizer, task, problems, *, temperature: float, max_tokens: int, k: int = 1, seed: int = 0,
                      batch_size: int = 256) -> float:
    """Held-out pass rate of `model`: k samples per problem at `temperature` (<= 0: greedy), mean verdict."""
    import torch

    from components.engines.torch_engine import kv_cache_name
    from components.tasks import render_prompt

    pad = tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(seed)
    prompts = [list(render_prompt(p, tokenizer)) for p in problems for _ in range(k)]
    owners = [p for p in problems for _ in range(k)]
    passed = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # [N, P] left-padded
            attention = (ids != pad).long()
            out = []
            done = torch.zeros(len(chunk), dtype=torch.bool)
            past = None
            position = (attention.cumsum(-1) - 1).clamp(min=0)  # [N, P]
            step_ids = ids
            for _ in range(max_tokens):
                name = kv_cache_name(model)  # "cache" in transformers 5.2x ("past_key_values" warns there)
                res = model(input_ids=step_ids, attention_mask=attention, position_ids=position, use_cache=True,
                            **{name: past})
                past = getattr(res, name)
                logits = res.logits[:, -1].float()  # [N, V]
                if temperature <= 0:
                    nxt = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # [N]
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                out.append(nxt)
                done |= nxt == tokenizer.eos_token_id
                if bool(done.all()):
                    break
                step_ids = nxt[:, None]
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)  # [N, P+t]
                position = position[:, -1:] + 1
            tokens = torch.stack(out, dim=1).tolist()  # [N, T]
            for owner, row in zip(owners[start : start + batch_size], tokens):
                text = tokenizer.decode([t for t in row if t != pad], skip_special_tokens=False)
                passed += bool(task.verify(owner, text).passed)
    return passed / max(len(prompts), 1)


def build_warm_policy(
    path: str | os.PathLike,
    *,
    task: str,
    task_kwargs: dict,
    model_kwargs: dict,
    sft_steps: int,
    sft_batch_size: int,
    sft_lr: float,
    label_noise: float,
    noise_offsets: Sequence[int],
    label_smoothing: float,
    seed: int,
    eval_temperature: float,
    eval_max_tokens: int,
    num_threads: Optional[int],
    progress: bool,
) -> dict:
    """Build a tiny policy at `path` and warm-start it by SFT; returns the metadata written to warm_start.json."""
    import torch

    from components.models import build_tiny_policy, load_causal_lm, load_tokenizer
    from components.tasks import make_task

    t0 = time.perf_counter()
    path = Path(path)
    with _torch_threads(num_threads):
        the_task = make_task(task, seed=seed, **task_kwargs)
        build = dict(model_kwargs)
        if build.pop("tokenizer", "chars") == "words":  # a word-level tokenizer over the task's vocabulary
            if not hasattr(the_task, "vocabulary"):
                raise TypeError(f"model_kwargs tokenizer='words' needs a task with vocabulary(); {task!r} has none")
            build["vocabulary"] = the_task.vocabulary()
        build_tiny_policy(path, seed=seed, **build)
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, dtype=torch.float32)
        train, held_out = list(the_task.train_problems()), list(the_task.eval_problems())
        torch.manual_seed(seed)
        draw = sft_examples(the_task, tokenizer, train, label_noise=label_noise, noise_offsets=noise_offsets,
                            rng=random.Random(seed))
        opt = torch.optim.AdamW(model.parameters(), lr=sft_lr, weight_decay=0.0)
        model.train()
        losses: list[float] = []
        bar = _progress(sft_steps, "warm start (SFT)", progress)
        for step in range(sft_steps):
            ids, loss_mask, attention = draw(sft_batch_size)
            loss = sft_loss(model, ids, loss_mask, attention, label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
                if step % 20 == 0:
                    bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if bar is not None:
            bar.close()
        t_sft = time.perf_counter() - t0
        sampled = sampled_pass_rate(model, tokenizer, the_task, held_out, temperature=eval_temperature,
                                    max_tokens=eval_max_tokens, seed=seed)
        greedy = sampled_pass_rate(model, tokenizer, the_task, held_out, temperature=0.0, max_tokens=eval_max_tokens, seed=seed)
        model.save_pretrained(path)
    meta = {
        "sft_final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1),
        "held_out_pass_rate_sampled": sampled,
        "held_out_pass_rate_greedy": greedy,
        "eval_temperature": eval_temperature,
        "held_out_prompts": len(held_out),
        "sft_seconds": t_sft,
        "total_seconds": time.perf_counter() - t0,
    }
    return meta


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)


# The values `warm_start.*` may take (the same forms as a registered component's `ranges=`).
WARM_START_RANGES = {
    "sft_steps": ">= 0",
    "sft_batch_size": ">= 1",
    "sft_lr": "> 0",
    "label_noise": "[0, 1]",
    "label_smoothing": "[0, 1)",
    "eval_temperature": ">= 0",
    "eval_max_tokens": ">= 1",
    "num_threads": ">= 1",
}


def check_warm_start_values(values: dict) -> None:
    """Refuse warm_start.* numbers that are not finite or outside `WARM_START_RANGES`, before any
    build (`ParamRangeError` naming each, e.g. ``warm_start.sft_lr = inf is out of range``)."""
    from components.registry import check_numeric, configurable_params

    values = {k: v for k, v in values.items() if v is not None}  # num_threads=None: leave torch's setting
    check_numeric("warm_start", configurable_params(ensure_warm_policy), values, WARM_START_RANGES)


@gin.configurable("warm_start")
def ensure_warm_policy(
    cache_dir: Optional[str | os.PathLike] = None,
    *,
    task: str = "arithmetic",
    task_kwargs: Optional[dict] = None,
    model_kwargs: Optional[dict] = None,
    sft_steps: int = 600,
    sft_batch_size: int = 64,
    sft_lr: float = 2e-3,
    label_noise: float = 0.0,
    noise_offsets: Sequence[int] = (-2, -1, 1, 2),
    label_smoothing: float = 0.4,
    seed: int = 0,
    eval_temperature: float = 1.0,
    eval_max_tokens: int = 8,
    num_threads: Optional[int] = None,
    progress: bool = True,
    rebuild: bool = False,
) -> str:
    """The path of a warm-started tiny policy for `task`, built once and cached.

    cache_dir: where cached policies live (default `default_cache_dir()`); the policy is at
        `<cache_dir>/warm-<hash of all settings>`.
    task / task_kwargs: the task whose TRAIN split is the SFT data (held-out split untouched
        except for the pass rate recorded in warm_start.json). Use the same values as `train.*`.
    model_kwargs: `components.models.build_tiny_policy` keywords (hidden_size, num_layers, ...).
    sft_steps / sft_batch_size / sft_lr: the supervised phase (AdamW, constant lr).
    label_noise: fraction of SFT targets replaced by a near miss (gold + one of `noise_offsets`);
        sets how low the warm policy's sampled pass rate starts (see the module docstring).
    seed: model init, task split and SFT batches; the build is deterministic for a given seed
        and thread count.
    eval_temperature / eval_max_tokens: how the held-out pass rate in warm_start.json is sampled
        (use the training temperature and max_tokens).
    num_threads: torch threads during the build (None: leave as is).
    rebuild: ignore an existing cache entry and build again.
    """
    check_warm_start_values(dict(sft_steps=sft_steps, sft_batch_size=sft_batch_size, sft_lr=sft_lr,
                                 label_noise=label_noise, label_smoothing=label_smoothing, seed=seed,
                                 eval_temperature=eval_temperature, eval_max_tokens=eval_max_tokens,
                                 num_threads=num_threads))
    settings = {
        "task": task,
        "task_kwargs": dict(task_kwargs or {}),
        "model_kwargs": dict(model_kwargs or {}),
        "sft_steps": int(sft_steps),
        "sft_batch_size": int(sft_batch_size),
        "sft_lr": float(sft_lr),
        "label_noise": float(label_noise),
        "noise_offsets": [int(o) for o in noise_offsets],
        "label_smoothing": float(label_smoothing),
        "seed": int(seed),
        "eval_temperature": float(eval_temperature),
        "eval_max_tokens": int(eval_max_tokens),
    }
    if not 0.0 <= settings["label_noise"] < 1.0:
        raise ValueError(f"label_noise must be in [0, 1), got {label_noise}")
    if not 0.0 <= settings["label_smoothing"] < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if settings["label_noise"] > 0 and (not settings["noise_offsets"] or 0 in settings["noise_offsets"]):
        raise ValueError(f"noise_offsets must be non-empty and not contain 0, got {list(noise_offsets)}")
    if settings["sft_steps"] < 0 or settings["sft_batch_size"] < 1:
        raise ValueError(f"sft_steps must be >= 0 and sft_batch_size >= 1, got {sft_steps}, {sft_batch_size}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = settings_key(settings)
    final = (root / f"warm-{key}").absolute()
    if (final / META_FILE).is_file() and not rebuild:
        log.info("warm start: cache hit %s", final)
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".warm-{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"warm start: building {final} (once; cached for later runs)", flush=True)
    try:
        meta = build_warm_policy(tmp, **settings, num_threads=num_threads, progress=progress)
        meta = {"key": key, "settings": settings, **meta}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if rebuild and final.exists():
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / META_FILE).is_file():  # not a concurrent build that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"warm start: done in {meta['total_seconds']:.0f}s; held-out pass rate {meta['held_out_pass_rate_sampled']:.3f} "
        f"sampled at T={settings['eval_temperature']:g} (greedy {meta['held_out_pass_rate_greedy']:.3f})",
        flush=True,
    )
    return str(final)


def warm_start_info(path: str | os.PathLike) -> dict:
    """The metadata recorded with a cached warm policy (settings, SFT loss, pass rates, timings)."""
    return json.loads((Path(path) / META_FILE).read_text())
