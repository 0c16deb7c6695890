"""Stage 4: smoke-test built images in containers (selftest, single- and multi-node DDP)."""
