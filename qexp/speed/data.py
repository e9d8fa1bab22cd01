"""The published device figures (published.yaml) as objects: SoCs, model shapes, decode and TTFT points, each point
with the bytes its program streams per graph call (qexp/speed/bytes.py)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from qexp.core.errors import ConfigError
from qexp.core.provenance import REPO_ROOT
from qexp.speed.bytes import Shapes, StreamBytes, stream_bytes

DATA_FILE = Path(__file__).with_name("published.yaml")
CONF_QUANT = REPO_ROOT / "conf" / "quant"


@dataclass(frozen=True)
class Soc:
    name: str  # QcomChipset name, e.g. SM8750
    marketing_name: str
    htp_arch: str
    peak_gbs: float  # peak DRAM bandwidth
    relative_compute: float  # the NPU's speed against SM8750's, as Qualcomm states it


@dataclass(frozen=True)
class Point:
    """One published figure: decode tokens/s (ar_len 1) or a TTFT in ms (prefill chunks of ar_len)."""

    metric: str  # decode_tok_s | ttft_ms
    value: float
    model: str
    quant: str
    context: int
    soc: str
    kind: str  # measured | floor
    source: str  # the key of its source in published.yaml
    shapes: Shapes
    bytes_per_call: StreamBytes  # one call of the graph the figure times
    ar_len: int = 1
    prompt: int = 0  # TTFT: prompt tokens
    use: bool = True
    label: str = ""
    why: str = ""
    quote: str = ""  # what the source says of the figure

    @property
    def is_floor(self) -> bool:
        return self.kind == "floor"

    @property
    def name(self) -> str:
        extra = f" [{self.label}]" if self.label else ""
        what = f"TTFT {self.prompt} tok" if self.metric == "ttft_ms" else "decode"
        return f"{self.model} {self.quant}{extra} ctx {self.context} {self.soc} {what} ({self.kind}, {self.source})"


RUNTIMES = ("executorch", "genie")  # the runners the figures were timed with (qexp.speed.model: CallFeatures.genie)


@dataclass(frozen=True)
class Published:
    socs: Dict[str, Soc]
    sources: Dict[str, str]  # key -> reference
    runtimes: Dict[str, str]  # source key -> runtime
    decode: List[Point]
    ttft: List[Point]
    sha256: str  # of the data file: part of the estimate's version
    path: Path

    @property
    def socs_with_figures(self) -> List[str]:
        return socs_with_figures(str(self.path))

    def soc(self, name: str) -> Soc:
        check_soc(name, str(self.path))
        return self.socs[name]


def _load(path: Optional[str]) -> Tuple[Path, str, dict]:
    import yaml

    file = Path(path) if path else DATA_FILE
    text = file.read_text()
    return file, text, yaml.safe_load(text)


@functools.lru_cache(maxsize=None)
def socs_with_figures(path: Optional[str] = None) -> List[str]:
    """The SoCs the estimate is for: those with a fitted decode figure (the others have nothing to check it by)."""
    _, _, data = _load(path)
    return [name for name in data["socs"] if any(e["soc"] == name and e.get("use", True) for e in data["decode"])]


def check_soc(name: str, path: Optional[str] = None) -> None:
    """A ConfigError naming the SoCs with figures, for one without."""
    known = socs_with_figures(path)
    if name not in known:
        raise ConfigError(f"no published HTP speed figures for SoC {name}, so no speed estimate",
                          f"use one of {', '.join(known)}")


@functools.lru_cache(maxsize=None)
def quant_config(name: str):
    """conf/quant/<name>.yaml merged onto the quant schema (what grid_for reads)."""
    from omegaconf import OmegaConf

    from qexp.core.config import QuantConfig

    path = CONF_QUANT / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"published.yaml names quant config {name!r}, not in conf/quant/", "fix the data file")
    return OmegaConf.merge(OmegaConf.structured(QuantConfig), OmegaConf.load(path))


@functools.lru_cache(maxsize=None)
def published(path: Optional[str] = None) -> Published:
    file, text, data = _load(path)
    socs = {name: Soc(name, s["name"], s["htp_arch"], float(s["peak_gbs"]), float(s["relative_compute"]))
            for name, s in data["socs"].items()}
    shapes = {name: Shapes.of(dims) for name, dims in data["architectures"].items()}

    def point(entry: dict, metric: str) -> Point:
        quant = quant_config(entry["quant"])
        ar_len = int(entry.get("ar_len", 1))
        if entry.get("kind") not in ("measured", "floor"):
            raise ConfigError(f"published.yaml: {entry} has kind {entry.get('kind')!r}", "give measured or floor")
        if entry["source"] not in data["sources"] or entry["soc"] not in socs:
            raise ConfigError(f"published.yaml: {entry} names an unknown source or SoC", "fix the data file")
        return Point(metric=metric, value=float(entry["tok_s"] if metric == "decode_tok_s" else entry["ms"]),
                     model=entry["model"], quant=entry["quant"], context=int(entry["context"]), soc=entry["soc"],
                     kind=entry["kind"], source=entry["source"], shapes=shapes[entry["model"]],
                     bytes_per_call=stream_bytes(shapes[entry["model"]], quant, int(entry["context"]), ar_len,
                                                 kv_bits_override=entry.get("kv_bits")),
                     ar_len=ar_len, prompt=int(entry.get("prompt", 0)), use=bool(entry.get("use", True)),
                     label=entry.get("label", ""), why=entry.get("why", ""), quote=entry.get("quote", ""))

    for key, source in data["sources"].items():
        if source.get("runtime") not in RUNTIMES:
            raise ConfigError(f"published.yaml: source {key} has runtime {source.get('runtime')!r}",
                              f"give one of {', '.join(RUNTIMES)}")
    return Published(socs=socs, sources={key: s["ref"] for key, s in data["sources"].items()},
                     runtimes={key: s["runtime"] for key, s in data["sources"].items()},
                     decode=[point(e, "decode_tok_s") for e in data["decode"]],
                     ttft=[point(e, "ttft_ms") for e in data["ttft"]],
                     sha256=hashlib.sha256(text.encode()).hexdigest(), path=file)
