"""A non-leader rank: it follows the leader's steps over its own shard and KV heads."""

from __future__ import annotations

import torch

from specdec.distributed.group import TensorParallelError
from specdec.distributed.journal import replay
from specdec.distributed.messages import MessageKind, StepMessage, decode, layout_from_fields
from specdec.distributed.model import TensorParallelLlama, model_fingerprint
from specdec.kv.allocator import PageAllocator
from specdec.kv.paged import KVCacheManager

__all__ = ["Follower"]


class Follower:
    """Runs ``model`` (this rank's shard) over each step the leader broadcasts.

    Its KV manager replays the leader's page-table operations, so its tables (checked on every
    step) and its free pages always equal the leader's.

    Example:
        >>> follower = Follower(model, backend)    # waits for the leader's generator
        >>> follower.follow()                       # until the leader's generate() returns
    """

    def __init__(self, model: TensorParallelLlama, backend: object) -> None:
        self.model = model
        self.group = model.group
        self.backend = backend
        setup = self._receive()
        if setup.kind is not MessageKind.SETUP:
            raise self.group.fail(RuntimeError(f"expected the leader's setup, got {setup.kind.name}"))
        num_pages, page_size, *fingerprint = setup.fields[0].tolist()
        if fingerprint != model_fingerprint(model):
            raise self.group.fail(
                ValueError(
                    f"rank {self.group.rank} loaded another model than rank 0 (shape words "
                    f"{model_fingerprint(model)} vs {fingerprint}): every rank must load the "
                    "same checkpoint with the same dtype"
                )
            )
        self.kv = KVCacheManager(PageAllocator(num_pages), page_size)
        self.target_kv = self.kv.add_pool(model.kv_spec("target"), model.device)

    def follow(self) -> bool:
        """Run the leader's steps until its ``generate`` returns (``True``) or it closes the
        generator (``False``). A failure here ends every rank (see :class:`TensorParallelGroup`)."""
        while True:
            message = self._receive()
            kind, fields = message.kind, message.fields
            try:
                replay(self.kv, fields[0].tolist())
                if kind is MessageKind.FORWARD:
                    self._forward(fields[1].tolist(), fields[2:])
                elif kind is MessageKind.END_CALL:
                    return True
                elif kind is MessageKind.SHUTDOWN:
                    return False
                else:
                    raise RuntimeError(f"unexpected {kind.name} message from the leader")
            except TensorParallelError:
                raise
            except Exception as exc:  # the leader waits in a collective: release it
                raise self.group.fail(exc) from exc

    def _receive(self) -> StepMessage:
        return decode(self.group.receive_message())

    @torch.inference_mode()
    def _forward(self, logit_rows: list[int], fields) -> None:
        """One target pass: ``logit_rows`` is ``[0]`` (logits of every row) or ``[1, rows...]``;
        ``fields`` the layout's words."""
        layout = layout_from_fields(fields, self.model.device)
        _, indices, _ = self.kv.page_metadata(layout.seq_ids, layout.kv_lens)
        if not torch.equal(indices, layout.kv_page_indices.cpu()):
            raise RuntimeError(
                f"rank {self.group.rank}: page tables diverged from the leader's for sequences "
                f"{list(layout.seq_ids)}"
            )
        plan = self.backend.plan(layout, self.model.attention_spec)
        embeds = self.model.embed_tokens(layout.token_ids)
        # The same layer loop as the leader's forward (same collectives, same order); hidden
        # states are the leader's business, and so are the logits unless they are vocab-parallel.
        (h,) = self.model.layer_states(
            embeds, layout.positions, self.target_kv, self.backend, plan, (self.model.config.num_layers,)
        )
        if self.model.head_shard is not None:
            if logit_rows[0]:  # the rows the leader asked logits for
                h = h.index_select(0, torch.tensor(logit_rows[1:], dtype=torch.int64, device=h.device))
            self.model.logits(h)
