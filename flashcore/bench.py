"""``python -m flashcore.bench``: the benchmark harness (``flashcore.tuning.bench``)."""

from .tuning.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
