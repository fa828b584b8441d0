"""The Ray cluster a run uses: joined, or started here on 127.0.0.1 and stopped afterwards."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import dpcore


@contextlib.contextmanager
def ray_cluster(cfg):
    """Join ``ray_address`` (or RAY_ADDRESS, e.g. under ``ray job submit``) and stay connected, or
    else start a local cluster, on 127.0.0.1 with the dashboard on, and stop it afterwards.
    Yields how: "connected" (Ray was already initialised here), "joined" or "started".
    ``cfg`` needs ``ray_address``, ``num_workers`` and ``use_gpu`` (a TrainConfig has them)."""
    import logging

    import ray

    if ray.is_initialized():
        yield "connected"
        return
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith(("http://", "https://")):
        raise dpcore.DPConfigError(
            f"RAY_ADDRESS={address} is a Ray Jobs API address, which a driver cannot join. Submit the run there "
            "(dp-platform submit CONFIG), or give the cluster's GCS address (HOST:6379) or 'auto' on a cluster node."
        )
    if address:
        # Joined, not started here: stay connected until the process ends, so that the job's
        # runtime env (under `ray job submit`, the package the driver runs from) stays referenced
        # while the driver still logs to MLflow from it.
        # log_to_driver=False: the workers' own output stays in Ray's session logs, off this terminal
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        yield "joined"
        return
    else:
        # A one-node cluster of our own is never drained by a cloud provider: Ray Train's
        # preemption watcher (an extra actor process, started at every run) has nothing to watch.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        ray.init(
            log_to_driver=False,
            num_cpus=max(os.cpu_count() or 1, cfg.num_workers),
            num_gpus=None if cfg.use_gpu else 0,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            logging_level=logging.WARNING,
            configure_logging=True,
        )
        keep_token_private()
    try:
        yield "started"
    finally:
        ray.shutdown()


def keep_token_private() -> None:
    """``ray.init`` writes the cluster's auth token (``~/.ray/auth_token``, or
    ``RAY_AUTH_TOKEN_PATH``) readable by everyone on the machine; it is admin access to the
    cluster, so make it the owner's alone (a file of another user's is left as it is)."""
    import stat

    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    with contextlib.suppress(OSError):
        if path.is_file() and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            path.chmod(0o600)
