"""Model definitions (Llama family, proposer heads) and checkpoint loading."""

from specdec.models.llama import LlamaModel, ModelConfig

__all__ = ["LlamaModel", "ModelConfig"]
