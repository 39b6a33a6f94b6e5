"""A user's own reward, OUTSIDE the scalerl-zoo package (README "A plain-function reward").

A gin file that says `import my_rewards` registers it; `hf_dataset.reward = "digits_partial_credit"`
selects it and `digits_partial_credit.partial = 0.25` sets its parameter.
"""

from components.registry import REWARDS


@REWARDS.register("digits_partial_credit")
def digits_partial_credit(prompt: str, completion: str, *, answer, partial: float = 0.3, **row) -> float:
    """1.0 for exactly the answer, `partial` for a completion with any digit in it, else 0.0."""
    text = completion.replace("</s>", "").strip()
    if text == str(answer).strip():
        return 1.0
    return partial if any(ch.isdigit() for ch in text) else 0.0
