"""Tiny local policies and tokenizers: nothing is downloaded, everything is built from configs.

`build_tiny_policy(path)` writes a character-level tokenizer (with a chat template) and a
small randomly initialised Llama to `path` with `save_pretrained`, so every engine and the
trainer load it exactly as they would load a real checkpoint: `load_tokenizer(path)`,
`load_causal_lm(path)`.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from typing import Optional

# Characters a tiny arithmetic policy needs. Specials come first so their ids are stable.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<think>", "</think>", "<|user|>", "<|assistant|>"]
DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*/=()?.,:;!'\"\n\\{}[]^_<>|#%&$@~`"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}</s>"
    "{% else %}{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level `PreTrainedTokenizerFast` with special tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = []
    for ch in alphabet:
        if ch not in chars:
            chars.append(ch)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters, keeping whitespace as tokens.
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<think>", "</think>", "<|user|>", "<|assistant|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_policy(
    path: str | os.PathLike,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: Optional[int] = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
) -> Path:
    """Write a tiny random Llama + char tokenizer to `path` (save_pretrained); returns the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.quiet import quiet_libraries

    quiet_libraries()  # no "Writing model shards" bar
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_char_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "scalerl_tiny.json").write_text(json.dumps({"built_by": "components.models.build_tiny_policy", "seed": seed}))
    return path


def check_model_path(path: str | os.PathLike) -> Path:
    """Fail early and clearly when a model path is not a local checkpoint directory."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a directory. Pass a local checkpoint saved with "
            "save_pretrained (nothing is downloaded at run time)."
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} has no config.json; is it a transformers checkpoint?")
    return p


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    from components.quiet import quiet_libraries

    quiet_libraries()  # no library progress bars in any process that loads a model

    tok = AutoTokenizer.from_pretrained(str(check_model_path(path)), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | os.PathLike, dtype=None, attn_implementation: Optional[str] = None):
    import torch
    from transformers import AutoModelForCausalLM

    from components.quiet import quiet_libraries

    quiet_libraries()  # no "Loading weights" bar (one per process would stack up around the trainer's)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(check_model_path(path)), dtype=dtype or torch.float32, local_files_only=True, **extra
    )
    return model
