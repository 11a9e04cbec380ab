"""From spec to stored artifact: the compiler (worker processes running the CuTe DSL), the
checksummed cache and catalogs, the parameter ABI, and readers of PTX and cubins. Never imports
the DSL or torch."""
