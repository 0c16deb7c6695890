"""Stage: `build.py diff A B`: what changed between two images (cells or image references).

:mod:`builder.diff.facts` reads each image once (labels and layers from the engine; Debian
packages, Python distributions and every directory's size from one throwaway container);
:mod:`builder.diff.compare` compares two such fact sets and renders text or JSON (pure).
"""
