"""A user's own loss, OUTSIDE the scalerl-zoo package (docs/adding_a_loss.md).

A gin file that says `import my_losses` registers it; `train.loss = "my_reinforce"` selects it
and `my_reinforce.scale = 0.5` sets its hyper-parameter.
"""

import torch

from components.registry import LOSSES


@LOSSES.register("my_reinforce")
def my_reinforce(logp, gen_logp, advantages, mask, *, scale=1.0):
    """Plain REINFORCE, -scale * A * log pi per token (ignores gen_logp: no IS correction)."""
    loss = -scale * advantages[:, None] * logp  # [B, T]
    return torch.where(mask, loss, torch.zeros_like(loss))  # 0 on padding
