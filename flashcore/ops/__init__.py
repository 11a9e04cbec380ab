"""User-facing ops."""

from .attention import attention
from .serving import attention_paged, attention_varlen

__all__ = ["attention", "attention_paged", "attention_varlen"]
