"""User-facing ops."""

from .attention import attention, attention_paged, attention_varlen
from .kv_append import append_paged_kv

__all__ = ["append_paged_kv", "attention", "attention_paged", "attention_varlen"]
