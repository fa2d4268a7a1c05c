"""Qwen2 / Qwen2.5 (mlx-lm ``qwen2``): full attention in every layer."""

from __future__ import annotations

from .base import FamilyAdapter


class Qwen2Adapter(FamilyAdapter):
    model_types = ("qwen2",)
