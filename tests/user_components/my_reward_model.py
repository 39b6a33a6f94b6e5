"""A reward MODEL as a reward function, OUTSIDE the scalerl-zoo package (README "Several weighted rewards").

`classifier_reward` is a tiny torch classifier: it embeds each character of a completion's answer
(the text after ``</think>``), averages the embeddings and maps them through a linear layer and a
sigmoid to a score in (0, 1), "how much this answer looks like a bare number". Its weights are set
by hand here (digits score high, letters and punctuation low), where a real reward model would load
trained ones (``torch.load``, ``from_pretrained``).

It is called as TRL's GRPOTrainer calls a reward function, once per group of completions:
``classifier_reward(prompts=[...], completions=[...], completion_ids=[...], **columns)`` returns one
float per completion. The module is built on the first call, in each generator process that scores::

    import my_rewards                      # (optional) plain-function rewards registered by name
    train.reward_funcs = ["verifier", "my_reward_model:classifier_reward"]
    train.reward_weights = [1.0, 0.5]
"""

from __future__ import annotations

import threading

import torch

ALPHABET = 128  # ASCII; any other character maps to 0


class TinyAnswerClassifier(torch.nn.Module):
    """mean-pooled character embeddings -> linear -> logit."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(ALPHABET, dim)
        self.head = torch.nn.Linear(dim, 1)
        with torch.no_grad():  # hand-set weights: feature 0 = "is a digit", feature 1 = "is anything else"
            self.embed.weight.zero_()
            self.embed.weight[:, 1] = 1.0
            for ch in "0123456789-":
                self.embed.weight[ord(ch), 0] = 1.0
                self.embed.weight[ord(ch), 1] = 0.0
            self.head.weight.zero_()
            self.head.weight[0, 0], self.head.weight[0, 1] = 4.0, -4.0
            self.head.bias.fill_(0.0)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, L] -> logits [B]."""
        emb = self.embed(ids) * mask[..., None]  # [B, L, D]
        pooled = emb.sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp_min(1.0)  # [B, D]
        return self.head(pooled).squeeze(-1)  # [B]


def _encode(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(t) for t in texts))
    ids = torch.zeros((len(texts), width), dtype=torch.long)
    mask = torch.zeros((len(texts), width), dtype=torch.float32)
    for i, t in enumerate(texts):
        codes = [ord(c) if ord(c) < ALPHABET else 0 for c in t]
        if codes:
            ids[i, : len(codes)] = torch.tensor(codes)
            mask[i, : len(codes)] = 1.0
    return ids, mask


class ClassifierReward:
    """A reward function backed by `TinyAnswerClassifier` (built lazily, once per process)."""

    def __init__(self):
        self._model = None
        self._lock = threading.Lock()

    def model(self) -> TinyAnswerClassifier:
        with self._lock:
            if self._model is None:
                self._model = TinyAnswerClassifier().eval()
            return self._model

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        answers = []
        for c in completions:
            text = c[0]["content"] if isinstance(c, list) else str(c)  # TRL's conversational form, or text
            answers.append(text.rsplit("</think>", 1)[-1].replace("</s>", "").strip())
        ids, mask = _encode(answers)
        with torch.no_grad():
            scores = torch.sigmoid(self.model()(ids, mask))  # [B]
        return [float(s) for s in scores]


classifier_reward = ClassifierReward()
