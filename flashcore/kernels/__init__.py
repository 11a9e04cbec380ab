"""The only package that imports ``cutlass`` (the CuTe DSL).

Importing ``flashcore`` never imports this package's modules that need the DSL; the compiler runs
them in a worker process whose ``CUTE_DSL_ARCH`` is set before ``cutlass`` is imported.
"""
