"""PostgreSQL for the stack: installed from Debian's packages if missing, started as its own user, one role and database per service."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from .common import StackError, _tail, _write_secret


def find_postgres_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: Debian keeps them in /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


def ensure_postgres(install: bool = True) -> Path:
    """PostgreSQL's binaries; installs Debian's ``postgresql`` package when they are missing."""
    bindir = find_postgres_bindir()
    if bindir is not None:
        return bindir
    how = "apt-get update && apt-get install -y postgresql"
    if not install:
        raise StackError(f"PostgreSQL is not installed (no initdb found). Install it ({how}) or drop --no-install.")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise StackError(
            f"PostgreSQL is not installed, and this command installs it only as root on Debian or Ubuntu. Run: sudo sh -c '{how}'"
        )
    print(
        "PostgreSQL is not installed: installing Debian's postgresql package (apt-get update; apt-get install -y postgresql) ...",
        flush=True,
    )
    # No default cluster: the stack makes its own, on loopback; Debian's would listen on 5432.
    drop_in = Path("/etc/postgresql-common/createcluster.d/dp-platform.conf")
    drop_in.parent.mkdir(parents=True, exist_ok=True)
    drop_in.write_text("create_main_cluster = false\n")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [
        "apt-get",
        "install",
        "-y",
        "--no-install-recommends",
        "-o",
        "Dpkg::Options::=--force-confold",
        "postgresql",
    ]
    for cmd in (["apt-get", "update"], install):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise StackError(
                f"installing PostgreSQL failed: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}"
            )
    bindir = find_postgres_bindir()
    if bindir is None:
        raise StackError("apt-get installed postgresql but no initdb was found under /usr/lib/postgresql.")
    return bindir


def _as_postgres_user(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root; as root, run its programs as the 'postgres' user."""
    if os.geteuid() != 0:
        return cmd
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        raise StackError(
            "running as root, PostgreSQL needs a 'postgres' system user (Debian's package creates it): useradd --system postgres"
        ) from None
    return ["runuser", "-u", "postgres", "--", *cmd]


def _pg_base(root: Path) -> Path:
    """Where the database cluster lives. As root it goes under the postgres user's home, which
    that user can reach (the stack folder under /root is not)."""
    if os.geteuid() != 0:
        return root / "postgres"
    import pwd

    home = Path(pwd.getpwnam("postgres").pw_dir)
    return home / "dp-stack" / hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]


def _chown_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def _pg_connect(state: dict, admin: dict, dbname: str = "postgres", timeout: int = 5):
    import psycopg2

    return psycopg2.connect(
        host=state["host"],
        port=state["ports"]["postgres"],
        user="dpadmin",
        password=admin["PG_ADMIN_PASSWORD"],
        dbname=dbname,
        connect_timeout=timeout,
    )


def _start_postgres(state: dict, admin: dict, bindir: Path) -> None:
    base, host, port = Path(state["pg_base"]), state["host"], state["ports"]["postgres"]
    data, log = base / "data", base / "postgres.log"
    if not (data / "PG_VERSION").exists():
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        _chown_to_postgres(base)
        pwfile = base / "initdb.pw"
        _write_secret(pwfile, admin["PG_ADMIN_PASSWORD"] + "\n")
        _chown_to_postgres(pwfile)
        try:
            r = subprocess.run(
                _as_postgres_user(
                    [
                        str(bindir / "initdb"),
                        "-D",
                        str(data),
                        "-U",
                        "dpadmin",
                        f"--pwfile={pwfile}",
                        "--auth=scram-sha-256",
                        "-E",
                        "UTF8",
                        "--locale=C",
                    ]
                ),
                capture_output=True,
                text=True,
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if r.returncode != 0:
            raise StackError(f"initdb failed ({r.returncode}):\n{r.stderr[-2000:]}")
    # listen on the stack's interface only; the unix socket sits in the private folder
    opts = f"-c listen_addresses={host} -p {port} -c unix_socket_directories={base}"
    r = subprocess.run(
        _as_postgres_user(
            [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "30", "start"]
        ),
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise StackError(
            f"PostgreSQL did not start on {host}:{port} (pg_ctl exited {r.returncode}). Its log, {log}:\n{_tail(log)}"
        )


def _pg_is_up(state: dict, admin: dict) -> str | None:
    """None when PostgreSQL accepts the admin's connection, else the reason."""
    try:
        _pg_connect(state, admin, timeout=3).close()
        return None
    except Exception as e:  # psycopg2.OperationalError: refused, auth, ...
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _provision_databases(state: dict, admin: dict) -> None:
    """Roles mlflow and optuna with their own passwords; databases mlflow and mlflow_auth (owned
    by mlflow) and optuna (owned by optuna); no role may connect to another's database."""
    from psycopg2 import sql
    from psycopg2.extensions import encrypt_password

    conn = _pg_connect(state, admin)
    conn.autocommit = True
    with conn.cursor() as cur:
        for role, password in (("mlflow", admin["PG_MLFLOW_PASSWORD"]), ("optuna", admin["PG_OPTUNA_PASSWORD"])):
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            verb = "ALTER" if cur.fetchone() else "CREATE"
            # the SCRAM verifier, not the password, goes into the statement (statements can reach the log)
            verifier = encrypt_password(password, role, conn, "scram-sha-256")
            cur.execute(sql.SQL(verb + " ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(role)), (verifier,))
        for db, owner in (("mlflow", "mlflow"), ("mlflow_auth", "mlflow"), ("optuna", "optuna")):
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
            if not cur.fetchone():
                cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(db), sql.Identifier(owner)))
        for db in ("mlflow", "mlflow_auth", "optuna", "postgres"):
            cur.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(sql.Identifier(db)))
    conn.close()
