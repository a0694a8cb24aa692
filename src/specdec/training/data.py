"""Training text for proposer heads: text files, or the target's own generations.

Both end as fixed-length token chunks (``token_chunks``), the unit the feature cache and the
trainer work on.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

__all__ = ["TrainData", "build_chunks", "text_files", "token_chunks", "pack_chunks", "self_distill", "read_prompts"]

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

    Self-distillation runs ``distill_batch_size`` sequences at a time (``None``: see
    :func:`default_distill_batch`) at ``distill_temperature``.
    With ``distill_stop_at_eos`` a generation ends at the target's end-of-sequence token, and
    the sequences, now of different lengths, are joined (end-of-sequence between them) and cut
    like text files; otherwise each runs ``distill_tokens`` and is cut on its own.

    Example:
        >>> TrainData(files=("corpus/*.py",), chunk_len=256, max_chunks=208)
        >>> TrainData(self_distill_samples=320, distill_prompts=read_prompts("code.jsonl"),
        ...           distill_tokens=160, distill_temperature=0.7, distill_stop_at_eos=True)
    """

    files: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(str(x) for x in (v or ())))
    self_distill_samples: int = attrs.field(default=0)
    distill_prompts: tuple = attrs.field(default=(), converter=_prompts)
    distill_tokens: int = attrs.field(default=256, validator=_positive)
    distill_temperature: float = 1.0
    distill_batch_size: int | None = attrs.field(default=None, validator=_positive)
    distill_stop_at_eos: bool = False
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
        temperature = self.distill_temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"distill_temperature must be a number >= 0, got {temperature!r}")
        if not isinstance(self.distill_stop_at_eos, bool):
            raise ValueError(f"distill_stop_at_eos must be a bool, got {self.distill_stop_at_eos!r}")


def build_chunks(model: object, tokenizer: object, data: TrainData) -> tuple[list[list[int]], list]:
    """``(training chunks, held-out prompts)`` for ``data``: text files and/or the target's own
    generations (``model`` is the target); the last NUM_VAL_PROMPTS chunks are held out and their
    beginnings are the prompts unless ``data.val_prompts`` names others."""
    chunks: list[list[int]] = []
    if data.files:
        texts = text_files(data.files, max_bytes=data.max_bytes)
        chunks += token_chunks(tokenizer, texts, chunk_len=data.chunk_len, max_chunks=data.max_chunks,
                               separator_id=next(iter(model.config.eos_token_ids), None))
    if data.self_distill_samples > 0:
        sequences = _distilled_sequences(model, tokenizer, data)
        n = data.chunk_len
        if data.distill_stop_at_eos:
            eos = next(iter(model.config.eos_token_ids), None)
            chunks += pack_chunks(sequences, chunk_len=n, separator_id=eos)
        else:
            chunks += [s[j : j + n] for s in sequences for j in range(0, len(s) - n + 1, n)]
    if len(chunks) < NUM_VAL_PROMPTS + 2:
        raise ValueError(f"only {len(chunks)} chunks of {data.chunk_len} tokens: give more data or a smaller chunk_len")
    held_out = chunks[-NUM_VAL_PROMPTS:]  # never trained on
    prompts = [list(p) if not isinstance(p, str) else p for p in data.val_prompts]
    return chunks[:-NUM_VAL_PROMPTS], prompts or [c[:VAL_PROMPT_TOKENS] for c in held_out]


def _distilled_sequences(model: object, tokenizer: object, data: TrainData) -> list[list[int]]:
    """The target's own sampled continuations of ``data.distill_prompts`` (cycled), one seed
    per sample, through one Generator whose continuous batching keeps
    ``data.distill_batch_size`` sequences running (a finished one's slot is refilled at once)."""
    from specdec import CacheConfig, Generator, SamplingParams

    # token ids throughout (text encoded as the Generator does), so text and ids may mix
    prompts = [list(tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in data.distill_prompts]
    prompts = prompts or [[tokenizer.bos_token_id or 0]]
    longest = max(len(p) for p in prompts)
    context = model.config.max_position_embeddings
    if longest + data.distill_tokens > context:
        raise ValueError(
            f"distill_tokens ({data.distill_tokens}) + the longest distillation prompt ({longest} tokens) "
            f"exceed the target's context ({context} tokens); lower distill_tokens to at most {context - longest}"
        )
    batch = data.distill_batch_size or default_distill_batch(model)
    gen = Generator.from_components(
        model, tokenizer, cache_config=CacheConfig(max_batch_size=batch, max_model_len=longest + data.distill_tokens)
    )
    prompts = [prompts[i % len(prompts)] for i in range(data.self_distill_samples)]
    params = [SamplingParams(max_new_tokens=data.distill_tokens, temperature=data.distill_temperature, seed=i,
                             ignore_eos=not data.distill_stop_at_eos) for i in range(data.self_distill_samples)]  # fmt: skip
    return self_distill(gen, prompts, params)


def default_distill_batch(model: object) -> int:
    """How many generations self-distillation runs at once when not told: 64 on an accelerator
    or for a small model on a CPU (there a step is overhead, which a batch shares: stories260K
    makes 3.0k tok/s at 16 and 5.9k at 64 on one core); 16 for a CPU model of 100M parameters
    or more, already compute-bound there (the 0.5B makes 78 tok/s at 16 but 46 at 64)."""
    if model.device.type != "cpu":
        return 64
    return 16 if sum(p.numel() for p in model.parameters()) >= 100_000_000 else 64


def read_prompts(path: str | Path) -> list[str | list[int]]:
    """Prompts from a JSON-lines file: each non-empty line a JSON string (a text prompt), a
    list of token ids, or an object with a ``"prompt"`` key holding either.

    Raises ValueError naming the file and line of an entry that is none of these.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    prompts: list[str | list[int]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if isinstance(value, dict):
            value = value.get("prompt")
        ids = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in value)  # fmt: skip
        if not (isinstance(value, str) and value) and not ids:
            raise ValueError(f"{path}:{lineno}: a prompt must be a non-empty string, a list of token ids "
                             f"or an object with a \"prompt\" key holding one")  # fmt: skip
        prompts.append(value)
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} holds no prompt")
    return prompts


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
    encoded = (tokenizer.encode(text, add_special_tokens=False) for text in texts)  # lazily: max_chunks stops early
    return pack_chunks(encoded, chunk_len=chunk_len, max_chunks=max_chunks, separator_id=separator_id)


def pack_chunks(
    sequences: Iterable[Sequence[int]],
    *,
    chunk_len: int,
    max_chunks: int | None = None,
    separator_id: int | None = None,
) -> list[list[int]]:
    """Join token ``sequences`` into one stream (``separator_id`` after each that does not
    already end with it; empty ones skipped) and cut it into chunks of exactly ``chunk_len``
    tokens (the remainder is dropped), stopping after ``max_chunks``."""
    if not isinstance(chunk_len, int) or chunk_len < 2:
        raise ValueError(f"chunk_len must be an int >= 2, got {chunk_len!r}")
    chunks, buf = [], []
    for seq in sequences:
        if not seq:
            continue
        buf.extend(seq)
        if separator_id is not None and seq[-1] != separator_id:
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
