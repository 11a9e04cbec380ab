"""``python -m flashcore.autotune``: the autotuner (``flashcore.tuning.search``)."""

from .tuning.search import main

if __name__ == "__main__":
    raise SystemExit(main())
