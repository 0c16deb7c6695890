"""`build.py export`: a local image as a file an HPC runtime runs (enroot squashfs, Apptainer SIF)."""
