"""``flashcore.spec`` is now ``flashcore.specs``: this name keeps old imports working (the same
module objects, so classes compare equal) with a DeprecationWarning, and will go."""

import importlib
import pkgutil
import sys
import warnings

from . import specs as _moved

warnings.warn("flashcore.spec is now flashcore.specs", DeprecationWarning, stacklevel=2)
for _sub in pkgutil.iter_modules(_moved.__path__):
    sys.modules[f"{__name__}.{_sub.name}"] = importlib.import_module(
        f"{_moved.__name__}.{_sub.name}")
sys.modules[__name__] = _moved
