"""QNN's compile-time performance estimates of an HTP graph: simulated accelerator cycles, with bounds.

HTP's graph preparation simulates the graph it has scheduled and reports, per graph, the accelerator cycles of one
call (with a lower and an upper estimate), the DRAM fill and spill bytes of its inputs, intermediates and outputs,
and how many ops it had no cost for. This QNN build computes them only for SoC SA8797 (Hexagon v81; every phone SoC
logs "Performance Estimates unsupported on soc"), and only when the compile spec asks for detailed profiling.

ExecuTorch passes its profile handle to QNN's graphFinalize but reads profile events only after an execute, so the
estimates are dropped. `install` wraps the graphFinalize entry of libQnnHtp.so's interface table (a ctypes patch,
in place, before ExecuTorch creates its backend) with a function that calls the real one and then walks the profile
handle's events; `collected` yields what the finalizes meanwhile reported, one dict per finalized graph.

Layout (QNN API 2.x, QnnInterface.h): QnnInterface_t = {uint32 backendId; const char* providerName;
Qnn_ApiVersion_t (6 x uint32); function table}, the table at offset 40. Slots: 3 backendGetApiVersion,
19 graphFinalize, 30 profileGetEvents, 31 profileGetSubEvents, 32 profileGetEventData. The layout is checked at
install (getApiVersion must return the struct's version); a mismatch leaves the library untouched.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from typing import Dict, Iterator, List, Optional

log = logging.getLogger(__name__)

SOCS = ("SA8797",)  # where this QNN build simulates a graph's cycles
PROFILE_LEVEL = 2  # "detailed": the level at which HTP's prepare attaches its performance estimates

# profile event identifiers -> the keys qexp logs (htp_sim_<key>_<graph>)
EVENTS = {
    "Simulated (Accelerator exec cycles)": "cycles",
    "Simulated (Accelerator exec cycles (lower estimate))": "cycles_lower",
    "Simulated (Accelerator exec cycles (upper estimate))": "cycles_upper",
    "Input Fill": "input_fill_bytes",
    "Intermediate Fill": "intermediate_fill_bytes",
    "Intermediate Spill": "intermediate_spill_bytes",
    "Output Spill": "output_spill_bytes",
    "Missing Ops (Number of Ops with no Costs associated)": "missing_ops",
}
_START = "Performance Estimates"

_TABLE_OFFSET, _VERSION_OFFSET = 40, 16
_GET_API_VERSION, _GRAPH_FINALIZE, _GET_EVENTS, _GET_SUB_EVENTS, _GET_EVENT_DATA = 3, 19, 30, 31, 32


class _EventData(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("unit", ctypes.c_uint32), ("value", ctypes.c_uint64),
                ("identifier", ctypes.c_char_p)]


_FINALIZE = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_GET_EVENTS_T = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)),
                                 ctypes.POINTER(ctypes.c_uint32))
_GET_SUB_T = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)),
                              ctypes.POINTER(ctypes.c_uint32))
_GET_DATA_T = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(_EventData))

_finalized: List[List[tuple]] = []  # per graphFinalize call: its (identifier, value) events, depth-first
_installed: dict = {}  # library path -> what must stay alive (the callback, the real function)


def install(lib_path: str) -> bool:
    """Wrap libQnnHtp.so's graphFinalize so that its profile events are kept (once per process); False, with a
    warning, where the library's interface table is not laid out as expected."""
    if lib_path in _installed:
        return True
    lib = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)
    providers, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_uint32()
    if lib.QnnInterface_getProviders(ctypes.byref(providers), ctypes.byref(count)) != 0 or not count.value:
        log.warning("QNN simulated cycles unavailable: libQnnHtp.so lists no interface provider")
        return False
    table = providers[0] + _TABLE_OFFSET

    def slot(i):
        return ctypes.c_void_p.from_address(table + 8 * i)

    expected = list((ctypes.c_uint32 * 6).from_address(providers[0] + _VERSION_OFFSET))
    got = (ctypes.c_uint32 * 6)()
    ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)(slot(_GET_API_VERSION).value)(ctypes.addressof(got))
    if list(got) != expected:
        log.warning("QNN simulated cycles unavailable: libQnnHtp.so's interface table is not laid out as QNN API "
                    "2.x (getApiVersion %s, table %s)", list(got), expected)
        return False
    get_events, get_sub = _GET_EVENTS_T(slot(_GET_EVENTS).value), _GET_SUB_T(slot(_GET_SUB_EVENTS).value)
    get_data, real_finalize = _GET_DATA_T(slot(_GET_EVENT_DATA).value), _FINALIZE(slot(_GRAPH_FINALIZE).value)

    def walk(ids, n: int, into: list) -> None:
        for k in range(n):
            data = _EventData()
            if get_data(ids[k], ctypes.byref(data)) != 0:
                continue
            into.append(((data.identifier or b"").decode(errors="replace"), int(data.value)))
            sub, m = ctypes.POINTER(ctypes.c_uint64)(), ctypes.c_uint32()
            if get_sub(ids[k], ctypes.byref(sub), ctypes.byref(m)) == 0 and m.value:
                walk(sub, m.value, into)

    def finalize(graph, profile, signal):
        rc = real_finalize(graph, profile, signal)
        events: list = []
        if profile:
            ids, n = ctypes.POINTER(ctypes.c_uint64)(), ctypes.c_uint32()
            if get_events(profile, ctypes.byref(ids), ctypes.byref(n)) == 0:
                walk(ids, n.value, events)
        _finalized.append(events)
        return rc

    callback = _FINALIZE(finalize)
    page = table & ~(mmap.PAGESIZE - 1)
    if ctypes.CDLL(None).mprotect(ctypes.c_void_p(page), ctypes.c_size_t(2 * mmap.PAGESIZE), 7) != 0:
        log.warning("QNN simulated cycles unavailable: the interface table's page cannot be made writable")
        return False
    slot(_GRAPH_FINALIZE).value = ctypes.cast(callback, ctypes.c_void_p).value
    _installed[lib_path] = (callback, real_finalize, lib)
    return True


def estimates(events: List[tuple]) -> Optional[Dict[str, int]]:
    """One finalize's performance estimates (EVENTS' keys), or None where it reported none."""
    if not any(name == _START for name, _ in events):
        return None
    out: Dict[str, int] = {}
    for name, value in events[[n for n, _ in events].index(_START):]:
        key = EVENTS.get(name)
        if key and key not in out:
            out[key] = value
    return out if "cycles" in out else None


def total(per_finalize: List[Optional[Dict[str, int]]]) -> Optional[Dict[str, int]]:
    """A graph's estimates summed over its finalizes (one per QNN context when sharded; the contexts run one after
    the other), or None unless every finalize reported them."""
    if not per_finalize or any(e is None for e in per_finalize):
        return None
    return {key: sum(e[key] for e in per_finalize) for key in per_finalize[0]}


@contextlib.contextmanager
def collected() -> Iterator[List[Optional[Dict[str, int]]]]:
    """The estimates of every graph finalized meanwhile, in order (None for a graph without them)."""
    start = len(_finalized)
    out: List[Optional[Dict[str, int]]] = []
    try:
        yield out
    finally:
        out.extend(estimates(events) for events in _finalized[start:])
        del _finalized[start:]
