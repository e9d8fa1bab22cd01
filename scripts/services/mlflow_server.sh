#!/usr/bin/env bash
# A team MLflow tracking server: runs and metrics in PostgreSQL (scripts/services/postgres.sh), artifacts served by
# the server itself (--serve-artifacts) from $QEXP_SERVICES_DIR/artifacts, so jobs on other hosts need only its URL.
#   scripts/services/mlflow_server.sh start   # starts PostgreSQL too; prints the URL to use as tracking.uri
#   scripts/services/mlflow_server.sh stop    # the server only (postgres.sh stop stops the database)
# QEXP_MLFLOW_PORT (default 5077), QEXP_MLFLOW_HOST (the address it listens on: default 127.0.0.1; 0.0.0.0 to serve
# a cluster), QEXP_MLFLOW_WORKERS (default 4).
# Clients on other nodes address the server by a name of this host (http://store-host:5077). MLflow refuses a request
# whose Host header it does not know (its DNS-rebinding guard: 403 "Invalid Host header"), so the server is started
# with --allowed-hosts: every name and address of this host (hostname, hostname -f, hostname -I, the listening
# address, localhost), with and without the port, plus QEXP_MLFLOW_ALLOWED_HOSTS (comma-separated: an alias in the
# cluster's DNS, a load balancer's name). Browsers on those names may call it too (--cors-allowed-origins).
# `url` (and `start`) print the URL clients should use: http://<hostname -f>:PORT when it listens on 0.0.0.0, else
# the listening address.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PORT=${QEXP_MLFLOW_PORT:-5077}
HOST=${QEXP_MLFLOW_HOST:-127.0.0.1}
if [ "$HOST" = 0.0.0.0 ]; then
  URL="http://$(hostname -f 2>/dev/null || hostname):$PORT"
  LOCAL="http://127.0.0.1:$PORT"  # the health check, from this host
else
  URL="http://$HOST:$PORT"
  LOCAL=$URL
fi

# host_names: the Host headers the server accepts (comma-separated), each name with and without the port
host_names() {
  local names name out=""
  names="localhost 127.0.0.1 $HOST $(hostname 2>/dev/null) $(hostname -f 2>/dev/null) $(hostname -I 2>/dev/null)"
  names="$names $(echo "${QEXP_MLFLOW_ALLOWED_HOSTS:-}" | tr ',' ' ')"
  for name in $names; do
    [ "$name" = 0.0.0.0 ] && continue
    case "$name" in *:*) name="[$name]" ;; esac  # an IPv6 address, as a Host header writes it
    case ",$out," in *",$name,"*) continue ;; esac
    out="$out,$name,$name:$PORT"
  done
  echo "${out#,}"
}

# origins: the browser origins allowed to call the API (http://NAME:PORT for each accepted name)
origins() {
  host_names | tr ',' '\n' | grep ":$PORT$" | sed 's|^|http://|' | paste -sd, -
}

start() {
  if [ -s "$D/mlflow.pid" ] && kill -0 "$(cat "$D/mlflow.pid")" 2>/dev/null; then echo "$URL"; return 0; fi
  local store
  store=$("$(dirname "$0")/postgres.sh" start)
  # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: no GenAI job consumers (dozens of idle processes)
  # setsid: the server and its workers form one process group, stopped (or killed by a test) together
  # the store URI (with its password) through the environment, not the command line that `ps` shows
  MLFLOW_BACKEND_STORE_URI=$store MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid nohup "$REPO/.venv/bin/mlflow" \
    server --serve-artifacts --artifacts-destination "$D/artifacts" \
    --host "$HOST" --port "$PORT" --workers "${QEXP_MLFLOW_WORKERS:-4}" \
    --allowed-hosts "$(host_names)" --cors-allowed-origins "$(origins)" > "$D/log/mlflow.log" 2>&1 &
  echo $! > "$D/mlflow.pid"
  for _ in $(seq 600); do
    if curl -sf "$LOCAL/health" >/dev/null 2>&1; then
      say "MLflow server on PostgreSQL up at $URL after $(elapsed) s" >&2
      echo "$URL"
      return 0
    fi
    kill -0 "$(cat "$D/mlflow.pid")" 2>/dev/null || die "the MLflow server exited: $(tail -3 "$D/log/mlflow.log" | tr '\n' ' ')"
    sleep 0.5
  done
  die "the MLflow server did not answer at $LOCAL within 300 s (see $D/log/mlflow.log)"
}

case "${1:-}" in
  start) start ;;
  stop) stop_pidfile "$D/mlflow.pid" group ;;
  url) echo "$URL" ;;
  *) die "usage: $0 start|stop|url" ;;
esac
