"""Training pipelines for proposer heads (MTP and EAGLE share the data, features and loop)."""

from specdec.training.data import (
    TrainData,
    build_chunks,
    read_prompts,
    self_distill,
    text_files,
    token_chunks,
)
from specdec.training.eagle import EagleTrainConfig, EagleTrainResult, train_eagle
from specdec.training.features import FeatureStore, compute_features
from specdec.training.mtp import MTPTrainConfig, MTPTrainResult, train_mtp

__all__ = [
    "EagleTrainConfig",
    "EagleTrainResult",
    "FeatureStore",
    "MTPTrainConfig",
    "MTPTrainResult",
    "TrainData",
    "build_chunks",
    "compute_features",
    "read_prompts",
    "self_distill",
    "text_files",
    "token_chunks",
    "train_eagle",
    "train_mtp",
]
