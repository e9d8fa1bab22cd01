"""The cache heals (a missing, truncated or corrupt entry is quarantined and rebuilt, and the run succeeds with the
same numbers), records who used each entry, and is bounded (`python -m qexp.cache`, `cache.max_gb`)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from helpers import TINY
from qexp.cache import MANIFEST, USES, Cache
from qexp.cache.__main__ import main as cache_cli
from qexp.cache.usage import entries, prune
from qexp.core.errors import CacheFullError


def _builder(calls):
    def build(tmp):
        calls.append(1)
        (tmp / "weights.bin").write_bytes(os.urandom(4096))
        (tmp / "sub").mkdir()
        (tmp / "sub" / "meta.json").write_text('{"a": 1}')
        return {"built": len(calls)}

    return build


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _corrupt, os.remove], ids=["truncated", "corrupt", "missing"])
@pytest.mark.parametrize("name", ["weights.bin", "sub/meta.json"])
def test_a_damaged_entry_is_quarantined_and_rebuilt(tmp_path, caplog, damage, name):
    cache, calls = Cache(tmp_path / "cache"), []
    path, hit = cache.get_or_build("kind", "key", _builder(calls))
    assert not hit and cache.get_or_build("kind", "key", _builder(calls)) == (path, True) and len(calls) == 1
    damage(path / name)
    with caplog.at_level(logging.WARNING, logger="qexp"):
        again, hit = cache.get_or_build("kind", "key", _builder(calls))
    assert (again, hit) == (path, False) and len(calls) == 2  # rebuilt, same place
    assert "is damaged" in caplog.text and name in caplog.text
    assert len(list((tmp_path / "cache" / ".quarantine").iterdir())) == 1
    assert cache.get_or_build("kind", "key", _builder(calls))[1]  # the rebuilt entry is whole


def test_an_entry_from_before_manifests_is_trusted_once_and_then_checked(tmp_path):
    cache, calls = Cache(tmp_path), []
    path, _ = cache.get_or_build("kind", "key", _builder(calls))
    (path / MANIFEST).unlink()
    assert cache.get_or_build("kind", "key", _builder(calls))[1] and (path / MANIFEST).exists()
    _truncate(path / "weights.bin")
    assert not cache.get_or_build("kind", "key", _builder(calls))[1]


def test_a_failed_build_leaves_nothing_that_looks_valid(tmp_path):
    cache = Cache(tmp_path)

    def full_disk(tmp):
        (tmp / "half.bin").write_bytes(b"x" * 100)
        raise OSError(28, "No space left on device")

    with pytest.raises(CacheFullError, match="no room to write the kind cache entry"):
        cache.get_or_build("kind", "key", full_disk)
    assert not cache.has("kind", "key") and not [p for p in (tmp_path / "kind").iterdir() if p.is_dir()]


def test_uses_list_and_prune(tmp_path, capsys):
    cache, calls = Cache(tmp_path), []
    for key, run in (("old", "run-a"), ("new", "run-b")):
        cache.run_id = run
        cache.get_or_build("kind", key, _builder(calls))
    uses = [json.loads(line) for line in (cache.path("kind", "new") / USES).read_text().splitlines()]
    assert [u["run_id"] for u in uses] == ["run-b"]
    assert cache_cli(["--dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert "old" in out and "run-b" in out and "2 entries" in out
    # Bounded: the least recently used goes first, never an entry the current run used.
    removed = prune(tmp_path, max_bytes=1, keep_run="run-b")
    assert [e.key for e in removed] == ["old"] and [e.key for e in entries(tmp_path)] == ["new"]
    assert cache_cli(["--dir", str(tmp_path), "prune", "--max-gb", "0"]) == 0 and not entries(tmp_path)
    assert cache_cli(["--dir", str(tmp_path), "prune"]) == 2  # says what it needs


def test_every_kind_of_entry_of_a_run_heals(compose, tmp_path):
    """Truncate one file of every entry a tiny run built (model, text, FP eval, QDQ program), corrupt them again
    after, and re-run: each time the run succeeds with the same numbers and every entry is rebuilt."""
    from qexp.pipeline import run_experiment

    cfg = compose(TINY + ["quant=16a4w"])
    cfg.cache_dir = str(tmp_path)
    first = run_experiment(cfg).metrics
    kinds, n_entries = sorted({e.kind for e in entries(tmp_path)}), len(entries(tmp_path))
    assert {"tiny", "text", "eval", "qdq"} <= set(kinds), kinds
    for damage in (_truncate, _corrupt):
        for entry in entries(tmp_path):
            biggest = max((p for p in entry.path.rglob("*") if p.is_file() and not p.is_symlink()
                           and p.name not in (MANIFEST, USES, ".complete")), key=lambda p: p.stat().st_size)
            damage(biggest)
        again = run_experiment(cfg).metrics
        for name in ("ppl_fp", "ppl_qdq"):
            assert again[name] == first[name], (damage.__name__, name)
    assert len(list((tmp_path / ".quarantine").iterdir())) == 2 * n_entries
    assert cache_cli(["--dir", str(tmp_path), "verify"]) == 0


def test_cache_max_gb_bounds_the_cache_after_a_run(compose, tmp_path):
    from qexp.pipeline import run_experiment

    Cache(tmp_path).get_or_build("stale", "entry", lambda tmp: (tmp / "x.bin").write_bytes(b"x" * 4096) and None)
    cfg = compose(TINY + ["quant=16a8w", "cache.max_gb=1e-9"])
    cfg.cache_dir = str(tmp_path)
    result = run_experiment(cfg)
    kinds = {e.kind for e in entries(tmp_path)}
    assert "stale" not in kinds and "qdq" in kinds  # what the run used stays
    assert all(result.run_id in e.runs for e in entries(tmp_path))
