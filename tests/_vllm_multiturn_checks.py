"""vLLM engine multi-turn check, run by tests/test_multiturn_vllm.py with the vllm python ($SCALERL_VLLM_PYTHON).

    python tests/_vllm_multiturn_checks.py multiturn MODEL_DIR

Scripted conversations (fixed observation ids after each turn, a per-turn budget) on the vllm engine:
the observations lie between the turns, forced and observed; each turn is handed over as sampled;
gen_logp of every sampled token is the trainer's log-prob with the observations in the context.
The protocol: tests/_helpers_vllm.py.
"""

from __future__ import annotations


def check_multiturn(model_dir: str) -> dict:
    import torch

    from _helpers_engines import recompute_logprobs  # tests/ is this script's directory
    from components.engines import GenerationRequest, SamplingParams, make_engine
    from components.engines.base import Conversation
    from components.engines.logprobs import logprob_gap_stats
    from components.models import load_causal_lm
    from components.precision import get_precision

    class Echo(Conversation):
        def __init__(self, obs, turns, per_turn):
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

    torch.manual_seed(0)
    eng = make_engine("vllm", model_dir, precision="fp32", seed=0, max_batch_size=16)
    obs = [20, 21, 22]
    convs = [Echo(obs, 2, 4) for _ in range(3)]
    reqs = [GenerationRequest(group_id=0, prompt_ids=[9, 10, 11, 12], n=3, conversations=convs),
            GenerationRequest(group_id=1, prompt_ids=[13, 14, 15], n=2)]
    groups = {g.request.group_id: g for g in eng.generate(reqs, SamplingParams(temperature=1.0, max_tokens=40))}
    for c, conv in zip(groups[0].completions, convs):
        assert len(conv.calls) == 3 and c.episode == {"turns": 3}, (conv.calls, c.episode)
        segs = []
        for tok, o in zip(c.token_ids, c.observed):
            if segs and segs[-1][0] == o:
                segs[-1][1].append(tok)
            else:
                segs.append((o, [tok]))
        assert [ids for o, ids in segs if o] == [obs, obs], segs
        assert [ids for o, ids in segs if not o] == [ids for ids, _, _ in conv.calls]
        assert c.forced == c.observed and all(len(ids) <= 4 for o, ids in segs if not o)
    for c in groups[1].completions:
        assert c.observed is None and c.episode is None
    comps = [c for g in groups.values() for c in g.completions]
    trainer = get_precision("fp32").prepare_model(load_causal_lm(model_dir)).eval()
    gap = logprob_gap_stats(*recompute_logprobs(trainer, comps, 1.0))
    assert gap["logp_gap_max_abs"] < 1e-4, gap
    return {"gap": gap, "turns": [len(c.calls) for c in convs]}


CHECKS = {"multiturn": check_multiturn}

if __name__ == "__main__":
    from _helpers_vllm import checks_main  # tests/ is this script's directory

    checks_main(CHECKS)  # python tests/_vllm_multiturn_checks.py multiturn MODEL_DIR
