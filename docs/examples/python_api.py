"""The Python API: train the tiny run on a conversational `datasets.Dataset` with two weighted reward
functions, train the default tiny run beside it, and compare the two.

    python docs/examples/python_api.py --runs runs/python_api            # tiny_cpu.gin's own budget
    python docs/examples/python_api.py --runs /tmp/python_api --quick    # a few steps (~1-2 minutes)

The dataset holds tiny_cpu.gin's arithmetic prompts as conversations (TRL's conversational format: a
"prompt" column of [{"role": "user", "content": "12+7-3="}] lists, an "answer" column). The tiny char
tokenizer's chat template renders them exactly as the arithmetic task renders its own prompts, so the
two runs see the same inputs. The reward functions are TRL-style: called once per group with the
prompts, the completions ([{"role": "assistant", "content": text}] for conversations) and every dataset
column as a list. They are defined at the top level of this file, which the run's generator processes
import by name (`python_api:answer_reward`): the work below stays under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "experiments" / "configs" / "tiny_cpu.gin"
# tiny_cpu.gin's task (TASK_KWARGS there), so the dataset's prompts are the ones its warm start learned
TASK_KWARGS = {"max_operand": 30, "operators": "+-", "num_operands": 3, "scratchpad": True}


def _answer_text(completion) -> str:
    """The text after the thinking part of a completion (a string, or TRL's [{"role": "assistant", ...}])."""
    text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
    return text.split("</think>")[-1].strip()


def answer_reward(prompts, completions, answer, **columns) -> list[float]:
    """1 for the exact answer after </think>, else the fraction of its characters in place (partial credit)."""
    out = []
    for completion, gold in zip(completions, answer):
        got, gold = _answer_text(completion), str(gold)
        same = sum(a == b for a, b in zip(got, gold))
        out.append(1.0 if got == gold else same / max(len(gold), len(got), 1))
    return out


def format_reward(prompts, completions, **columns) -> list[float]:
    """1 when the completion closes its thinking part (<think>...</think>) before the answer, else 0."""
    texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
    return [1.0 if "</think>" in t and t.split("</think>")[-1].strip() else 0.0 for t in texts]


def conversational_dataset(num_train: int, num_eval: int, seed: int = 0):
    """(train, held-out) `datasets.Dataset`s of tiny_cpu.gin's arithmetic prompts wrapped as conversations."""
    import datasets

    from components.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=seed, num_train=num_train, num_eval=num_eval, **TASK_KWARGS)

    def rows(problems):
        return [{"prompt": [{"role": "user", "content": p.prompt}], "answer": str(p.answer)} for p in problems]

    return (datasets.Dataset.from_list(rows(task.train_problems())),
            datasets.Dataset.from_list(rows(task.eval_problems())))


def settings(quick: bool) -> dict:
    """Shared overrides of both runs: the quick budget shrinks the warm start, the steps and the evaluations."""
    if not quick:
        return {}
    return {"warm_start.sft_steps": 40, "train.total_steps": 6, "train.eval_every": 2, "train.eval_prompts": 16,
            "train.eval_k": 2, "train.prompts_per_step": 4, "train.micro_batch_size": 32, "train.checkpoint_every": 6}


def main(argv=None) -> int:
    import scalerl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/python_api", help="the sweep directory both runs go in")
    parser.add_argument("--quick", action="store_true", default=bool(os.environ.get("SCALERL_EXAMPLE_QUICK")),
                        help="a few steps and a small warm start (also SCALERL_EXAMPLE_QUICK=1)")
    args = parser.parse_args(argv)
    runs = Path(args.runs)
    overrides = settings(args.quick)
    train, held_out = conversational_dataset(200 if args.quick else 3000, 16 if args.quick else 200)

    default = scalerl.train(CONFIG, overrides, run_dir=runs / "default", name="default")
    custom = scalerl.train(CONFIG, overrides, run_dir=runs / "dataset_rewards", name="dataset_rewards",
                           train_dataset=train, eval_dataset=held_out,
                           reward_funcs=[answer_reward, format_reward, "verifier"], reward_weights=[0.5, 0.25, 1.0])
    table = scalerl.load_runs(runs)
    columns = ["run", "status", "n_steps", "flops", "last_pass_rate", "best_pass_rate", "train.task",
               "train.reward_funcs"]
    print(table[[c for c in columns if c in table]].to_string(index=False))
    pairs = scalerl.compare(runs)
    print(pairs.to_string(index=False) if len(pairs) else "nothing to compare")
    print(f"runs: {default} and {custom}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
