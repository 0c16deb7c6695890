"""Stage 1: images.yaml -> a validated, frozen :class:`Matrix` of :class:`ImageSpec` cells."""

from builder.spec import platforms
from builder.spec.expand import select
from builder.spec.model import ImageSpec, Matrix
from builder.spec.validate import load_matrix, parse

__all__ = ["ImageSpec", "Matrix", "load_matrix", "parse", "platforms", "select"]
