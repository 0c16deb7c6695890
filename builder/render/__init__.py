"""Stage 2: ImageSpec -> docker/<cell>/Dockerfile (pure), and the files generated beside it."""
