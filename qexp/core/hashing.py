"""Stable hashes: the cache keys and the config hashes are built from these, so they must not change."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hash of a JSON-able object, independent of dict order."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]
