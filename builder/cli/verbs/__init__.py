"""Every verb of `build.py`, in the order `--help` and the README list them."""

from builder.cli.registry import Verb
from builder.cli.verbs import audit, base, build, doctor, launch, matrix, publish, render, test

VERBS: tuple[Verb, ...] = (matrix.VERB, render.VERB, build.VERB, base.VERB, test.VERB, audit.VERB, publish.VERB,
                           launch.VERB, doctor.VERB)

__all__ = ["VERBS", "Verb"]
