"""Curricula and filters (registry CURRICULA): uniform, zero_variance_filter,
no_positive_resampling, dynamic_sampling, and their composition."""

from __future__ import annotations

from collections import Counter

import gin
import pytest

from _helpers_trainer import read_jsonl, tiny_model, write_gin
from components.curricula import (
    CurriculumExhausted,
    DynamicSampling,
    NoPositiveResampling,
    UniformSampler,
    ZeroVarianceFilter,
    build_curriculum,
    is_zero_variance,
)
from components.registry import CURRICULA, UnknownComponentError
from components.tasks.base import Problem


@pytest.fixture(autouse=True)
def _fresh_gin():
    """Gin bindings are process-global: start and end every test with none."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()



def problems(n=10):
    return [Problem(id=f"p{i}", prompt=f"{i}+0=", answer=i) for i in range(n)]


def test_registered():
    assert {"uniform", "no_positive_resampling", "zero_variance_filter", "dynamic_sampling"} <= set(CURRICULA.names())


def test_uniform_is_epoch_permutation_and_seeded():
    a = build_curriculum(["uniform"], problems(10), seed=3)
    first = [p.id for p in a.sample(10)]
    second = [p.id for p in a.sample(10)]
    assert sorted(first) == sorted(second) == sorted(p.id for p in problems(10))  # each epoch covers all
    assert first != second  # a fresh permutation per epoch
    b = build_curriculum(["uniform"], problems(10), seed=3)
    assert [p.id for p in b.sample(20)] == first + second  # deterministic in the seed
    c = build_curriculum(["uniform"], problems(10), seed=4)
    assert [p.id for p in c.sample(10)] != first


def test_zero_variance_filter_drops_equal_reward_groups_without_refill():
    f = ZeroVarianceFilter()
    assert not f.keep([1.0, 1.0, 1.0]) and not f.keep([-1.0, -1.0]) and f.keep([1.0, -1.0, -1.0])
    assert not f.refill
    assert is_zero_variance([0.5, 0.5]) and not is_zero_variance([0.5, 0.4])
    cur = build_curriculum(["zero_variance_filter"], problems(4))
    assert isinstance(cur.sampler, UniformSampler) and not cur.refill  # no sampler named: uniform


def test_no_positive_resampling_drops_for_good():
    cur = build_curriculum(["no_positive_resampling"], problems(6), seed=0)
    sampler = cur.sampler
    assert isinstance(sampler, NoPositiveResampling) and sampler.threshold == 0.9
    cur.observe("p1", 0.875)  # below 0.9: stays
    cur.observe("p2", 0.9)  # reaches 0.9: dropped
    cur.observe("p3", 1.0)
    drawn = Counter(p.id for p in cur.sample(60))
    assert drawn["p2"] == 0 and drawn["p3"] == 0
    assert {"p0", "p1", "p4", "p5"} <= set(drawn)
    cur.observe("p2", 0.0)  # for good: a later failure does not bring it back
    assert "p2" not in {p.id for p in cur.sample(40)}
    assert sampler.stats()["curriculum_dropped"] == 2


def test_no_positive_resampling_history_and_threshold_configurable():
    gin.clear_config()
    try:
        gin.parse_config(["no_positive_resampling.threshold = 0.5", "no_positive_resampling.history = 3"])
        cur = build_curriculum(["no_positive_resampling"], problems(4))
    finally:
        gin.clear_config()
    s = cur.sampler
    assert (s.threshold, s.history) == (0.5, 3)
    for rate in (1.0, 0.0, 0.0):  # mean of the last 3: 1/3 < 0.5
        cur.observe("p0", rate)
    assert "p0" not in s.dropped
    cur.observe("p0", 1.0)  # last 3: 0, 0, 1 -> 1/3
    assert "p0" not in s.dropped
    cur.observe("p0", 1.0)  # last 3: 0, 1, 1 -> 2/3 >= 0.5
    assert "p0" in s.dropped


def test_no_positive_resampling_state_round_trip_and_exhaustion():
    cur = build_curriculum(["no_positive_resampling"], problems(5), seed=1)
    cur.sample(3)
    cur.observe("p0", 1.0)
    cur.observe("p1", 0.25)
    state = cur.state_dict()
    twin = build_curriculum(["no_positive_resampling"], problems(5), seed=1)
    twin.load_state_dict(state)
    assert [p.id for p in twin.sample(12)] == [p.id for p in cur.sample(12)]
    assert twin.sampler.pass_history["p1"] == cur.sampler.pass_history["p1"]
    for p in problems(5):  # every prompt solved: a clear error, never a silent fall-back to solved prompts
        cur.observe(p.id, 1.0)
    with pytest.raises(CurriculumExhausted, match=r"all 5 training prompts have been dropped \(mean pass rate >= 0.9 "
                                                  r"over their last 1 rollout group\(s\)\).*num_train"):
        cur.sample(7)
    assert cur.sampler.stats()["curriculum_exhausted"] == 1


def test_no_positive_resampling_warns_once_when_the_pool_is_thinner_than_an_order(caplog):
    cur = build_curriculum(["no_positive_resampling"], problems(6), seed=0)
    with caplog.at_level("WARNING", logger="components.curricula"):
        cur.sample(4)  # 6 active >= 4: nothing to say
        assert not caplog.records
        for pid in ("p0", "p1", "p2"):
            cur.observe(pid, 1.0)
        cur.sample(3)  # 3 left, 3 ordered: each prompt still once
        assert not caplog.records
        drawn = [p.id for p in cur.sample(5)]  # 3 left, 5 ordered: repeats
        cur.sample(5)
    assert sorted(set(drawn)) == ["p3", "p4", "p5"] and len(drawn) == 5
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert "3 of 6 training prompts are left" in msgs[0] and "5 were ordered at once" in msgs[0]


def test_dynamic_sampling_is_a_refilling_zero_variance_filter():
    cur = build_curriculum(["no_positive_resampling", "dynamic_sampling"], problems(4))
    assert cur.refill and cur.max_refill_rounds == 8
    assert isinstance(cur.filters[0], DynamicSampling)
    assert not cur.keep([1, 1]) and cur.keep([1, -1])


def test_composition_errors():
    with pytest.raises(ValueError, match="two prompt samplers"):
        build_curriculum(["uniform", "no_positive_resampling"], problems(3))
    with pytest.raises(UnknownComponentError, match="zero_variance_filter"):
        build_curriculum(["zero_variance_filtr"], problems(3))
    with pytest.raises(ValueError, match="no training problems"):
        build_curriculum(["uniform"], [])
    with pytest.raises(ValueError, match="threshold"):
        NoPositiveResampling(problems(3), threshold=1.5)


@pytest.mark.slow
def test_filters_in_a_run(tmp_path):
    """zero_variance_filter removes groups from the loss; dynamic_sampling refills the batch."""
    from experiments.train import run_training

    model = tiny_model(tmp_path.parent / "model")
    common = dict(train__total_steps="3", train__eval_every="100", train__checkpoint_every="100", train__max_tokens="4",
                  train__lr="1e-3")
    zv = write_gin(tmp_path / "zv.gin", model, train__curriculum='["no_positive_resampling", "zero_variance_filter"]', **common)
    assert run_training([zv], [], str(tmp_path / "zv"), progress=False) == "done"
    for m in read_jsonl(tmp_path / "zv" / "metrics.jsonl"):
        # an untrained model fails every prompt: every group is zero-variance, none is trained on
        assert m["prompts"] == 4
        assert m["groups_trained"] == round(4 * (1 - m["zero_variance_frac"]))
        assert m["filtered_frac"] == pytest.approx(m["zero_variance_frac"])

    ds = write_gin(tmp_path / "ds.gin", model, train__curriculum='["dynamic_sampling"]', dynamic_sampling__max_rounds="2", **common)
    assert run_training([ds], [], str(tmp_path / "ds"), progress=False) == "done"
    for m in read_jsonl(tmp_path / "ds" / "metrics.jsonl"):
        # refilled: only non-zero-variance groups reach the learner (at most max_rounds extra rounds)
        assert m["zero_variance_frac"] in (0.0, None)  # None: no group with signal within max_rounds
        assert m["prompts"] <= 4
    assert sum(m["refill_dropped"] for m in read_jsonl(tmp_path / "ds" / "metrics.jsonl")) > 0
