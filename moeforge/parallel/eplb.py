"""Expert Parallelism Load Balancer (EPLB): where each MoE layer's experts live on the expert-parallel ranks.

DeepSeek's published algorithm, implemented from its description. Given the measured load of every logical
expert (``load`` [L, E]: routed tokens per MoE layer and expert), ``N`` ranks, ``R`` redundant slots (``E + R``
physical slots, ``(E + R) / N`` consecutive ones per rank), ``K`` nodes and the model's ``G`` expert groups:

- **hierarchical** (``G`` divisible by ``K``): pack the expert groups onto the nodes by group load (each node gets
  ``G / K`` groups), so a group's experts stay on one node and group-limited routing touches few nodes; within each
  node, replicate: every expert gets one slot, then each of the node's ``R / K`` spare slots goes to the expert with
  the highest load per replica (a replica carries an equal share of its expert's load); then pack the node's
  physical experts onto its ``N / K`` ranks with balanced packing (equal slot counts; heaviest first onto the least
  loaded rank that still has a free slot).
- **global** (otherwise): the same replication and packing over all ``N`` ranks, ignoring groups and nodes.

A layer whose load is all zero (nothing measured) is planned as if every expert had the same load (and its
predicted imbalance is 1). The prediction (``rank_load``, ``imbalance`` = max / mean rank load) assumes each replica
serves ``load / replicas`` of its expert.

Every input is bounded before any work (``check_plan_args``, ``_check_load``): at most ``MAX_SLOTS`` physical slots
(``E + R``, so also ``N`` ranks) and ``MAX_LAYERS`` MoE layers, loads finite token counts in ``0..MAX_LOAD``. The
greedy replication costs ``R x E / K`` steps and the packing ``(E + R) x N`` per layer, so a typo such as
``--redundant 10000000`` is refused at once instead of planning for minutes; at the bounds a plan takes seconds.

A plan compiles into an expert-parallel artifact with ``moeforge compile MODEL --tp N --ep N --placement plan.json``
(``moeforge.model.expert_slots``: each rank holds its slots' experts; the router's logical choice goes to one replica).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.core.errors import MoeforgeError
from moeforge.core.safe_paths import write_output_file
from moeforge.core.strict_json import (
    JsonFileError,
    json_int,
    json_list,
    json_str,
    parse_json_text,
    read_regular_file,
)
from moeforge.model.expert_slots import EMPTY, PLAN_FORMAT, PLAN_VERSION, ExpertSlots

FORMAT = PLAN_FORMAT
FORMAT_VERSION = PLAN_VERSION
MODES = ("hierarchical", "global", "contiguous", "round_robin")
METRIC = "moeforge:expert_routed_tokens_total"
# The bounds of a plan (see the module docstring). The largest published deployments have a few hundred slots per
# layer (DeepSeek-V3: 256 experts + 32 redundant, on 32 to 320 ranks) and under 100 MoE layers (DeepSeek-V3 58,
# Qwen3-235B 94): these leave ten times that room and keep the worst plan to seconds.
MAX_SLOTS = 4096  # physical expert slots per layer, E + R (N ranks <= E + R: each rank holds one slot at least)
MAX_LAYERS = 256  # MoE layers
MAX_LOAD = 2**53  # routed tokens of one expert: a count above this is not exact in a double, and no run routes it
STATS_FIX = ("pass the JSON statistics that run/serve/bench --expert-load-out wrote (loads are token counts >= 0: "
             "finite, no NaN or inf), or a scrape of the server's /metrics")
# EMPTY (-1): a physical slot holding no expert (baselines with fill_redundant=False)


class EplbError(MoeforgeError):
    """Bad expert-load statistics, placement arguments or plan file; the message names the problem and the fix."""


@dataclass(frozen=True, eq=False)
class Placement:
    """One placement per MoE layer: ``physical_to_logical`` [L, E+R] (slot -> logical expert, ``EMPTY`` for an
    unused slot), ``replica_count`` [L, E] (slots per logical expert) and the ``load`` [L, E] it was planned from.
    Rank ``r`` holds slots ``r * S .. (r + 1) * S - 1`` with ``S = (E + R) / N`` (``rank_slots``)."""

    mode: str
    ep: int
    redundant: int
    nodes: int
    groups: int
    load: np.ndarray
    physical_to_logical: np.ndarray
    replica_count: np.ndarray
    artifact_sha256: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EplbError(f"placement mode {self.mode!r} is unknown; use one of {', '.join(MODES)}")
        load = _check_load(self.load)
        _check_args(load.shape[1], self.ep, self.redundant, self.nodes, self.groups)
        layers, experts = load.shape
        phy = np.asarray(self.physical_to_logical)
        count = np.asarray(self.replica_count)
        if phy.shape != (layers, experts + self.redundant) or count.shape != (layers, experts):
            raise EplbError(f"placement shapes {phy.shape} / {count.shape} do not match load {load.shape} with "
                            f"{self.redundant} redundant slots; regenerate the plan with moeforge eplb")
        if not np.issubdtype(phy.dtype, np.integer) or not np.issubdtype(count.dtype, np.integer):
            raise EplbError("physical_to_logical and replica_count must be integers; regenerate the plan")
        if phy.min() < EMPTY or phy.max() >= experts:
            raise EplbError(f"physical_to_logical holds experts outside 0..{experts - 1}; regenerate the plan")
        for layer in range(layers):
            held = np.bincount(phy[layer][phy[layer] >= 0], minlength=experts)
            if (held == 0).any():
                raise EplbError(f"layer {layer}: expert {int(np.argmin(held))} has no slot; regenerate the plan")
            if not np.array_equal(held, count[layer]):
                raise EplbError(f"layer {layer}: replica_count disagrees with physical_to_logical; regenerate it")
        object.__setattr__(self, "load", load)
        object.__setattr__(self, "physical_to_logical", phy.astype(np.int64))
        object.__setattr__(self, "replica_count", count.astype(np.int64))

    def slots(self) -> ExpertSlots:
        """What a compile needs of the plan: slot -> logical expert per layer, on ``ep`` ranks."""
        return ExpertSlots.from_array(self.physical_to_logical, self.ep)

    @property
    def slots_per_rank(self) -> int:
        return int(self.physical_to_logical.shape[1]) // self.ep

    @property
    def rank_slots(self) -> np.ndarray:
        """[L, N, S]: the logical expert of each rank's slots (``EMPTY`` for an unused slot)."""
        layers = self.physical_to_logical.shape[0]
        return self.physical_to_logical.reshape(layers, self.ep, self.slots_per_rank)

    @property
    def rank_load(self) -> np.ndarray:
        """[L, N]: predicted load per rank, each replica carrying ``load / replicas`` of its expert."""
        share = self.load / self.replica_count
        slots = self.rank_slots
        per_slot = np.where(slots >= 0, share[np.arange(len(share))[:, None, None], np.maximum(slots, 0)], 0.0)
        result: np.ndarray = per_slot.sum(axis=2)
        return result

    @property
    def imbalance(self) -> np.ndarray:
        """[L]: max / mean of the predicted rank load (1 = balanced)."""
        return _imbalance(self.rank_load)

    @property
    def imbalance_before(self) -> np.ndarray:
        """[L]: the imbalance of the contiguous placement without redundancy (expert e on rank e * N // E)."""
        load = self.load
        rank = np.arange(load.shape[1]) * self.ep // load.shape[1]
        per_rank = np.stack([load[:, rank == r].sum(axis=1) for r in range(self.ep)], axis=1)
        return _imbalance(per_rank)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plan (``plan.json``); the predicted loads are included for readers, recomputed on load."""
        return {"format": FORMAT, "version": FORMAT_VERSION, "mode": self.mode, "ep": self.ep,
                "redundant": self.redundant, "nodes": self.nodes, "groups": self.groups,
                "slots_per_rank": self.slots_per_rank, "artifact_sha256": self.artifact_sha256,
                "load": self.load.tolist(), "physical_to_logical": self.physical_to_logical.tolist(),
                "replica_count": self.replica_count.tolist(), "rank_load": self.rank_load.tolist(),
                "imbalance": self.imbalance.tolist(), "imbalance_before": self.imbalance_before.tolist()}

    @classmethod
    def from_dict(cls, data: Any) -> Placement:
        """The placement ``to_dict`` wrote; a plan of another format or version, or an inconsistent one, raises."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise EplbError(f"not an EPLB plan (format {FORMAT!r} expected); write one with moeforge eplb")
        if data.get("version") != FORMAT_VERSION:
            raise EplbError(f"plan version {data.get('version')!r} is not supported (this moeforge reads version "
                            f"{FORMAT_VERSION}); regenerate it with moeforge eplb")
        source, fix = "EPLB plan", "regenerate it with moeforge eplb"
        try:  # strict types: "ep": 2.9 or "2" is not 2, Infinity not a count (OverflowError in int())
            counts = {name: json_int(data.get(name), source=source, field=name, lo=lo, hi=MAX_SLOTS, fix=fix)
                      for name, lo in (("ep", 1), ("redundant", 0), ("nodes", 1), ("groups", 1))}
            sha = data.get("artifact_sha256")
            return cls(mode=json_str(data.get("mode"), source=source, field="mode", max_len=64, fix=fix),
                       load=np.asarray(data["load"]),
                       physical_to_logical=np.asarray(data["physical_to_logical"]),
                       replica_count=np.asarray(data["replica_count"]),
                       artifact_sha256=None if sha is None else json_str(sha, source=source, field="artifact_sha256",
                                                                         max_len=128, fix=fix), **counts)
        except JsonFileError as exc:
            raise EplbError(str(exc)) from None
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise EplbError(f"malformed EPLB plan ({type(exc).__name__}: {exc}); regenerate it") from None


def rebalance(load: Any, ep: int, redundant: int, nodes: int = 1, groups: int = 1,
              artifact_sha256: str | None = None) -> Placement:
    """EPLB placement of ``load`` [L, E] on ``ep`` ranks with ``redundant`` spare slots: hierarchical when
    ``groups`` divides by ``nodes``, global otherwise (see the module docstring)."""
    weights = _check_load(load)
    layers, experts = weights.shape
    _check_args(experts, ep, redundant, nodes, groups)
    hierarchical = groups % nodes == 0
    plan_nodes, plan_groups = (nodes, groups) if hierarchical else (1, 1)  # global: one node, one group
    phy = np.empty((layers, experts + redundant), dtype=np.int64)
    count = np.empty((layers, experts), dtype=np.int64)
    for layer, row in enumerate(_effective(weights)):
        phy[layer], count[layer] = _plan_layer(row, ep, redundant, plan_nodes, plan_groups)
    return Placement("hierarchical" if hierarchical else "global", ep, redundant, nodes, groups, weights, phy,
                     count, artifact_sha256)


def contiguous(load: Any, ep: int, redundant: int = 0, fill_redundant: bool = False,
               artifact_sha256: str | None = None) -> Placement:
    """Baseline, today's ``--ep N``: rank ``r`` holds logical experts ``r * E / N .. (r + 1) * E / N - 1`` (E must
    divide by N), no replicas: its ``R / N`` spare slots stay ``EMPTY`` (the ``imbalance_before`` of every plan).
    With ``fill_redundant`` they get the replicas EPLB's greedy replication picks, dealt to the ranks in turn."""
    weights = _check_load(load)
    experts = weights.shape[1]
    _check_args(experts, ep, redundant, 1, 1)
    if experts % ep:
        raise EplbError(f"the contiguous placement needs the {experts} experts to divide by --ep {ep}; "
                        "use round-robin or EPLB, or another --ep")
    extra = _spare_replicas(weights, redundant, fill_redundant)
    per_rank = experts // ep
    phy = np.concatenate([np.concatenate([np.tile(np.arange(r * per_rank, (r + 1) * per_rank), (len(weights), 1)),
                                          extra[:, r::ep]], axis=1) for r in range(ep)], axis=1)
    return _baseline("contiguous", weights, ep, redundant, phy, artifact_sha256)


def round_robin(load: Any, ep: int, redundant: int = 0, fill_redundant: bool = True,
                artifact_sha256: str | None = None) -> Placement:
    """Baseline: logical expert ``e`` on rank ``e % N``. By default (a fair comparison: the same replicas, only the
    packing differs) the ``R`` spare slots get EPLB's greedy replicas, continuing the round (item ``E + j`` on rank
    ``(E + j) % N``); with ``fill_redundant=False`` they stay ``EMPTY`` (each rank padded to ``(E + R) / N`` slots)."""
    weights = _check_load(load)
    layers, experts = weights.shape
    _check_args(experts, ep, redundant, 1, 1)
    items = np.concatenate([np.tile(np.arange(experts), (layers, 1)),
                            _spare_replicas(weights, redundant, fill_redundant)], axis=1)
    slots = (experts + redundant) // ep
    phy = np.full((layers, experts + redundant), EMPTY, dtype=np.int64)
    for rank in range(ep):
        mine = items[:, rank::ep]
        mine = mine[:, (mine != EMPTY).all(axis=0)]  # unfilled spare slots go to the end of the rank
        phy[:, rank * slots: rank * slots + mine.shape[1]] = mine
    return _baseline("round_robin", weights, ep, redundant, phy, artifact_sha256)


def _baseline(mode: str, weights: np.ndarray, ep: int, redundant: int, phy: np.ndarray,
              sha: str | None) -> Placement:
    count = np.stack([np.bincount(row[row >= 0], minlength=weights.shape[1]) for row in phy])
    return Placement(mode, ep, redundant, 1, 1, weights, phy, count, sha)


def _spare_replicas(weights: np.ndarray, redundant: int, fill: bool) -> np.ndarray:
    """[L, R]: the experts EPLB's greedy replication adds, in the order it adds them (or ``EMPTY``)."""
    if not fill:
        return np.full((len(weights), redundant), EMPTY, dtype=np.int64)
    experts = weights.shape[1]
    return np.stack([_replicate(row, experts + redundant)[0][experts:] for row in _effective(weights)])


def _plan_layer(load: np.ndarray, ep: int, redundant: int, nodes: int, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's hierarchical plan (global = one node, one group): slot -> logical expert, replica counts."""
    experts = load.shape[0]
    group_size, ranks_per_node = experts // groups, ep // nodes
    slots_per_node, slots_per_rank = (experts + redundant) // nodes, (experts + redundant) // ep
    group_node = _pack(load.reshape(groups, group_size).sum(axis=1), nodes)
    phy = np.empty(experts + redundant, dtype=np.int64)
    count = np.zeros(experts, dtype=np.int64)
    for node in range(nodes):
        local = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                for g in np.flatnonzero(group_node == node)])  # the node's logical experts
        replica_of, replicas = _replicate(load[local], slots_per_node)
        count[local] = replicas
        rank_of = _pack(load[local][replica_of] / replicas[replica_of], ranks_per_node)
        for rank in range(ranks_per_node):
            start = node * slots_per_node + rank * slots_per_rank
            phy[start: start + slots_per_rank] = np.sort(local[replica_of[rank_of == rank]])
    return phy, count


def _replicate(load: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Every item once, then each spare slot to the item with the highest load per replica (lowest index on ties):
    (slot -> item [slots], replicas per item)."""
    count = np.ones(load.shape[0], dtype=np.int64)
    order = list(range(load.shape[0]))
    for _ in range(slots - load.shape[0]):
        item = int(np.argmax(load / count))
        order.append(item)
        count[item] += 1
    return np.asarray(order, dtype=np.int64), count


def _pack(load: np.ndarray, packs: int) -> np.ndarray:
    """Balanced packing: ``len(load) / packs`` items per pack, heaviest first (stable) onto the least loaded pack
    that still has room. Returns the pack of each item."""
    capacity = load.shape[0] // packs
    pack_of = np.empty(load.shape[0], dtype=np.int64)
    pack_load, pack_items = np.zeros(packs), np.zeros(packs, dtype=np.int64)
    for item in np.argsort(-load, kind="stable"):
        pack = int(np.argmin(np.where(pack_items < capacity, pack_load, np.inf)))
        pack_of[item] = pack
        pack_load[pack] += load[item]
        pack_items[pack] += 1
    return pack_of


def _imbalance(rank_load: np.ndarray) -> np.ndarray:
    mean = rank_load.mean(axis=1)
    return np.where(mean > 0, rank_load.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def _effective(load: np.ndarray) -> np.ndarray:
    """``load`` with every all-zero layer replaced by a uniform one (nothing measured: plan for equal load)."""
    zero = np.asarray(~load.any(axis=1))
    return np.where(zero[:, None], 1.0, load) if zero.any() else load


def _check_load(load: Any) -> np.ndarray:
    try:
        array = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise EplbError("expert load must be a [layers, experts] table of numbers with equal-length rows; "
                        "fix the statistics file") from None
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise EplbError(f"expert load must be 2-D [layers, experts] and non-empty, got shape {array.shape}; "
                        "give one row of per-expert loads per MoE layer")
    if array.shape[0] > MAX_LAYERS or array.shape[1] > MAX_SLOTS:
        raise EplbError(f"expert load has {array.shape[0]} layers x {array.shape[1]} experts, over the "
                        f"{MAX_LAYERS} MoE layers x {MAX_SLOTS} experts a plan may have (far above any model "
                        "today); check the statistics")
    bad = np.argwhere(~np.isfinite(array))
    if len(bad):
        layer, expert = (int(i) for i in bad[0])
        raise EplbError(f"expert load of layer {layer}, expert {expert} is {array[layer, expert]} (NaN or inf); "
                        "loads must be finite: re-record the statistics")
    bad = np.argwhere(array < 0)
    if len(bad):
        layer, expert = (int(i) for i in bad[0])
        raise EplbError(f"expert load of layer {layer}, expert {expert} is negative ({array[layer, expert]}); "
                        "loads are token counts >= 0: re-record the statistics")
    bad = np.argwhere(array > MAX_LOAD)
    if len(bad):
        layer, expert = (int(i) for i in bad[0])
        raise EplbError(f"expert load of layer {layer}, expert {expert} is {array[layer, expert]:g}, over the "
                        f"{MAX_LOAD} (2**53) tokens a count can be; re-record the statistics")
    return array


def check_plan_args(ep: int, redundant: int, nodes: int = 1, groups: int | None = 1) -> None:
    """The ranges of the plan's flags alone (before the statistics are read): ``--ep`` and ``--groups`` in
    ``1..MAX_SLOTS``, ``--redundant`` in ``0..MAX_SLOTS``, ``--nodes`` in ``1..--ep``. How they fit the experts is
    ``_check_args``'s, once the statistics are read."""
    if not 1 <= ep <= MAX_SLOTS:
        raise EplbError(f"--ep must be in 1..{MAX_SLOTS} (a plan has at most {MAX_SLOTS} slots per layer, one rank "
                        f"holds one slot at least), got {ep}")
    if not 0 <= redundant <= MAX_SLOTS:
        raise EplbError(f"--redundant must be in 0..{MAX_SLOTS} (spare expert slots per layer; the experts and "
                        f"the spares together at most {MAX_SLOTS}), got {redundant}")
    if not 1 <= nodes <= ep:
        raise EplbError(f"--nodes must be in 1..--ep ({ep}), got {nodes}")
    if groups is not None and not 1 <= groups <= MAX_SLOTS:
        raise EplbError(f"--groups must be in 1..{MAX_SLOTS} (the model's n_group; 1 if it has none), got {groups}")


def _check_args(experts: int, ep: int, redundant: int, nodes: int, groups: int) -> None:
    if ep < 1 or nodes < 1 or groups < 1:
        raise EplbError(f"--ep ({ep}), --nodes ({nodes}) and --groups ({groups}) must be >= 1")
    if redundant < 0:
        raise EplbError(f"--redundant must be >= 0 (spare expert slots), got {redundant}")
    if experts + redundant > MAX_SLOTS:
        raise EplbError(f"{experts} experts + --redundant {redundant} are {experts + redundant} slots per layer, "
                        f"over the {MAX_SLOTS} a plan may have (planning cost grows with them; far above any "
                        "deployment today); choose a smaller --redundant")
    if experts % groups:
        raise EplbError(f"{experts} experts do not divide into --groups {groups}; pass the model's n_group "
                        "(1 if it has none)")
    if (experts + redundant) % ep:
        raise EplbError(f"--ep {ep} does not divide the {experts} experts + {redundant} redundant slots; choose "
                        f"--redundant so that {experts} + R is a multiple of {ep}")
    if ep % nodes:
        raise EplbError(f"--nodes {nodes} does not divide --ep {ep}; every node needs the same number of ranks")


_SAMPLE = re.compile(r"^" + re.escape(METRIC) + r"\{([^}]*)\}\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# A label's integer and a sample's value as Prometheus writes them, in ASCII only: Python's int() and float() also
# take "0_1", "+0", " 0 " and other scripts' digits ("٢"), which no exposition holds.
_LABEL_INT = re.compile(r"[0-9]{1,10}", re.ASCII)
_VALUE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?Inf|NaN", re.ASCII)


@dataclass(frozen=True, eq=False)
class ExpertStats:
    """Measured expert load as ``moeforge eplb`` reads it: ``load`` [L, E], the sha256 of the artifact that routed
    it and the model's expert groups (each None where the statistics do not record it: a plain list, a scrape)."""

    load: np.ndarray
    artifact_sha256: str | None = None
    groups: int | None = None


def read_stats(path: str | os.PathLike[str]) -> ExpertStats:
    """The statistics file at ``path`` (a regular file of at most 64 MiB, read once): see ``parse_stats``."""
    try:
        data = read_regular_file(Path(path), what="file", fix=STATS_FIX)
    except JsonFileError as exc:
        raise EplbError(f"cannot read statistics: {exc}") from None
    return _parse(data, f"statistics {path}")


def parse_stats(text: str | bytes, source: str = "statistics") -> tuple[np.ndarray, str | None]:
    """Expert-load statistics -> (load [L, E], artifact sha256 or None). Accepts JSON ``{"artifact_sha256": ...,
    "layers": [[...], ...], "groups": G}`` (what ``--expert-load-out`` writes), a plain 2-D JSON list, or a
    Prometheus scrape of ``/metrics`` with ``moeforge:expert_routed_tokens_total{layer="i",expert="j"}`` samples.
    JSON is read strictly (``core.strict_json``: no NaN, no nesting bomb, no number out of a double's range) and
    every load must be a number in ``0..MAX_LOAD`` in a table of at most ``MAX_LAYERS x MAX_SLOTS``; anything else
    raises ``EplbError`` naming the field (``source`` names the file)."""
    stats = _parse(text, source)
    return stats.load, stats.artifact_sha256


def _parse(text: str | bytes, source: str) -> ExpertStats:
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise EplbError(f"{source} is not UTF-8 text; {STATS_FIX}") from None
    text = text.removeprefix("\ufeff")  # a byte order mark some editors write: not part of the JSON or scrape
    if not text.lstrip().startswith(("{", "[")):  # a scrape's lines start with '#' or a metric name
        return ExpertStats(_parse_scrape(text))
    try:
        return _stats_from_json(parse_json_text(text, source=source, fix=STATS_FIX), source)
    except JsonFileError as exc:  # one error type for the statistics' reader
        raise EplbError(str(exc)) from None


def _stats_from_json(data: Any, source: str) -> ExpertStats:
    sha, groups = None, None
    if isinstance(data, dict):
        if "layers" not in data:
            raise EplbError(f'{source}: statistics JSON needs a "layers" list ([layers][experts] loads); {STATS_FIX}')
        if data.get("artifact_sha256") is not None:
            sha = json_str(data["artifact_sha256"], source=source, field="artifact_sha256", max_len=128)
        if data.get("groups") is not None:
            groups = json_int(data["groups"], source=source, field="groups", lo=1, hi=MAX_SLOTS)
        data = data["layers"]
    rows = json_list(data, source=source, field="layers", max_len=MAX_LAYERS, fix=STATS_FIX)
    if not rows or not all(isinstance(row, list) for row in rows):
        raise EplbError(f"{source}: statistics JSON must be a 2-D list of per-expert loads (one row per MoE "
                        f"layer); {STATS_FIX}")
    width = len(rows[0])
    for layer, row in enumerate(rows):
        json_list(row, source=source, field=f"layers[{layer}]", max_len=MAX_SLOTS, fix=STATS_FIX)
        if len(row) != width:
            raise EplbError(f"{source}: layer {layer} has {len(row)} loads but layer 0 has {width}: every layer needs "
                            f"one load per expert; {STATS_FIX}")
        for expert, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise EplbError(f"{source}: load layers[{layer}][{expert}] must be a number (a token count), got "
                                f"{value!r:.40}; {STATS_FIX}")
    return ExpertStats(_check_load(rows), sha, groups)


def _parse_scrape(text: str) -> np.ndarray:
    samples: dict[tuple[int, int], float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        labels = dict(_LABEL.findall(match.group(1)))
        layer, expert, text = labels.get("layer", ""), labels.get("expert", ""), match.group(2)
        if not (_LABEL_INT.fullmatch(layer) and _LABEL_INT.fullmatch(expert) and len(text) <= 64
                and _VALUE.fullmatch(text)):
            raise EplbError(f"line {number}: {METRIC} sample without integer layer/expert labels or a number "
                            "value; pass an unedited scrape of /metrics")
        key, value = (int(layer), int(expert)), float(text)
        if key in samples or min(key) < 0:
            raise EplbError(f"line {number}: layer {key[0]} expert {key[1]} appears twice or is negative; pass the "
                            "scrape of one server")
        if key[0] >= MAX_LAYERS or key[1] >= MAX_SLOTS:
            raise EplbError(f"line {number}: layer {key[0]} expert {key[1]} is beyond the {MAX_LAYERS} MoE layers x "
                            f"{MAX_SLOTS} experts a plan may have; pass an unedited scrape of /metrics")
        samples[key] = value
    if not samples:
        raise EplbError(f"statistics are neither JSON nor a /metrics scrape with {METRIC} samples; pass the JSON "
                        "statistics or a scrape of a MoE artifact's server")
    layers, experts = (max(k[i] for k in samples) + 1 for i in (0, 1))
    if len(samples) != layers * experts:
        missing = next((a, b) for a in range(layers) for b in range(experts) if (a, b) not in samples)
        raise EplbError(f"the scrape lacks layer {missing[0]} expert {missing[1]}; pass a complete scrape")
    load = np.zeros((layers, experts))
    for (layer, expert), value in samples.items():
        load[layer, expert] = value
    return _check_load(load)


def write_plan(placement: Placement, path: str | os.PathLike[str], force: bool = False) -> Path:
    """Writes ``placement.to_dict()`` to ``path`` under the safe-path rule (``core.safe_paths``: atomic, never
    through a link or over a special file, an existing file replaced only with ``force``); returns the path."""
    # One line per key: the tables stay one row per line.
    text = "{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(value, allow_nan=False)}"
                              for key, value in placement.to_dict().items()) + "\n}\n"
    return write_output_file(Path(path), text, force=force, flag="-o")
