"""Off-policy schemes: ppo_off_policy(k) and pipeline_rl(k) (PAPER.md §5), a user's own scheme
(docs/examples/bounded_async.py), and the one loop that runs them all (components/offpolicy.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import gin
import pytest

from _helpers_trainer import REPO, read_jsonl, tiny_model, write_gin, write_user_task
from components.engines.base import Completion
from components.offpolicy import LoopState, OffPolicyScheme, make_scheme, pipeline_rl, ppo_off_policy
from components.registry import OFF_POLICY
from components.trainer.rollout import Rollout

EXAMPLES = REPO / "docs" / "examples"
if str(EXAMPLES) not in sys.path:  # as `scalerl train` does for a config file's directory
    sys.path.insert(0, str(EXAMPLES))
importlib.import_module("bounded_async")  # registers the documented user scheme


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are process-global: start and end every test with none."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()



def test_schemes_registered_and_gin_bindable():
    assert {"ppo_off_policy", "pipeline_rl"} <= set(OFF_POLICY.names())
    assert OFF_POLICY.get("ppo_off_policy")().k == 1  # synchronous by default
    gin.clear_config()
    try:
        gin.parse_config(["pipeline_rl.k = 4", "pipeline_rl.inflight_batches = 3"])
        scheme = OFF_POLICY.get("pipeline_rl")()
        assert (scheme.k, scheme.inflight_batches) == (4, 3)
        assert scheme.takes_weights_mid_sequence() and scheme.push_after_step(_state())  # streaming
    finally:
        gin.clear_config()
    ppo = ppo_off_policy(k=8)
    assert not ppo.takes_weights_mid_sequence() and not ppo.push_after_step(_state())
    assert ppo.prompts_to_order(_state(P=4)) == 8 * 4  # a round: k batches with frozen weights
    assert ppo.prompts_to_order(_state(P=4, waiting=False)) == 0  # never while the learner trains
    assert pipeline_rl(k=8, inflight_batches=1).prompts_to_order(_state(P=4)) == 4  # one batch ahead


@pytest.mark.parametrize("scheme", [pipeline_rl, ppo_off_policy])
@pytest.mark.parametrize("bad", [0, -1])
def test_bad_k_fails_clearly(scheme, bad):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        scheme(k=bad)


def test_lag_and_staleness_rule():
    assert OffPolicyScheme.lag(10, _group(0, [7, 9, 10])) == 3
    assert OffPolicyScheme.lag(3, _group(0, [], engine_version=3)) == 0  # no sampled token: the engine's version
    assert OffPolicyScheme.lag(10, _group(0, [2, 9], forced=[True, False])) == 1  # forced tokens are not trained
    scheme = pipeline_rl(k=8)
    assert scheme.usable(10, _group(0, [2]))  # exactly k old is allowed
    assert not scheme.usable(10, _group(0, [1]))  # k + 1 old is not
    assert ppo_off_policy(k=1).usable(10, _group(0, [1]))  # frozen rounds: every group is used
    bounded = make_scheme("bounded_async")
    assert bounded.usable(10, _group(0, [8])) and not bounded.usable(10, _group(0, [7]))  # k = 2


# ---------------------------------------------------------------------------------------
# the one loop, with the processes simulated: every scheme's decisions, in milliseconds
def _state(P: int = 2, waiting: bool = True, **fields) -> LoopState:
    base = dict(step=0, total_steps=100, prompts_per_step=P, learner_version=0, pushed_version=0, pending=(),
                outstanding=0, next_order=0, waiting=waiting, orders_this_wait=0, max_refill_rounds=0, run_seed=0)
    return LoopState(**{**base, **fields})


def _group(order_id: int, versions: list, engine_version: int = 0, forced: list = None) -> Rollout:
    completion = Completion(group_id=order_id, sample_index=0, prompt_ids=[1], token_ids=[2] * len(versions),
                            gen_logp=[0.0] * len(versions), versions=list(versions),
                            forced=list(forced or [False] * len(versions)), finish_reason="stop")
    return Rollout(order_id=order_id, problem_id=f"p{order_id}", completions=[completion], rewards=[1.0],
                   passed=[True], engine_version=engine_version)


class _Curriculum:
    """Every prompt, every group kept (a refilling filter is the trainer runs' business)."""

    refill, max_refill_rounds = False, 0

    def sample(self, n: int) -> list:
        return [None] * n

    def observe(self, problem_id, pass_rate) -> None:
        pass

    def keep(self, rewards) -> bool:
        return True


def simulate(scheme: OffPolicyScheme, total_steps: int = 8, P: int = 2) -> dict:
    """The trainer's own control flow (`Trainer._train_loop`) with its processes replaced: the
    generators finish groups in order, each at the version they held when it was ordered.
    Returns what each step trained on (lags), when weights were pushed and prompts ordered."""
    from components.trainer.loop import Trainer

    t = Trainer.__new__(Trainer)
    t.cfg, t.P, t.scheme = SimpleNamespace(total_steps=total_steps, seed=0), P, scheme
    t.learner, t.curriculum = SimpleNamespace(version=0), _Curriculum()
    t.totals = {"stale_dropped": 0, "refill_dropped": 0}
    t.step = t.next_order = t.pushed_version = t.outstanding = t.orders_this_wait = 0
    t.pending, t.batches = [], []
    t._reset_since()
    in_flight, out = [], {"lags": [], "pushes": [], "orders": []}

    def order(problems, seed):
        ids = list(range(t.next_order, t.next_order + len(problems)))
        t.next_order += len(problems)
        in_flight.extend((oid, t.pushed_version) for oid in ids)
        out["orders"].append((t.step, len(ids)))
        return ids

    def receive():
        oid, version = in_flight.pop(0)
        return _group(oid, [version])

    def push():
        t.pushed_version = t.learner.version
        out["pushes"].append(t.step)

    def train_step(batch):
        out["lags"].append([t.learner.version - g.min_version for g in batch])
        t.step += 1
        t.learner.version += 1

    t._order, t._receive, t.push_weights, t._train_step = order, receive, push, train_step
    t._after_step = lambda: t.step >= total_steps
    t._train_loop()
    out["steps"], out["stale_dropped"], out["in_flight"] = t.step, t.totals["stale_dropped"], len(in_flight)
    return out


def test_ppo_off_policy_rounds_in_the_loop():
    got = simulate(ppo_off_policy(k=2), total_steps=5, P=2)
    assert got["lags"] == [[0, 0], [1, 1], [0, 0], [1, 1], [0, 0]]  # k steps per frozen round
    assert got["orders"] == [(0, 4), (2, 4), (4, 2)]  # k batches at once; the last round is cut to the run
    assert got["pushes"] == [2, 4]  # weights only before a new round
    assert got["in_flight"] == 0 and got["stale_dropped"] == 0


def test_pipeline_rl_in_the_loop_bounds_lag_and_drops_stale_groups():
    got = simulate(pipeline_rl(k=1, inflight_batches=3), total_steps=10, P=2)
    assert got["steps"] == 10 and all(len(b) == 2 for b in got["lags"])
    assert max(max(b) for b in got["lags"]) == 1  # runs ahead, never more than k behind
    assert got["stale_dropped"] > 0  # 3 batches in flight, k = 1: some groups are too old
    assert got["pushes"] == list(range(1, 11))  # weights after every step


def test_bounded_async_in_the_loop():
    scheme = make_scheme("bounded_async")
    assert not scheme.takes_weights_mid_sequence()
    got = simulate(scheme, total_steps=10, P=2)
    assert got["steps"] == 10 and max(max(b) for b in got["lags"]) <= scheme.k
    assert max(max(b) for b in got["lags"]) >= 1  # the generators do run ahead
    assert got["pushes"] == list(range(1, 11))


@pytest.mark.parametrize("name", OFF_POLICY.names())
def test_every_registered_scheme_runs_through_the_same_loop(name):
    """Shipped schemes and the documented user scheme alike: the loop asks, the scheme decides."""
    got = simulate(make_scheme(name), total_steps=6, P=3)
    assert got["steps"] == 6 and all(len(b) <= 3 for b in got["lags"])


def test_loop_names_no_scheme():
    """The loop never branches on a scheme's name or kind: its source names none."""
    source = (REPO / "components" / "trainer" / "loop.py").read_text()
    for word in OFF_POLICY.names() + ["streaming", "_run_ppo", "_run_pipeline"]:
        assert word not in source, word


def test_a_scheme_that_neither_trains_nor_orders_fails_clearly():
    class Stuck(OffPolicyScheme):
        name = "stuck"

        def prompts_to_order(self, s):
            return 0

    with pytest.raises(ValueError, match="'stuck' forms no batch.*orders no prompts"):
        simulate(Stuck(), total_steps=2)
    with pytest.raises(NotImplementedError, match="'off_policy_scheme'.*must define prompts_to_order"):
        simulate(OffPolicyScheme(), total_steps=2)


def test_make_scheme_refuses_what_is_not_a_scheme(monkeypatch):
    monkeypatch.setattr(OFF_POLICY, "get", lambda name: (lambda: {"k": 1}))
    with pytest.raises(TypeError, match="'my_scheme' built dict.*not an OffPolicyScheme.*ppo_off_policy"):
        make_scheme("my_scheme")


@pytest.mark.slow
def test_ppo_off_policy_k_lag_pattern(tmp_path):
    """ppo_off_policy(2): each round is generated with frozen weights, so the 2nd step of a round is 1 version stale."""
    from experiments.train import run_training

    gin_file = write_gin(
        tmp_path / "ppo2.gin", tiny_model(tmp_path.parent / "model"),
        train__off_policy='"ppo_off_policy"', ppo_off_policy__k="2", train__total_steps="6",
        train__eval_every="100", train__checkpoint_every="100",
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [m["lag_max"] for m in metrics] == [0, 1, 0, 1, 0, 1]
    assert [m["lag_mean"] for m in metrics] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert all(m["multi_version_frac"] == 0.0 for m in metrics)  # frozen weights: never mixed


@pytest.mark.slow
@pytest.mark.parametrize("generators", [1, 2])
def test_pipeline_rl_bounds_staleness_and_spans_versions(tmp_path, generators):
    """pipeline_rl(k): never trains on a token more than k versions old, and in-flight
    weight updates make completions span several versions; with 2 generators the bound holds
    across both (each gets every weight update)."""
    from experiments.train import run_training

    k = 1
    gin_file = write_gin(
        tmp_path / "pipe.gin", tiny_model(tmp_path.parent / "model"), imports=(write_user_task(tmp_path),),
        train__engine='"trainer_test_slow_torch"',  # decoding slower than a learner step, as on real hardware
        trainer_test_slow_torch__step_delay="0.02",
        train__off_policy='"pipeline_rl"', pipeline_rl__k=str(k), pipeline_rl__inflight_batches="3",
        train__max_tokens="32", train__total_steps="10", train__eval_every="100", train__checkpoint_every="100",
        train__task_kwargs='{"num_train": 120, "num_eval": 8, "max_operand": 12, "operators": "+"}',
        train__num_generators=str(generators),
    )
    assert run_training([gin_file], [], str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    used = {g for m in metrics for g in m["groups_by_generator"]}
    assert used == {f"generator-{i}" for i in range(generators)}, used
    trained = [m for m in metrics if m["lag_max"] is not None]
    assert trained and all(m["lag_max"] <= k for m in trained), [m["lag_max"] for m in metrics]
    # the generator really runs ahead of the learner: some tokens are off-policy ...
    assert max(m["lag_max"] for m in trained) == k
    # ... and some completions contain tokens of more than one policy version
    assert sum(m["multi_version_frac"] for m in metrics) > 0
    # too-stale groups were dropped rather than trained on (3 batches in flight, k=1)
    assert sum(m["stale_dropped"] for m in metrics) > 0


# ---------------------------------------------------------------------------------------
# the same, end to end (processes, weights, evaluations, checkpoints)
@pytest.mark.slow
@pytest.mark.parametrize("name", OFF_POLICY.names())
def test_every_registered_scheme_trains_end_to_end(tmp_path, name):
    """A 3-step tiny run per scheme, the example's gin file among the configs (its module is then
    importable in every process) and the scheme chosen by one binding."""
    from experiments.train import run_training

    gin_file = write_gin(tmp_path / "tiny.gin", tiny_model(tmp_path.parent / "model"),
                         train__total_steps="3", train__eval_every="100", train__checkpoint_every="100")
    assert run_training([gin_file, str(EXAMPLES / "bounded_async.gin")], [f'train.off_policy = "{name}"'],
                        str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert f"train.off_policy = '{name}'" in (tmp_path / "run" / "config.gin").read_text()  # the operative config


@pytest.mark.slow
def test_bounded_async_runs_ahead_but_never_takes_weights_mid_sequence(tmp_path):
    """bounded_async(k=2) with generation slower than a learner step (as pipeline_rl's test): the
    generators run ahead (stale tokens appear), none is more than k versions old, and, unlike
    under pipeline_rl, no completion spans two versions."""
    from experiments.train import run_training

    gin_file = write_gin(
        tmp_path / "bounded.gin", tiny_model(tmp_path.parent / "model"), imports=(write_user_task(tmp_path),),
        train__engine='"trainer_test_slow_torch"', trainer_test_slow_torch__step_delay="0.02",
        train__max_tokens="32", train__total_steps="10", train__eval_every="100", train__checkpoint_every="100",
        train__task_kwargs='{"num_train": 120, "num_eval": 8, "max_operand": 12, "operators": "+"}',
    )
    assert run_training([gin_file, str(EXAMPLES / "bounded_async.gin")], ["bounded_async.k = 2"],
                        str(tmp_path / "run"), progress=False) == "done"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    lags = [m["lag_max"] for m in metrics if m["lag_max"] is not None]
    assert lags and 1 <= max(lags) <= 2, lags
    assert all(m["multi_version_frac"] == 0.0 for m in metrics), [m["multi_version_frac"] for m in metrics]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bounded_async_example_learns_from_its_gin_file(tmp_path):
    """`scalerl train experiments/configs/tiny_cpu.gin docs/examples/bounded_async.gin`, as the
    guide runs it (100 steps instead of 500): the held-out pass rate rises."""
    import json
    import os
    import subprocess

    exe = Path(sys.executable).with_name("scalerl")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "experiments.cli"]
    run_dir = tmp_path / "run"
    proc = subprocess.run(cli + ["train", "experiments/configs/tiny_cpu.gin", "docs/examples/bounded_async.gin",
                                 "--gin", "train.total_steps = 100", "--gin", "train.eval_every = 50",
                                 "--run-dir", str(run_dir), "--no-progress"],
                          cwd=str(REPO), env=dict(os.environ), capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "done"
    assert "train.off_policy = 'bounded_async'" in (run_dir / "config.gin").read_text()
    evals = [e for e in read_jsonl(run_dir / "eval.jsonl") if "benchmark" not in e]
    start, end = evals[0]["pass_rate"], evals[-1]["pass_rate"]
    assert end >= start + 0.15, f"bounded_async did not raise the held-out pass rate: {start:.3f} -> {end:.3f}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert max(m["lag_max"] for m in metrics if m["lag_max"] is not None) <= 2  # bounded_async.k = 2
    assert all(m["multi_version_frac"] == 0.0 for m in metrics)
