"""One parse of a GGUF file per process, and transformers' GGUF loader made to use it.

gguf's `GGUFReader` builds a numpy view for every part of every metadata field; for SmolLM2's GGUF (49k vocabulary
entries) that takes ~3 s, and a cold load parsed the file five times: the block-size check before any work, then
transformers once per `from_pretrained(..., gguf_file=...)` step (config, the model's config, its weights, the
tokenizer). Its weight loader also rebuilds gguf's tensor-name table once per module of the model (397 times for
SmolLM2). Both measured with py-spy / cProfile on the load stage. The reader memory-maps the file and is only read,
so one instance serves every reader of the same, unchanged file; the name table is a pure function of its arguments.
"""

from __future__ import annotations

import contextlib
import functools
import os

import gguf

# Captured at import, before `transformers_reading_gguf_once` replaces the module attribute for a while.
_PARSE = gguf.GGUFReader


@functools.lru_cache(maxsize=1)  # one file at a time (a sweep over models moves on to the next file)
def _parsed(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return _PARSE(path)


def gguf_reader(path: str) -> gguf.GGUFReader:
    """The parsed file, parsed again only when it changed (size or modification time) or another file was read."""
    real = os.path.realpath(os.path.expanduser(path))
    stat = os.stat(real)
    return _parsed(real, stat.st_size, stat.st_mtime_ns)


def forget() -> None:
    """Drop the parsed file (its memory map) once the model is loaded."""
    _parsed.cache_clear()


@contextlib.contextmanager
def transformers_reading_gguf_once(path: str):
    """Inside this block, transformers' GGUF loader gets this module's one parse of `path`, and one tensor-name table
    per (architecture, layer count).

    A patch of upstream code: transformers' parse site (`load_gguf_checkpoint`) and its weight-name mapping
    (`get_gguf_hf_weights_map`) import `GGUFReader` / `get_tensor_name_map` from the `gguf` module at call time, so
    the module attributes are replaced for the block's duration (other files are parsed as before). Tested by
    tests/test_load.py::test_a_gguf_file_is_parsed_once, which fails if transformers parses some other way; the
    converted folder is byte-identical to the unpatched conversion's (checked when this was written).
    """
    wanted = os.path.realpath(os.path.expanduser(path))
    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(file, *args, **kwargs):
        if not args and not kwargs and os.path.realpath(os.fspath(file)) == wanted:
            return gguf_reader(wanted)
        return parse(file, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map
