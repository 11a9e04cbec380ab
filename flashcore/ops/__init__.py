"""User-facing ops."""

from .attention import attention, attention_paged, attention_varlen

__all__ = ["attention", "attention_paged", "attention_varlen"]
