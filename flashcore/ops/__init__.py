"""User-facing ops."""

from .attention import attention

__all__ = ["attention"]
