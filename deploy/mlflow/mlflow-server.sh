#!/usr/bin/env bash
# The team's MLflow tracking server: PostgreSQL backend store, an artifact store, basic auth,
# bound to 127.0.0.1 (put a TLS reverse proxy in front of it to serve other machines).
#
# Every value a site must change is marked "SITE:". Secrets come from the environment, filled
# from your secret store before this runs; this script refuses to start without them:
#   MLFLOW_AUTH_ADMIN_PASSWORD       the admin user's password (basic auth)
#   MLFLOW_FLASK_SERVER_SECRET_KEY   the Flask session key
set -euo pipefail
: "${MLFLOW_AUTH_ADMIN_PASSWORD:?set it from your secret store}"
: "${MLFLOW_FLASK_SERVER_SECRET_KEY:?set it from your secret store}"
here="$(cd "$(dirname "$0")" && pwd)"
export MLFLOW_AUTH_CONFIG_PATH="${MLFLOW_AUTH_CONFIG_PATH:-$here/basic_auth.ini}"
# SITE: the runs database: peer authentication over the unix socket, so no password in the URI
BACKEND="${MLFLOW_BACKEND_STORE_URI:-postgresql+psycopg2://mlflow@/mlflow?host=/var/run/postgresql}"
# SITE: the artifact store (s3://bucket/prefix, gs://..., or a shared path); credentials from the instance role
ARTIFACTS="${MLFLOW_ARTIFACTS_DESTINATION:-file:///srv/mlflow/artifacts}"
exec mlflow server \
  --backend-store-uri "$BACKEND" \
  --artifacts-destination "$ARTIFACTS" \
  --serve-artifacts \
  --app-name basic-auth \
  --host "${MLFLOW_HOST:-127.0.0.1}" \
  --port "${MLFLOW_PORT:-5000}"
