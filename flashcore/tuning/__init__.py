"""Finding configs: the autotuner (``search``) and the benchmark (``bench``, its ``peers``),
both timing with ``timing``. The tables they write live in ``flashcore.tuned``."""
