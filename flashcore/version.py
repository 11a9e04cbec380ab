"""flashcore's version (a leaf module: the compiler records it in artifacts and catalogs)."""

__version__ = "0.1.0"
