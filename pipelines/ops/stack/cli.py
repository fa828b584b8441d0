"""``dp-platform stack``: the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ...config.options import Parser
from .commands import check, down, listening_sockets, up
from .common import DEFAULT_PORTS, JOBS_USER, PROG, StackError, default_dir
from .ray_node import add_node


def _ports_from(a) -> dict:
    return {k: getattr(a, f"{k}_port") for k in DEFAULT_PORTS if getattr(a, f"{k}_port") is not None}


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog=PROG,
        description="The platform's services on this machine: PostgreSQL, MLflow (basic auth) and a Ray head (token "
        "auth), on 127.0.0.1 (Ray's internal ports excepted: see status --ports).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    dir_help = (
        f"the stack's folder: state, secrets (mode 0600), artifacts, logs (default: $DP_STACK_DIR or {default_dir()})"
    )
    u = sub.add_parser("up", help="start PostgreSQL, MLflow and the Ray head")
    u.add_argument("--dir", type=Path, help=dir_help)
    u.add_argument(
        "--host", default="127.0.0.1", help="the interface every service binds (default 127.0.0.1: this machine only)"
    )
    for k, v in DEFAULT_PORTS.items():
        u.add_argument(f"--{k}-port", type=int, help=f"port of {k} (default {v})")
    u.add_argument("--num-cpus", type=int, help="CPUs the Ray head offers (default: all)")
    u.add_argument(
        "--resources", type=json.loads, help="custom Ray resources of the head, as JSON, e.g. '{\"head_node\": 1}'"
    )
    u.add_argument("--no-install", action="store_true", help="do not install PostgreSQL if it is missing")
    u.add_argument(
        "--cleartext-network",
        action="store_true",
        help="allow a --host other than loopback: the services are then reachable from the network, and their "
        "passwords and the Ray token travel in clear text (put TLS in front, or keep 127.0.0.1 and tunnel)",
    )
    n = sub.add_parser(
        "add-node", help="start one more Ray node on this machine that joins the head (ray start --address)"
    )
    n.add_argument("--dir", type=Path, help=dir_help)
    n.add_argument("--num-cpus", type=int, help="CPUs this node offers")
    n.add_argument(
        "--resources", type=json.loads, help="custom Ray resources of this node, as JSON, e.g. '{\"worker_node\": 1}'"
    )
    s = sub.add_parser("status", help="is each service up, and where")
    s.add_argument("--dir", type=Path, help=dir_help)
    s.add_argument(
        "--ports",
        action="store_true",
        help="also list every TCP port the stack's processes listen on, and on which address",
    )
    d = sub.add_parser("down", help="stop the services (data stays)")
    d.add_argument("--dir", type=Path, help=dir_help)
    d.add_argument("--purge", action="store_true", help="also delete the databases, artifacts and secrets")
    a = p.parse_args(argv)
    root = Path(a.dir or default_dir()).expanduser().resolve()
    try:
        if a.cmd == "up":
            state = up(
                root,
                host=a.host,
                ports=_ports_from(a),
                num_cpus=a.num_cpus,
                resources=a.resources,
                install=not a.no_install,
                cleartext_network=a.cleartext_network,
            )
            _print_up(root, state)
        elif a.cmd == "add-node":
            gcs = add_node(root, num_cpus=a.num_cpus, resources=a.resources)
            print(f"a Ray node joined {gcs} (token auth). Nodes stop with `{PROG} down`.")
        elif a.cmd == "status":
            bad = 0
            for name, v in check(root).items():
                bad += not v["ok"]
                print(f"{name:<9} {'up' if v['ok'] else 'DOWN':<5} {v['where']}  ({v['detail']})")
            if a.ports:
                print(f"\n{'service':<9} {'process':<22} {'address':<16} port")
                for r in listening_sockets(root):
                    where = "all interfaces" if r["ip"] in ("0.0.0.0", "::") else r["ip"].replace("::ffff:", "")
                    print(f"{r['service']:<9} {r['process'][:22]:<22} {where:<16} {r['port']}")
            return 1 if bad else 0
        else:
            for line in down(root, purge=a.purge):
                print(line)
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _print_up(root: Path, state: dict) -> None:
    creds = root / "credentials.env"
    host, p = state["host"], state["ports"]
    print(
        f"the stack is up ({root}):\n"
        f"  PostgreSQL  {host}:{p['postgres']}   databases mlflow, mlflow_auth, optuna   log {Path(state['pg_base']) / 'postgres.log'}\n"
        f"  MLflow      http://{host}:{p['mlflow']}   PostgreSQL backend, basic auth (user {JOBS_USER})   log {root / 'mlflow.log'}\n"
        f"  Ray head    {host}:{p['gcs']}   Jobs API and dashboard http://{host}:{p['dashboard']}   token auth\n"
        f"credentials: {creds} (mode 0600; the admin passwords are in {root / 'admin.env'})\n"
        f"  load them in a shell:  set -a; . {creds}; set +a\n"
        f"submit a job:            dp-platform submit configs/digits.yaml\n"
        f"note: Ray listens on some internal ports (GCS, raylet, agents) on every interface whatever --host says; they need\n"
        f"  the token, but firewall them on a shared network. `{PROG} status --ports` lists them (deploy/README.md).\n"
        f"stop:                    {PROG} down"
    )
