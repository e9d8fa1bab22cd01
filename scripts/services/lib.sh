# Shared by the service scripts (sourced): where services keep their state, timing, stopping by PID file, and
# installing a missing Debian package.
# QEXP_SERVICES_DIR: the folder for databases, logs, PID files (default ~/.local/share/qexp/services).
D=${QEXP_SERVICES_DIR:-$HOME/.local/share/qexp/services}
mkdir -p "$D/log"
chmod 755 "$D"
T0=$(date +%s.%N)
elapsed() { echo "$(date +%s.%N) - $T0" | bc; }
say() { echo "services: $*"; }
die() { echo "services: error: $*" >&2; exit 1; }

# running FILE: whether the process in the PID file FILE lives (a zombie, killed and not yet reaped, does not)
running() {
  local p
  [ -s "$1" ] || return 1
  p=$(cat "$1")
  kill -0 "$p" 2>/dev/null && ! grep -qs '^State:[[:space:]]*Z' "/proc/$p/status"
}

# stop_pidfile FILE [group]: stop the process in FILE (TERM, then KILL after 10 s; with `group`, its whole process
# group) and remove FILE. Never by name.
stop_pidfile() {
  local f=$1 p target
  [ -s "$f" ] || return 0
  p=$(cat "$f")
  target=$p
  [ "${2:-}" = group ] && target=-$p
  if kill -TERM -- "$target" 2>/dev/null; then
    for _ in $(seq 100); do kill -0 -- "$target" 2>/dev/null || break; sleep 0.1; done
    kill -0 -- "$target" 2>/dev/null && kill -KILL -- "$target" 2>/dev/null
    say "stopped $(basename "$f" .pid) (pid $p)"
  fi
  rm -f "$f"
}

# need_debian COMMAND PACKAGE...: install PACKAGE(s) from Debian when COMMAND is missing (as root), else fail with how.
need_debian() {
  local cmd=$1; shift
  [ -x "$cmd" ] || command -v "$cmd" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing $* (Debian packages)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@") \
      > "$D/log/apt-$1.log" 2>&1 || die "apt-get install $* failed (see $D/log/apt-$1.log)"
  else
    die "$cmd not found: install it with: sudo apt-get install $*"
  fi
}
