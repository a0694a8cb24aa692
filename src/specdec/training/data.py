"""Training text for proposer heads: text files, or the target's own generations.

Both end as fixed-length token chunks (``token_chunks``), the unit the feature cache and the
trainer work on.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

__all__ = ["TrainData", "build_chunks", "text_files", "token_chunks", "self_distill"]

NUM_VAL_PROMPTS = 8  # held-out chunks whose beginnings are the acceptance prompts
VAL_PROMPT_TOKENS = 48


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _prompts(value: object) -> tuple:
    """Prompts as a tuple: strings stay, token-id lists become tuples."""
    return tuple(v if isinstance(v, str) else tuple(v) for v in (value or ()))


@attrs.frozen(kw_only=True)
class TrainData:
    """Where a head's training text comes from and how it is cut: ``files`` (text files,
    directories or globs) and/or ``self_distill_samples`` sampled generations of the target
    (``distill_tokens`` each, from ``distill_prompts``, default BOS), in chunks of ``chunk_len``
    tokens; the last :data:`NUM_VAL_PROMPTS` chunks are held out, and their beginnings (or
    ``val_prompts``) are the prompts acceptance is measured on, ``val_tokens`` tokens each.

    Example:
        >>> TrainData(files=("corpus/*.py",), chunk_len=256, max_chunks=208)
    """

    files: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(str(x) for x in (v or ())))
    self_distill_samples: int = attrs.field(default=0)
    distill_prompts: tuple = attrs.field(default=(), converter=_prompts)
    distill_tokens: int = attrs.field(default=256, validator=_positive)
    distill_temperature: float = 1.0
    chunk_len: int = attrs.field(default=256)
    max_chunks: int | None = attrs.field(default=None, validator=_positive)
    max_bytes: int | None = attrs.field(default=None, validator=_positive)
    val_prompts: tuple = attrs.field(default=(), converter=_prompts)
    val_tokens: int = attrs.field(default=64, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.self_distill_samples, int) or self.self_distill_samples < 0:
            raise ValueError(f"self_distill_samples must be an int >= 0, got {self.self_distill_samples!r}")
        if not self.files and self.self_distill_samples == 0:
            raise ValueError("give files (text files) or self_distill_samples > 0 (the target's own generations)")
        if not isinstance(self.chunk_len, int) or self.chunk_len < 2:
            raise ValueError(f"chunk_len must be an int >= 2, got {self.chunk_len!r}")
        if not self.distill_temperature >= 0:
            raise ValueError(f"distill_temperature must be >= 0, got {self.distill_temperature!r}")


def build_chunks(model: object, tokenizer: object, data: TrainData) -> tuple[list[list[int]], list]:
    """``(training chunks, held-out prompts)`` for ``data``: text files and/or the target's own
    generations (``model`` is the target); the last NUM_VAL_PROMPTS chunks are held out and their
    beginnings are the prompts unless ``data.val_prompts`` names others."""
    from specdec import CacheConfig, Generator, SamplingParams

    chunks: list[list[int]] = []
    if data.files:
        texts = text_files(data.files, max_bytes=data.max_bytes)
        chunks += token_chunks(tokenizer, texts, chunk_len=data.chunk_len, max_chunks=data.max_chunks,
                               separator_id=next(iter(model.config.eos_token_ids), None))
    if data.self_distill_samples > 0:
        prompts = list(data.distill_prompts) or [[tokenizer.bos_token_id or 0]]
        longest = max(len(p) if not isinstance(p, str) else len(tokenizer.encode(p)) for p in prompts)
        gen = Generator.from_components(
            model, tokenizer,
            cache_config=CacheConfig(max_batch_size=64, max_num_tokens=longest + data.distill_tokens + 1),
        )
        prompts = [prompts[i % len(prompts)] for i in range(data.self_distill_samples)]
        params = [SamplingParams(max_new_tokens=data.distill_tokens, temperature=data.distill_temperature, seed=i,
                                 ignore_eos=True) for i in range(data.self_distill_samples)]  # fmt: skip
        sequences = []
        for i in range(0, len(prompts), 64):  # batches of 64 bound the KV cache
            sequences += self_distill(gen, prompts[i : i + 64], params[i : i + 64])
        n = data.chunk_len
        chunks += [s[j : j + n] for s in sequences for j in range(0, len(s) - n + 1, n)]
    if len(chunks) < NUM_VAL_PROMPTS + 2:
        raise ValueError(f"only {len(chunks)} chunks of {data.chunk_len} tokens: give more data or a smaller chunk_len")
    held_out = chunks[-NUM_VAL_PROMPTS:]  # never trained on
    prompts = [list(p) if not isinstance(p, str) else p for p in data.val_prompts]
    return chunks[:-NUM_VAL_PROMPTS], prompts or [c[:VAL_PROMPT_TOKENS] for c in held_out]

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
