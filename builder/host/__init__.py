"""Checks of the host the builder runs on (engine, BuildKit, disk, GPUs)."""
