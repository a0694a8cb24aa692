"""Text in and out of a generator: its tokenizer, behind one lock, and the loading of one.

Tokenizers are not thread-safe, so every encode and decode of a generator goes through its
:class:`TextCodec`'s lock; generators made by ``Generator.with_proposer`` share the codec,
hence the lock, with the generator they came from.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

from specdec.models.llama import LlamaModel

__all__ = ["TextCodec", "eos_ids", "load_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class TextCodec:
    """A tokenizer (or ``None``: token ids only) with the lock that serialises its calls.

    Example:
        >>> codec = TextCodec(tokenizer)
        >>> codec.text_of(prompt_ids, output_ids, stop_text_len=None)
    """

    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._grammars: dict[tuple, object] = {}  # (vocab, eos ids) -> GrammarCompiler

    def encode_plain(self, text: str) -> list[int]:
        """The token ids of ``text`` alone, without BOS or other special tokens (a fragment of
        a longer text, such as a banned word)."""
        if self.tokenizer is None:
            raise ValueError("this generator has no tokenizer: pass token ids instead of text")
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def grammar_compiler(self, vocab_size: int, eos_token_ids: Sequence[int]):
        """The :class:`~specdec.logits.grammar.GrammarCompiler` of this tokenizer, made on first
        use (it reads the whole vocabulary) and shared by every request after that, so each
        grammar is compiled once per tokenizer."""
        if self.tokenizer is None:
            raise ValueError("params.structured_output needs a tokenizer (this generator has none)")
        key = (vocab_size, tuple(sorted(eos_token_ids)))
        with self._lock:
            compiler = self._grammars.get(key)
            if compiler is None:
                from specdec.logits.grammar import GrammarCompiler

                compiler = self._grammars[key] = GrammarCompiler(
                    self.tokenizer, vocab_size, list(key[1])
                )
            return compiler

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``; ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this generator has no tokenizer: pass token ids instead of text")
        with self._lock:
            return list(self.tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` without special tokens; ``""`` without a tokenizer."""
        if self.tokenizer is None:
            return ""
        with self._lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def decode_output(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
        """Decode output tokens in the context of the prompt's last tokens.

        SentencePiece-style tokenizers drop a word's leading space when it starts the decoded
        text; decoding a few prompt tokens along and cutting their text off keeps it.
        """
        context = list(prompt_ids[-4:])
        prefix = self.decode(context)
        full = self.decode(context + list(output_ids))
        return full[len(prefix) :] if full.startswith(prefix) else self.decode(output_ids)

    def text_of(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], stop_text_len: int | None
    ) -> str:
        """The output's text, cut before a matched stop string."""
        text = self.decode_output(prompt_ids, output_ids)
        return text if stop_text_len is None else text[:stop_text_len]


def load_tokenizer(path: Path | None) -> object | None:
    """The transformers tokenizer of a model directory or ``.gguf`` file.

    ``None`` for a directory without tokenizer files, or no directory (a model object built in
    memory): such a generator takes token ids only.
    """
    from transformers import AutoTokenizer

    if path is None:
        return None
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **_gguf_tokenizer_type(path))
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def _gguf_tokenizer_type(path: Path) -> dict[str, str]:
    """``tokenizer_type`` for AutoTokenizer on the GGUF file ``path``, where naming it picks the
    class AutoTokenizer would pick: otherwise AutoTokenizer parses the whole file once more (with
    gguf-py's reader, 7-9 s for a 150k-token vocabulary) only to learn the model type, which a
    header parse (:class:`~specdec.models.gguf_file.GgufFile`) reads in well under a second.
    Empty (AutoTokenizer decides) where this transformers has no tokenizer by that model type's
    name (llama in 5.x), or a ``tokenizer_config.json`` beside the file could name another."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from specdec.models.gguf_file import GgufFile

    if (path.parent / "tokenizer_config.json").exists():
        return {}
    model_type = GgufFile.read(path).model_type
    return {"tokenizer_type": model_type} if TOKENIZER_MAPPING_NAMES.get(model_type) else {}


def eos_ids(path: Path | None, model: LlamaModel, tokenizer: object) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json (in ``path``, if any) and the
    tokenizer, united."""
    ids = set(model.config.eos_token_ids)
    gen_cfg = path / "generation_config.json" if path is not None else None
    if gen_cfg is not None and gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
