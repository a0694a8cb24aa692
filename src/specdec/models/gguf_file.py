"""A GGUF file read once per load: its metadata, its tensor table and the config they make.

Reading a GGUF through transformers parses the file again for each thing asked of it (the
config, then the model, which asks for the config again), with gguf-py's ``GGUFReader``, which
builds numpy views of every string of the vocabulary and merge table: 7-9 s per parse for a
Qwen2 GGUF (151k tokens and as many merges), whatever the size of its weights. A load of a 40 MB
file took 23-36 s that way. :meth:`GgufFile.read` parses the header once, with the file memory
mapped, walking past those string arrays without building anything (their value here is their
length), in well under a second; the loader then takes the config, the tensor table and every
tensor's bytes from that one object (:func:`specdec.models.loading.load_model`).

The config follows transformers' GGUF reader for the architectures specdec runs (its key names,
its defaults, and ``tie_word_embeddings`` where the file has no ``output.weight``), so a model
loads as it did through transformers; tests hold the two together (transformers reads no
``olmo2`` file: OLMo 2's config is read the same way, its tests hold it to its source model;
OLMo 3 files, also written as ``olmo2``, are refused). For Gemma 2 / Gemma 3 it
also reads what llama.cpp writes and transformers' reader skips (the soft caps, Gemma 3's
linear RoPE scaling and layer pattern) and sets the attention scale by llama.cpp's rule
(:meth:`GgufFile._gemma_config`). For Phi-3 it reads what transformers' reader skips: partial
RoPE, longrope (its factors are tensors of the file) and the window (:meth:`GgufFile._phi3_config`).
For Qwen3 (dense) it reads ``head_dim`` from ``attention.key_length`` and attention biases from
the tensors (:meth:`GgufFile._qwen3_config`); its q/k rows are stored unpermuted, as Qwen2's
(llama.cpp rotates both NeoX-style), and its per-head q/k norms as they are. Qwen3-MoE
(``qwen3moe``) is read as Qwen3, plus its experts' keys (:data:`_MOE_KEYS`; every layer sparse,
top-k renormalised, as llama.cpp's qwen3moe graph computes it).

Example::

    file = GgufFile.read(Path("model.gguf"))
    cfg = ModelConfig.from_hf_config(file.hf_config())
    embedding = file.tensor("token_embd.weight").values()   # [vocab, hidden] float32
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from pathlib import Path

import attrs
import numpy as np
import torch

__all__ = ["GgufFile", "GgufTensor", "hf_row_order"]

_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9

# transformers' GGUF_CONFIG_MAPPING for llama, mistral and qwen2: "<architecture>.<key>" -> config key.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# Mistral is written as "llama".
_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "olmo2", "phi3")
_QWEN3_FAMILY = ("qwen3", "qwen3moe")  # per-head q/k norms, head_dim in attention.key_length
# Qwen3-MoE's keys (llama.cpp's converter writes the config's fields there; transformers' reader
# has the first two, and leaves moe_intermediate_size at Qwen3MoeConfig's default).
_MOE_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
# Gemma's keys beside _CONFIG_KEYS: transformers' GGUF_CONFIG_MAPPING for gemma2 and gemma3, plus
# the soft caps llama.cpp's converter writes (transformers' reader skips them and falls back on
# Gemma2Config's defaults, 50 and 30, which are also the released checkpoints' values).
_GEMMA_KEYS = {
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
_GEMMA_MODEL_TYPES = {"gemma2": "gemma2", "gemma3": "gemma3_text"}  # text only: Gemma3ForCausalLM
# llama.cpp's attention scale for Gemma (llama-model.cpp): 1/sqrt(hidden / heads) for the 27B
# models (46 layers for Gemma 2, 62 for Gemma 3), 1/sqrt(head_dim) for the others; the file has
# no key for it, so query_pre_attn_scalar is set by the same rule.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp writes OLMo 3 as "olmo2" too, with its sliding-window layers, and OLMo 2's YaRN RoPE
# scaling as keys this reader does not map: files with these keys are refused.
_OLMO2_REFUSED_KEYS = ("attention.sliding_window", "attention.sliding_window_pattern", "rope.scaling.type")
# llama.cpp writes Qwen3's YaRN RoPE scaling (long-context configs) as keys this reader does not
# map: such files are refused rather than rotated unscaled.
_QWEN3_REFUSED_KEYS = ("rope.scaling.type",)


@attrs.frozen(eq=False)
class GgufTensor:
    """One tensor of a GGUF file: its bytes as stored, a read-only view of the mapped file."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the contiguous dimension (columns) first
    data: np.ndarray  # [bytes] uint8

    def values(self) -> torch.Tensor:  # [*reversed(shape)] float32
        """The tensor dequantized to float32, in PyTorch's dimension order."""
        from gguf.quants import dequantize

        rows = int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1
        values = dequantize(self.data.reshape(rows, -1), self.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32)).view(*reversed(self.shape))


class GgufFile:
    """A GGUF file's metadata and tensors, parsed once (:meth:`read`); tensors are views of the
    memory-mapped file, read from disk only where used."""

    def __init__(
        self, path: Path, metadata: Mapping[str, object], tensors: Mapping[str, GgufTensor]
    ) -> None:
        self.path, self.metadata, self.tensors = path, dict(metadata), dict(tensors)

    @classmethod
    def read(cls, path: Path) -> GgufFile:
        """Parse the header of the GGUF file ``path``; raises ValueError naming it where it is
        not a little-endian GGUF v2/v3 file or is cut short."""
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                raise ValueError(f"{path.name} is empty, not a GGUF file")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        reader = _Reader(buf, path)
        try:
            metadata, tensor_table = reader.header()
        except struct.error as err:
            raise ValueError(f"{path.name} is cut short inside its header") from err
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-reader.pos // alignment) * alignment  # the data section follows, aligned
        tensors = {entry[0]: _tensor(buf, path, start, *entry) for entry in tensor_table}
        return cls(path, metadata, tensors)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def model_type(self) -> str:
        """transformers' ``model_type``; a ``"llama"`` file named exactly ``"mistral"`` is a Mistral
        model, the one case transformers' GGUF reader tells apart (it tests the name's list); a
        ``"gemma3"`` file is the text model ``"gemma3_text"``."""
        if self.architecture == "llama" and self.metadata.get("general.name") == "mistral":
            return "mistral"
        if self.architecture == "qwen3moe":
            return "qwen3_moe"
        return _GEMMA_MODEL_TYPES.get(self.architecture, self.architecture)

    @property
    def norm_shift(self) -> float:
        """What llama.cpp added to every norm weight (Gemma's ``1 + w`` norms are stored as
        ``1 + w``), which a load must subtract (transformers' reader does too)."""
        return 1.0 if self.architecture in _GEMMA_MODEL_TYPES else 0.0

    @property
    def permutes_qk(self) -> bool:
        """Whether llama.cpp stored the q/k rows permuted for its RoPE (its "llama" models,
        Mistral's included), which a load must undo (:func:`hf_row_order`)."""
        return self.architecture == "llama"

    def config_dict(self) -> dict[str, object]:
        """The transformers config of the file as keyword arguments (``model_type`` included);
        raises ValueError naming the file for an architecture specdec does not run."""
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                f"specdec loads {', '.join(_ARCHITECTURES)} (and Mistral, written as llama) files"
            )
        keys = dict(
            _CONFIG_KEYS, **({"rope.dimension_count": "head_dim"} if self.permutes_qk else {})
        )
        if self.architecture in _GEMMA_MODEL_TYPES:
            keys.update(_GEMMA_KEYS)
        if self.architecture == "olmo2":
            self._check_olmo2()
            keys["attention.key_length"] = "head_dim"
        if self.architecture in _QWEN3_FAMILY:
            self._check_qwen3()
            keys["attention.key_length"] = "head_dim"
        if self.architecture == "qwen3moe":
            keys.update(_MOE_KEYS)
        config: dict[str, object] = {"model_type": self.model_type}
        for key, name in keys.items():
            if f"{self.architecture}.{key}" in self.metadata:
                config[name] = self.metadata[f"{self.architecture}.{key}"]
        config.update(
            {name: self.metadata[key] for key, name in _TOKEN_KEYS.items() if key in self.metadata}
        )
        config["tie_word_embeddings"] = "output.weight" not in self.tensors
        if "vocab_size" not in config and "tokenizer.ggml.tokens" in self.metadata:
            config["vocab_size"] = self.metadata["tokenizer.ggml.tokens"]  # its length, see _Reader
        if self.architecture in _GEMMA_MODEL_TYPES:
            config.update(self._gemma_config(config))
        if self.architecture == "phi3":
            config.update(self._phi3_config(config))
        if self.architecture in _QWEN3_FAMILY:
            config.update(self._qwen3_config(config))
        if self.architecture == "qwen3moe":  # llama.cpp's qwen3moe renormalises the top-k weights
            config.update(norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1)
        return config

    def _qwen3_config(self, config: dict[str, object]) -> dict[str, object]:
        """What a Qwen3 file implies beyond its keys. ``head_dim`` is ``attention.key_length``
        (llama.cpp's converter writes the config's ``head_dim`` there); a file without it gets the
        q rows per head of ``blk.0.attn_q`` (Qwen3Config's own default, 128, is only a default).
        ``attention_bias`` is whether the file has ``blk.0.attn_q.bias`` (released Qwen3 models
        have none; llama.cpp's converter writes whatever the checkpoint holds)."""
        out: dict[str, object] = {"attention_bias": "blk.0.attn_q.bias" in self.tensors}
        heads, q = config.get("num_attention_heads"), self.tensors.get("blk.0.attn_q.weight")
        if "head_dim" not in config and heads and q is not None and len(q.shape) == 2:
            out["head_dim"] = int(q.shape[1]) // int(heads)  # GGUF order: [inputs, rows]
        return out

    def _check_qwen3(self) -> None:
        """ValueError naming the key where a ``qwen3`` file has RoPE scaling (YaRN)."""
        arch = self.architecture
        for key in _QWEN3_REFUSED_KEYS:
            value = self.metadata.get(f"{arch}.{key}")
            if value is not None and value != "none":
                raise ValueError(
                    f"{self.path.name}: GGUF key {arch}.{key}={value!r} is not supported (RoPE "
                    f"scaling); specdec loads {arch} files without it"
                )

    def _phi3_config(self, config: dict[str, object]) -> dict[str, object]:
        """What a Phi-3 file says beyond the common keys, as llama.cpp's converter writes it
        (transformers' reader skips all of it): ``rope.dimension_count``, the rotated channels of
        a head (``partial_rotary_factor``: 0.75 for Phi-4-mini); ``attention.sliding_window``
        (0: none); for longrope ``rope.scaling.original_context_length``,
        ``rope.scaling.attn_factor`` (the factor llama.cpp applies, kept as the config's
        ``attention_factor``) and the ``rope_factors_short``/``rope_factors_long`` tensors."""
        out: dict[str, object] = {}
        meta = {k.removeprefix("phi3."): v for k, v in self.metadata.items() if k.startswith("phi3.")}
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        dims = meta.get("rope.dimension_count")
        if dims and heads and hidden:
            out["partial_rotary_factor"] = dims / (hidden // heads)
        out["sliding_window"] = meta.get("attention.sliding_window") or None
        if "rope.scaling.original_context_length" in meta:
            out["original_max_position_embeddings"] = meta["rope.scaling.original_context_length"]
        if "rope_factors_short.weight" in self.tensors:
            scaling: dict[str, object] = {"rope_type": "longrope"}
            for field in ("short", "long"):
                factors = self.tensor(f"rope_factors_{field}.weight").values()
                scaling[f"{field}_factor"] = factors.tolist()
            if "rope.scaling.attn_factor" in meta:
                scaling["attention_factor"] = float(meta["rope.scaling.attn_factor"])
            out["rope_scaling"] = scaling
        return out

    def _gemma_config(self, config: dict[str, object]) -> dict[str, object]:
        """What a Gemma file implies beyond its keys: the attention scale (llama.cpp's rule),
        Gemma 3's linear RoPE scaling and its sliding-window pattern where the file has them
        (transformers' reader skips both: its Gemma 3 then rotates the global layers of the 4B
        and larger models unscaled). The sliding layers' RoPE base is 10000 in llama.cpp and in
        Gemma3TextConfig alike."""
        arch, out = self.architecture, {}
        heads, layers = config.get("num_attention_heads"), config.get("num_hidden_layers")
        head_dim = config.get("head_dim")
        if layers == _GEMMA_27B_LAYERS[arch] and heads:
            out["query_pre_attn_scalar"] = config["hidden_size"] // heads
        elif head_dim:
            out["query_pre_attn_scalar"] = head_dim
        scaling = self.metadata.get(f"{arch}.rope.scaling.type")
        factor = self.metadata.get(f"{arch}.rope.scaling.factor")
        if scaling == "linear" and factor is not None:
            out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        pattern = self.metadata.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list) and layers and len(pattern) == layers:
            out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        elif isinstance(pattern, int) and arch == "gemma3":
            out["sliding_window_pattern"] = pattern
        return out

    def _check_olmo2(self) -> None:
        """ValueError naming the key where an ``olmo2`` file is not plain OLMo 2: an OLMo 3 file
        (sliding-window layers) or one with RoPE scaling (YaRN)."""
        for key in _OLMO2_REFUSED_KEYS:
            value = self.metadata.get(f"olmo2.{key}")
            if value is not None and value != "none":
                raise ValueError(
                    f"{self.path.name}: GGUF key olmo2.{key}={value!r} is not supported (an OLMo 3 "
                    "file, or RoPE scaling); specdec loads olmo2 files of OLMo 2 without it"
                )

    def hf_config(self) -> object:
        """The transformers ``PretrainedConfig`` of :meth:`config_dict`."""
        from transformers import AutoConfig

        config = self.config_dict()
        return AutoConfig.for_model(config.pop("model_type"), **config)

    def tensor(self, name: str) -> GgufTensor:
        """The tensor ``name``; a missing one raises ValueError naming the file."""
        if name not in self.tensors:
            raise ValueError(f"{self.path.name} has no tensor {name!r}, which its config requires")
        return self.tensors[name]


def hf_row_order(rows: int, heads: int) -> torch.Tensor:  # [rows] int64
    """The file row of each Hugging Face (and specdec) row of a Llama q/k tensor. llama.cpp's
    converter stores each head's rows as interleaved pairs for its RoPE
    (``reshape(heads, 2, r / 2).swapaxes(1, 2)``); this is the inverse, as transformers' GGUF
    reader applies it.

    >>> hf_row_order(4, 1).tolist()
    [0, 2, 1, 3]
    """
    order = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(order)


def _tensor(
    buf: mmap.mmap,
    path: Path,
    start: int,
    name: str,
    shape: tuple[int, ...],
    type_id: int,
    offset: int,
) -> GgufTensor:
    """One tensor of the table: its bytes viewed in the mapped file, checked to lie inside it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        tensor_type = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    except (ValueError, KeyError) as err:
        raise ValueError(f"{path.name}: tensor {name} has unknown GGML type {type_id}") from err
    nbytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
    if start + offset + nbytes > len(buf):
        raise ValueError(f"{path.name} is cut short: tensor {name} ends past the end of the file")
    return GgufTensor(
        name, tensor_type, shape, np.frombuffer(buf, np.uint8, nbytes, start + offset)
    )


class _Reader:
    """Reads a GGUF header front to back from a buffer; ``pos`` is where the next read starts."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def header(self) -> tuple[dict[str, object], list[tuple[str, tuple[int, ...], int, int]]]:
        """``(metadata, [(name, shape, GGML type, offset in the data section)])``."""
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{self.path.name} is not a GGUF file (it does not start with 'GGUF')")
        self.pos = 4
        version = self._scalar("<I")
        if version not in _VERSIONS:
            raise ValueError(
                f"{self.path.name} is GGUF version {version} (or big-endian); specdec reads "
                f"little-endian versions {_VERSIONS}"
            )
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(self._scalar("<I"))
        table = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            table.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        return metadata, table

    def _scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        text = self.buf[self.pos : self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def _value(self, value_type: int) -> object:
        """One metadata value. An array of strings (a vocabulary, a merge table) is walked, not
        read: its value is its length; arrays of numbers are lists."""
        if value_type in _SCALARS:
            return self._scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ValueError(f"{self.path.name}: unknown GGUF metadata type {value_type}")
        item_type, count = self._scalar("<I"), self._scalar("<Q")
        if item_type in _SCALARS:
            values = struct.unpack_from(f"<{count}{_SCALARS[item_type][1]}", self.buf, self.pos)
            self.pos += count * struct.calcsize(_SCALARS[item_type])
            return list(values)
        if item_type == _STRING:
            for _ in range(count):  # variable lengths: nothing to do but walk them
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return count
        return [self._value(item_type) for _ in range(count)]
