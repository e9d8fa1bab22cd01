"""The QNN libraries the HTP backend needs, without a QNN SDK install.

A user's SDK (QNN_SDK_ROOT set and non-empty) wins. Otherwise qexp builds the SDK-root layout ExecuTorch expects
($QNN_SDK_ROOT/lib/x86_64-linux-clang/) in its cache, as symlinks to the x86_64 libraries bundled in the
`onnxruntime-qnn==2.5.0` wheel (QNN 2.49; 2.3, 2.4, 2.6 and 2.7 fail at backend init with executorch 1.5.1), points
QNN_SDK_ROOT at it, and loads the libraries into the process so a delegated .pte can run.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from qexp.cache import Cache, stable_hash
from qexp.core.errors import QexpError

log = logging.getLogger("qexp")

LIB_SUBDIR = Path("lib") / "x86_64-linux-clang"
REQUIRED_LIBS = ("libQnnHtp.so", "libQnnSystem.so", "libQnnHtpPrepare.so")
WHEEL = "onnxruntime-qnn"
WHEEL_VERSION = "2.5.0"
INSTALL_HINT = f"run `make setup` (installs {WHEEL}=={WHEEL_VERSION} with --no-deps) or set QNN_SDK_ROOT to a QNN SDK"


class QnnLibrariesMissing(QexpError):
    pass


@dataclass
class QnnSdk:
    root: Path
    source: str  # "user" (QNN_SDK_ROOT) or "onnxruntime-qnn <version>"

    @property
    def lib_dir(self) -> Path:
        return self.root / LIB_SUBDIR

    @property
    def version(self) -> str:
        """What to log as the QNN library version."""
        try:
            from executorch.backends.qualcomm.utils.check_qnn_version import get_sdk_build_id

            return f"{self.source}; build {get_sdk_build_id()}"
        except Exception:  # noqa: BLE001 - the build id is informative only
            return self.source


_loaded: QnnSdk | None = None


def ensure_qnn_sdk(cache: Cache) -> QnnSdk:
    """Find or build the SDK root, export QNN_SDK_ROOT and load the libraries. Idempotent."""
    global _loaded
    if _loaded is not None:
        return _loaded
    user_root = os.environ.get("QNN_SDK_ROOT")
    if user_root:
        sdk = QnnSdk(Path(user_root), "user")
    else:
        sdk = _wheel_sdk_root(cache)
        os.environ["QNN_SDK_ROOT"] = str(sdk.root)
    missing = [name for name in REQUIRED_LIBS if not (sdk.lib_dir / name).exists()]
    if missing:
        raise QnnLibrariesMissing(f"QNN libraries missing in {sdk.lib_dir}: {', '.join(missing)}", INSTALL_HINT)
    # The .pte loader dlopens these by name: they must be in the process before the first HTP .pte loads
    # (setting LD_LIBRARY_PATH now would be too late for this process).
    for name in ("libQnnSystem.so", "libQnnHtp.so"):
        try:
            ctypes.CDLL(str(sdk.lib_dir / name), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise QnnLibrariesMissing(f"cannot load {sdk.lib_dir / name}: {exc}", INSTALL_HINT) from exc
    log.info("QNN libraries: %s (%s)", sdk.lib_dir, sdk.source)
    _loaded = sdk
    return sdk


def _wheel_sdk_root(cache: Cache) -> QnnSdk:
    spec = importlib.util.find_spec("onnxruntime_qnn")  # not imported: only its .so files are used
    if spec is None or not spec.submodule_search_locations:
        raise QnnLibrariesMissing("the QNN libraries are not installed", INSTALL_HINT)
    version = metadata.version(WHEEL)
    if version != WHEEL_VERSION:
        raise QnnLibrariesMissing(
            f"{WHEEL} {version} is installed; only {WHEEL_VERSION} works with executorch 1.5.1",
            f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}",
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    runtime_dir = package_dir.parent / "onnxruntime_qnn.libs"  # the C++ runtime the libraries link against

    def build(tmp: Path) -> dict:
        lib_dir = tmp / LIB_SUBDIR
        lib_dir.mkdir(parents=True)
        sources = sorted(package_dir.glob("lib*.so")) + sorted(runtime_dir.glob("*"))
        for source in sources:
            (lib_dir / source.name).symlink_to(source)
        # ExecuTorch looks for the HTP preparation library under the SDK's name.
        (lib_dir / "libQnnHtpPrepare.so").symlink_to(package_dir / "libHtpPrepare.so")
        return {"package_dir": str(package_dir), "version": version}

    key = stable_hash({"wheel": WHEEL, "version": version, "dir": str(package_dir)})
    root, _ = cache.get_or_build("qnn_sdk", key, build)
    return QnnSdk(root, f"{WHEEL} {version}")
