#!/usr/bin/env bash
# System packages the test suite uses beyond Python's: Chromium, for the MLflow UI screenshots (tests/test_ui.py);
# r-cran-janeaustenr, Jane Austen's novels for text=austen (tests/test_text.py; read without R, but apt pulls in
# r-base-core: ~55 MB installed); PostgreSQL and SLURM (slurm-wlm, slurmdbd, munge, MariaDB for slurmdbd) for
# tests/test_cluster.py, which starts them through scripts/services/ (those scripts install them on demand too). Each is installed from Debian's packages when missing and this user can; otherwise
# one line says how, and those tests skip with that reason.
set -uo pipefail

updated=no
# install_debian PACKAGE TESTS: apt-get install PACKAGE, or one line saying that TESTS will skip.
install_debian() {
  local package=$1 tests=$2
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing $package (Debian package) for $tests"
    if ( ([ "$updated" = yes ] || apt-get update -qq) \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package") \
        >"/tmp/qexp-apt-$package.log" 2>&1; then
      updated=yes
      return 0
    fi
    echo "setup: warning: apt-get install $package failed (see /tmp/qexp-apt-$package.log); $tests will skip"
  else
    echo "setup: no $package: $tests will skip (install it: sudo apt-get install $package)"
  fi
}

if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  install_debian chromium "the UI screenshot tests"
fi
if [ ! -f /usr/lib/R/site-library/janeaustenr/data/Rdata.rdb ] \
    && [ ! -f /usr/local/lib/R/site-library/janeaustenr/data/Rdata.rdb ]; then
  install_debian r-cran-janeaustenr "the text=austen tests"
fi
if [ ! -x /usr/lib/postgresql/15/bin/postgres ] && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  install_debian postgresql "the team-store tests"
fi
for pair in slurmctld:slurm-wlm slurmdbd:slurmdbd munged:munge mariadbd:mariadb-server; do
  if ! command -v "${pair%%:*}" >/dev/null 2>&1 && [ ! -x "/usr/sbin/${pair%%:*}" ]; then
    install_debian "${pair#*:}" "the SLURM tests"
  fi
done
exit 0
