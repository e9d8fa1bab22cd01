"""The served store's logins, for its admin (MLFLOW_TRACKING_USERNAME=admin, MLFLOW_TRACKING_PASSWORD from the
file scripts/services/mlflow_server.sh wrote), and the upload of runs spooled while it was away:

    python -m qexp.store user add NAME [--password-file FILE]   # a generated password, written to FILE (owner only)
    python -m qexp.store grant EXPERIMENT NAME read|edit|manage|none
    python -m qexp.store replay [SPOOL]   # runs whose store went away mid-run (default: <repo>/spool)

The store is MLFLOW_TRACKING_URI (or --uri); `replay` defaults to the store each run was in. Every user reads every
experiment and changes the ones they created; `grant` gives another user edit (or manage) on one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qexp.core.errors import QexpError


def main(argv=None) -> int:
    from qexp.tracking.logins import PERMISSIONS, add_user, grant

    parser = argparse.ArgumentParser(prog="python -m qexp.store", description=__doc__.splitlines()[0])
    parser.add_argument("--uri", help="the store (default: MLFLOW_TRACKING_URI; for replay, each run's own store)")
    commands = parser.add_subparsers(dest="command", required=True)
    user = commands.add_parser("user", help="add a user").add_subparsers(dest="action", required=True)
    add = user.add_parser("add", help="create a user with a generated password")
    add.add_argument("name")
    add.add_argument("--password-file", type=Path, help="where the password goes (default: ./NAME.mlflow-password)")
    granted = commands.add_parser("grant", help="give a user a permission on an experiment")
    granted.add_argument("experiment")
    granted.add_argument("name")
    granted.add_argument("permission", choices=PERMISSIONS)
    replayed = commands.add_parser("replay", help="upload the runs spooled while their store was away")
    replayed.add_argument("spool", nargs="?", type=Path, help="a spool folder, or one run's (default: <repo>/spool)")
    args = parser.parse_args(argv)
    if args.command == "replay":
        return _replay(args.spool, args.uri)
    args.uri = args.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not args.uri or not args.uri.startswith(("http://", "https://")):
        print("qexp.store: error: no served store. set MLFLOW_TRACKING_URI (or --uri) to its http(s) URL",
              file=sys.stderr)
        return 2
    try:
        if args.command == "user":
            path = add_user(args.uri, args.name, args.password_file or Path(f"{args.name}.mlflow-password"))
            print(f"qexp.store: user {args.name} added; password in {path} (readable by you only): they log in with "
                  f"MLFLOW_TRACKING_USERNAME={args.name} MLFLOW_TRACKING_PASSWORD=$(cat {path})")
        else:
            experiment_id = grant(args.uri, args.experiment, args.name, args.permission)
            print(f"qexp.store: {args.name} has {args.permission} on {args.experiment} (experiment {experiment_id})")
    except QexpError as exc:
        print(f"qexp.store: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _replay(spool, uri) -> int:
    from qexp.core.provenance import REPO_ROOT
    from qexp.core.redact import redact_text
    from qexp.tracking.spool import pending, replay
    from qexp.tracking.writer import SENDERS

    spool = spool or REPO_ROOT / "spool"
    folders = pending(spool)
    if not folders:
        print(f"qexp.store: nothing to replay in {spool}")
        return 0
    failed = 0
    for folder in folders:
        try:
            print(f"qexp.store: replayed {replay(folder, SENDERS, uri).describe()}")
        except Exception as exc:  # noqa: BLE001 - one line per run; the others still go
            failed += 1
            message = redact_text(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")[:300]
            print(f"qexp.store: error: {folder} not replayed ({message}); it stays for the next replay",
                  file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
