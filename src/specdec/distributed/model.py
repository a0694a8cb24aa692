"""One rank's shard of the target; on the leader, every forward first tells the other ranks.

The leader (rank 0) runs the whole generator: scheduler, proposer, sampling, verification.
Its target is a :class:`TensorParallelLlama` whose :meth:`~TensorParallelLlama.forward`
broadcasts the step (the batch layout plus the page-table operations since the last step) and
then computes its shard; the other ranks run the same shard forward over the same layout in
:class:`~specdec.distributed.follower.Follower`, meeting the leader in the two all-reduces of
every layer. The embedding is replicated, so is the residual stream: the hidden states a
proposer needs are on the leader without a gather. The target's logits are vocab-parallel by
default (each rank computes its rows of the LM head, gathered on the leader); the leader also
keeps the whole LM head, which the MTP and EAGLE heads borrow as in one process.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdec.distributed.group import TensorParallelError, TensorParallelGroup
from specdec.distributed.journal import JournaledKVCacheManager
from specdec.distributed.layers import RowParallelLinear, VocabParallelHead, float32_output
from specdec.distributed.messages import MessageKind, encode, layout_fields
from specdec.distributed.sharding import check_shardable, read_shard, shard_config
from specdec.kv.paged import ModelKV
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.packed import pack_linears, should_pack
from specdec.types import BatchLayout, ModelOutput

__all__ = ["TensorParallelLlama", "load_tensor_parallel", "model_fingerprint"]


class TensorParallelLlama(LlamaModel):
    """A :class:`LlamaModel` holding one rank's shard (``layer_config``: its heads and MLP
    slice), whose o_proj and down_proj are :class:`RowParallelLinear`.

    ``config`` stays the whole model's, so proposers built on the target (MTP, EAGLE) see the
    full shape; ``attention_spec`` and ``kv_spec`` are the shard's.

    With ``head_shard`` (see :meth:`make_vocab_parallel`) :meth:`logits` is a collective: every
    rank computes its rows of the LM head and the leader gets the whole logits. ``lm_head``
    stays whole on the leader (proposers borrow it) and is dropped on the other ranks.
    """

    def __init__(self, cfg: ModelConfig, *, layer_config: ModelConfig, group: TensorParallelGroup) -> None:
        super().__init__(cfg, layer_config=layer_config)
        self.group = group
        self.head_shard: VocabParallelHead | None = None
        self._manager: JournaledKVCacheManager | None = None  # the leader's, once bound

    def make_row_parallel(self) -> None:
        """Wrap every layer's o_proj and down_proj in :class:`RowParallelLinear` (in place)."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.o_proj, self.group, self.dtype)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, self.group, self.dtype)

    def make_vocab_parallel(self) -> None:
        """Give this rank its rows of the LM head (a copy); drop the whole head off the leader."""
        vocab, rank, n = self.config.vocab_size, self.group.rank, self.group.world_size
        shard = -(-vocab // n)
        rows = slice(rank * shard, min(vocab, (rank + 1) * shard))
        weight = self.lm_head.weight[rows]  # [<= shard, hidden]
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.head_shard = VocabParallelHead(linear, self.group, vocab, shard)
        if not self.group.is_leader:
            self.lm_head = None

    def logits(self, hidden: torch.Tensor, head: torch.nn.Module | None = None) -> torch.Tensor:
        """:meth:`LlamaModel.logits`; vocab-parallel (a collective, whole on the leader only)
        with ``head_shard``; a given ``head`` runs whole on every rank."""
        if head is not None or self.head_shard is None:
            return super().logits(hidden, head)
        return self.head_shard(self.norm(hidden))

    # ---- the leader's side ------------------------------------------------------------------

    def bind(self, manager: JournaledKVCacheManager) -> None:
        """Leader: serve the generator whose KV manager is ``manager``, and send the other
        ranks its cache shape (they build the same pages)."""
        if self._manager is not None:
            raise ValueError(
                "this tensor-parallel target already serves a Generator: build another with "
                "Generator.from_pretrained(..., tensor_parallel_size=N) (with_proposer is not "
                "supported under tensor parallelism)"
            )
        self._manager = manager
        setup = [manager.allocator.num_total_pages, manager.page_size, *model_fingerprint(self)]
        self.group.send_message(encode(MessageKind.SETUP, [setup]))

    def end_call(self, kind: MessageKind = MessageKind.END_CALL) -> None:
        """Leader: a ``generate`` call ended (or, with SHUTDOWN, the generator closed); the
        page operations since the last step travel along, so the other ranks free the same pages."""
        if self._manager is not None and not self.group.broken:
            self.group.send_message(encode(kind, [self._manager.take_journal()]))

    @torch.inference_mode()
    def forward(
        self, layout: BatchLayout, kv: ModelKV, backend: object, plan: object, **kwargs
    ) -> ModelOutput:
        """:meth:`LlamaModel.forward`, after broadcasting the step on the leader."""
        if self._manager is None:
            raise RuntimeError("a tensor-parallel target runs inside its Generator only")
        try:
            ops = self._manager.take_journal()
            rows = kwargs.get("logits_indices")
            rows = [0] if rows is None else [1, *rows.tolist()]  # flag 0: every row
            self.group.send_message(encode(MessageKind.FORWARD, [ops, rows, *layout_fields(layout)]))
            return super().forward(layout, kv, backend, plan, **kwargs)
        except TensorParallelError:
            raise
        except Exception as exc:  # the other ranks wait in a collective: release them
            raise self.group.fail(exc) from exc


def model_fingerprint(model: LlamaModel) -> list[int]:
    """Shape words every rank must agree on (they loaded the same checkpoint the same way)."""
    cfg, dtypes = model.config, (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    return [cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, dtypes.index(model.dtype)]  # fmt: skip


def load_tensor_parallel(
    source: str | Path,
    world_size: int,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    vocab_parallel_head: bool = True,
) -> tuple[TensorParallelLlama, object, Path]:
    """This rank's shard of ``source`` (a safetensors checkpoint directory or known name),
    joining the group first. A model whose heads do not divide by ``world_size`` is refused
    before the group forms or any weight is read. ``vocab_parallel_head=False`` computes the
    target's logits with the whole LM head on the leader alone (measured slower on CPU, see
    docs/distributed.md). Returns ``(model, hf_config, model_dir)``."""
    from specdec.models.loading import (
        load_hf_config,
        model_from_state_dict,
        resolve_device,
        resolve_dtype,
        resolve_source,
        safetensors_files,
        settle_weights,
    )

    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    path = resolve_source(source)
    if path.suffix == ".gguf":
        raise ValueError(
            "tensor_parallel_size > 1 loads safetensors checkpoints (each rank reads its slices); "
            f"got the GGUF file {str(path)!r}: use the model's directory or known name"
        )
    hf_config = load_hf_config(path)
    cfg = ModelConfig.from_hf_config(hf_config)
    check_shardable(cfg, world_size)
    files = safetensors_files(path)
    group = TensorParallelGroup.initialize(world_size, device=torch_device)
    layer_cfg = shard_config(cfg, world_size)
    model = model_from_state_dict(
        cfg,
        read_shard(files, cfg, group.rank, world_size),
        dtype=torch_dtype,
        device=torch_device,
        layer_config=layer_cfg,
        make_model=lambda: TensorParallelLlama(cfg, layer_config=layer_cfg, group=group),
    )
    model.make_row_parallel()
    if vocab_parallel_head:
        model.make_vocab_parallel()
    if should_pack(model):
        pack_linears(model)
        for module in model.modules():
            if isinstance(module, (RowParallelLinear, VocabParallelHead)):
                float32_output(module.linear)
    return settle_weights(model), hf_config, path
