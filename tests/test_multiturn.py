"""Multi-turn rollouts (issue 45 items 1-2): the ENVIRONMENTS registry, tools, the episode runner,
the torch engine's turns, scoring and accounting, and the settings' checks.

The gradient side (observation tokens never trained on) is tests/test_multiturn_grad.py."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from _helpers_engines import recompute_logprobs
from components.engines import GenerationRequest, SamplingParams, make_engine
from components.engines.base import Completion, CompletedGroup, Conversation
from components.environments import (Calculator, EpisodeRunner, Observation, Reward, SingleTurn, ToolCall, calculate,
                                     episode_stats, generated_token_count, make_episode_runners, observation_framing,
                                     observation_token_count, parse_tool_call)
from components.models import build_tiny_policy, load_causal_lm, load_tokenizer
from components.precision import get_precision
from components.registry import ENVIRONMENTS, TASKS, UnknownComponentError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny_multiturn")))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


def _task():
    return TASKS.get("arithmetic")(seed=0, num_train=20, num_eval=5, operators="*", max_operand=99, min_operand=10)


# =========================================================================================
# registry and tools
def test_registry_lists_environments_and_names_unknown_ones():
    assert {"single_turn", "calculator"} <= set(ENVIRONMENTS.names())
    with pytest.raises(UnknownComponentError, match=r"Unknown environment 'calculater'.*calculator, single_turn.*'calculator'"):
        ENVIRONMENTS.get("calculater")


@pytest.mark.parametrize("turn,call", [
    ("Let me compute. <tool>calc: 37*91</tool>", ToolCall("calc", "37*91")),
    ("<tool> calc :  (2+3) * 4 </tool> and <tool>calc: 1</tool>", ToolCall("calc", "(2+3) * 4")),  # the first call
    ("no call here: 3367", None),
])
def test_parse_tool_call(turn, call):
    assert parse_tool_call(turn) == call


@pytest.mark.parametrize("turn,problem", [("<tool>calc: 37*91", "not closed"), ("<tool>37*91</tool>", "NAME: ARGUMENTS"),
                                          ("<tool>: 3</tool>", "NAME: ARGUMENTS")])
def test_parse_tool_call_malformed_names_the_problem(turn, problem):
    call = parse_tool_call(turn)
    assert call is not None and call.error is not None and problem in call.error


def test_calculate_exact_and_refuses_anything_but_arithmetic():
    assert calculate("37*91") == "3367"
    assert calculate("123456789*987654321") == str(123456789 * 987654321)  # exact integers
    assert calculate("(2+3)**2 - 10 // 3 % 2") == "24"
    assert calculate("7/2") == "3.5" and calculate("4/2") == "2" and calculate("-1/3") == "-0.3333333333"
    for bad in ["__import__('os')", "x*2", "abs(3)", "2**1000", "'a'*3", ""]:
        with pytest.raises(ValueError):
            calculate(bad)
    with pytest.raises(ZeroDivisionError):
        calculate("1/0")


def test_calculator_environment_answers_tools_errors_and_grades_the_final_turn():
    task = _task()
    problem = task.train_problems()[0]
    env = ENVIRONMENTS.get("calculator")(task, problem)
    assert isinstance(env, Calculator)
    expr = problem.meta["expr"]
    out = env.step(f"<tool>calc: {expr}</tool></s>")
    assert out == Observation(f"<result>{problem.answer}</result>", kind="tool")
    assert env.step("<tool>calc: 2 +* 3</tool>").kind == "malformed"
    unknown = env.step("<tool>search: cats</tool>")
    assert unknown.kind == "malformed" and "unknown tool 'search'; tools: calc" in unknown.text
    assert env.step("<tool>calc: 1/0</tool>").kind == "malformed"  # a raising tool is an error observation
    assert env.step(f"{problem.answer}</s>") == Reward(1.0, True, {"verifier": 1.0})
    assert env.step(f"{problem.answer + 1}</s>") == Reward(-1.0, False, {"verifier": -1.0})
    assert env.stop("max_turns") == Reward(-1.0, False)


# =========================================================================================
# the episode runner (string level, through the tiny char tokenizer)
def test_observation_framing_from_the_chat_template(tokenizer):
    assert observation_framing(tokenizer, "tool") == ("", "\n<|assistant|>")
    assert observation_framing(tokenizer, "user") == ("<|user|>", "\n<|assistant|>")
    plain = SimpleNamespace(chat_template=None)
    assert observation_framing(plain, "tool") == ("", "\n")


class _Scripted(SingleTurn):
    """Answers from a script: an Observation per entry, then the verifier."""

    def __init__(self, task, problem, script=()):
        super().__init__(task, problem)
        self.script, self.seen = list(script), []

    def step(self, turn):
        self.seen.append(turn)
        return self.script.pop(0) if self.script else self.grade(turn)


def _ids(tokenizer, text):
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_runner_turns_observations_and_outcome(tokenizer):
    task = _task()
    problem = task.train_problems()[0]
    env = _Scripted(task, problem, [Observation("<result>12</result>", kind="tool"), Observation("<error>x</error>", kind="malformed")])
    runner = EpisodeRunner(env, tokenizer, max_turns=4, max_observation_tokens=64)
    assert runner.max_observation_tokens == 3 * 64
    obs = runner.on_turn_end(_ids(tokenizer, "<tool>calc: 3*4</tool></s>"), "stop", 10)
    assert tokenizer.decode(obs, skip_special_tokens=False) == "<result>12</result>\n<|assistant|>"
    assert env.seen == ["<tool>calc: 3*4</tool></s>"]  # the decoded turn, stop token included
    assert runner.on_turn_end(_ids(tokenizer, "<tool>calc 3</tool></s>"), "stop", 8) is not None
    assert runner.on_turn_end(_ids(tokenizer, f"{problem.answer}</s>"), "stop", 6) is None  # the final answer
    o = runner.outcome
    assert (o.reward, o.passed, o.turns, o.tool_calls, o.malformed_calls, o.end) == (1.0, True, 3, 1, 1, "reward")
    assert o.observation_tokens == len(obs) + len(_ids(tokenizer, "<error>x</error>\n<|assistant|>"))
    assert runner.finish_reason("stop") == "stop"


def test_runner_cuts_at_max_turns_and_budgets(tokenizer):
    task, problem = _task(), _task().train_problems()[0]
    tool = Observation("<result>1</result>", kind="tool")
    runner = EpisodeRunner(_Scripted(task, problem, [tool] * 5), tokenizer, max_turns=2)
    assert runner.on_turn_end([5], "stop", 10) is not None
    assert runner.on_turn_end([5], "stop", 9) is None  # a 2nd observation would need a 3rd turn
    assert (runner.outcome.end, runner.outcome.reward, runner.outcome.passed) == ("max_turns", -1.0, False)
    assert runner.finish_reason("stop") == "length"
    for reason, left in (("length", 10), ("stop", 0)):  # the turn's budget, or the episode's
        runner = EpisodeRunner(_Scripted(task, problem, [tool]), tokenizer, max_turns=4)
        assert runner.on_turn_end([5], reason, left) is None
        assert runner.outcome.end == "length" and runner.outcome.tool_calls == 1


def test_runner_cuts_long_observations_keeping_the_framing(tokenizer):
    task, problem = _task(), _task().train_problems()[0]
    runner = EpisodeRunner(_Scripted(task, problem, [Observation("9" * 100)]), tokenizer, max_turns=3, max_observation_tokens=20)
    obs = runner.on_turn_end([5], "stop", 50)
    framing = len(_ids(tokenizer, "\n<|assistant|>"))  # 2 tokens: kept whole
    assert len(obs) == 20 and tokenizer.decode(obs, skip_special_tokens=False) == "9" * (20 - framing) + "\n<|assistant|>"


def test_runner_refuses_an_observation_budget_below_its_framing(tokenizer):
    task, problem = _task(), _task().train_problems()[0]
    runner = EpisodeRunner(_Scripted(task, problem, [Observation("hi", role="user")]), tokenizer, max_turns=3,
                           max_observation_tokens=2)
    with pytest.raises(ValueError, match="needs 3 tokens of chat framing.*max_observation_tokens = 2"):
        runner.on_turn_end([5], "stop", 50)


def test_runner_environment_errors_fail_the_sample_not_the_run(tokenizer):
    class Broken(SingleTurn):
        def step(self, turn):
            raise KeyError("boom")

    class Wrong(SingleTurn):
        def step(self, turn):
            return "not an answer"

    task, problem = _task(), _task().train_problems()[0]
    for cls, says in ((Broken, "KeyError: 'boom'"), (Wrong, "not an Observation or a Reward")):
        runner = EpisodeRunner(cls(task, problem), tokenizer, max_turns=3)
        assert runner.on_turn_end([5], "stop", 5) is None
        assert runner.outcome.end == "error" and says in runner.outcome.error and runner.outcome.reward == -1.0


# =========================================================================================
# the torch engine
class _Echo(Conversation):
    """Token-level script: after each turn, the observation `obs` (fixed ids), `turns` times; records the calls."""

    def __init__(self, obs, turns, per_turn=None):
        self.obs, self.left, self.max_tokens_per_turn = list(obs), turns, per_turn
        self.max_observation_tokens = len(obs) * turns
        self.calls = []

    def on_turn_end(self, turn_ids, finish_reason, budget_left):
        self.calls.append((list(turn_ids), finish_reason, budget_left))
        if self.left > 0 and budget_left > 0:
            self.left -= 1
            return list(self.obs)
        self.outcome = {"turns": len(self.calls)}
        return None


def _segments(c: Completion) -> list[tuple[bool, list[int]]]:
    """The completion as runs of (observed, token ids)."""
    out = []
    for tok, o in zip(c.token_ids, c.observed):
        if out and out[-1][0] == o:
            out[-1][1].append(tok)
        else:
            out.append((o, [tok]))
    return out


def test_torch_engine_appends_observations_between_turns(tiny):
    eng = make_engine("torch", tiny, precision="fp32", seed=5, max_batch_size=5)
    obs = [20, 21, 22]
    convs = [_Echo(obs, turns=2, per_turn=4) for _ in range(3)]
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 60) for _ in range(rng.randint(3, 8))] for _ in range(3)]
    reqs = [GenerationRequest(group_id=0, prompt_ids=prompts[0], n=3, conversations=convs),
            GenerationRequest(group_id=1, prompt_ids=prompts[1], n=2),  # a single-turn request in the same batch
            GenerationRequest(group_id=2, prompt_ids=prompts[2], n=2, conversations=[_Echo(obs, 1, 3), _Echo(obs, 1, 3)])]
    groups = {g.request.group_id: g for g in eng.generate(reqs, SamplingParams(temperature=1.0, max_tokens=40))}
    for c, conv in zip(groups[0].completions, convs):
        assert len(conv.calls) == 3 and c.episode == {"turns": 3}
        segs = _segments(c)
        turns = [ids for o, ids in segs if not o]
        assert [ids for o, ids in segs if o] == [obs, obs]  # observations appended whole, between the turns
        assert turns == [ids for ids, _, _ in conv.calls]  # each turn handed over as sampled
        assert c.forced == c.observed and all(lp == 0.0 for lp, o in zip(c.gen_logp, c.observed) if o)
        assert all(len(t) <= 4 for t in turns)  # max_tokens_per_turn
        assert sum(not f for f in c.forced) == sum(len(t) for t in turns)
    for c in groups[1].completions:
        assert c.observed is None and c.episode is None and not any(c.forced)
    # gen_logp of every sampled token is the trainer's log-prob with the observations in the context
    comps = [c for g in groups.values() for c in g.completions]
    model = get_precision("fp32").prepare_model(load_causal_lm(tiny)).eval()
    logp, gen, sampled = recompute_logprobs(model, comps, 1.0)
    assert float((logp - gen).abs()[sampled].max()) < 1e-4


def test_torch_engine_turn_ends_on_stop_token_and_budget(tiny):
    eng = make_engine("torch", tiny, precision="fp32", seed=2)
    prompt = [10, 11, 12, 13]
    first = next(iter(eng.generate([GenerationRequest(0, prompt, n=1)], SamplingParams(temperature=0.0, max_tokens=1))))
    t0 = first.completions[0].token_ids[0]  # the greedy first token: made a stop token below
    conv = _Echo([30, 31], turns=50)
    params = SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=(t0,))
    c = next(iter(eng.generate([GenerationRequest(0, prompt, n=1, conversations=[conv])], params))).completions[0]
    assert conv.calls[0][:2] == ([t0], "stop")  # the stop token ends the turn and is part of it
    assert sum(not f for f in c.forced) == 7  # the whole episode samples max_tokens, observations apart
    assert conv.calls[-1][2] == 0  # the last turn ended with no budget left: the episode is over
    assert c.finish_reason in ("stop", "length")


def test_torch_engine_refuses_bad_conversation_requests(tiny):
    from components.engines.base import Interruption

    eng = make_engine("torch", tiny, precision="fp32", seed=0)
    params = SamplingParams(max_tokens=5)
    with pytest.raises(ValueError, match="2 conversations for n=3"):
        eng.add_requests([GenerationRequest(0, [5, 6], n=3, conversations=[_Echo([1], 1), _Echo([1], 1)])], params)
    it = Interruption(at_token=2, phrase_ids=(5,), answer_budget=2)
    with pytest.raises(ValueError, match="cannot be combined"):
        eng.add_requests([GenerationRequest(0, [5, 6], n=1, interruptions=[it], conversations=[_Echo([1], 1)])], params)
    huge = _Echo([1] * 10, turns=100)  # 1000 observation tokens: beyond the tiny model's positions
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.add_requests([GenerationRequest(0, [5, 6], n=1, conversations=[huge])], params)


def test_engine_episode_with_the_calculator_end_to_end(tiny, tokenizer):
    """Real runners on the torch engine: each sample's episode ends with a verdict, the observations decode
    to the calculator's answers, and every observation token is forced and observed."""
    from components.trainer.generator import build_requests, score_group
    from components.trainer.rollout import WorkOrder

    task = _task()
    cfg = SimpleNamespace(environment="calculator", max_turns=3, max_tokens_per_turn=8, max_observation_tokens=16,
                          generations_per_prompt=4, seed=0, verifier_timeout_s=10.0)
    problems = task.train_problems()[:3]
    reqs = build_requests(WorkOrder(orders=list(enumerate(problems)), seed=0), tokenizer, None, cfg, task)
    assert all(len(r.conversations) == 4 for r in reqs)
    eng = make_engine("torch", tiny, precision="fp32", seed=0)
    for group in eng.generate(reqs, SamplingParams(temperature=1.0, max_tokens=20)):
        rollout = score_group(group, problems[group.request.group_id], task, tokenizer, None, cfg)
        for c, r in zip(rollout.completions, rollout.rewards):
            assert c.episode is not None and c.episode.turns >= 1 and r == c.episode.reward
            assert c.episode.observation_tokens == observation_token_count(c)
            assert generated_token_count(c) == sum(not o for o in c.observed) <= 20


# =========================================================================================
# scoring, accounting, metrics, settings
def _completion(observed, episode, finish="stop"):
    n = len(observed)
    return Completion(group_id=0, sample_index=0, prompt_ids=[1, 2], token_ids=[9] * n, gen_logp=[0.0] * n,
                      versions=[0] * n, forced=list(observed), finish_reason=finish, observed=list(observed), episode=episode)


def test_score_group_takes_the_episode_reward_and_logs_its_parts(tokenizer):
    from components.environments import EpisodeOutcome
    from components.length_control import LengthPenalty
    from components.trainer.generator import score_group

    task = _task()
    outcomes = [EpisodeOutcome(1.0, True, {"verifier": 1.0, "bonus": 0.5}, turns=2, tool_calls=1),
                EpisodeOutcome(-1.0, False, {"verifier": -1.0}, turns=3, end="max_turns")]
    comps = [_completion([False] * 6 + [True] * 10 + [False] * 4, outcomes[0]), _completion([False] * 3, outcomes[1])]
    for i, c in enumerate(comps):
        c.sample_index = i
    group = CompletedGroup(request=GenerationRequest(7, [1, 2], n=2), completions=comps)
    cfg = SimpleNamespace(verifier_timeout_s=5.0)
    # a length penalty that starts at 8 tokens: the first sample generated 10 (its 10 observation tokens do not count)
    rollout = score_group(group, task.train_problems()[0], task, tokenizer, LengthPenalty(l_max=12, l_cache=4), cfg)
    assert rollout.passed == [True, False]
    assert rollout.rewards == [1.0 + (12 - 10) / 4 - 1.0, -1.0]
    assert rollout.reward_parts["bonus"][0] == 0.5 and math.isnan(rollout.reward_parts["bonus"][1])
    assert rollout.reward_parts["verifier"] == [1.0, -1.0]
    stats = episode_stats([rollout])
    assert stats == {"turns_mean": 2.5, "tool_calls_per_sample": 0.5, "malformed_call_frac": 0.0,
                     "observation_tokens": 0, "episode_cut_frac": 0.5, "episode_error_frac": 0.0}
    assert episode_stats([SimpleNamespace(completions=[_completion([False], None)])]) == {}


def test_accounting_counts_observations_as_prompt_tokens():
    from components.trainer.accounting import FlopCounter

    c = _completion([False] * 5 + [True] * 7 + [False] * 3, None)
    assert (generated_token_count(c), observation_token_count(c)) == (8, 7)
    single = Completion(0, 0, [1], [4, 5, 6], [0.0] * 3, [0] * 3, [False, True, False], "stop")  # interruption: forced, not observed
    assert (generated_token_count(single), observation_token_count(single)) == (3, 0)
    fc = FlopCounter(n_params=100, layers=2, attn_width=8)
    assert fc.generation(2 + 7, 8) == fc.generation(2, 15)  # the same forward, whichever side they count on


def test_make_episode_runners_from_settings(tokenizer):
    task = _task()
    problem = task.train_problems()[0]
    assert make_episode_runners(SimpleNamespace(environment=None), task, problem, tokenizer, 3) is None
    cfg = SimpleNamespace(environment="calculator", max_turns=3, max_tokens_per_turn=5, max_observation_tokens=9)
    runners = make_episode_runners(cfg, task, problem, tokenizer, 3)
    assert len(runners) == 3 and len({id(r.environment) for r in runners}) == 3  # a fresh episode per sample
    assert (runners[0].max_tokens_per_turn, runners[0].max_observation_tokens) == (5, 18)


def test_settings_are_checked():
    from components.trainer.config import ConfigError, TrainConfig, check_settings, validate

    base = TrainConfig(model_path="x", max_tokens=16, micro_batch_size=8)
    validate(base)  # single turn, the default
    validate(base.replace(environment="calculator", max_turns=3, max_tokens_per_turn=8))
    with pytest.raises(ConfigError, match="max_tokens_per_turn = 8 needs train.environment"):
        validate(base.replace(max_tokens_per_turn=8))
    with pytest.raises(ConfigError, match="max_tokens_per_turn = 32 is above train.max_tokens = 16"):
        validate(base.replace(environment="calculator", max_tokens_per_turn=32))
    with pytest.raises(ConfigError, match="'interruption' cannot run with train.environment"):
        validate(base.replace(environment="calculator", length_control="interruption"))
    with pytest.raises(ConfigError, match="max_turns = 0 is out of range"):
        validate(base.replace(environment="calculator", max_turns=0))
    with pytest.raises(UnknownComponentError, match="train.environment = 'calc'.*calculator, single_turn"):
        check_settings(base.replace(environment="calc"))


# =========================================================================================
# the tiny tool task (item 4) and the documented user environment
def test_tool_arithmetic_problems_need_the_tool():
    task = TASKS.get("tool_arithmetic")(seed=0, num_train=50, num_eval=10)
    for p in task.train_problems() + task.eval_problems():
        a, b = p.meta["operands"]
        assert 10 <= a <= 99 and 10 <= b <= 99 and p.meta["operators"] == ["*"] and p.answer == a * b
        assert p.prompt == f"{a}*{b}="
    p = task.train_problems()[0]
    assert task.tool_transcript(p) == [("assistant", f"<tool>calc: {p.meta['expr']}</tool>"),
                                       ("tool", f"<result>{p.answer}</result>"), ("assistant", str(p.answer))]
    with pytest.raises(ValueError, match="digits must be >= 1"):
        TASKS.get("tool_arithmetic")(digits=0)


def test_gold_episode_is_what_the_warm_start_imitates(tokenizer):
    """The gold transcript's tokens (warm start) are exactly the tokens of the same episode run through the
    calculator environment and the episode runner (RL), and the warm start trains on the assistant turns only."""
    from components.warm_start import transcript_ids

    task = TASKS.get("tool_arithmetic")(seed=0, num_train=20, num_eval=5)
    problem = task.train_problems()[3]
    ids, trained = transcript_ids(task.tool_transcript(problem), tokenizer)
    runner = make_episode_runners(SimpleNamespace(environment="calculator", max_turns=3, max_tokens_per_turn=None,
                                                  max_observation_tokens=24), task, problem, tokenizer, 1)[0]
    eos = tokenizer.eos_token_id
    call = _ids(tokenizer, f"<tool>calc: {problem.meta['expr']}</tool>") + [eos]
    obs = runner.on_turn_end(call, "stop", 40)
    answer = _ids(tokenizer, str(problem.answer)) + [eos]
    assert runner.on_turn_end(answer, "stop", 40 - len(call)) is None
    assert ids == call + obs + answer
    assert trained == [True] * len(call) + [False] * len(obs) + [True] * len(answer)
    assert (runner.outcome.passed, runner.outcome.tool_calls, runner.outcome.turns) == (True, 1, 2)


def test_warm_start_loss_mask_leaves_observations_out(tokenizer):
    from components.tasks import render_prompt
    from components.warm_start import sft_examples, transcript_ids

    task = TASKS.get("tool_arithmetic")(seed=0, num_train=20, num_eval=5)
    problems = task.train_problems()[:1]
    ids, mask, attention = sft_examples(task, tokenizer, problems, label_noise=0.0, noise_offsets=(1,), rng=random.Random(0))(2)
    prompt = list(render_prompt(problems[0], tokenizer))
    episode, trained = transcript_ids(task.tool_transcript(problems[0]), tokenizer)
    assert ids[0].tolist() == prompt + episode and bool(attention.all())
    assert mask[0].tolist() == [float(t) for t in ([False] * len(prompt) + trained)[1:]]  # [L-1]: token t+1 is a target


def test_documented_user_environment_trains_end_to_end(tmp_path):
    """docs/adding_an_environment.md as a new user runs it: the example module and gin file on the tiny recipe."""
    import json
    from pathlib import Path

    from experiments.train import run_training

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "retry"
    status = run_training([str(root / "experiments/configs/tiny_cpu.gin"), str(root / "docs/examples/retry_env.gin")],
                          ["train.total_steps = 3", "train.eval_every = 3", "train.eval_prompts = 4", "train.eval_k = 2",
                           "train.checkpoint_every = 100", "warm_start.sft_steps = 50", "train.off_policy = 'ppo_off_policy'"],
                          str(run), progress=False)
    assert status == "done", (run / "error.txt").read_text() if (run / "error.txt").exists() else status
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert 1.0 <= r["turns_mean"] <= 2.0 and 1.0 <= r["reward/attempts"] <= 2.0
        assert r["tool_calls_per_sample"] == 0.0 and r["episode_error_frac"] == 0.0
        assert r["observation_tokens"] == round((r["turns_mean"] - 1) * r["generations"] * 20)  # 20 tokens each
    from retry_env import Retry  # the module the gin file imported (docs/examples on sys.path)

    task = _task()
    problem = task.train_problems()[0]
    env = Retry(task, problem, tries=2, retry_cost=0.5)
    assert env.step("1</s>") == Observation("Wrong, try again.", role="user")
    assert env.step(f"{problem.answer}</s>") == Reward(0.5, True, {"verifier": 1.0, "attempts": 2.0})
