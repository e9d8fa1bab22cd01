"""User-facing errors: one readable line saying what is wrong and how to fix it."""


class QexpError(Exception):
    """An error caused by the user's input or environment. Printed as one line, no traceback."""

    def __init__(self, what: str, fix: str = ""):
        self.what = what
        self.fix = fix
        super().__init__(f"{what}. {fix}".strip() if fix else what)


class ConfigError(QexpError):
    pass


class InputError(QexpError):
    """Missing or unreadable checkpoints, GGUF files, tokenizers, text or calibration data."""


class TrackingError(QexpError):
    pass


class CacheFullError(QexpError):
    """The cache's disk (or the process's file size limit) ran out while an entry was written."""


class CacheLockError(QexpError):
    """Waited longer than cache.lock_timeout_s for a cache entry another job is building."""


def require_file(path: str | None, what: str, fix: str) -> str:
    import os

    if not path:
        raise InputError(f"{what}: no path given", fix)
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise InputError(f"{what} not found: {path}", fix)
    return path


def one_line(exc: BaseException) -> tuple[str, int]:
    """The one terminal line and exit status of a failed command: `qexp: error:` for the user's input or environment
    (exit 2), `qexp: failed:` with where the traceback is for anything else (exit 1). With QEXP_TRACEBACK set, a
    non-qexp error is raised again instead, traceback and all."""
    import os

    from qexp.core.redact import redact_text

    if isinstance(exc, QexpError):
        return redact_text(f"qexp: error: {exc}"), 2
    if os.environ.get("QEXP_TRACEBACK"):
        raise exc
    first = redact_text(str(exc).splitlines()[0]) if str(exc) else ""
    return (f"qexp: failed: {type(exc).__name__}: {first} (traceback: error.txt of the MLflow run, or rerun with "
            "QEXP_TRACEBACK=1)"), 1
