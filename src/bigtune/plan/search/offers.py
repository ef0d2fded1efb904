"""What a run can be given: GPU offers with a price per GPU-hour, for ``bigtune plan --compare-gpus``.

Two sources:

* the GPU catalog with a price table: the bundled defaults (``assets/gpu_prices.yaml``: published
  on-demand list prices, each with its provider and the date it was read) overridden by ``--prices FILE``
  (YAML: GPU name -> price per GPU-hour);
* a cluster profile (``--cluster FILE``): Slurm partitions with their GPU type, GPUs per node, CPU cores
  and RAM per node, wall-time limit and a price or allocation units per GPU-hour.

Bad files raise ``OfferError`` (a PlanError: exit code 2) naming the file, the entry and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from bigtune.core.gpus import CATALOG, GPU, UnknownGPUError, custom_gpu, find_gpu
from bigtune.plan.base.constants import GIB, PlanError

BUNDLED_PRICES = Path(__file__).resolve().parents[2] / "assets" / "gpu_prices.yaml"  # bigtune/assets
CLOUD_GPUS_PER_NODE = 8  # the largest common cloud instance; more GPUs are counted as several nodes


class OfferError(PlanError):
    """A price table or cluster profile that cannot be used as given."""


@dataclass(frozen=True)
class Partition:
    """One Slurm partition of a cluster profile (the host side of an offer)."""

    name: str
    cpus_per_node: int
    mem_per_node_bytes: int
    max_time_s: Optional[int]  # None: no wall-time limit
    max_nodes: int
    gres: str  # the --gres name before the count: "gpu" or "gpu:a100"


@dataclass(frozen=True)
class Offer:
    """A GPU type one can get ``max_gpus`` of, ``gpus_per_node`` to a node, at ``price`` per GPU-hour."""

    name: str  # catalog key, or partition name
    gpu: GPU
    gpus_per_node: int
    max_gpus: int
    price: Optional[float]  # per GPU-hour in ``unit``; None: no price known
    unit: str  # "USD", another currency, or the cluster's allocation units
    price_source: str = ""
    partition: Optional[Partition] = None

    def counts(self) -> list[int]:
        """GPU counts a job can ask for: any within one node, whole nodes beyond it."""
        return [n for n in range(1, self.max_gpus + 1) if n <= self.gpus_per_node or n % self.gpus_per_node == 0]

    def nodes(self, gpus: int) -> int:
        return max(1, -(-gpus // self.gpus_per_node))


@dataclass
class PriceTable:
    prices: dict[str, tuple[float, str]] = field(default_factory=dict)  # GPU key -> (price, source)
    unit: str = "USD"
    label: str = ""  # one line: where the prices come from


def _read_yaml(path: Path, what: str) -> Any:
    if not path.is_file():
        raise OfferError(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise OfferError(f"{what} {path}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None


def _number(value: Any, where: str, key: str = "price") -> float:
    if isinstance(value, dict):
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise OfferError(f"{where}: {key} must be a number ≥ 0 per GPU-hour, got {value!r}")
    return float(value)


def _gpu(name: Any, where: str) -> GPU:
    try:
        return find_gpu(str(name))
    except UnknownGPUError as e:
        raise OfferError(f"{where}: {e}") from None


def load_prices(path: Optional[str] = None) -> PriceTable:
    """The bundled price table, with ``path``'s prices (``GPU: price`` or ``prices: {GPU: price}``) over it.

    A file in another currency (``currency: EUR``) replaces the bundled table instead of mixing currencies.
    """
    raw = _read_yaml(BUNDLED_PRICES, "bundled price table")
    bundled = PriceTable(unit=raw.get("currency", "USD"))
    for key, entry in raw["prices"].items():
        bundled.prices[CATALOG[key].key] = (float(entry["price"]), f"{entry['offer']}, list price read {entry['date']}")
    bundled.label = (
        f"bundled defaults (published on-demand list prices read {raw['taken']}, see {BUNDLED_PRICES.name}); "
        "override with --prices FILE"
    )
    if path is None:
        return bundled
    tree = _read_yaml(Path(path), "--prices file")
    if not isinstance(tree, dict) or not tree:
        raise OfferError(f"--prices file {path}: expected a mapping of GPU name -> price per GPU-hour")
    unit = str(tree.get("currency", "USD"))
    entries = tree.get("prices", {k: v for k, v in tree.items() if k != "currency"})
    if not isinstance(entries, dict):
        raise OfferError(f"--prices file {path}: 'prices' must map GPU names to prices per GPU-hour")
    own = {
        _gpu(k, f"--prices file {path}, entry {k!r}").key: _number(v, f"--prices file {path}, entry {k!r}")
        for k, v in entries.items()
    }
    table = PriceTable(unit=unit) if unit != bundled.unit else PriceTable(dict(bundled.prices), unit)
    table.prices.update({k: (v, f"from {path}") for k, v in own.items()})
    rest = len(table.prices) - len(own)
    table.label = f"{len(own)} from {path}" + (
        f", {rest} bundled defaults (list prices read {raw['taken']})" if rest else ""
    )
    return table


def catalog_offers(names: Optional[list[str]], prices: PriceTable, max_gpus: int) -> list[Offer]:
    """One offer per catalog GPU (or per name in ``names``), up to ``max_gpus``, 8 to a node."""
    gpus = [_gpu(n, "--compare-gpus") for n in names] if names else list(CATALOG.values())
    out = []
    for g in dict.fromkeys(gpus):
        price, source = prices.prices.get(g.key, (None, ""))
        out.append(Offer(g.key, g, CLOUD_GPUS_PER_NODE, max_gpus, price, prices.unit, source))
    return out


_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_slurm_time(text: Any, where: str) -> Optional[int]:
    """Seconds in a Slurm time limit ("MM", "HH:MM:SS", "D-HH", "D-HH:MM:SS"...); None for "UNLIMITED"."""
    s = str(text).strip()
    if s.lower() in ("unlimited", "infinite", "none"):
        return None
    m = _SLURM_TIME.match(s)
    if not m:
        raise OfferError(f"{where}: max_time {text!r} is not a Slurm time (e.g. 48:00:00 or 2-00:00:00)")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is None:  # MM, MM:SS, HH:MM:SS
        parts = [x for x in (a, b, c) if x is not None]
        h, mi, se = (
            ([0] * (3 - len(parts)) + parts) if len(parts) == 3 else (0, parts[0], parts[1] if len(parts) > 1 else 0)
        )
        return h * 3600 + mi * 60 + se
    return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)


def format_slurm_time(seconds: float) -> str:
    """``--time`` text: HH:MM:SS, or D-HH:MM:SS from a day up (rounded up to the minute)."""
    minutes = -(-int(seconds) // 60)
    d, rest = divmod(minutes, 24 * 60)
    h, m = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:00" if d else f"{h:02d}:{m:02d}:00"


_PARTITION_KEYS = {
    "gpu",
    "gpus_per_node",
    "gpu_memory_gib",
    "cpus_per_node",
    "mem_per_node_gib",
    "max_time",
    "max_nodes",
    "gres",
    "price_per_gpu_hour",
    "units_per_gpu_hour",
}


def _partition(name: str, p: Any, where: str) -> tuple[Offer, str]:
    """(offer, "price" or "units") for one partition entry."""
    if not isinstance(p, dict):
        raise OfferError(f"{where}: expected a mapping of keys ({', '.join(sorted(_PARTITION_KEYS))})")
    unknown = set(p) - _PARTITION_KEYS
    missing = {"gpu", "gpus_per_node", "cpus_per_node", "mem_per_node_gib", "max_time"} - set(p)
    if unknown or missing:
        bad = [f"unknown key(s) {sorted(unknown)}" for _ in [0] if unknown] + [
            f"missing {sorted(missing)}" for _ in [0] if missing
        ]
        raise OfferError(f"{where}: {'; '.join(bad)} (keys: {', '.join(sorted(_PARTITION_KEYS))})")
    priced = [k for k in ("price_per_gpu_hour", "units_per_gpu_hour") if k in p]
    if len(priced) != 1:
        raise OfferError(f"{where}: give exactly one of price_per_gpu_hour or units_per_gpu_hour")
    for k in ("gpus_per_node", "cpus_per_node", "max_nodes"):
        if k in p and (isinstance(p[k], bool) or not isinstance(p[k], int) or p[k] < 1):
            raise OfferError(f"{where}: {k} must be a whole number ≥ 1, got {p[k]!r}")
    gpu = _gpu(p["gpu"], f"{where}, gpu")
    if "gpu_memory_gib" in p and abs(_number(p["gpu_memory_gib"], where, "gpu_memory_gib") - gpu.memory_gib) > 0.01:
        gpu = custom_gpu(p["gpu_memory_gib"], gpu)
    host = Partition(
        name,
        p["cpus_per_node"],
        int(_number(p["mem_per_node_gib"], where, "mem_per_node_gib") * GIB),
        parse_slurm_time(p["max_time"], where),
        p.get("max_nodes", 1),
        str(p.get("gres", "gpu")),
    )
    price = _number(p[priced[0]], where, priced[0])
    gpn = p["gpus_per_node"]
    offer = Offer(name, gpu, gpn, gpn * host.max_nodes, price, "", f"partition {name}", host)
    return offer, priced[0]


def load_cluster(path: str, max_gpus: Optional[int] = None) -> tuple[str, list[Offer]]:
    """(cluster name, one offer per partition) from a cluster profile YAML."""
    tree = _read_yaml(Path(path), "--cluster file")
    if not isinstance(tree, dict) or not isinstance(tree.get("partitions"), dict) or not tree["partitions"]:
        raise OfferError(
            f"--cluster file {path}: expected a 'partitions' mapping (name -> GPU type, GPUs per node, ...)"
        )
    offers, kinds = [], set()
    for name, p in tree["partitions"].items():
        offer, kind = _partition(str(name), p, f"--cluster file {path}, partition {name!r}")
        offers.append(offer)
        kinds.add(kind)
    if len(kinds) > 1:
        raise OfferError(
            f"--cluster file {path}: every partition must be priced the same way (all price_per_gpu_hour or all "
            "units_per_gpu_hour), or their costs cannot be compared"
        )
    unit = str(tree.get("currency", "USD")) if kinds == {"price_per_gpu_hour"} else str(tree.get("units", "units"))
    cap = (lambda n: min(n, max_gpus)) if max_gpus else (lambda n: n)
    offers = [
        Offer(o.name, o.gpu, o.gpus_per_node, cap(o.max_gpus), o.price, unit, o.price_source, o.partition)
        for o in offers
    ]
    return str(tree.get("name", Path(path).stem)), offers
