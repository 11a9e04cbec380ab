"""Choosing configs: the tuned tables that ``tile=None`` reads (``table``), and the search and
timing behind them (``search``, ``timing``) that the autotuner and the benchmark use."""
