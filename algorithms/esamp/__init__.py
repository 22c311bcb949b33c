"""ESamp (Exploratory Sampling): an online-trained Latent Distiller steers sampling away
from what it already predicts. See ``docs`` and the spec for the exact semantics."""

from algorithms.esamp.config import ESampConfig
from algorithms.esamp.consumer import ESampConsumer
from algorithms.esamp.cpu import GroupedDistiller

__all__ = ["ESampConfig", "ESampConsumer", "GroupedDistiller"]
