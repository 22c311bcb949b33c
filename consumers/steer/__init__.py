"""``steer`` consumer: add or ablate fixed vectors in the residual stream."""

from consumers.steer.vectors import check_vector, load_vector

__all__ = ["check_vector", "load_vector"]
