"""GGUF files read densely through transformers' GGUF reader (the ``[gguf]`` extra).

Both the loader (:func:`specdec.models.loading.load_model` on a ``.gguf`` file) and the fetcher
(:func:`specdec.hub.convert_gguf`) read a GGUF this way; it lives here, apart from both, so
neither has to import the other (the loader already turns known names into paths through the
hub). ``quantization="q4"`` reads a GGUF differently, keeping its codes
(:mod:`specdec.models.gguf_q4`).

Example::

    model = read_gguf_model(Path("model.gguf"), torch.bfloat16)   # a transformers model
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

__all__ = ["gguf_load_kwargs", "read_gguf_model"]


def read_gguf_model(path: Path, dtype: torch.dtype) -> object:
    """The transformers causal-LM model of the GGUF file ``path``, dequantized to ``dtype``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, **gguf_load_kwargs(dtype)
    )


def gguf_load_kwargs(dtype: torch.dtype) -> dict[str, object]:
    """``from_pretrained`` arguments that read a GGUF file into plain dense ``dtype`` weights.

    Newer transformers keep GGUF weights packed in their quantized blocks (such a model has no
    plain state dict and refuses ``save_pretrained``); ``GgufConfig(dequantize=True)`` asks for
    dense weights, which is what older versions always produced (they have no GgufConfig).
    """
    import transformers

    kwargs: dict[str, object] = {_dtype_kwarg(transformers.__version__): dtype}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    return kwargs


def _dtype_kwarg(version: str) -> str:
    """``transformers`` renamed ``torch_dtype`` to ``dtype`` in 4.56 (the old name warns in 5.x)."""
    major, minor = (int(p) for p in re.findall(r"\d+", version)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
