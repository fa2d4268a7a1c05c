"""Model conversion into mlx-lm folders.

:func:`convert_gguf` turns a llama.cpp GGUF file (``qwen2``, ``llama``, ``gemma3``) into a folder
that ``mlx_lm.load`` opens; :mod:`.pypi_models` assembles the two demo GGUFs shipped on PyPI.
"""

from .gguf import ConversionError, convert_gguf
from .pypi_models import assemble_gemma3_270m, assemble_qwen25_coder_05b

__all__ = ["ConversionError", "assemble_gemma3_270m", "assemble_qwen25_coder_05b", "convert_gguf"]
