"""A module imported on its first use. dp_accounting imports scipy.stats and scipy.signal
(about 0.55 s on a 2-core machine), and most of the platform's processes that import dpcore
compose no ε: the command line, a worker module's import (a PLD-accounted Ray worker still
imports it before its first step, when it unpickles the PLDs the driver hands it)."""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr in ("_name", "_module"):  # copy and pickle probe before __init__ ran
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __reduce__(self):
        return LazyModule, (self._name,)
