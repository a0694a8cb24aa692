"""The target's hidden states over training chunks, computed once and cached on disk.

A head trains for many epochs over the same chunks; the target forward is by far the most
expensive part, so it runs once, with specdec's own inference model (batched prefill over the
paged KV cache, the packed CPU kernel for bf16), and the hidden states of the layers a head
feeds on (``layers``: the inputs of those target layers, ``num_layers`` = the last layer's
output before the final norm; MTP and EAGLE-1 heads need ``(num_layers,)``, EAGLE-3 three
layers) are written side by side as safetensors shards next to the chunk tokens. A manifest
ties the cache to the target, the layers and the exact chunks; a cache for other data or another target is recomputed, and an
interrupted computation resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from specdec.attention import default_backend
from specdec.kv.allocator import PageAllocator
from specdec.kv.paged import KVCacheManager
from specdec.models.llama import LlamaModel

__all__ = ["FeatureStore", "compute_features", "features_key"]

_FORMAT = "specdec-features"


def features_key(target: LlamaModel, chunks: Sequence[Sequence[int]], layers: tuple[int, ...] | None = None) -> str:
    """Hash of the target's weights sample, shape, the layers and the chunk tokens: what the
    cache depends on."""
    h = hashlib.sha256()
    h.update(repr(attrs.asdict(target.config)).encode())
    h.update(repr(_layers(target, layers)).encode())
    probe = target.embed_tokens.weight[:4].float().cpu()  # weights fingerprint without hashing GBs
    h.update(probe.numpy().tobytes())
    for chunk in chunks:
        h.update(torch.tensor(chunk, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


def compute_features(
    target: LlamaModel,
    chunks: Sequence[Sequence[int]],
    out_dir: str | Path,
    *,
    batch_size: int = 8,
    layers: tuple[int, ...] | None = None,
    log: Callable[[str], None] | None = print,
) -> FeatureStore:
    """Run ``target`` over ``chunks`` (all one length) and cache tokens + hidden states of
    ``layers`` (default ``(num_layers,)``: the last hidden state before the final norm), stored
    ``[chunks, T, len(layers) * hidden]``.

    Returns the store at once if ``out_dir`` already holds the same features.

    Example:
        >>> store = compute_features(target, chunks, "feats", layers=(1, 2, 4))  # an EAGLE-3 head's
    """
    layers = _layers(target, layers)
    if not chunks:
        raise ValueError("chunks is empty: no training data")
    length = len(chunks[0])
    if any(len(c) != length for c in chunks):
        raise ValueError("all chunks must have the same length")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = features_key(target, chunks, layers)
    manifest = out / "manifest.json"
    if manifest.is_file():
        meta = json.loads(manifest.read_text())
        if meta.get("key") == key and meta.get("complete"):
            return FeatureStore(out)
    shards = [(i, chunks[i : i + batch_size]) for i in range(0, len(chunks), batch_size)]
    meta = {"format": _FORMAT, "key": key, "chunk_len": length, "num_chunks": len(chunks),
            "hidden_size": target.config.hidden_size, "layers": list(layers), "dtype": str(target.dtype).removeprefix("torch."),
            "shards": [f"shard-{i // batch_size:05d}.safetensors" for i, _ in shards], "complete": False}
    manifest.write_text(json.dumps(meta, indent=1))
    start, done = time.perf_counter(), 0
    for (first, batch), name in zip(shards, meta["shards"]):
        path = out / name
        if not _shard_ok(path, key):
            _write_shard(target, batch, path, key, layers)
        done += len(batch) * length
        if log is not None:
            rate = done / max(time.perf_counter() - start, 1e-9)
            log(f"features: {first + len(batch)}/{len(chunks)} chunks, {done} tokens, {rate:.0f} tok/s")
    meta["complete"] = True
    manifest.write_text(json.dumps(meta, indent=1))
    return FeatureStore(out)


def _shard_ok(path: Path, key: str) -> bool:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("key") == key
    except (SafetensorError, OSError):
        return False


def _layers(target: LlamaModel, layers: tuple[int, ...] | None) -> tuple[int, ...]:
    n = target.config.num_layers
    layers = (n,) if layers is None else tuple(layers)
    if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= n for i in layers):
        raise ValueError(f"layers must be a non-empty tuple of ints in 0..{n}, got {layers!r}")
    return layers


def _write_shard(target: LlamaModel, batch: Sequence[Sequence[int]], path: Path, key: str, layers: tuple[int, ...]) -> None:
    from safetensors.torch import save_file

    hidden = batch_hidden_states(target, batch, layers=layers)  # [B, T, len(layers) * H]
    tokens = torch.tensor([list(c) for c in batch], dtype=torch.int32)
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": tokens, "hidden": hidden.cpu().contiguous()}, str(tmp), metadata={"key": key})
    tmp.replace(path)


def batch_hidden_states(
    target: LlamaModel, batch: Sequence[Sequence[int]], page_size: int = 16, *, layers: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``[B, T, len(layers) * hidden]`` hidden states of ``layers`` (default: the last, before
    the final norm) of a batch of equal-length token rows: one batched prefill through
    specdec's own paged inference path."""
    layers = _layers(target, layers)
    length = len(batch[0])
    pages_per_seq = -(-length // page_size)
    kv = KVCacheManager(PageAllocator(len(batch) * pages_per_seq), page_size)
    model_kv = kv.add_pool(target.kv_spec("target"), target.device)
    seq_ids = list(range(len(batch)))
    for s in seq_ids:
        kv.add_sequence(s)
        kv.reserve(s, length)
    backend = default_backend(target.device, target.dtype)
    layout = model_kv.layout(seq_ids, [list(c) for c in batch], [0] * len(batch), device=target.device)
    plan = backend.plan(layout, target.attention_spec)
    with torch.inference_mode():
        embeds = target.embed(layout.token_ids)
        states = target.layer_states(embeds, layout.positions, model_kv, backend, plan, layers)
    hidden = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
    return hidden.view(len(batch), length, -1)


class FeatureStore:
    """Read access to a feature cache: ``len(store)`` chunks, ``store.batch(indices)``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        meta = json.loads((self.directory / "manifest.json").read_text())
        if meta.get("format") != _FORMAT or not meta.get("complete"):
            raise ValueError(f"{str(self.directory)!r} is not a complete specdec feature cache")
        self.meta = meta
        self.chunk_len = int(meta["chunk_len"])
        self.layers = tuple(meta.get("layers") or ())  # target layers, side by side in hidden
        tokens, hidden = [], []
        from safetensors import safe_open

        for name in meta["shards"]:
            with safe_open(str(self.directory / name), framework="pt") as f:
                tokens.append(f.get_tensor("tokens"))
                hidden.append(f.get_tensor("hidden"))
        self.tokens = torch.cat(tokens).to(torch.int64)  # [N, T]
        self.hidden = torch.cat(hidden)  # [N, T, len(layers) * H] in the target dtype

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, T] int64, hidden [B, T, len(layers) * H])`` for chunk ``indices``."""
        return self.tokens[indices], self.hidden[indices]

    def vocabulary(self) -> torch.Tensor:
        """Sorted ids of every token in the chunks."""
        return torch.unique(self.tokens)

    def tokens_by_frequency(self) -> torch.Tensor:
        """``[distinct tokens] int64``: every token id of the chunks, most frequent first (ties
        by id), the draft vocabulary of a head trained on them."""
        ids, counts = torch.unique(self.tokens, return_counts=True)
        return ids[torch.argsort(counts, descending=True, stable=True)]
