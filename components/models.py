"""Tiny local policies and tokenizers: nothing is downloaded, everything is built from configs.

`build_tiny_policy(path)` writes a character-level tokenizer (with a chat template) and a
small randomly initialised Llama to `path` with `save_pretrained`, so every engine and the
trainer load it exactly as they would load a real checkpoint: `load_tokenizer(path)`,
`load_causal_lm(path)`.

A run's `model.path` must hold a checkpoint; a NEW randomly initialised model is built only when
asked for explicitly with ``model.new_model = True`` (`ensure_new_model`), so a mistyped path is
an error, never a silently random model.

`model.path` may also be a Hugging Face hub id ("Qwen/Qwen2.5-0.5B-Instruct", at ``model.revision``):
`resolve_model_path` turns it into the local snapshot directory huggingface_hub downloads and
caches (``HF_HOME``; nothing is downloaded under ``HF_HUB_OFFLINE=1``), so every consumer (learner,
engines, eval) loads a local directory.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from typing import Optional, Sequence

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


def _wrap_fast(tok):
    """A `tokenizers.Tokenizer` as the tiny policies' `PreTrainedTokenizerFast`: the special tokens,
    the chat template, left padding."""
    from transformers import PreTrainedTokenizerFast

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


def make_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level `PreTrainedTokenizerFast` with special tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

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
    return _wrap_fast(tok)


def make_word_tokenizer(words: Sequence[str]):
    """A word-level `PreTrainedTokenizerFast` trained with `tokenizers` (WordLevelTrainer) on
    `words`: one token per whitespace-separated word of the corpus, the specials first (stable ids),
    the same chat template as the char tokenizer. Decoding joins tokens with a space."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1, show_progress=False)
    tok.train_from_iterator(list(dict.fromkeys(words)), trainer=trainer)
    return _wrap_fast(tok)


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
    vocabulary: Optional[Sequence[str]] = None,
) -> Path:
    """Write a tiny random Llama + tokenizer to `path` (save_pretrained); returns the path. The
    tokenizer is character-level over `alphabet`, or word-level over `vocabulary` when given
    (`make_word_tokenizer`: a task's whole vocabulary, e.g. `StoryTask.vocabulary()`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.quiet import quiet_libraries

    quiet_libraries()  # no "Writing model shards" bar
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_char_tokenizer(alphabet) if vocabulary is None else make_word_tokenizer(vocabulary)
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


# Written into a directory `ensure_new_model` built: a later run with model.new_model = True reuses
# it. The other names are what the tiny and warm-start builders write themselves.
NEW_MODEL_MARKER = "scalerl_new_model.json"
_BUILT_MARKERS = (NEW_MODEL_MARKER, "scalerl_tiny.json", "warm_start.json")


def ensure_new_model(path: str | os.PathLike, *, builder=None, build_kwargs: Optional[dict] = None) -> Path:
    """The model `model.new_model = True` asks for: built at `path` by `builder(path, **build_kwargs)`
    (default `build_tiny_policy`) if nothing is there yet, else the model an earlier such build left.

    The build goes to a temporary directory renamed into place (a concurrent run's build wins).
    A directory at `path` that no builder made (a real checkpoint, or anything else) is refused:
    the setting asks for a new model, and training that directory instead would be a silent swap.
    """
    p = Path(path)
    wanted = json.loads(json.dumps(dict(build_kwargs or {}), default=str))  # as the marker records them
    if p.exists():
        if (p / NEW_MODEL_MARKER).is_file():
            built = json.loads((p / NEW_MODEL_MARKER).read_text()).get("build_kwargs")
            if built != wanted:
                raise FileExistsError(
                    f"the new model at {str(p)!r} was built with model.build_kwargs = {built}, but this run asks for "
                    f"{wanted}; point model.path at a directory that does not exist yet to build that one"
                )
            return p
        if any((p / m).is_file() for m in _BUILT_MARKERS):
            return p
        raise FileExistsError(
            f"model.new_model = True asks for a NEW model at {str(p)!r}, but that path already holds something no "
            "model builder made. To train the checkpoint there, set model.new_model = False; for a new model, "
            "point model.path at a directory that does not exist yet."
        )
    if builder is None:
        builder = build_tiny_policy
    tmp = p.with_name(f".{p.name}.building-{os.getpid()}")
    builder(tmp, **dict(build_kwargs or {}))
    (tmp / NEW_MODEL_MARKER).write_text(json.dumps(
        {"builder": f"{getattr(builder, '__module__', '?')}.{getattr(builder, '__qualname__', builder)}",
         "build_kwargs": wanted}))
    try:
        os.rename(tmp, p)
    except OSError:  # built concurrently by another run: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return p


class ModelPathError(FileNotFoundError):
    """`model.path` names no usable model: a missing local path, a malformed hub id, or a hub id that
    cannot be resolved (not cached under HF_HUB_OFFLINE=1, no such repository or revision)."""


# What a model repository may hold besides the files transformers and vLLM load from a snapshot
# (other frameworks' weights, the original consolidated checkpoints): never downloaded.
HUB_IGNORE_PATTERNS = (
    "original/*", "*.pth", "*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5", "flax_model*",
    "tf_model*", "*.ot", "*.tflite", "*.mlmodel", "coreml/*", "openvino/*", "*.ckpt",
)
# PyTorch pickles: downloaded only when the repository has no *.safetensors weights.
_PICKLED_WEIGHTS = ("*.bin", "*.pt")

# local snapshot directory -> {"model_id", "model_revision", "model_commit"} of the hub ids this process resolved
_HUB_SOURCES: dict[str, dict] = {}


def looks_local(path: str | os.PathLike) -> bool:
    """True when `path` is meant as a filesystem path, not a Hugging Face hub id ("name" or "org/name").

    Local: it exists; it starts with /, ./, ../ or ~ (or is . or ..); it has a backslash or more
    than one /; or its first component exists here (``runs/tiny`` where ``runs/`` exists).
    """
    s = os.fspath(path)
    if s in (".", "..") or s.startswith(("/", "./", "../", "~")) or "\\" in s or s.count("/") > 1:
        return True
    if os.path.lexists(s):
        return True
    return "/" in s and os.path.lexists(s.split("/", 1)[0])


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_where() -> str:
    from huggingface_hub import constants

    return f"the hub cache {constants.HF_HUB_CACHE} (HF_HOME={constants.HF_HOME})"


def _hub_call(repo_id: str, revision: Optional[str], fn):
    """`fn(offline)` (a huggingface_hub download), its errors as one-line `ModelPathError`s naming the
    id, the revision, the cache and the fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ModelPathError(
            f"model.path {repo_id!r} is neither an existing local path nor a valid Hugging Face hub id "
            f"('name' or 'org/name' of letters, digits, '-', '_', '.'): {err}"
        ) from None
    what = f"Hugging Face hub id {repo_id!r} (revision {revision or 'main'!r})"
    offline = hub_offline()
    try:
        return fn(offline)
    except GatedRepoError:
        raise ModelPathError(f"model.path: {what} is a gated repository: accept its terms on huggingface.co and log in "
                             "(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelPathError(f"model.path: {what} names no repository on the hub (nor is it a local path); check the id, "
                             "or log in (`hf auth login` or HF_TOKEN) for a private one") from None
    except RevisionNotFoundError:
        raise ModelPathError(f"model.path: {what}: the repository has no such revision (model.revision: a branch, tag or "
                             "commit hash; default main)") from None
    except LocalEntryNotFoundError as err:
        if offline and not isinstance(err, IncompleteSnapshotError):
            raise ModelPathError(
                f"model.path: {what} is not in {_hub_where()}, and HF_HUB_OFFLINE=1 forbids downloading it (nor is it a "
                f"local path). Download it once online (`hf download {repo_id}"
                f"{f' --revision {revision}' if revision else ''}` or a run without HF_HUB_OFFLINE), point HF_HOME at the "
                "cache that holds it, or unset HF_HUB_OFFLINE."
            ) from None
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelPathError(f"model.path: {what} could not be downloaded and is not in {_hub_where()}: {reason}") from None


def resolve_model_path(path: str | os.PathLike, revision: Optional[str] = None) -> str:
    """`model.path` as a local directory: a local path as an absolute path (it must exist), a hub id
    ("org/name") as its snapshot directory in the Hugging Face cache, downloaded there first unless
    cached (`huggingface_hub.snapshot_download`: honours HF_HOME, HF_HUB_OFFLINE, HF_TOKEN).

    `revision` (``model.revision``): a branch, tag or commit hash of the hub repository; None: main.
    Only the files transformers and vLLM load are downloaded (no other frameworks' weights, no
    ``original/``; PyTorch pickles only when there are no safetensors). Raises `ModelPathError`.
    """
    s = os.fspath(path)
    if revision is not None and not isinstance(revision, str):
        raise ModelPathError(f"model.revision must be a string (a branch, tag or commit hash), got {revision!r}")
    if looks_local(s):
        p = Path(s).expanduser().absolute()
        if revision is not None:
            raise ModelPathError(f"model.revision = {revision!r} selects a revision of a Hugging Face hub id, but "
                                 f"model.path {s!r} is a local path; drop model.revision")
        if not p.exists():
            raise ModelPathError(
                f"model.path {s!r} does not exist (a local path). Give a local checkpoint directory (save_pretrained) or a "
                "Hugging Face hub id ('org/name', e.g. \"Qwen/Qwen2.5-0.5B-Instruct\"); to train a NEW randomly "
                "initialised model at that path instead, set model.new_model = True."
            )
        return str(p)

    from huggingface_hub import snapshot_download

    def download(offline: bool) -> str:
        kw = dict(revision=revision, local_files_only=offline)
        local = snapshot_download(s, ignore_patterns=list(HUB_IGNORE_PATTERNS + _PICKLED_WEIGHTS), **kw)
        if not any(Path(local).glob("*.safetensors")):  # weights only as pytorch_model*.bin
            local = snapshot_download(s, ignore_patterns=list(HUB_IGNORE_PATTERNS), **kw)
        return str(local)

    local = _hub_call(s, revision, download)
    _HUB_SOURCES[local] = {"model_id": s, "model_revision": revision, "model_commit": Path(local).name}
    return local


def hub_model_file(repo_id: str, filename: str, revision: Optional[str] = None) -> str:
    """One file of a hub model (e.g. config.json for `scalerl plan`), downloaded alone into the
    Hugging Face cache unless cached; its local path. Raises `ModelPathError` as `resolve_model_path`."""
    from huggingface_hub import hf_hub_download

    return _hub_call(repo_id, revision,
                     lambda offline: hf_hub_download(repo_id, filename, revision=revision, local_files_only=offline))


def hub_model_info(local_path: str | os.PathLike) -> dict:
    """{"model_id", "model_revision", "model_commit"} when `local_path` is the snapshot this process
    resolved a hub id to (`resolve_model_path`), else {} (a local model)."""
    return dict(_HUB_SOURCES.get(os.fspath(local_path), {}))


def check_model_path(path: str | os.PathLike) -> Path:
    """Fail early and clearly when a model path is not a local checkpoint directory."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a directory. Pass a local checkpoint saved with "
            "save_pretrained (nothing is downloaded at run time); to train a NEW randomly initialised "
            "model there instead, set model.new_model = True."
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


def empty_causal_lm(path: str | os.PathLike, dtype=None, attn_implementation: Optional[str] = None):
    """The model at `path` as an empty skeleton on the meta device: its config is read, its weights are not.

    Learner ranks >= 1 build this (no host or device memory for the weights); after
    `fully_shard` each allocates only its own shards and receives them from learner rank 0,
    the one process that reads the checkpoint (`Learner`, `load_from_rank0`). An 8B model on
    8 ranks of a node then needs one full fp32 copy in host memory at start, not eight.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from components.quiet import quiet_libraries

    quiet_libraries()
    config = AutoConfig.from_pretrained(str(check_model_path(path)), local_files_only=True)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32, **extra)
    return model.eval()  # as from_pretrained returns it
