#!/usr/bin/env bash
# A team MLflow tracking server: runs and metrics in PostgreSQL (scripts/services/postgres.sh), artifacts served by
# the server itself (--serve-artifacts) from $QEXP_SERVICES_DIR/artifacts, so jobs on other hosts need only its URL.
#   scripts/services/mlflow_server.sh start   # starts PostgreSQL too; prints the URL to use as tracking.uri
#   scripts/services/mlflow_server.sh stop    # the server only (postgres.sh stop stops the database)
# QEXP_MLFLOW_PORT (default 5077), QEXP_MLFLOW_HOST (the address it listens on: default 127.0.0.1; 0.0.0.0 to serve
# a cluster), QEXP_MLFLOW_WORKERS (default 4). A lab's own PostgreSQL instead of the one postgres.sh starts:
# QEXP_MLFLOW_DATABASE_URI (runs) and QEXP_MLFLOW_AUTH_DATABASE_URI (logins), SQLAlchemy URIs
# (postgresql+psycopg2://USER:PASSWORD@HOST:5432/DB), through the environment: they hold a password.
# Clients on other nodes address the server by a name of this host (http://store-host:5077). MLflow refuses a request
# whose Host header it does not know (its DNS-rebinding guard: 403 "Invalid Host header"), so the server is started
# with --allowed-hosts: every name and address of this host (hostname, hostname -f, hostname -I, the listening
# address, localhost), with and without the port, plus QEXP_MLFLOW_ALLOWED_HOSTS (comma-separated: an alias in the
# cluster's DNS, a load balancer's name). Browsers on those names may call it too (--cors-allowed-origins).
# `url` (and `start`) print the URL clients should use: http://<hostname -f>:PORT when it listens on 0.0.0.0, else
# the listening address.
# Logins (QEXP_MLFLOW_AUTH, default on): MLflow's basic-auth app, its users and permissions in PostgreSQL (database
# mlflowauth), every user reads every experiment and changes only those they own or are granted (default_permission
# READ). The admin's password is generated on the first start into $QEXP_SERVICES_DIR/mlflow-admin-password (owner
# only; user `admin`) and reaches the server through its environment, never a command line, a log or the store.
# Clients log in with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD; `python -m qexp.store user add NAME` and
# `grant EXPERIMENT NAME edit` manage users. QEXP_MLFLOW_AUTH=off serves without logins, on loopback only unless
# QEXP_MLFLOW_TRUSTED_NETWORK=1 says everyone who can reach the port may read and delete every run.
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

AUTH=${QEXP_MLFLOW_AUTH:-on}

# auth_config: the basic-auth app's settings file (owner only: it holds the database URI and its password)
auth_config() {
  (umask 077
   [ -s "$D/mlflow-admin-password" ] || head -c 24 /dev/urandom | base64 | tr -d '/+=' > "$D/mlflow-admin-password"
   # the key the workers sign their CSRF tokens with: one for all workers, kept across restarts
   [ -s "$D/mlflow-secret-key" ] || head -c 32 /dev/urandom | base64 | tr -d '/+=' > "$D/mlflow-secret-key"
   cat > "$D/mlflow-auth.ini" <<INI
[mlflow]
default_permission = READ
database_uri = ${QEXP_MLFLOW_AUTH_DATABASE_URI:-$("$(dirname "$0")/postgres.sh" auth-uri)}
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
# a verified login is remembered for 60 s per worker: checking a password (scrypt) costs ~0.12 s of CPU and a run
# makes ~80 requests; a changed password or a deleted user takes effect at once on the worker that changed it and
# within 60 s on the others (MLflow's own trade-off, off by default)
auth_cache_ttl_seconds = 60
INI
  )
}

start() {
  case "$AUTH" in
    on) ;;
    off) case "$HOST" in
           127.*|localhost|::1) ;;
           *) [ "${QEXP_MLFLOW_TRUSTED_NETWORK:-0}" = 1 ] || die "serving on $HOST without logins is refused: anyone \
who can reach the port could read and delete every run. Keep QEXP_MLFLOW_AUTH=on (the default), or set \
QEXP_MLFLOW_TRUSTED_NETWORK=1 if everyone on that network may" ;;
         esac ;;
    *) die "QEXP_MLFLOW_AUTH=$AUTH: use on (the default) or off" ;;
  esac
  if running "$D/mlflow.pid"; then echo "$URL"; return 0; fi
  local store app=()
  if [ -n "${QEXP_MLFLOW_DATABASE_URI:-}" ]; then  # the lab's own PostgreSQL: none is started here
    [ "$AUTH" = off ] || [ -n "${QEXP_MLFLOW_AUTH_DATABASE_URI:-}" ] || die "QEXP_MLFLOW_DATABASE_URI without \
QEXP_MLFLOW_AUTH_DATABASE_URI: give the database for the logins too (another database on the same server)"
    store=$QEXP_MLFLOW_DATABASE_URI
  else
    store=$("$(dirname "$0")/postgres.sh" start)
  fi
  if [ "$AUTH" = on ]; then
    auth_config
    app=(--app-name basic-auth)
  fi
  # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: no GenAI job consumers (dozens of idle processes)
  # setsid: the server and its workers form one process group, stopped (or killed by a test) together
  # the store URI and the admin password (both secrets) through the environment, not the command line `ps` shows
  MLFLOW_BACKEND_STORE_URI=$store MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_AUTH_CONFIG_PATH="$D/mlflow-auth.ini" \
    MLFLOW_AUTH_ADMIN_PASSWORD=$([ "$AUTH" = on ] && cat "$D/mlflow-admin-password") \
    MLFLOW_FLASK_SERVER_SECRET_KEY=$([ "$AUTH" = on ] && cat "$D/mlflow-secret-key") \
    setsid nohup "$REPO/.venv/bin/mlflow" server "${app[@]}" --serve-artifacts --artifacts-destination "$D/artifacts" \
    --host "$HOST" --port "$PORT" --workers "${QEXP_MLFLOW_WORKERS:-4}" \
    --allowed-hosts "$(host_names)" --cors-allowed-origins "$(origins)" > "$D/log/mlflow.log" 2>&1 &
  echo $! > "$D/mlflow.pid"
  for _ in $(seq 600); do
    if curl -sf "$LOCAL/health" >/dev/null 2>&1; then
      say "MLflow server on PostgreSQL up at $URL after $(elapsed) s" >&2
      [ "$AUTH" = on ] && say "logins on: user admin, password in $D/mlflow-admin-password; add users with" \
        "python -m qexp.store user add NAME (docs/cluster.md)" >&2
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
