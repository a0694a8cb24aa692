"""Training pipelines for proposer heads (MTP and EAGLE share the data, features and loop)."""

from specdec.deprecation import moved_names
from specdec.training.data import (
    TrainData,
    build_chunks,
    read_prompts,
    self_distill,
    text_files,
    token_chunks,
)
from specdec.training.eagle import EagleTrainConfig, train_eagle
from specdec.training.features import FeatureStore, compute_features
from specdec.training.loop import TrainResult
from specdec.training.mtp import MTPTrainConfig, train_mtp

__all__ = [
    "EagleTrainConfig",
    "FeatureStore",
    "MTPTrainConfig",
    "TrainData",
    "TrainResult",
    "build_chunks",
    "compute_features",
    "read_prompts",
    "self_distill",
    "text_files",
    "token_chunks",
    "train_eagle",
    "train_mtp",
]

# Both trainers return one record now.
__getattr__ = moved_names(
    __name__,
    {
        "EagleTrainResult": "specdec.training.loop:TrainResult",
        "MTPTrainResult": "specdec.training.loop:TrainResult",
    },
)
