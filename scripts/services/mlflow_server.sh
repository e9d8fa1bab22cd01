#!/usr/bin/env bash
# A team MLflow tracking server: runs and metrics in PostgreSQL (scripts/services/postgres.sh), artifacts served by
# the server itself (--serve-artifacts) from $QEXP_SERVICES_DIR/artifacts, so jobs on other hosts need only its URL.
#   scripts/services/mlflow_server.sh start   # starts PostgreSQL too; prints the URL to use as tracking.uri
#   scripts/services/mlflow_server.sh stop    # the server only (postgres.sh stop stops the database)
# QEXP_MLFLOW_PORT (default 5077), QEXP_MLFLOW_HOST (default 127.0.0.1; 0.0.0.0 to serve a cluster),
# QEXP_MLFLOW_WORKERS (default 4).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PORT=${QEXP_MLFLOW_PORT:-5077}
HOST=${QEXP_MLFLOW_HOST:-127.0.0.1}
URL="http://127.0.0.1:$PORT"

start() {
  if [ -s "$D/mlflow.pid" ] && kill -0 "$(cat "$D/mlflow.pid")" 2>/dev/null; then echo "$URL"; return 0; fi
  local store
  store=$("$(dirname "$0")/postgres.sh" start)
  # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: no GenAI job consumers (dozens of idle processes)
  # setsid: the server and its workers form one process group, stopped (or killed by a test) together
  # the store URI (with its password) through the environment, not the command line that `ps` shows
  MLFLOW_BACKEND_STORE_URI=$store MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid nohup "$REPO/.venv/bin/mlflow" \
    server --serve-artifacts --artifacts-destination "$D/artifacts" \
    --host "$HOST" --port "$PORT" --workers "${QEXP_MLFLOW_WORKERS:-4}" > "$D/log/mlflow.log" 2>&1 &
  echo $! > "$D/mlflow.pid"
  for _ in $(seq 600); do
    if curl -sf "$URL/health" >/dev/null 2>&1; then
      say "MLflow server on PostgreSQL up at $URL after $(elapsed) s" >&2
      echo "$URL"
      return 0
    fi
    kill -0 "$(cat "$D/mlflow.pid")" 2>/dev/null || die "the MLflow server exited: $(tail -3 "$D/log/mlflow.log" | tr '\n' ' ')"
    sleep 0.5
  done
  die "the MLflow server did not answer at $URL within 300 s (see $D/log/mlflow.log)"
}

case "${1:-}" in
  start) start ;;
  stop) stop_pidfile "$D/mlflow.pid" group ;;
  url) echo "$URL" ;;
  *) die "usage: $0 start|stop|url" ;;
esac
