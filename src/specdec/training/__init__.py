"""Training pipelines for proposer heads (MTP now; EAGLE heads share the data and features)."""

from specdec.training.data import self_distill, text_files, token_chunks
from specdec.training.features import FeatureStore, compute_features
from specdec.training.mtp import MTPTrainConfig, MTPTrainResult, train_mtp

__all__ = [
    "FeatureStore",
    "MTPTrainConfig",
    "MTPTrainResult",
    "compute_features",
    "self_distill",
    "text_files",
    "token_chunks",
    "train_mtp",
]
