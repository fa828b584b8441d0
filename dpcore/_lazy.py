"""A module imported on its first use. dp_accounting imports scipy.stats and scipy.signal
(about 0.55 s on a 2-core machine): a training worker needs it only once ε is composed, which
is after its first step, so the modules that compose events import it this way."""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
