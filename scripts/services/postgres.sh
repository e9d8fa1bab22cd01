#!/usr/bin/env bash
# A PostgreSQL server for a team MLflow store, on loopback, without systemd (Debian's postgresql, started by
# pg_ctl). Its data, socket and log live in $QEXP_SERVICES_DIR/pg*; a role `mlflow` and its databases `mlflowdb`
# (runs) and `mlflowauth` (the MLflow server's users and permissions) are created once, with a random password kept
# in $QEXP_SERVICES_DIR/pg-password (readable by its owner only).
#   scripts/services/postgres.sh start   # prints the store URI (postgresql+psycopg2://...)
#   scripts/services/postgres.sh uri | auth-uri | stop | status
# QEXP_PG_PORT: its port (default 54329).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
PORT=${QEXP_PG_PORT:-54329}
pgbin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
# postgres refuses to run as root: as root it runs as the postgres user, otherwise as this user
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
uri() { echo "postgresql+psycopg2://mlflow:$(cat "$D/pg-password")@127.0.0.1:$PORT/${1:-mlflowdb}"; }

start() {
  [ -n "$(pgbin)" ] || need_debian /usr/lib/postgresql/15/bin/postgres postgresql
  local bin; bin=$(pgbin)
  [ -x "$bin/postgres" ] || die "no PostgreSQL server binaries under /usr/lib/postgresql (sudo apt-get install postgresql)"
  mkdir -p "$D/pg" "$D/pgsock"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$D/pg" "$D/pgsock" "$D/log"
  chmod 700 "$D/pg"
  if [ ! -s "$D/pg/PG_VERSION" ]; then
    as_pg "$bin/initdb -D '$D/pg' -U postgres --auth-local=trust --auth-host=scram-sha-256 -E UTF8" \
      > "$D/log/initdb.log" 2>&1 || die "initdb failed (see $D/log/initdb.log)"
  fi
  if ! as_pg "$bin/pg_ctl -D '$D/pg' status" >/dev/null 2>&1; then
    # max_connections: every MLflow server worker keeps a pool (SQLAlchemy: 5 + 10 overflow)
    as_pg "$bin/pg_ctl -D '$D/pg' -l '$D/log/postgres.log' -w -t 60 start \
      -o \"-p $PORT -k '$D/pgsock' -c listen_addresses=127.0.0.1 -c max_connections=300\"" >/dev/null \
      || die "PostgreSQL did not start (see $D/log/postgres.log)"
  fi
  [ -s "$D/pg-password" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$D/pg-password")
  as_pg "psql -q -h '$D/pgsock' -p $PORT -U postgres -v ON_ERROR_STOP=1" >/dev/null <<SQL
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mlflow') THEN CREATE ROLE mlflow LOGIN; END IF;
END \$\$;
ALTER ROLE mlflow PASSWORD '$(cat "$D/pg-password")';
SELECT 'CREATE DATABASE mlflowdb OWNER mlflow' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mlflowdb')\gexec
SELECT 'CREATE DATABASE mlflowauth OWNER mlflow' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mlflowauth')\gexec
SQL
  say "PostgreSQL up on 127.0.0.1:$PORT after $(elapsed) s" >&2
  uri
}

stop() {
  local bin; bin=$(pgbin)
  if [ -n "$bin" ] && [ -s "$D/pg/postmaster.pid" ]; then
    as_pg "$bin/pg_ctl -D '$D/pg' -m fast -w stop" >/dev/null && say "stopped PostgreSQL"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  uri) uri ;;
  auth-uri) uri mlflowauth ;;
  status) as_pg "$(pgbin)/pg_ctl -D '$D/pg' status" ;;
  *) die "usage: $0 start|stop|uri|status" ;;
esac
