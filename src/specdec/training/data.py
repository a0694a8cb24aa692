"""Training text for proposer heads: text files, or the target's own generations.

Both end as fixed-length token chunks (``token_chunks``), the unit the feature cache and the
trainer work on.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["text_files", "token_chunks", "self_distill"]

_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".js", ".json")


def text_files(patterns: Sequence[str | Path], *, max_bytes: int | None = None) -> list[str]:
    """Read the texts of files named by ``patterns`` (files, directories searched recursively
    for text suffixes, or glob patterns), in sorted order, stopping after ``max_bytes``.

    Raises FileNotFoundError naming the pattern that matched nothing.
    """
    texts, total = [], 0
    for pattern in patterns:
        paths = _expand(str(pattern))
        if not paths:
            raise FileNotFoundError(f"data pattern {str(pattern)!r} matches no readable text file")
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary or unreadable files are not training text
            texts.append(text)
            total += len(text.encode())
            if max_bytes is not None and total >= max_bytes:
                return texts
    return texts


def _expand(pattern: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
    return sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())


def token_chunks(
    tokenizer: object,
    texts: Iterable[str],
    *,
    chunk_len: int,
    max_chunks: int | None = None,
    separator_id: int | None = None,
) -> list[list[int]]:
    """Tokenize ``texts``, join them (``separator_id`` between texts when given) and cut the
    stream into chunks of exactly ``chunk_len`` tokens (the remainder is dropped)."""
    if not isinstance(chunk_len, int) or chunk_len < 2:
        raise ValueError(f"chunk_len must be an int >= 2, got {chunk_len!r}")
    chunks, buf = [], []
    for text in texts:
        buf.extend(tokenizer.encode(text, add_special_tokens=False))
        if separator_id is not None:
            buf.append(separator_id)
        while len(buf) >= chunk_len:
            chunks.append(buf[:chunk_len])
            buf = buf[chunk_len:]
            if max_chunks is not None and len(chunks) >= max_chunks:
                return chunks
    return chunks


def self_distill(generator: object, prompts: Sequence[str | Sequence[int]], params: object) -> list[list[int]]:
    """The target's own continuations: ``prompt + completion`` token ids per prompt, generated
    by ``generator`` (a :class:`specdec.Generator`, plain decoding is fine) with ``params``
    (sampled params give diverse data; seeds per prompt make it reproducible)."""
    outs = generator.generate(list(prompts), params)
    return [list(o.prompt_token_ids) + list(o.token_ids) for o in outs]
