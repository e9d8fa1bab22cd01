"""Logins on a served store (MLflow's basic-auth app, which scripts/services/mlflow_server.sh turns on): what a
refused client is told, and the admin's user and permission commands (`python -m qexp.store`).

Clients log in the way MLflow reads it, through MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in the
environment: nothing of qexp's config holds a password, so none reaches params, tags, artifacts or a SLURM script.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from qexp.core.errors import TrackingError
from qexp.core.redact import redact_text

PERMISSIONS = ("read", "edit", "manage", "none")  # MLflow's READ, EDIT, MANAGE, NO_PERMISSIONS


def raise_if_refused(uri: str, exc: BaseException, wanted: str) -> None:
    """A store that refused this client's login or its permission: one line naming the user (never the password)
    and how to fix it. Anything else is left to the caller."""
    code = getattr(exc, "error_code", "")
    if code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    who = f"user {user!r}" if user else "a client without a login (MLFLOW_TRACKING_USERNAME unset)"
    if code == "UNAUTHENTICATED":
        raise TrackingError(f"the store at {redact_text(uri)} refused {who}: not logged in (no or wrong password)",
                            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to your login on that "
                            "store (its admin adds users: python -m qexp.store user add NAME)") from None
    raise TrackingError(f"the store at {redact_text(uri)} refused {who}: no permission to {wanted}",
                        "ask the experiment's owner or the store's admin to grant it (python -m qexp.store grant "
                        f"EXPERIMENT {user or 'NAME'} edit), or use another tracking.experiment") from None


def _client(uri: str):
    import warnings

    with warnings.catch_warnings():  # MLflow's server package imports a starlette module deprecated upstream
        warnings.simplefilter("ignore")
        from mlflow.server.auth.client import AuthServiceClient
    return AuthServiceClient(uri)


def _admin_call(uri: str, what: str, call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the server's refusal or error, in one line
        raise_if_refused(uri, exc, what)
        raise TrackingError(f"the store at {redact_text(uri)} could not {what}: {str(exc).splitlines()[0][:200]}",
                            "check the name and that the store runs with logins (docs/cluster.md)") from exc


def add_user(uri: str, name: str, password_file: Path) -> Path:
    """Create `name` with a generated password, written to `password_file` (created, owner only, never
    overwritten): the admin hands it over; the password is printed nowhere."""
    if password_file.exists():
        raise TrackingError(f"{password_file} exists", "choose another --password-file, or remove it first")
    password = secrets.token_urlsafe(18)
    _admin_call(uri, f"add user {name!r}", lambda: _client(uri).create_user(name, password))
    fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    return password_file


def grant(uri: str, experiment: str, name: str, permission: str) -> str:
    """Give `name` `permission` on the experiment called `experiment`; returns its id."""
    import mlflow

    if permission not in PERMISSIONS:
        raise TrackingError(f"permission {permission!r}", f"use one of {', '.join(PERMISSIONS)}")
    found = _admin_call(uri, f"read experiment {experiment!r}",
                        lambda: mlflow.tracking.MlflowClient(uri).get_experiment_by_name(experiment))
    if found is None:
        raise TrackingError(f"no experiment {experiment!r} on {redact_text(uri)}", "check its name in the UI")
    level = {"none": "NO_PERMISSIONS"}.get(permission, permission.upper())
    _admin_call(uri, f"grant {name!r} {permission} on {experiment!r}", lambda: _client(uri).grant_user_permission(
        name, "experiment", found.experiment_id, level))
    return found.experiment_id
