"""Where each rank ran, and its memory: written by the workers into the run folder, logged by
the driver to MLflow (``ray/placement.json``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import RunPlan

import json
import os
from pathlib import Path


def memory_status() -> dict:
    """This process's memory in MiB (Linux /proc): peak and current resident set, and the
    current anonymous (heap) and file-backed (memory-mapped shards) parts of it."""
    keys = {"VmHWM": "peak_rss_mib", "VmRSS": "rss_mib", "RssAnon": "rss_anon_mib", "RssFile": "rss_file_mib"}
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in keys:
                out[keys[name]] = round(int(value.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def record_placement(plan: RunPlan, rank: int, memory: dict | None = None) -> None:
    """Where this rank runs (Ray node, host, process), and with ``memory`` its memory use, in
    the run folder; the driver logs it (``ray/placement.json``). A restarted group overwrites
    it with its new placement."""
    import socket

    import ray

    d = Path(plan.run_dir) / "placement"
    d.mkdir(parents=True, exist_ok=True)
    if plan.config.get("in_process") or not ray.is_initialized():
        # Ray Train's local mode: this process is the worker, even where the driver process
        # holds a Ray connection made for something else
        node_id, node_ip = f"in-process:{socket.gethostname()}", "127.0.0.1"
    else:
        node_id, node_ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    info = {"rank": rank, "node_id": node_id, "node_ip": node_ip, "hostname": socket.gethostname(), "pid": os.getpid()}
    if memory:
        info["memory"] = memory
    tmp = d / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, d / f"rank{rank}.json")


def read_placement(plan: RunPlan) -> list[dict]:
    d = Path(plan.run_dir) / "placement"
    return [json.loads(f.read_text()) for f in sorted(d.glob("rank*.json"))] if d.is_dir() else []
