"""Ray Jobs: ``dp-platform submit``, ``status``, ``logs`` and ``stop``.

``submit`` is ``ray job submit --working-dir . -- python -m pipelines.train CONFIG`` (or the sweep),
with the config checked here first, the job id printed, and its logs followed until it ends:

    dp-platform submit configs/digits.yaml                # a training run
    dp-platform submit --sweep configs/digits.yaml -- --n-trials 8
    dp-platform status [JOB_ID]                           # one job, or all
    dp-platform logs JOB_ID [--follow]
    dp-platform stop JOB_ID

The cluster address is ``--address``, else ``RAY_ADDRESS``, else the local stack's
(``dp-platform stack up``). The token comes from ``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH``,
else the stack's token file. Credentials never travel with the job: a job reads the MLflow and
PostgreSQL credentials from its node's environment (the stack starts its nodes with them; on
Kubernetes they come from a Secret).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import dpcore

from ..config.options import Parser
from .stack import StackError, default_dir, load_state, read_env_file

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# never uploaded with a job: environments, local stores and outputs (.gitignore is honoured too)
EXCLUDES = [
    ".git",
    ".venv",
    "venv",
    "dp_runs",
    "mlruns",
    "mlartifacts",
    "*.db",
    ".dp-stack",
    "test-artifacts",
    "__pycache__",
]


class JobError(dpcore.DPConfigError):
    """A job cannot be submitted or found; the message says why and what to do."""


def resolve_cluster(address: str | None = None, stack_dir: Path | None = None) -> str:
    """The Jobs API address, and the token settings in this process's environment (before Ray is
    imported, because Ray reads RAY_AUTH_MODE once)."""
    root = Path(stack_dir or default_dir()).expanduser()
    stack = {}
    if (root / "stack.json").exists():
        load_state(root)
        stack = read_env_file(root / "credentials.env")
    address = address or os.environ.get("RAY_ADDRESS") or stack.get("DP_RAY_JOBS_ADDRESS")
    if not address:
        raise JobError(
            "no cluster to submit to: give --address http://HEAD:8265, set RAY_ADDRESS, or start the local stack (dp-platform stack up)."
        )
    if "://" not in address:
        address = f"http://{address}"
    if address.startswith("ray://"):
        raise JobError(f"--address {address} is a Ray Client address; jobs go to the Jobs API, http://HEAD:8265.")
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")) and stack.get(
        "RAY_AUTH_TOKEN_PATH"
    ):
        same = lambda a: a.rstrip("/").replace("://localhost:", "://127.0.0.1:")  # noqa: E731
        if same(stack.get("DP_RAY_JOBS_ADDRESS", "")) == same(address):
            os.environ["RAY_AUTH_TOKEN_PATH"] = stack["RAY_AUTH_TOKEN_PATH"]
    if (
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or Path("~/.ray/auth_token").expanduser().exists()
    ):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    return address


def client(address: str):
    import logging

    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    from ..logs import library_imported

    logging.getLogger("ray").setLevel(logging.WARNING)
    library_imported()  # Ray's terminal handler, added at its import: errors only while a command log is open
    try:
        return JobSubmissionClient(address)
    except AuthenticationError:
        raise JobError(
            f"the Ray cluster at {address} refused the request (401: token authentication). Give it the cluster's token: "
            "RAY_AUTH_TOKEN_PATH=/path/to/token (mode 0600) or RAY_AUTH_TOKEN, with RAY_AUTH_MODE=token; "
            "for the local stack, `set -a; . ~/.dp-platform/stack/credentials.env; set +a`."
        ) from None
    except ConnectionError:
        raise JobError(
            f"cannot reach the Ray Jobs API at {address}: nothing answers there. Check the address (the head's dashboard "
            "port, 8265 by default; tunnel it with ssh -L 8265:127.0.0.1:8265 for a remote head) or start the stack "
            "(dp-platform stack up)."
        ) from None


def entrypoint(config: str | None, sweep: bool, args: list[str]) -> list[str]:
    module = ["-m", "pipelines.cli", "sweep"] if sweep else ["-m", "pipelines.train"]
    return ["python", *module, *([config] if config else []), *args]


def check_train_args(argv: list[str]) -> None:
    """Parse and validate a training job's arguments (config file, then flags)."""
    from ..config import load_config
    from ..train import build_parser

    ns = vars(build_parser().parse_args(argv))
    path = ns.pop("config", None)
    if ns.pop("resume", None) is None:
        load_config(path, ns).validate()


def check_locally(config: str | None, sweep: bool, args: list[str], checker: Callable | None = None) -> None:
    """Parse and validate the config here, so that a bad one is refused before it is uploaded.
    The data and the budget are checked again by the job, on the cluster. ``checker(argv)``
    checks a sweep's arguments (the CLI hands in :func:`tuning.cli.check_args`; pipelines
    does not import tuning)."""
    if sweep and checker is None:
        raise JobError("a sweep's config cannot be checked here (no checker given); use --no-check.")
    try:
        (checker if sweep else check_train_args)([*([config] if config else []), *args])
    except SystemExit:
        raise JobError("the job's arguments are invalid (see above); nothing was submitted.") from None


def submit(
    config: str | None,
    args: list[str],
    sweep: bool = False,
    address: str | None = None,
    working_dir: str = ".",
    stack_dir=None,
    check: bool = True,
    job_id: str | None = None,
    sweep_checker: Callable | None = None,
) -> tuple[object, str]:
    if config is not None and not Path(working_dir, config).is_file() and not Path(config).is_file():
        raise JobError(f"config file {config!r} does not exist.")
    if check:
        local = str(Path(working_dir, config)) if config is not None and Path(working_dir, config).is_file() else config
        check_locally(local, sweep, args, sweep_checker)
    if config is not None and Path(config).is_absolute():
        raise JobError(
            f"give the config as a path inside --working-dir ({working_dir}), not {config}: the job runs in its own copy of that folder."
        )
    address = resolve_cluster(address, stack_dir)
    c = client(address)
    cmd = shlex.join(entrypoint(config, sweep, args))
    jid = c.submit_job(
        entrypoint=cmd,
        submission_id=job_id,
        runtime_env={"working_dir": working_dir, "excludes": EXCLUDES, "env_vars": {"PYTHONUNBUFFERED": "1"}},
        metadata={"dp_platform": "sweep" if sweep else "train"},
    )
    return c, jid


async def _follow(c, job_id: str) -> None:
    async for chunk in c.tail_job_logs(job_id):
        print(chunk, end="", flush=True)


def follow(c, job_id: str) -> str:
    """Print the job's logs as they come; returns its final status."""
    try:
        asyncio.run(_follow(c, job_id))
    except KeyboardInterrupt:
        print(
            f"\nstopped following; the job keeps running. `dp-platform logs {job_id} --follow`, or `dp-platform stop {job_id}`."
        )
        return "RUNNING"
    for _ in range(100):  # the log stream can close a moment before the status is final
        info = c.get_job_info(job_id)
        if str(info.status) in TERMINAL:
            break
        time.sleep(0.2)
    return str(info.status)


def describe(info) -> str:
    took = ""
    if info.start_time and info.end_time:
        took = f"  ({(info.end_time - info.start_time) / 1000:.1f}s)"
    from ..tracking import redact

    line = f"{info.submission_id}  {info.status}{took}  {redact(info.entrypoint)}"
    if info.message and str(info.status) in ("FAILED", "STOPPED"):
        line += "\n  " + redact(info.message.strip()).replace("\n", "\n  ")
    return line


# ------------------------------------------------------------------------------------ CLI
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address", help="the cluster's Jobs API, http://HEAD:8265 (default: RAY_ADDRESS, else the local stack's)"
    )
    p.add_argument(
        "--stack-dir", type=Path, help="the local stack's folder (default: $DP_STACK_DIR or ~/.dp-platform/stack)"
    )


def main_submit(argv: list[str], prog: str = "dp-platform submit", sweep_checker: Callable | None = None) -> int:
    p = Parser(
        prog=prog,
        usage=f"{prog} [options] [CONFIG] [-- JOB OPTIONS]",
        description="Submit a training run (or, with --sweep, a sweep) to a Ray cluster through the Jobs API, print its "
        "id and follow its logs. It runs 'python -m pipelines.train CONFIG ARGS' (or 'python -m pipelines.cli sweep ...') "
        "in a copy of --working-dir on the cluster.",
        epilog="The same job by hand: RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- "
        "python -m pipelines.train configs/digits.yaml",
    )
    p.add_argument("config", nargs="?", help="YAML config, relative to --working-dir")
    p.add_argument(
        "--sweep", action="store_true", help="submit a sweep (dp-platform sweep) instead of one training run"
    )
    p.add_argument("--working-dir", default=".", help="the folder uploaded as the job's working directory (default: .)")
    p.add_argument("--job-id", help="the submission id (default: Ray's raysubmit_...)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return; do not follow the logs")
    p.add_argument("--no-check", action="store_true", help="skip the local config check (the job still checks it)")
    _common(p)
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    args = argv[cut + 1 :]  # the job's own options: everything after --
    from ..logs import library_logs
    from .clean import cache_dir

    # Ray's job client logs (the upload, the log stream) go to a file, as a run's libraries do
    with library_logs(cache_dir() / "logs" / f"submit-{time.strftime('%Y%m%d-%H%M%S')}.log") as logs:
        code = _submit_and_follow(a, args, sweep_checker)
    if code is not None:
        print(logs.summary("Ray's job client"))
    return code if code is not None else 2


def _submit_and_follow(a: argparse.Namespace, args: list[str], sweep_checker) -> int | None:
    """Submit, print the job's id and commands, follow its logs; the exit code (None: refused)."""
    try:
        c, jid = submit(
            a.config,
            args,
            a.sweep,
            a.address,
            a.working_dir,
            a.stack_dir,
            check=not a.no_check,
            job_id=a.job_id,
            sweep_checker=sweep_checker,
        )
    except (
        JobError,
        StackError,
        dpcore.DPError,
        RuntimeError,
    ) as e:  # RuntimeError: the Jobs API refused (e.g. a duplicate --job-id)
        print(f"error: {e}", file=sys.stderr)
        return None
    print(
        f"submitted job {jid}\n  status: dp-platform status {jid}\n  logs:   dp-platform logs {jid} --follow\n  stop:  "
        f" dp-platform stop {jid}",
        flush=True,
    )
    if a.no_wait:
        return 0
    status = follow(c, jid)
    info = c.get_job_info(jid)
    print(describe(info) if status in TERMINAL else f"{jid}  {status}")
    return 0 if status == "SUCCEEDED" else 1


def main_status(argv: list[str], prog: str = "dp-platform status") -> int:
    p = Parser(prog=prog, description="The status of one Ray job (with the reason when it failed), or of all jobs.")
    p.add_argument("job_id", nargs="?", help="submission id (default: list all jobs)")
    _common(p)
    a = p.parse_args(argv)
    try:
        c = client(resolve_cluster(a.address, a.stack_dir))
        if a.job_id:
            info = c.get_job_info(a.job_id)
            print(describe(info))
            return {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 1}.get(str(info.status), 0)
        for info in sorted(c.list_jobs(), key=lambda i: i.start_time or 0):
            print(describe(info).splitlines()[0])
    except (
        JobError,
        StackError,
        RuntimeError,
    ) as e:  # RuntimeError: the SDK's "Request failed with status code 404: Job ... does not exist."
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main_logs(argv: list[str], prog: str = "dp-platform logs") -> int:
    p = Parser(prog=prog, description="A Ray job's logs (its driver's stdout and stderr).")
    p.add_argument("job_id", help="submission id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    _common(p)
    a = p.parse_args(argv)
    try:
        c = client(resolve_cluster(a.address, a.stack_dir))
        if a.follow:
            status = follow(c, a.job_id)
            return 0 if status == "SUCCEEDED" else 1
        print(c.get_job_logs(a.job_id), end="")
    except (JobError, StackError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main_stop(argv: list[str], prog: str = "dp-platform stop") -> int:
    p = Parser(
        prog=prog,
        description="Stop a running Ray job. A stopped training run keeps its ledger; --resume RUN_ID continues it.",
    )
    p.add_argument("job_id", help="submission id")
    _common(p)
    a = p.parse_args(argv)
    try:
        c = client(resolve_cluster(a.address, a.stack_dir))
        print(f"{a.job_id}: {'stop requested' if c.stop_job(a.job_id) else 'not running'}")
    except (JobError, StackError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
