"""specdec: lossless speculative decoding for LLMs."""

from specdec.config import CacheConfig, SamplingParams, StructuredOutput
from specdec.generator import GenerationOutput, Generator
from specdec.handle import RequestHandle
from specdec.metrics import SpecMetrics
from specdec.policy import AdaptivePolicy, AdaptivePolicyConfig, FixedPolicy
from specdec.request import RequestError
from specdec.types import PAD_TOKEN_ID

__all__ = [
    "AdaptivePolicy",
    "AdaptivePolicyConfig",
    "CacheConfig",
    "FixedPolicy",
    "GenerationOutput",
    "Generator",
    "PAD_TOKEN_ID",
    "RequestError",
    "RequestHandle",
    "SamplingParams",
    "SpecMetrics",
    "StructuredOutput",
]
__version__ = "0.1.0"
