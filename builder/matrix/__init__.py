"""Stage 1: images.yaml -> a validated, frozen :class:`Matrix` of :class:`ImageSpec` cells."""

from builder.matrix import platforms
from builder.matrix.expand import select
from builder.matrix.model import ImageSpec, Matrix
from builder.matrix.validate import load_matrix, parse

__all__ = ["ImageSpec", "Matrix", "load_matrix", "parse", "platforms", "select"]
