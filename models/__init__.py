"""The supported base models and their trained drafters (installed as ``redrafter_models``).

Each folder holds ``entry.json`` (where the LLM comes from, how it is converted, default beam
shape) and, once one is trained, ``drafter/`` (``config.json`` + ``model.safetensors``).
:mod:`redrafter_mlx.registry` reads them.
"""
