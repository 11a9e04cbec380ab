"""The autotuner's tables (``<arch>.json``) and their reader (``table``): the configs that
``tile=None`` runs. Written by ``flashcore.tuning.search``, read by ``flashcore.ops``."""
