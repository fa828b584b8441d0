"""Start-up timeline for measurements: with ``DP_TRACE=FILE``, each phase of a run (driver and
workers) appends ``<unix time> <pid> <phase>`` to FILE. Used by
``docs/benchmarks/fashion_mnist.py startup``; a no-op otherwise."""

import os
import time


def trace(label: str) -> None:
    path = os.environ.get("DP_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {os.getpid()} {label}\n")
