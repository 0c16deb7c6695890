"""Every verb of `build.py`, in the order `--help` and the README list them."""

from builder.cli.registry import Verb
from builder.cli.verbs import (
                               audit,
                               base,
                               build,
                               diff,
                               doctor,
                               export,
                               keygen,
                               launch,
                               lock,
                               matrix,
                               publish,
                               render,
                               repro,
                               sbom,
                               test,
                               verify,
)

VERBS: tuple[Verb, ...] = (matrix.VERB, render.VERB, lock.VERB, build.VERB, base.VERB, test.VERB, sbom.VERB,
                           export.VERB, repro.VERB, audit.VERB, diff.VERB, publish.VERB, keygen.VERB, verify.VERB,
                           launch.VERB, doctor.VERB)

__all__ = ["VERBS", "Verb"]
