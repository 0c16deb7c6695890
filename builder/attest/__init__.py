"""Signed provenance: in-toto statements (SLSA provenance, the CycloneDX SBOM, the gate results), each
DSSE-signed with an ECDSA P-256 key and stored beside the image the way cosign stores them (the
``sha256-<hex>.att`` and ``.sig`` tags), and checked again by ``build.py verify``.

- :mod:`builder.attest.keys`: the key pair (``build.py keygen``), read from files only;
- :mod:`builder.attest.dsse`: DSSE envelopes (PAE, sign, open);
- :mod:`builder.attest.statements`: the statements and their predicates (pure);
- :mod:`builder.attest.cosign_store`: the ``.att``/``.sig`` images in a registry (through a small port);
- :mod:`builder.attest.verify`: what a consumer checks;
- :mod:`builder.attest.rebuild`: ``verify --rebuild``'s comparison of the published image with a rebuild's
  OCI layout, file by file (the layouts and tars read with :mod:`builder.imaging.repro`).

This stage needs no engine and no publish code: ``builder/publish/signing.py`` gathers the facts and
hands it a registry port; the CLI runs the rebuild and hands over its OCI layout.
"""
