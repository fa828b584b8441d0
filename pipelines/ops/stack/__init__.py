"""``dp-platform stack``: the platform's services on this machine. PostgreSQL, MLflow and the
Ray Jobs API listen on 127.0.0.1; Ray itself listens on some internal ports on every interface
whatever it is told (`stack status --ports` lists them; see deploy/README.md), and those need
the token.

    dp-platform stack up        PostgreSQL (installed from Debian's packages if missing), an
                                MLflow server on it with basic auth, a Ray head with token auth
    dp-platform stack add-node  one more Ray node (``ray start --address``) joining the head
    dp-platform stack status    what runs, where
    dp-platform stack down      stop everything (the databases and artifacts stay; --purge removes them)

Secrets are generated here, written only to files of mode 0600 in the stack folder, and passed
to the services through their environment (never on a command line, which ``ps`` shows):

* ``credentials.env``: what a user or a job needs (the MLflow address and the ``dp-jobs``
  user, the Ray Jobs address and token file, the Optuna storage URL without its password,
  the PostgreSQL password file). ``set -a; . credentials.env; set +a`` loads it in a shell.
* ``admin.env``: the PostgreSQL roles' passwords, the MLflow admin's, and the MLflow server's
  Flask key. Only ``stack`` reads it, but jobs run as the user who started the stack, so
  whoever can submit a job can read this folder: on this machine the Ray token is admin access.

Ray nodes are started with the job credentials in their environment, so a job submitted
through the Jobs API inherits them from the node: no credential travels in a job's
runtime_env, its entrypoint, or MLflow's params and tags.
"""

from .cli import main
from .commands import check, down, listening_sockets, stack_processes, up
from .common import DEFAULT_PORTS, StackError, default_dir, free_port, load_state, port_in_use, read_env_file
from .ray_node import add_node, node_env

__all__ = [
    "DEFAULT_PORTS", "StackError", "add_node", "check", "default_dir", "down", "free_port", "listening_sockets",
    "load_state", "main", "node_env", "port_in_use", "read_env_file", "stack_processes", "up",
]  # fmt: skip
