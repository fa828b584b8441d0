"""The Ray cluster a run uses: joined, or started here on 127.0.0.1 and stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

import dpcore

from .._trace import trace


@contextlib.contextmanager
def ray_cluster(cfg, early: EarlyCluster | None = None):
    """Join ``ray_address`` (or RAY_ADDRESS, e.g. under ``ray job submit``) and stay connected, or
    else start a local cluster, on 127.0.0.1 (its dashboard only with ``ray_dashboard``), and stop it afterwards.
    Yields how: "connected" (Ray was already initialised here), "joined" or "started".
    ``cfg`` needs ``ray_address``, ``num_workers`` and ``use_gpu`` (a TrainConfig has them).
    With ``early`` (an :class:`EarlyCluster` that began), its cluster is the one started."""
    import logging

    import ray

    if early is not None and early.began:
        early.wait()
        try:
            yield "started"
        finally:
            early.stop()
        return
    if ray.is_initialized():
        yield "connected"
        return
    address = cluster_address(cfg)
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
        _start_local(cfg)
    try:
        yield "started"
    finally:
        ray.shutdown()


def cluster_address(cfg) -> str | None:
    """The cluster a run joins: ``ray_address``, else RAY_ADDRESS (None: it starts its own)."""
    return cfg.ray_address or os.environ.get("RAY_ADDRESS")


def _start_local(cfg, prestart: bool = True) -> None:
    """``ray.init`` of a one-node cluster on 127.0.0.1. ``prestart=False``: no idle worker processes
    started ahead (Ray Train's actors, with their own runtime env, cannot use them).

    Ray's dashboard (its HTTP server and Jobs API, and a process for each of its modules: ten more
    Python processes here) starts only with ``cfg.ray_dashboard``: a cluster that lives as long
    as one run has the progress line and MLflow to watch it by, and on 2 cores the dashboard
    delays the cluster's start by about a second (docs/fashion-mnist.md, start-up). Ray still
    runs its minimal dashboard process and agent, which the cluster itself needs."""
    import logging

    import ray

    # A one-node cluster of our own is never drained by a cloud provider: Ray Train's
    # preemption watcher (an extra actor process, started at every run) has nothing to watch.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    if not prestart:
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    write_token_first()  # ray.init would write it readable by everyone for the seconds of the start
    ray.init(
        address="local",  # a cluster of its own, even beside one that `ray start` left running here
        log_to_driver=False,
        num_cpus=max(os.cpu_count() or 1, cfg.num_workers),
        num_gpus=None if cfg.use_gpu else 0,
        include_dashboard=bool(getattr(cfg, "ray_dashboard", False)),
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
        configure_logging=True,
    )
    keep_token_private()


class EarlyCluster:
    """The local cluster of a training run, started in a background thread while the driver
    still plans (σ, the step bound, cached features, the MLflow run), then used by
    :func:`ray_cluster`. It starts no worker, and nothing is spent before the plan is done.

    Use as a context manager around the planning and the fit: on the way out (an error in the
    plan included) the cluster is stopped. :meth:`begin` does nothing where the run would not
    start a cluster (``ray_address``/RAY_ADDRESS given, Ray already initialised, in-process).

    Ray's processes die with the *thread* that started them (``PR_SET_PDEATHSIG``), so the
    thread stays alive, waiting, until :meth:`stop`. It also imports Ray Train's trainer once the
    cluster is up, so that the fit does not wait for that import."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._release = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False

    @property
    def began(self) -> bool:
        return self._thread is not None

    def begin(self, cfg) -> None:
        import ray

        if self.began or cfg.in_process or cluster_address(cfg) or ray.is_initialized():
            return
        if threading.current_thread() is threading.main_thread():
            # What ray.init installs when it runs on the main thread: SIGTERM ends the driver by
            # SystemExit, so that the run's clean-up (MLflow status, the cluster) still runs.
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        self._thread = threading.Thread(target=self._run, args=(cfg,), name="ray-cluster-start", daemon=True)
        trace("checked: cluster start begun")
        self._thread.start()

    def _run(self, cfg) -> None:
        import logging

        # "SIGTERM handler is not set because current thread is not the main thread": set above.
        logging.getLogger("ray._private.worker").addFilter(lambda r: "SIGTERM handler" not in r.getMessage())
        try:
            _start_local(cfg, prestart=False)
            trace("cluster up (background)")
        except BaseException as e:  # raised on the driver's thread by wait()
            self._error = e
        finally:
            self._ready.set()
        if self._error is None:
            from . import lean  # noqa: F401 - Ray Train's trainer, imported while the driver plans
        self._release.wait()

    def wait(self) -> None:
        """Block until the cluster is up; raise what ``ray.init`` raised."""
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Shut the cluster down (once the start has finished) and let the thread end."""
        if not self.began or self._stopped:
            return
        self._stopped = True
        self._ready.wait()
        try:
            import ray

            if self._error is None:
                ray.shutdown()
        finally:
            self._release.set()

    def __enter__(self) -> EarlyCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _token_path() -> Path:
    """The file Ray reads the cluster's auth token from: ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def write_token_first() -> bool:
    """Write the auth token a new local cluster will use before ``ray.init`` does.

    Where it finds none, ``ray.init`` creates ``~/.ray`` (mode 755) and writes a new token there
    readable by everyone on the machine (644), then starts the cluster: for the seconds of the
    start the token, admin access to this and every later local cluster, is open to all. So the
    token (``secrets.token_hex(32)``, what Ray would draw) is written here first: its folder made
    700 where it is new, the file 600 from its creation, and put in place whole by a hard link
    (a second run starting at the same moment keeps the first one's token). Nothing is done
    where the token comes from ``RAY_AUTH_TOKEN``, where token auth is turned off, or where the
    file exists (:func:`keep_token_private` then narrows its mode). Returns whether it wrote one."""
    import secrets

    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return False
    path = _token_path()
    if path.exists() or path.is_symlink():
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:  # no hard links on this filesystem: a rename, unless a token came meanwhile
        if path.exists():
            return False
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return True


def keep_token_private() -> None:
    """Make the cluster's auth token file the owner's alone where it is readable by others (a
    token ``ray.init`` wrote before :func:`write_token_first` existed, or one ``ray start``
    wrote); a file of another user's is left as it is."""
    import stat

    path = _token_path()
    with contextlib.suppress(OSError):
        if path.is_file() and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            path.chmod(0o600)
