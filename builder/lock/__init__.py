"""Stage: locked, hash-checked installs.

- :mod:`builder.lock.target`: what a cell's lock must hold (its requirements per layer) and for
  which target (Python, ``<arch>-manylinux_2_<glibc>``), and which of a package's wheels that
  target installs;
- :mod:`builder.lock.model`: the lock file, ``locks/<cell>/pylock.toml`` (PEP 751, one wheel per
  package: exactly what the image installs, with URL, size and sha256);
- :mod:`builder.lock.resolve`: ``build.py lock``: uv resolves each cell for its target;
- :mod:`builder.lock.check`: ``build.py lock --check``: images.yaml and the locks agree;
- :mod:`builder.lock.store`: the host's wheel store (every file hash-verified; a torch wheel is
  downloaded once per machine), filled with the host's index, proxy and CA settings;
- :mod:`builder.lock.staging`: a build's context folder: the files the image copies, the cell's
  wheels per layer (hard links into the store), the install requirements, the static uv and the
  SBOM's input.

The Dockerfile installs from that folder only: ``uv pip install --no-index --require-hashes
--no-deps --only-binary :all:`` with no uv cache, so every wheel is hash-checked on every build.
"""
