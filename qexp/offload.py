"""The float model's weights held on disk while they are not needed, in place: the same tensor objects before and
after, bit for bit.

The QDQ phase's evaluation runs the calibrated program with its weights dequantized once, a second float copy of the
model's size, while the float model (needed again later: the tasks' FP scorer, the deploy stage's re-export) sits
unused. For a 1B model that is 6 GB held twice. `on_disk` writes the bytes of each storage of the given tensors to an
unlinked temporary file and frees the storage (`resize_(0)`: every tensor and view sharing it, the static llama's conv
weights included, now has no memory, so nothing may read one meanwhile: see below); at exit, normal or not, it
reallocates each storage and reads its bytes back. Nothing else changes: the objects, their views and their ties
are the same.

Weights loaded from safetensors files are private memory maps of the file (the cached HF folder): as long as none
of their pages has been written, the pages are the file's, so they need no copy. `on_disk` hands those pages back
to the kernel (madvise MADV_DONTNEED) and a later read faults them in from the file again, bit for bit, inside the
block too. Only file mappings that /proc/self/smaps shows without a modified (anonymous) page are treated so; on a
mapping with one, the same call would lose the modification.

For the others (resizable storages), torch does not check a storage's size on every read, so the work inside must
not read an offloaded tensor (it would read freed memory and crash the process): every storage it may read is passed
in `keep` (the QDQ phase keeps every tensor its program's graph reads, which includes what the program shares with
the float model, such as norm weights). Storages torch can neither resize nor hand back (e.g. numpy's) and small
ones stay in memory.
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, List, Tuple

import torch

log = logging.getLogger("qexp")

SMALLEST = 1 << 20  # bytes: smaller storages are not worth a file read


def tensors_of(module: torch.nn.Module) -> List[torch.Tensor]:
    """Every tensor a module holds: parameters, buffers and plain tensor attributes (an exported program's
    constants)."""
    from qexp.core.device import tensor_slots

    return [value for _, _, value in tensor_slots(module)]


def tensors_read_by(program: torch.fx.GraphModule) -> List[torch.Tensor]:
    """The tensors a graph module's graph reads: its get_attr constants and the tensors of the modules it calls (not
    every tensor it holds: an exported program keeps the float parameters it was traced from as attributes, and its
    graph, once converted, reads their integer versions)."""
    import operator

    found = []
    for node in program.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(program)
            found += [value] if isinstance(value, torch.Tensor) else tensors_of(value)
        elif node.op == "call_module":
            found += tensors_of(program.get_submodule(node.target))
    return found


def _storages(tensors: Iterable[torch.Tensor], keep: Iterable[torch.Tensor],
              smallest: int) -> List[torch.UntypedStorage]:
    kept = {t.untyped_storage().data_ptr() for t in keep}
    chosen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if tensor.device.type == "cpu" and ptr not in kept and ptr not in chosen and storage.nbytes() >= smallest:
            chosen[ptr] = storage
    return list(chosen.values())


CHUNK = 64 << 20  # bytes copied at a time through a buffer (a numpy view of the storage itself would pin it:
# torch refuses to resize a storage once numpy has seen it)


PAGE = 4096
MADV_DONTNEED = 4


def _clean_file_maps() -> List[Tuple[int, int]]:
    """(start, end) of this process's file-backed mappings none of whose pages has been modified (no anonymous,
    copy-on-write page: /proc/self/smaps), whose pages therefore equal the file's; none off Linux."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    regions, current = [], None
    for line in lines:
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):  # a mapping's header
            current = None
            if len(parts) >= 6 and parts[5].startswith("/"):
                current = tuple(int(x, 16) for x in parts[0].split("-"))
        elif current is not None and parts[:1] == ["Anonymous:"] and parts[1] == "0":
            regions.append(current)
    return regions


def _drop_mapped_pages(storages: List[torch.UntypedStorage]) -> Tuple[int, List[torch.UntypedStorage]]:
    """Hand the pages of storages that lie in clean file mappings back to the kernel; returns (bytes dropped, the
    storages that are not in such mappings)."""
    import ctypes

    regions = _clean_file_maps()
    if not regions:
        return 0, storages
    libc = ctypes.CDLL(None, use_errno=True)
    dropped, others = 0, []
    for storage in storages:
        ptr, size = storage.data_ptr(), storage.nbytes()
        if not any(start <= ptr and ptr + size <= end for start, end in regions):
            others.append(storage)
            continue
        first, last = -(-ptr // PAGE) * PAGE, (ptr + size) // PAGE * PAGE  # whole pages inside the storage
        if last > first and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) == 0:
            dropped += last - first
    return dropped, others


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _write(file, storage: torch.UntypedStorage) -> None:
    data = _bytes(storage)
    for start in range(0, data.numel(), CHUNK):
        file.write(data[start:start + CHUNK].clone().numpy().tobytes())


def _read(file, storage: torch.UntypedStorage) -> None:
    data = _bytes(storage)
    for start in range(0, data.numel(), CHUNK):
        want = min(CHUNK, data.numel() - start)
        chunk = file.read(want)
        if len(chunk) != want:
            raise RuntimeError("the float weights could not be read back (short read)")
        data[start:start + want].copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))


@contextmanager
def on_disk(tensors: Iterable[torch.Tensor], folder: Path, keep: Iterable[torch.Tensor] = (), smallest=None):
    """Within the block, the storages of `tensors` (less those of `keep` and small ones) hold no memory: the pages of
    read-only file mappings are handed back (a read faults them in again), resizable storages are written to an
    unlinked file in `folder` and read back at exit (nothing inside may read those); others stay."""
    from qexp.core.timing import release_memory

    mapped, others = _drop_mapped_pages(_storages(tensors, keep, SMALLEST if smallest is None else smallest))
    storages = [s for s in others if s.resizable()]  # the rest (e.g. numpy's) cannot be freed in place: kept
    folder.mkdir(parents=True, exist_ok=True)
    started, total = time.time(), sum(s.nbytes() for s in storages)
    with tempfile.TemporaryFile(dir=folder, prefix="qexp-offload-") as file:
        saved: List[Tuple[torch.UntypedStorage, int, int]] = []
        try:
            for storage in storages:
                offset, size = file.tell(), storage.nbytes()
                _write(file, storage)
                saved.append((storage, offset, size))
                storage.resize_(0)
            release_memory()
            log.info("float weights out of memory: %.2f GB of file-mapped pages handed back, %.2f GB in %d tensors "
                     "written to disk (%.1f s)", mapped / 1e9, total / 1e9, len(saved), time.time() - started)
            yield
        finally:
            back = time.time()
            for storage, offset, size in saved:
                if storage.nbytes() == size:  # never freed (a failure while writing)
                    continue
                storage.resize_(size)
                file.seek(offset)
                _read(file, storage)
            if saved:
                log.info("float weights back in memory (%.1f s)", time.time() - back)


def float_weights_on_disk(state, program: torch.nn.Module):
    """on_disk for a run's float models (the loaded and the transformed one, their static llamas) while `program` is
    evaluated, keeping every tensor `program`'s graph reads; the file goes in the run's cache folder, under
    `.offload`."""
    tensors = [*state.model.state_dict.values(), *state.deploy_model.state_dict.values()]
    for static in (state.fp_static, state.deploy_static):
        if static is not None:
            tensors += tensors_of(static.module)
    return on_disk(tensors, Path(state.cache.root) / ".offload", keep=tensors_read_by(program))
