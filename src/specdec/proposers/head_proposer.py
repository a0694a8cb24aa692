"""The base of the proposers that run a head on the target's features (``MTPHead``,
``EAGLETree``): binding the head to the generator's target, and following the target.

Per sequence such a proposer keeps ``g``: the head's output at the last committed row, which
ranks the tokens after the last emitted one (draft 1, or the tree root's children). After every
target pass (prefill, plain decode, verify) the head re-runs over the rows the target kept,
pairing the target's features with the committed tokens after them: that overwrites every
draft-time row of the head's KV with one computed from the target's (more accurate) features,
and yields the new ``g``.

A proposer made ``from_pretrained`` has checked the head's files; the weights are placed on the
target when a Generator attaches it (a head borrows the target's modules, so it cannot exist
before the target does).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.interfaces import TargetStep
from specdec.kv.paged import KVSpec
from specdec.models.head_module import HeadModule
from specdec.models.llama import LlamaModel

__all__ = ["HeadProposer"]


class HeadProposer:
    """What ``MTPHead`` and ``EAGLETree`` share. A subclass names its head (``head_name``, in
    messages), loads it from ``path`` (:meth:`_load`) and may map the target's states to the
    head's input (:meth:`_feature`)."""

    needs_target_hidden = True
    head_name = "head"
    # Prefix caching (SharesCachedPrefix): the head's row p pairs the target's features at p
    # with token p + 1, so a cached page is reused only where that token matches too.
    kv_lookahead = 1

    def __init__(self, *, head: HeadModule | None, path: Path | None, quantization: str | None) -> None:
        self.head = head
        self._path = path  # where from_pretrained found the head's files
        self._quantization = quantization  # of the head's linear layers
        self._g: dict[int, torch.Tensor] = {}  # seq_id -> [hidden] the head's last committed output

    def _load(self, target: LlamaModel) -> HeadModule:
        raise NotImplementedError

    def _feature(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input from the target's states of a kept row (default: as they are)."""
        return hidden

    def attach(self, target: LlamaModel) -> None:
        """Bind to the generator's target: load the weights (from_pretrained) or check that the
        head given fits ``target`` and borrows this very instance's weights."""
        if not isinstance(target, LlamaModel):  # the transformers adapter: logits only
            raise ValueError(
                f"the {self.head_name} reads the target's hidden states and LM head, which a model on the "
                f"transformers adapter ({target.config.architecture}) does not expose: use a draft model, "
                "PromptLookup or SuffixDecoding with it, or a natively supported family (docs/models.md)"
            )
        if self.head is None:
            self.head = self._load(target)
        elif self.head.target is not target:
            self.head.config.check_target(target.config)
            if self.head.target.embed_tokens.weight is not target.embed_tokens.weight:
                raise ValueError(
                    f"this {self.head_name} was built on another target model instance; load it with from_pretrained"
                )

    def _attached_head(self) -> HeadModule:
        if self.head is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a target yet (a Generator does that)")
        return self.head

    def kv_specs(self) -> tuple[KVSpec, ...]:
        return (self._attached_head().kv_spec(),)

    def _live_rows(self, seq_ids: Sequence[int]) -> list[int]:
        """The batch rows whose sequence has a ``g`` (all of them, normally)."""
        return [i for i, s in enumerate(seq_ids) if s in self._g]

    def _outputs(self, seq_ids: Sequence[int]) -> torch.Tensor:  # [len(seq_ids), hidden]
        return torch.stack([self._g[s] for s in seq_ids])

    def on_target_step(self, step: TargetStep) -> None:
        """Re-run the head over the rows ``step`` kept; keep each sequence's last output."""
        head = self.head
        hidden, next_tokens = step.kept_pairs()  # [kept rows, width of the target's states]
        layout = step.kv.layout(step.seq_ids, next_tokens, step.start_slots, device=head.device)
        plan = step.backend.plan(layout, head.attention_spec)
        g = head(self._feature(hidden), layout.token_ids, layout.positions, step.kv, step.backend, plan)
        last = g[layout.last_row_indices]  # [batch, hidden]
        for i, seq_id in enumerate(step.seq_ids):
            self._g[seq_id] = last[i]

    def kv_valid_slots(self, seq_id: int, num_computed: int) -> int:
        """Every committed slot: after each target pass the head has re-run the kept rows."""
        return num_computed if seq_id in self._g else 0

    def adopt_prefix(self, seq_id: int, num_slots: int) -> None:
        """Nothing to do: the prefill's kept rows (from ``num_slots`` on) give the new ``g``."""

    def release(self, seq_id: int) -> None:
        self._g.pop(seq_id, None)
