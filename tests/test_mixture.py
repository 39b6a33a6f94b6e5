"""Task mixtures (components/tasks/mixture.py): sampling by weight, per-task verifiers, unique
ids, per-task held-out rates, checkpointed sampler state, gin and a run end to end."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from _helpers_trainer import read_jsonl, tiny_model, write_gin
from components.curricula import build_curriculum, mixture_strata
from components.engines.base import CompletedGroup, Completion, Engine
from components.registry import TASKS, UnknownComponentError
from components.tasks import make_task
from components.tasks.base import Problem
from components.tasks.common import SplitTask


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


class _Echo(SplitTask):
    """A task whose ids collide with any other _Echo's: p0, p1, ... ; passes iff the text equals the answer."""

    def __init__(self, seed: int = 0, tag: str = "x", n_train: int = 10, n_eval: int = 4,
                 reward_correct: float = 1.0, reward_incorrect: float = -1.0):
        self.reward_correct, self.reward_incorrect = float(reward_correct), float(reward_incorrect)
        self._train = [Problem(id=f"p{i}", prompt=f"{tag}{i}", answer=f"{tag}{i}!") for i in range(n_train)]
        self._eval = [Problem(id=f"p{i}", prompt=f"{tag}e{i}", answer=f"{tag}e{i}!") for i in range(n_eval)]
        self.tag = tag

    def solution_text(self, problem):
        return problem.answer

    def verify(self, problem, completion):
        if not str(problem.prompt).startswith(self.tag):
            raise AssertionError(f"{self.tag} verifier called with {problem}")
        return self.verdict(completion.strip() == problem.answer)


class _EchoA(_Echo):
    pass


class _EchoB(_Echo):
    pass


class _EchoC(_Echo):
    pass


@pytest.fixture(autouse=True, scope="module")
def _echo_tasks():
    """The three echo tasks exist only while this module's tests run (other modules walk the registry)."""
    added = []
    for name, cls in (("_mixtest_a", _EchoA), ("_mixtest_b", _EchoB), ("_mixtest_c", _EchoC)):
        if name not in TASKS.names():
            TASKS.register(name, gin_configurable=False)(cls)
            added.append(name)
    yield
    for name in added:
        TASKS.unregister(name)


def echo_mixture(weights=None, **kw):
    weights = weights or {"_mixtest_a": 0.5, "_mixtest_b": 0.3, "_mixtest_c": 0.2}
    tags = {"_mixtest_a": "a", "_mixtest_b": "b", "_mixtest_c": "c"}
    per = {s: {"tag": tags[s], **kw.get(s, {})} for s in weights}
    return make_task(weights, seed=0, **per)


# ----------------------------------------------------------------------------- sampling by weight
@pytest.mark.parametrize("sampler", ["uniform", "no_positive_resampling"])
def test_prompts_are_sampled_by_weight(sampler):
    task = echo_mixture(_mixtest_a={"n_train": 7}, _mixtest_b={"n_train": 30}, _mixtest_c={"n_train": 3})
    cur = build_curriculum([sampler], task.train_problems(), seed=3)
    weights = {"_mixtest_a": 0.5, "_mixtest_b": 0.3, "_mixtest_c": 0.2}
    drawn = []
    for n in (5, 1, 17, 100, 877):  # in uneven batches: the schedule is carried across calls
        drawn += cur.sample(n)
    assert len(drawn) == 1000
    counts = Counter(p.meta["task"] for p in drawn)
    for t, w in weights.items():
        assert abs(counts[t] - 1000 * w) <= 1, counts  # the proportions, to within one prompt
    # and in every prefix (every batch is mixed by weight, not only the total)
    running = Counter()
    for i, p in enumerate(drawn, 1):
        running[p.meta["task"]] += 1
        assert all(abs(running[t] - i * w) <= 1.0 + 1e-9 for t, w in weights.items()), (i, running)
    # each task makes its own epochs: every prompt of a task once before any repeats
    a = [p.id for p in drawn if p.meta["task"] == "_mixtest_a"]
    assert len(set(a[:7])) == 7 and set(a[:7]) == set(a[7:14])


def test_sampling_proportions_of_real_tasks_with_unequal_pool_sizes():
    task = make_task({"arithmetic": 3, "reasoning_gym:spell_backward": 1}, seed=0,
                     arithmetic={"num_train": 40, "num_eval": 4, "max_operand": 20},
                     **{"reasoning_gym:spell_backward": {"num_train": 100, "num_eval": 4}})
    assert task.weights == {"arithmetic": 0.75, "reasoning_gym:spell_backward": 0.25}
    drawn = build_curriculum(["uniform"], task.train_problems(), seed=0).sample(400)
    counts = Counter(p.meta["task"] for p in drawn)
    assert abs(counts["arithmetic"] - 300) <= 1 and abs(counts["reasoning_gym:spell_backward"] - 100) <= 1


def test_one_task_sampler_is_the_plain_seeded_epoch_permutation():
    """A task without mixture weights is sampled exactly as before mixtures existed."""
    probs = [Problem(id=f"p{i}", prompt=str(i), answer=i) for i in range(7)]
    cur = build_curriculum(["uniform"], probs, seed=11)
    got = [p.id for p in cur.sample(20)]
    expected = []
    for epoch in range(3):  # independent reference: one default_rng([seed, epoch, 7919]) permutation per epoch
        expected += [f"p{j}" for j in np.random.default_rng([11, epoch, 7919]).permutation(7)]
    assert got == expected[:20]
    assert mixture_strata(probs) is None
    assert set(cur.sampler.state_dict()) == {"epoch", "position", "perm", "exhausted"}  # the old format


def test_mixture_sampler_state_round_trips():
    task = echo_mixture()
    a = build_curriculum(["no_positive_resampling"], task.train_problems(), seed=5)
    a.sample(37)
    for p in task.train_problems()[:4]:
        a.observe(p.id, 1.0)  # dropped for good (threshold 0.9, history 1)
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint keeps
    b = build_curriculum(["no_positive_resampling"], task.train_problems(), seed=5)
    b.load_state_dict(state)
    assert [p.id for p in a.sample(50)] == [p.id for p in b.sample(50)]
    one_task = build_curriculum(["no_positive_resampling"], [Problem(id="q", prompt="q", answer=1)], seed=5)
    with pytest.raises(ValueError, match="mixture"):
        b.load_state_dict(one_task.state_dict())


def test_a_task_whose_prompts_are_all_dropped_stops_the_run_with_a_clear_error():
    """Issue 12 item 4: No-Positive-Resampling exhaustion is an error (per task in a mixture), never a silent
    fall-back to the task's dropped prompts."""
    from components.curricula import CurriculumExhausted

    task = echo_mixture({"_mixtest_a": 0.5, "_mixtest_b": 0.5}, _mixtest_a={"n_train": 3}, _mixtest_b={"n_train": 5})
    cur = build_curriculum(["no_positive_resampling"], task.train_problems(), seed=0)
    a_ids = [p.id for p in task.train_problems() if p.meta["task"] == "_mixtest_a"]
    cur.sample(6)
    for pid in a_ids[:2]:
        cur.observe(pid, 1.0)
    drawn = cur.sample(20)  # task a keeps its weight on its one active prompt
    assert Counter(p.meta["task"] for p in drawn)["_mixtest_a"] == 10
    assert {p.id for p in drawn if p.meta["task"] == "_mixtest_a"} == {a_ids[2]}
    cur.observe(a_ids[2], 1.0)
    with pytest.raises(CurriculumExhausted, match="all 3 training prompts of task '_mixtest_a' have been dropped"):
        cur.sample(20)
    assert cur.sampler.stats()["curriculum_exhausted"] == 1 and cur.sampler.stats()["curriculum_dropped"] == 3


# ----------------------------------------------------------------------------- ids and verifiers
def test_ids_are_unique_across_tasks_and_prefixed():
    task = echo_mixture()
    members = [TASKS.get(s)(tag=t) for s, t in (("_mixtest_a", "a"), ("_mixtest_b", "b"))]
    inner = [p for m in members for p in m.train_problems()]
    assert len({p.id for p in inner}) < len(inner)  # the members' own ids collide ...
    with pytest.raises(ValueError, match="not unique"):
        build_curriculum(["uniform"], inner)
    ids = [p.id for p in task.train_problems() + task.eval_problems()]
    train_ids = [p.id for p in task.train_problems()]
    assert len(set(train_ids)) == len(train_ids)  # ... the mixture's do not
    assert all(i.startswith(("_mixtest_a/", "_mixtest_b/", "_mixtest_c/")) for i in ids)
    p = task.train_problems()[0]
    assert p.meta["task"] == "_mixtest_a" and p.meta["inner_id"] == "p0" and p.meta["mixture_weight"] == 0.5


def test_each_task_keeps_its_own_verifier():
    task = make_task({"arithmetic": 0.5, "reasoning_gym:spell_backward": 0.5}, seed=0,
                     arithmetic={"num_train": 20, "num_eval": 3, "max_operand": 9},
                     **{"reasoning_gym:spell_backward": {"num_train": 20, "num_eval": 3}})
    arith = next(p for p in task.eval_problems() if p.meta["task"] == "arithmetic")
    spell = next(p for p in task.eval_problems() if p.meta["task"] == "reasoning_gym:spell_backward")
    assert task.verify(arith, task.solution_text(arith)).passed
    assert task.verify(spell, task.solution_text(spell)).passed
    assert task.solution_text(spell) == f"<answer>{spell.answer}</answer>"  # the member's own gold format
    assert not task.verify(arith, task.solution_text(spell)).passed
    assert not task.verify(spell, task.solution_text(arith)).passed
    assert not task.verify(spell, f"<answer>{spell.answer}x</answer>").passed
    # the members' own verdicts, on the members' own problems
    _, member, inner = task.member_of(spell)
    assert inner.id == spell.meta["inner_id"] and member.verify(inner, task.solution_text(spell)).passed
    foreign = Problem(id="x", prompt="1+1=", answer=2)
    bad = task.verify(foreign, "2")
    assert not bad.passed and "not a problem of this mixture" in bad.error


def test_reasoning_gym_without_answer_tags_has_a_bare_gold_answer():
    """instruction="" (the tiny mixture's second task): the gold completion is the bare answer."""
    bare = make_task("reasoning_gym:spell_backward", num_train=5, num_eval=2, instruction="")
    p = bare.eval_problems()[0]
    assert bare.solution_text(p) == p.answer and bare.verify(p, bare.solution_text(p)).passed
    assert not bare.verify(p, p.answer[::-1] + "x").passed
    tagged = make_task("reasoning_gym:spell_backward", num_train=5, num_eval=2)
    assert tagged.solution_text(tagged.eval_problems()[0]).startswith("<answer>")


def test_held_out_split_interleaves_the_tasks():
    task = echo_mixture({"_mixtest_a": 0.9, "_mixtest_b": 0.1}, _mixtest_a={"n_eval": 5}, _mixtest_b={"n_eval": 2})
    order = [p.meta["task"][-1] for p in task.eval_problems()]
    assert order == ["a", "b", "a", "b", "a", "a", "a"]  # any prefix (train.eval_prompts) holds both


def test_mixture_errors_are_clear():
    with pytest.raises(ValueError, match="positive number"):
        make_task({"_mixtest_a": 0.0, "_mixtest_b": 1.0})
    with pytest.raises(ValueError, match="positive number"):
        make_task({"_mixtest_a": True})
    with pytest.raises(ValueError, match="non-empty dict"):
        make_task({})
    with pytest.raises(ValueError, match=r"not members of the mixture \['_mixtest_a', '_mixtest_b'\]"):
        make_task({"_mixtest_a": 1, "_mixtest_b": 1}, _mixtest_c={"tag": "c"})
    with pytest.raises(ValueError, match="data.path cannot pick"):
        make_task({"_mixtest_a": 1}, path="/data/x.parquet")
    with pytest.raises(ValueError, match="dict of constructor arguments"):
        make_task({"_mixtest_a": 1}, _mixtest_a=3)
    with pytest.raises(ValueError, match="sets 'seed'"):
        make_task({"_mixtest_a": 1}, _mixtest_a={"seed": 3})
    with pytest.raises(ValueError, match="another mixture"):
        make_task({"mixture": 1})
    with pytest.raises(ValueError, match="different rewards"):
        make_task({"_mixtest_a": 1, "_mixtest_b": 1}, _mixtest_a={"reward_incorrect": 0.0})
    with pytest.raises(UnknownComponentError, match="arithmetic"):
        make_task({"arithmetc": 1})


# ----------------------------------------------------------------------------- held-out evaluation
class ScriptedEngine(Engine):
    """Returns, for prompt i and sample j, the text `answer(i, j)` with given log-probs (some forced)."""

    def __init__(self, tokenizer, answer, logps):
        self.tok, self.answer, self.logps = tokenizer, answer, logps
        self.pending = []

    def add_requests(self, requests, params):
        self.pending = list(requests)

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        out = []
        for req in self.pending:
            comps = []
            for j in range(req.n):
                ids = self.tok.encode(self.answer(int(req.group_id), j), add_special_tokens=False)
                lp, forced = self.logps(len(ids))
                comps.append(Completion(group_id=req.group_id, sample_index=j, prompt_ids=req.prompt_ids, token_ids=ids,
                                        gen_logp=lp, versions=[0] * len(ids), forced=forced, finish_reason="stop"))
            out.append(CompletedGroup(request=req, completions=comps))
        self.pending = []
        return out

    def update_weights(self, state_dict, version):
        pass


def test_held_out_evaluation_reports_per_task_rates_and_entropy():
    from components.models import make_char_tokenizer
    from components.trainer.evaluation import evaluate

    tok = make_char_tokenizer()
    task = echo_mixture({"_mixtest_a": 0.5, "_mixtest_b": 0.5}, _mixtest_a={"n_eval": 3}, _mixtest_b={"n_eval": 3})
    problems = task.eval_problems()
    k = 4
    # task a: samples 0 and 1 right; task b: only sample 0 of its first prompt right
    def answer(i, j):
        p = problems[i]
        right = j < 2 if p.meta["task"] == "_mixtest_a" else (j == 0 and p.meta["inner_id"] == "p0")
        return p.answer if right else "nope"

    rng = np.random.default_rng(0)
    record_logps = []

    def logps(n):
        lp = (-rng.uniform(0.01, 3.0, size=n)).astype(np.float32).tolist()
        forced = [t % 3 == 2 for t in range(n)]  # every third token forced: not part of the estimate
        record_logps.append((lp, forced))
        return lp, forced

    rec = evaluate(ScriptedEngine(tok, answer, logps), task, problems, tok, k=k, seed=0, temperature=1.0, top_p=1.0,
                   max_tokens=16, task_name="mixture")
    assert rec["per_task"] == {"_mixtest_a": pytest.approx(0.5), "_mixtest_b": pytest.approx(1 / 12)}
    assert rec["pass_rate"] == pytest.approx((6 + 1) / 24)
    sampled = [-float(x) for lp, forced in record_logps for x, f in zip(lp, forced) if not f]
    assert rec["entropy"] == pytest.approx(np.mean(np.asarray(sampled, dtype=np.float64)), rel=1e-12)
    assert rec["eval_sampled_tokens"] == len(sampled) < rec["eval_tokens"]
    assert rec["k"] == k and rec["prompts"] == 6


def test_entropy_estimates_the_sampling_distribution_entropy():
    """-gen_logp averaged over sampled tokens converges to the entropy of the distribution sampled from."""
    from components.trainer.evaluation import Graded

    rng = np.random.default_rng(1)
    logits = rng.normal(size=12)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    true_h = float(-(p * np.log(p)).sum())
    draws = rng.choice(12, size=200_000, p=p)
    g = Graded(sampled_tokens=draws.size, neg_logp_sum=float(-np.log(p[draws]).sum()))
    assert g.entropy == pytest.approx(true_h, abs=0.01)


# ----------------------------------------------------------------------------- gin and the trainer
def test_gin_mixture_is_validated(tmp_path):
    from components.trainer.config import ConfigError
    from experiments.train import prepare

    model = tiny_model(tmp_path.parent / "model")
    mixture = '{"arithmetic": 0.5, "reasoning_gym:spell_backward": 0.5}'
    kwargs = ('{"arithmetic": {"num_train": 30, "num_eval": 4, "max_operand": 9}, '
              '"reasoning_gym:spell_backward": {"num_train": 30, "num_eval": 4, "instruction": ""}}')
    gin_file = write_gin(tmp_path / "mix.gin", model, train__task=mixture, train__task_kwargs=kwargs)
    cfg, _, _ = prepare([gin_file])
    assert cfg.task == {"arithmetic": 0.5, "reasoning_gym:spell_backward": 0.5}
    assert set(cfg.task_kwargs) == {"arithmetic", "reasoning_gym:spell_backward"}
    bad = write_gin(tmp_path / "bad.gin", model, train__task='{"arithmetic": 1, "reasoning_gym:spell_backwards": 1}',
                    train__task_kwargs="{}")
    with pytest.raises((ConfigError, ValueError), match="spell_backward"):
        prepare([bad])
    unknown = write_gin(tmp_path / "unk.gin", model, train__task='{"arithmetik": 1}', train__task_kwargs="{}")
    with pytest.raises(UnknownComponentError, match="arithmetic"):
        prepare([unknown])


@pytest.mark.slow
def test_a_mixture_run_logs_per_task_pass_rates(tmp_path):
    """The trainer needs no special case: a mixture run trains and eval.jsonl carries both tasks."""
    from experiments.train import run_training

    model = tiny_model(tmp_path.parent / "model")
    gin_file = write_gin(
        tmp_path / "mix.gin", model,
        train__task='{"arithmetic": 0.5, "reasoning_gym:spell_backward": 0.5}',
        train__task_kwargs=('{"arithmetic": {"num_train": 40, "num_eval": 4, "max_operand": 9, "operators": "+"}, '
                            '"reasoning_gym:spell_backward": {"num_train": 40, "num_eval": 4, "instruction": "", '
                            '"dataset_config": {"max_word_len": 4}}}'),
        train__total_steps="2", train__eval_every="2", train__checkpoint_every="2", train__eval_prompts="4",
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert set(e["per_task"]) == {"arithmetic", "reasoning_gym:spell_backward"}
        assert e["prompts"] == 4 and np.isfinite(e["entropy"]) and e["entropy"] > 0
        # 4 held-out prompts, interleaved: 2 per task, k samples each; pass_rate is their mean
        assert e["pass_rate"] == pytest.approx(np.mean(list(e["per_task"].values())))
