"""Stage 3: build the cells on the engine (base image, inputs hash, BuildKit, probe, labels)."""
