"""``sae`` consumer: sparse-autoencoder features and steering by feature inside vLLM."""

from consumers.sae.features import FeatureReader, FeatureRecord, read_features
from consumers.sae.loader import SAEFileError, load_sae, save_sae
from consumers.sae.model import SparseAutoencoder, top_features

__all__ = [
    "FeatureReader",
    "FeatureRecord",
    "SAEFileError",
    "SparseAutoencoder",
    "load_sae",
    "read_features",
    "save_sae",
    "top_features",
]
