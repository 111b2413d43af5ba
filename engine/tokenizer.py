"""A checkpoint's tokenizer and what its files say: loading it, its serialized form (for
structured output), its end-of-sequence ids, chat templates, bad words. Turning token ids back
into streamed text is ``detokenizer.py``'s.

Everything loads offline: a checkpoint directory holds its own tokenizer files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)



def load_tokenizer(model_dir: str) -> Any:
    """The checkpoint's fast (Rust-backed) transformers tokenizer, loaded without network."""
    from transformers import AutoTokenizer

    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"no checkpoint directory at {model_dir!r}")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                            trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model_dir!r}: {e}") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"the tokenizer in {model_dir!r} is not a fast tokenizer "
                         f"(kvrelay needs tokenizer.json)")
    return tok


def tokenizer_json(model_dir: str) -> str:
    """The checkpoint's fast tokenizer, serialized: ``tokenizer.json`` as the Rust `tokenizers`
    library reads and writes it (milliseconds), else converted by transformers (seconds: it
    imports transformers and may convert a slow tokenizer). What a worker needs of the
    tokenizer to compile structured-output grammars; the router holds the full one."""
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(path).to_str()
        except Exception as e:  # the Rust library's own error type
            raise ValueError(f"cannot read {path}: {e}") from e
    return load_tokenizer(model_dir).backend_tokenizer.to_str()


def eos_token_ids(model_dir: str, tokenizer: Any | None = None) -> frozenset[int]:
    """Every id that ends generation: generation_config.json, config.json and the tokenizer's.

    Instruct checkpoints often list several (end of turn and end of text), sometimes only in
    ``generation_config.json``; all of them stop a request. Without ``tokenizer``, the
    tokenizer's EOS comes from its files (``tokenizer_eos_token_id``).
    """
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
        ids.update(_as_ids(value, path))
    if tokenizer is not None:
        tok_eos = getattr(tokenizer, "eos_token_id", None)
    else:
        tok_eos = tokenizer_eos_token_id(model_dir)
    if tok_eos is not None:
        ids.add(int(tok_eos))
    if not ids:
        logger.warning("no EOS token id found for %s: requests stop only at max_tokens, stop "
                       "strings or stop_token_ids", model_dir)
    return frozenset(ids)


# Tokenizer classes whose EOS comes only from the files (no class default stands in for it).
_GENERIC_TOKENIZER_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}


def tokenizer_eos_token_id(model_dir: str) -> int | None:
    """``load_tokenizer(model_dir).eos_token_id``, read from the tokenizer's own files where they
    say it plainly: ``tokenizer_config.json`` names the token (``special_tokens_map.json``, if it
    names one, agrees: transformers versions differ on which wins and on whether it is read at
    all) and ``tokenizer.json`` holds its id. A worker needs only this id, and loading the
    transformers tokenizer in a process that has torch imports seconds of transformers' torch
    side. Anything less plain (a class that may default the token, the files disagreeing, a
    token not in the vocabulary) loads the tokenizer and asks it. None when the directory has
    no tokenizer at all."""
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(model_dir, "special_tokens_map.json")) or {}
    tokenizer_json = os.path.join(model_dir, "tokenizer.json")
    has_json = os.path.isfile(tokenizer_json)
    if config is None and not has_json:
        return None
    token = _token_text(config.get("eos_token")) if config is not None else None
    if (token is not None and has_json
            and _token_text(special_map.get("eos_token")) in (None, token)
            and config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES):
        from tokenizers import Tokenizer

        token_id = Tokenizer.from_file(tokenizer_json).token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return getattr(load_tokenizer(model_dir), "eos_token_id", None)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else None


def _token_text(value: Any) -> str | None:
    """A special token as the files write it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"eos_token_id in {where} must be an id or a list of ids, got {value!r}")
    return values


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja template, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    if not value.strip():
        raise ValueError("--chat-template is empty")
    return value


def apply_chat_template(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True,
                        chat_template: str | None = None) -> str:
    """Render chat ``messages`` with ``chat_template`` (a Jinja template; default: the
    tokenizer's own) into a prompt string.

    The result already holds the template's special tokens (BOS included, if the template has
    it): encode it with ``add_special_tokens=False``.
    """
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt "
                         "(completions), or start the router with --chat-template FILE|STRING")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a mapping with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]['content'] must be a string")
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template or None)
    except Exception as e:  # jinja's TemplateError, including the template's raise_exception
        raise ValueError(f"the chat template rejected the messages: {e}") from e
    assert isinstance(text, str)
    return text


def bad_words_token_ids(tokenizer: Any, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """Token sequences for vLLM's ``bad_words``: each word as the start of a text and after a
    space (BPE vocabularies spell the two differently), without special tokens, duplicates
    dropped. A word of nothing but spaces is refused (ValueError)."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        if not bare:
            raise ValueError("bad_words entries must not be empty")
        for text in (bare, " " + bare):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)
