"""A transformers model already in memory, read into specdec's native decoder.

An application that has loaded its model with transformers (``AutoModelForCausalLM``) hands
the object to :meth:`specdec.Generator.from_pretrained`, :meth:`DraftModel.from_pretrained
<specdec.proposers.DraftModel.from_pretrained>` or :func:`specdec.models.loading.load_model`
as it would a path. Its config goes through the same checks as a checkpoint's
(:meth:`ModelConfig.from_hf_config`: the architecture, and every field the decoder cannot
honour), and its ``state_dict`` through the same fusing loader
(:func:`~specdec.models.loading.model_from_state_dict`).

The weights are **copied** in the requested ``dtype`` (``bfloat16`` by default, not the
object's own): specdec fuses q/k/v and gate/up, may pack or quantize the linears and moves CPU
weights to huge pages, and none of that may reach into the caller's model, which stays usable
(as a transformers reference, say). The copy costs the model's size once more while both are
held; the caller may drop its object after the load. Nothing is written to the packed-weights
cache (its key is the checkpoint files, which an object does not have).

The tokenizer is the caller's to pass (``Generator.from_pretrained(model, tokenizer=tok)``);
otherwise the one in the directory the object was loaded from (``name_or_path``), when that is a
local directory; otherwise none, and the generator takes token ids.

Example::

    hf = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B")
    gen = Generator.from_pretrained(hf, tokenizer=AutoTokenizer.from_pretrained("Qwen/Qwen2.5-0.5B"))
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["generation_eos_ids", "is_transformers_model", "source_dir", "transformers_tensors"]


def is_transformers_model(obj: object) -> bool:
    """Whether ``obj`` is a transformers model (``PreTrainedModel``); checked without importing
    transformers for the paths and names most callers pass."""
    if isinstance(obj, (str, Path)) or not isinstance(obj, torch.nn.Module):
        return False
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel)


def transformers_tensors(
    hf_model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_model``'s named tensors, each a fresh copy in ``dtype`` on ``device`` (never a view
    of the caller's storage), for :func:`~specdec.models.loading.model_from_state_dict`;
    ValueError for weights that are not in memory (offloaded to the meta device)."""
    for name, tensor in hf_model.state_dict().items():
        if tensor.is_meta:
            raise ValueError(
                f"model tensor {name!r} is on the meta device (offloaded, e.g. by device_map="
                "'auto'): load the model fully into memory, or pass its checkpoint directory"
            )
        yield name, tensor.detach().to(device=device, dtype=dtype, copy=True)


def source_dir(hf_model: torch.nn.Module) -> Path | None:
    """The local directory ``hf_model`` was loaded from (its tokenizer and generation config
    may be there); ``None`` for a hub id, or a model built from a config."""
    name = getattr(hf_model, "name_or_path", None) or getattr(hf_model.config, "_name_or_path", None)
    if not name:
        return None
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def generation_eos_ids(hf_model: torch.nn.Module) -> tuple[int, ...]:
    """The EOS ids of the object's ``generation_config`` (what its ``generate`` stops at: for
    chat models often more than the config's own ``eos_token_id``)."""
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)
