"""Stage 5: push smoke-tested images to a registry; never overwrite an immutable tag; report."""
