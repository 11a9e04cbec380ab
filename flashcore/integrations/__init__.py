"""Drop-in front ends for the clients people already use.

* ``flashcore.integrations.flash_attn``: FlashAttention's functions (``flash_attn_func``,
  ``flash_attn_varlen_func``, ``flash_attn_with_kvcache`` and the packed variants) on its
  layouts, so switching is an import.
* ``flashcore.integrations.transformers``: ``register()`` makes flashcore an
  ``attn_implementation`` of Hugging Face transformers.

Nothing is imported here: each module pulls in only what it needs (transformers is optional).
"""
