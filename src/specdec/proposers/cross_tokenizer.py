"""Drafts from a model of another tokenizer, through text (universal assisted generation).

A draft model whose tokenizer is not the target's cannot hand the verifier its token ids or
its distributions. :class:`CrossTokenizerDraft` runs it in its own token space and meets the
target in text, as transformers' ``AssistedCandidateGeneratorDifferentTokenizers`` does:

1. the target tokens the draft has not seen become text (decoded with a look-behind window,
   so a SentencePiece word's leading space or a multi-byte character across the boundary comes
   out right) and then draft tokens; the last ``look_behind`` draft tokens are encoded again
   with the new text, so a merge across the old end is right, and the result is kept only when
   the encoding has a token boundary exactly where the kept tokens end (else the whole text is
   encoded again);
2. the draft (a :class:`~specdec.proposers.DraftModel` over its own KV pool, never the
   target's: its sequences have their own lengths) runs greedily for ``k + 1`` draft tokens,
   reusing its KV up to the first token that differs from what it ran before;
3. the new draft tokens become text, and that text target tokens, encoded after the target's
   last ``look_behind`` tokens (the same boundary check); the target token that ends the text
   is dropped (it might merge with what would follow: "def" before "ault"), at most k are kept.

The drafts are a chain without draft distributions (``draft_probs=None``): the verifier treats
them as deterministic proposals, as it does prompt lookup's, which is lossless at any
temperature. Whatever the text round trip gets wrong costs acceptance, never output.

Example:
    >>> draft = CrossTokenizerDraft.from_pretrained("path/to/draft", num_speculative_tokens=4)
    >>> gen = Generator.from_pretrained("path/to/target", proposer=draft)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from specdec.config import MAX_SPECULATIVE_TOKENS, SamplingParams
from specdec.interfaces import ProposeContext, TargetStep
from specdec.kv.allocator import OutOfPages, PageAllocator
from specdec.kv.paged import KVCacheManager, KVSpec
from specdec.models.hf_adapter import TransformersAdapter
from specdec.models.llama import LlamaModel
from specdec.proposers.draft_model import DraftModel
from specdec.types import DraftProposal, ProposalKind, RequestEnd, pad_rows

__all__ = ["CrossTokenizerDraft", "decode_after", "encode_after"]

_GREEDY = SamplingParams(temperature=0.0)


def decode_after(tokenizer, token_ids: Sequence[int], start: int, window: int) -> str | None:
    """The text ``token_ids[start:]`` add after ``token_ids[:start]``, decoded along with the
    ``window`` tokens before ``start`` (a SentencePiece word keeps its leading space); ``None``
    when that text is not a clean continuation (a multi-byte character cut at either end)."""
    lo = max(0, start - window)
    head = tokenizer.decode(list(token_ids[lo:start]), skip_special_tokens=True)
    full = tokenizer.decode(list(token_ids[lo:]), skip_special_tokens=True)
    if not full.startswith(head) or full.endswith("\ufffd"):
        return None
    return full[len(head) :]


def encode_after(tokenizer, context: str, text: str) -> tuple[list[int], list[int]] | None:
    """``text``'s token ids as they follow ``context``, and each token's end in ``text``.

    ``context`` is encoded along (so a tokenizer that prepends a space to its first word does it
    to the context's) and its tokens dropped; ``None`` when a token spans the boundary (the
    tokenizer would merge the context's end with the text's start).

    Example:
        >>> encode_after(tok, "Once upon a ti", "me there")   # "▁time" straddles: None
    """
    enc = tokenizer(context + text, add_special_tokens=False, return_offsets_mapping=True)
    boundary = len(context)
    ids: list[int] = []
    ends: list[int] = []
    clean = boundary == 0
    for token, (begin, end) in zip(enc["input_ids"], enc["offset_mapping"]):
        if end <= boundary:
            clean = clean or end == boundary
        elif begin < boundary:
            return None
        else:
            ids.append(token)
            ends.append(end - boundary)
    return (ids, ends) if clean else None


def _check_tokenizer(name: str, tokenizer: object, rows: int | None) -> None:
    if not all(
        callable(getattr(tokenizer, a, None))
        for a in ("decode", "get_vocab", "__call__", "__len__")
    ):
        raise TypeError(f"{name} must be a transformers tokenizer, got {type(tokenizer).__name__}")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"{name} must be a fast (tokenizers-backed) tokenizer: token offsets are needed"
        )
    if rows is not None and len(tokenizer) > rows:
        raise ValueError(
            f"{name} has {len(tokenizer)} tokens but its model's embedding has only {rows} rows: "
            "it is not that model's tokenizer"
        )


def _special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text (a BOS), which the draft's history starts with."""
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return list(full[:i])
    return []


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@attrs.define
class _Sequence:
    """One request's state in the draft's token space."""

    text: str = ""  # the text of the target's first ``target_len`` tokens
    target_len: int = 0
    draft_ids: list[int] = attrs.Factory(list)  # the draft's tokens of ``text`` (its BOS first)
    draft_ends: list[int] = attrs.Factory(list)  # each one's end in ``text``
    ran: list[int] = attrs.Factory(list)  # what the draft's KV holds, slot by slot (-1: junk)


class CrossTokenizerDraft:
    """Speculation with a draft model of another tokenizer (module docstring).

    ``draft``: a :class:`~specdec.proposers.DraftModel` or a specdec model; ``draft_tokenizer``:
    its tokenizer (default: the DraftModel's own, read beside its checkpoint);
    ``target_tokenizer``: the target's (default: the Generator's). ``look_behind``: tokens
    before a boundary encoded or decoded again with the text after it. ``max_draft_slots``: the
    draft's own KV pool, in draft tokens over every live request (a request that finds it full
    drafts nothing).

    Example:
        >>> draft = CrossTokenizerDraft(DraftModel.from_pretrained(path), num_speculative_tokens=4)
        >>> gen = Generator.from_pretrained("path/to/target", proposer=draft)
    """

    kind = ProposalKind.CHAIN
    needs_target_hidden = False

    def __init__(
        self,
        draft: DraftModel | LlamaModel,
        draft_tokenizer: object = None,
        *,
        num_speculative_tokens: int = 4,
        target_tokenizer: object = None,
        look_behind: int = 4,
        max_draft_slots: int = 8192,
        page_size: int = 16,
    ) -> None:
        if isinstance(draft, (str, Path)):
            raise TypeError("draft must be a DraftModel or a specdec model; load a path with "
                            "CrossTokenizerDraft.from_pretrained(path)")  # fmt: skip
        if isinstance(draft, (LlamaModel, TransformersAdapter)):
            draft = DraftModel.from_model(draft, tokenizer=draft_tokenizer)
        if not isinstance(draft, DraftModel):
            raise TypeError(
                f"draft must be a DraftModel or a specdec LlamaModel, got {type(draft).__name__}"
            )
        if (
            not isinstance(num_speculative_tokens, int)
            or not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            raise ValueError(
                f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens!r}"
            )
        for name, value in (
            ("look_behind", look_behind),
            ("max_draft_slots", max_draft_slots),
            ("page_size", page_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        draft_tokenizer = draft.tokenizer if draft_tokenizer is None else draft_tokenizer
        if draft_tokenizer is None:
            raise ValueError(
                "draft_tokenizer is needed: the draft's tokenizer (its model came without one)"
            )
        _check_tokenizer("draft_tokenizer", draft_tokenizer, draft.model.config.vocab_size)
        if target_tokenizer is not None:
            _check_tokenizer("target_tokenizer", target_tokenizer, None)
        self.draft = draft
        self.num_speculative_tokens = num_speculative_tokens
        self.look_behind = look_behind
        self.max_draft_slots = max_draft_slots
        self.page_size = page_size
        # Own copies: tokenizers are not thread-safe, and the generator's codec uses its own.
        self.draft_tokenizer = copy.deepcopy(draft_tokenizer)
        self.target_tokenizer = (
            None if target_tokenizer is None else copy.deepcopy(target_tokenizer)
        )
        self._explicit_target = target_tokenizer is not None
        self._prefix = _special_prefix(self.draft_tokenizer)
        self._target_vocab: int | None = None
        self._kv_manager: KVCacheManager | None = None  # made on first use (the pool's memory)
        self._kv = None
        self._seqs: dict[int, _Sequence] = {}
        self.num_full_encodes = 0  # the draft's text encoded again from its start (diagnostics)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        num_speculative_tokens: int = 4,
        dtype: str | torch.dtype = "bfloat16",
        device: str | torch.device = "cpu",
        quantization: str | None = None,
        draft_tokenizer: object = None,
        **kwargs,
    ) -> CrossTokenizerDraft:
        """Load the draft model and (unless given) its tokenizer from ``path``; the other
        arguments as :meth:`DraftModel.from_pretrained` and :class:`CrossTokenizerDraft`."""
        draft = DraftModel.from_pretrained(
            path, num_speculative_tokens=num_speculative_tokens, dtype=dtype, device=device,
            quantization=quantization, tokenizer=draft_tokenizer,
        )  # fmt: skip
        return cls(draft, num_speculative_tokens=num_speculative_tokens, **kwargs)

    # ---- binding to a generator ---------------------------------------------------------------

    def set_target_tokenizer(self, tokenizer: object | None) -> None:
        """The generator's tokenizer (:class:`~specdec.interfaces.UsesTargetTokenizer`), used
        unless one was given to the constructor."""
        if not self._explicit_target and tokenizer is not None:
            _check_tokenizer("the target's tokenizer", tokenizer, None)
            self.target_tokenizer = copy.deepcopy(tokenizer)

    def attach(self, target: LlamaModel) -> None:
        """Check that the target's tokenizer is known and fits the target's embedding."""
        if self.target_tokenizer is None:
            raise ValueError(
                "CrossTokenizerDraft needs the target's tokenizer: the generator has none "
                "(pass target_tokenizer=)"
            )
        rows = target.config.vocab_size
        if len(self.target_tokenizer) > rows:
            raise ValueError(
                f"target_tokenizer has {len(self.target_tokenizer)} tokens but the target's "
                f"embedding has only {rows} rows: it is not the target's tokenizer"
            )
        self._target_vocab = rows

    def kv_specs(self) -> tuple[KVSpec, ...]:
        return ()  # the draft's pool is its own: its sequences are not the target's length

    # ---- drafting ------------------------------------------------------------------------------

    def propose(self, ctx: ProposeContext) -> DraftProposal:
        if self.target_tokenizer is None:
            raise ValueError(
                "CrossTokenizerDraft needs the target's tokenizer (pass target_tokenizer=)"
            )
        k = ctx.num_speculative_tokens
        steps = min(k + 1, MAX_SPECULATIVE_TOKENS)  # one more: the last target token is dropped
        rows: list[list[int]] = [[] for _ in ctx.seq_ids]
        live = [
            i
            for i, (s, t) in enumerate(zip(ctx.seq_ids, ctx.token_ids))
            if self._catch_up(s, t, steps)
        ]
        if live:
            seq_ids = tuple(ctx.seq_ids[i] for i in live)
            inner = ProposeContext(
                seq_ids=seq_ids,
                token_ids=tuple(self._seqs[s].draft_ids for s in seq_ids),
                params=(_GREEDY,) * len(live),
                generators=(None,) * len(live),
                num_speculative_tokens=steps,
                kv=self._kv,
                backend=ctx.backend or self._backend(),
                device=self.draft.model.device,
            )
            chain = self.draft.propose(inner)
            for i, seq_id, drafted in zip(live, seq_ids, chain.draft_token_ids.tolist()):
                rows[i] = self._to_target(seq_id, ctx.token_ids[i], drafted, k)
        return DraftProposal(
            kind=ProposalKind.CHAIN,
            draft_token_ids=pad_rows(rows, k, ctx.device),
            num_draft_tokens=tuple(len(r) for r in rows),
            draft_probs=None,  # deterministic drafts: the verifier treats them as one-hot
        )

    def _catch_up(self, seq_id: int, token_ids: Sequence[int], steps: int) -> bool:
        """Bring the draft's tokens of ``seq_id`` up to the target's ``token_ids`` and its KV in
        line with them; whether it can draft this step."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Sequence(
                draft_ids=list(self._prefix), draft_ends=[0] * len(self._prefix)
            )
            self._manager().add_sequence(seq_id)
        if seq.target_len < len(token_ids):
            piece = decode_after(self.target_tokenizer, token_ids, seq.target_len, self.look_behind)
            if piece is None:
                return False  # a character cut in two: wait for its other bytes
            seq.text += piece
            seq.target_len = len(token_ids)
            self._encode_tail(seq)
        if len(seq.draft_ids) == 0:
            return False
        # The draft's KV is valid up to the first slot that differs from what it ran before;
        # at least its last token runs again, for the logits of its first draft.
        valid = min(_common_prefix(seq.ran, seq.draft_ids), len(seq.draft_ids) - 1)
        self.draft.adopt_prefix(seq_id, min(valid, self.draft.kv_valid_slots(seq_id, valid)))
        try:
            self._kv_manager.reserve(seq_id, len(seq.draft_ids) + steps)
        except OutOfPages:
            return False
        return True

    def _encode_tail(self, seq: _Sequence) -> None:
        """Encode the text after the draft's kept tokens again, with ``look_behind`` of them
        as context; from the start when the boundary does not hold."""
        base = len(self._prefix)
        keep = max(base, len(seq.draft_ids) - self.look_behind)
        start = max(base, keep - self.look_behind)
        at = seq.draft_ends[keep - 1] if keep > base else 0
        context = seq.text[seq.draft_ends[start - 1] if start > base else 0 : at]
        encoded = (
            encode_after(self.draft_tokenizer, context, seq.text[at:]) if keep > base else None
        )
        if encoded is None:
            self.num_full_encodes += keep > base
            keep, at = base, 0
            encoded = encode_after(self.draft_tokenizer, "", seq.text)
        ids, ends = encoded
        seq.draft_ids[keep:] = ids
        seq.draft_ends[keep:] = [at + e for e in ends]

    def _to_target(
        self, seq_id: int, token_ids: Sequence[int], drafted: list[int], k: int
    ) -> list[int]:
        """The draft's new tokens as at most ``k`` target tokens after ``token_ids``."""
        seq = self._seqs[seq_id]
        computed = self.draft.kv_valid_slots(seq_id, len(seq.draft_ids) + len(drafted))
        seq.ran = (seq.draft_ids + drafted)[:computed]
        drafted = [t for t in drafted if t >= 0]
        text = decode_after(
            self.draft_tokenizer, seq.draft_ids + drafted, len(seq.draft_ids), self.look_behind
        )
        if not text:
            return []
        window = list(token_ids[-self.look_behind :])
        context = self.target_tokenizer.decode(window, skip_special_tokens=True)
        encoded = encode_after(self.target_tokenizer, context, text)
        if encoded is None:
            return []
        ids, ends = encoded
        # The partial-token guard: the token that ends the draft's text may merge with text the
        # draft has not written yet.
        ids = [t for t, e in zip(ids, ends) if e < len(text)][:k]
        vocab = self._target_vocab if self._target_vocab is not None else len(self.target_tokenizer)
        cut = next((i for i, t in enumerate(ids) if t >= vocab), len(ids))
        return ids[:cut]

    def _manager(self) -> KVCacheManager:
        if self._kv_manager is None:
            num_pages = -(-self.max_draft_slots // self.page_size)
            self._kv_manager = KVCacheManager(PageAllocator(num_pages), self.page_size)
            (spec,) = self.draft.kv_specs()
            self._kv = self._kv_manager.add_pool(spec, self.draft.model.device)
        return self._kv_manager

    def _backend(self):
        from specdec.attention import default_backend

        return default_backend(self.draft.model.device, self.draft.model.dtype)

    # ---- lifecycle -----------------------------------------------------------------------------

    def on_target_step(self, step: TargetStep) -> None:
        """Nothing to roll back: the next ``propose`` compares the draft's tokens with what its
        KV holds and keeps the common prefix."""

    def on_request_start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        """A (re)admitted request starts from its prompt (:class:`~specdec.interfaces.TracksRequests`)."""
        self.release(seq_id)

    def on_request_end(self, seq_id: int, reason: RequestEnd) -> None:
        self.release(seq_id)

    def release(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is not None:
            self.draft.release(seq_id)
            self._kv_manager.free(seq_id)

    @property
    def num_live_sequences(self) -> int:
        """Requests whose state this proposer holds (0 once every request has ended)."""
        return len(self._seqs)
