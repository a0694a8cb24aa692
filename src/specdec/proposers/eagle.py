"""EAGLE proposer: a feature-level draft head grows a tree of candidates for one verify pass.

Per sequence the proposer keeps ``g``: the head's output at the last committed row, whose
logits rank the tokens after the last emitted one (the root's children). Each step:

- ``propose``: the tree grows depth by depth (:mod:`specdec.proposers.tree_shape`: a static
  list of paths or EAGLE-2's dynamic rule). Depth 1 ranks ``g``'s logits; each later depth runs
  the head once over every node expanded so far, as one tree-masked batch (a node sees the
  committed prefix and its own ancestors), pairing each node's token with its parent's head
  output at RoPE position ``start + depth - 1``. Their rows sit in the slots reserved for the
  verify pass and are rewritten by the next ``on_target_step``. The best nodes (by summed
  log-probability) go to the target, parents first.
- ``on_target_step``: re-run the head over the rows the target kept, pairing the target's
  features with the committed tokens (for trees the engine has put the kept path first). This
  replaces every draft-time row of the head's KV by one computed from the target's features,
  and yields the new ``g``.

Siblings are the draft's top-ranked tokens (deterministic given the context), so sampled
requests are verified with the tree verifier's rule for fixed siblings: lossless whatever the
head proposes (:mod:`specdec.verify.tree`).

Example:
    >>> eagle = EAGLETree.from_pretrained("heads/qwen-1.5b-eagle3", top_k=4, depth=5)
    >>> gen = Generator.from_pretrained("qwen2.5-coder-1.5b-instruct", proposer=eagle)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.interfaces import ProposeContext, TargetStep
from specdec.kv.paged import ModelKV
from specdec.models.eagle_checkpoints import load_eagle_head
from specdec.models.eagle_head import EagleHeadModel
from specdec.models.head_io import head_files
from specdec.models.llama import LlamaModel
from specdec.models.quantized import check_quantization
from specdec.proposers.head_proposer import HeadProposer
from specdec.proposers.tree_shape import Node, TreeShape, best_first, expansions
from specdec.types import DraftProposal, ProposalKind, pad_rows
from specdec.verify.tree_layout import tree_mask

__all__ = ["EAGLETree"]


class EAGLETree(HeadProposer):
    """Tree speculation with an EAGLE-1/2 or EAGLE-3 head (its network: :mod:`specdec.models.eagle_head`).

    ``tree``: a list of paths for a static tree; ``None`` for the dynamic tree of ``top_k``,
    ``depth`` and ``num_verify_tokens`` draft nodes. ``num_speculative_tokens`` is the tree's
    node count; ``FixedPolicy(n)`` verifies the ``n`` best nodes of each tree. ``min_path_prob``
    in [0, 1) verifies only the nodes whose path probability under the head reaches it (the best
    node always; n is then a ceiling): :class:`~specdec.proposers.tree_shape.TreeShape`.

    ``from_pretrained`` reads and checks the head's files at once; the weights are placed on the
    target when a Generator attaches the proposer (the head borrows the target's embedding, and
    an EAGLE-1 head its final norm and LM head).
    """

    kind = ProposalKind.TREE
    head_name = "EAGLE head"

    def __init__(self, shape: TreeShape, *, head: EagleHeadModel | None = None, path: Path | None = None,
                 target_layers: tuple[int, ...] | None = None, quantization: str | None = None) -> None:  # fmt: skip
        super().__init__(head=head, path=path, quantization=quantization)
        self.shape = shape
        self._target_layers = target_layers  # overrides a public EAGLE-3 head's

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        tree: Sequence[Sequence[int]] | None = None,
        *,
        top_k: int = 4,
        depth: int = 5,
        num_verify_tokens: int = 16,
        target_layers: tuple[int, ...] | None = None,
        quantization: str | None = None,
        min_path_prob: float = 0.0,
    ) -> EAGLETree:
        """A head directory (specdec's format, or a public EAGLE-1/2 or EAGLE-3 checkpoint with
        ``config.json`` + ``model.safetensors``). ``target_layers`` overrides the target layers a
        public EAGLE-3 head feeds on. ``quantization``: ``"int8"`` or ``"q4"`` stores the head's
        linear layers in that format on a CPU (cheaper head forwards; output unchanged)."""
        shape = TreeShape(
            paths=tree, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens, min_path_prob=min_path_prob
        )
        check_quantization(quantization, "cpu")  # the value; the device is checked on loading
        path = Path(path).expanduser()
        head_files(path, "EAGLE head")  # both files there (their contents are read on attach)
        return cls(shape, path=path, target_layers=target_layers, quantization=quantization)

    @classmethod
    def from_model(
        cls,
        head: EagleHeadModel,
        tree: Sequence[Sequence[int]] | None = None,
        *,
        top_k: int = 4,
        depth: int = 5,
        num_verify_tokens: int = 16,
        min_path_prob: float = 0.0,
    ) -> EAGLETree:
        shape = TreeShape(
            paths=tree, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens, min_path_prob=min_path_prob
        )
        return cls(shape, head=head)

    @property
    def num_speculative_tokens(self) -> int:
        return self.shape.num_nodes

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the head feeds on (the engine asks the target)."""
        return self._attached_head().config.target_layers

    def _load(self, target: LlamaModel) -> EagleHeadModel:
        return load_eagle_head(self._path, target, target_layers=self._target_layers, quantization=self._quantization)

    def _feature(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.target_feature(hidden)  # [rows, hidden] from the target layers' states

    # --------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> DraftProposal:
        n = ctx.num_speculative_tokens
        live = self._live_rows(ctx.seq_ids)
        trees: list[list[Node]] = [[] for _ in ctx.seq_ids]
        if live:
            grown = self._grow(
                [ctx.seq_ids[i] for i in live],
                [len(ctx.token_ids[i]) - 1 for i in live],  # the root's slot
                ctx.kv,
                ctx.backend,
                max_depth=min(self.shape.max_depth, n),  # n best nodes: at most n deep
                keep=n,
            )
            for i, nodes in zip(live, grown):
                trees[i] = nodes
        tokens, parents = [], []
        transforms = ctx.logits_transforms or (None,) * len(trees)
        for nodes, transform in zip(trees, transforms):
            kept, kept_parents = best_first(nodes, n, self.shape.min_score)
            kept_tokens = [nodes[j].token for j in kept]
            if transform is not None:  # nodes a mask forbids (grammar, bans) go, with their subtrees
                kept_tokens, kept_parents = transform.allowed(kept_tokens, kept_parents)
            tokens.append(kept_tokens)
            parents.append(kept_parents)
        return DraftProposal(
            kind=ProposalKind.TREE,
            draft_token_ids=pad_rows(tokens, n, ctx.device),
            num_draft_tokens=tuple(len(t) for t in tokens),
            parents=_pad_parents(parents, n, ctx.device),
        )

    def _grow(
        self,
        seq_ids: list[int],
        roots: list[int],
        kv: ModelKV,
        backend: object,
        max_depth: int,
        keep: int,
    ) -> list[list[Node]]:
        """Every sequence's tree to ``max_depth``, grown depth by depth; a dynamic tree only
        expands nodes that can lead to one of the ``keep`` best (:func:`expansions`)."""
        head = self.head
        trees: list[list[Node]] = [[] for _ in seq_ids]
        root_g = self._outputs(seq_ids)  # [batch, hidden]
        expanded: list[list[int]] = [[] for _ in seq_ids]  # per sequence: nodes with a head row
        outputs: list[dict[int, torch.Tensor]] = [{} for _ in seq_ids]  # node -> [hidden] g
        ids = head.draft_to_target  # [draft_vocab] target id of each draft logit
        for depth in range(1, max_depth + 1):
            plans = [expansions(self.shape, nodes, depth, keep) for nodes in trees]
            if not any(plans):
                break
            if depth == 1:
                logits = head.draft_logits(root_g)  # [batch, draft vocab]: the root's children
            else:
                for e, plan in zip(expanded, plans):
                    e.extend(i for i, _ in plan)
                growing = [b for b, plan in enumerate(plans) if plan]  # the others are done
                self._head_rows(growing, seq_ids, roots, trees, expanded, root_g, outputs, kv, backend)
                g = torch.stack([out[i] for out, plan in zip(outputs, plans) for i, _ in plan])
                logits = head.draft_logits(g)  # [expanded this depth, draft vocab]
            _add_children(trees, plans, logits, ids, depth)
        return trees

    def _head_rows(self, growing, seq_ids, roots, trees, expanded, root_g, outputs, kv, backend) -> None:
        """One head forward over every expanded node of the sequences ``growing`` (batch
        indices: those with nodes to expand at this depth), tree-masked; each node's output
        goes to ``outputs``.

        Row ``r`` of a sequence is its ``r``-th expanded node, at slot ``root + r`` and RoPE
        position ``root + depth - 1``, fed its parent's output (the root's: ``g``). Nodes
        expanded at earlier depths are run again: a row sees the committed prefix and the rows
        its mask allows, so the ancestors must be rows of the same pass.
        """
        head = self.head
        features, tokens, positions, masks = [], [], [], []
        for b in growing:
            nodes, e, root = trees[b], expanded[b], roots[b]
            row_of = {node: r for r, node in enumerate(e)}
            row_parents = [row_of.get(nodes[j].parent, -1) for j in e]
            features.extend(root_g[b] if nodes[j].parent < 0 else outputs[b][nodes[j].parent] for j in e)
            tokens.append([nodes[j].token for j in e])
            positions.append([root + nodes[j].depth - 1 for j in e])
            masks.append(tree_mask(row_parents, len(e))[1:, 1:])  # ancestors and self, no root
        layout = kv.layout(
            [seq_ids[b] for b in growing],
            tokens,
            [roots[b] for b in growing],
            positions=positions,
            tree_masks=masks,
            device=head.device,
        )
        plan = backend.plan(layout, head.attention_spec)
        g = head(torch.stack(features), layout.token_ids, layout.positions, kv, backend, plan)
        rows = iter(g)
        for b in growing:
            for j in expanded[b]:
                outputs[b][j] = next(rows)

    # ------------------------------------------------------ following the target
    @torch.inference_mode()
    def on_target_step(self, step: TargetStep) -> None:
        super().on_target_step(step)


def _add_children(
    trees: list[list[Node]], plans, logits: torch.Tensor, ids: torch.Tensor, depth: int
) -> None:
    """Each expanded node's children take the tokens of the ranks its plan asks for.

    ``logits`` ``[rows, draft vocab]``: one row per expanded node, in plan order over the batch;
    ``ids`` ``[draft vocab]``: the target token of each column.
    """
    width = max((max(r) + 1 for plan in plans for _, r in plan if r), default=0)
    if width == 0:
        return
    logp = torch.log_softmax(logits.float(), dim=-1).clamp_max(0.0)  # [rows, draft vocab]
    top_lp, top_cols = logp.topk(min(width, logp.shape[-1]), dim=-1)  # [rows, width]
    top_lp, top_ids = top_lp.tolist(), ids[top_cols].tolist()  # host copies: the tree is host data
    row = 0
    for nodes, plan in zip(trees, plans):
        for parent, ranks in plan:
            base = 0.0 if parent < 0 else nodes[parent].score
            prefix = () if parent < 0 else nodes[parent].ranks
            for rank in ranks:
                if rank < len(top_ids[row]):
                    nodes.append(
                        Node(
                            token=top_ids[row][rank],
                            parent=parent,
                            depth=depth,
                            score=base + top_lp[row][rank],
                            ranks=(*prefix, rank),
                        )
                    )
            row += 1


def _pad_parents(rows: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """``[batch, width]`` int64 parents, padded with -1 past each tree."""
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out.to(device)

