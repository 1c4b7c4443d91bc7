"""Which logical expert each physical expert slot of an expert-parallel model holds: the part of an EPLB plan
(``moeforge/parallel/eplb.py``) that a compile and a runtime need.

``physical_to_logical`` [L_moe, N * S]: MoE layer ``l``'s slot ``p`` holds logical expert ``physical_to_logical[l][p]``
(``EMPTY``: no expert, zero weights that nothing routes to); rank ``r`` holds slots ``r * S .. (r + 1) * S - 1``. A
logical expert held by several slots is *replicated*: the router's choice of it goes to one replica
(``moeforge.model.moe.route_to_replicas``), so the outputs equal the unsharded model's.

Dimension letters: L_moe MoE layers, E logical (routed) experts, N expert-parallel ranks, S slots per rank.

Every slot holds a copy of its expert's weights, so the slots of a layer are bounded: at most
``MAX_SLOTS_PER_EXPERT`` x E (``check``), and at most ``MAX_SLOTS`` before the model is known (``from_array``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeforge.core.errors import MoeforgeError
from moeforge.core.safe_paths import expand_user
from moeforge.core.strict_json import JsonFileError, json_int, json_object, read_json_file

EMPTY = -1
PLAN_FORMAT = "moeforge-eplb-plan"  # the plan file ``moeforge eplb`` writes
PLAN_VERSION = 1
MAX_MOE_LAYERS = 4096  # far above any model's (DeepSeek-V3: 58)
MAX_SLOTS = 65536  # slots of one layer, before the model's expert count bounds them (E + redundant: 288 for V3)
MAX_SLOTS_PER_EXPERT = 4  # slots of one layer per routed expert: each replica copies its expert's weights
_REGENERATE = "regenerate the plan with moeforge eplb"


class PlacementError(MoeforgeError):
    """A placement that does not fit the model or the ranks; the message names the mismatch and the fix."""


@dataclass(frozen=True)
class ExpertSlots:
    """Slot -> logical expert per MoE layer, for ``ep`` ranks (see the module docstring)."""

    physical_to_logical: tuple[tuple[int, ...], ...]
    ep: int

    @classmethod
    def from_array(cls, table: object, ep: int) -> ExpertSlots:
        """From a [L_moe, N * S] integer table (nested lists as JSON gives them, or a numpy array): at least one layer,
        rows of one length of at most ``MAX_SLOTS``, ids in EMPTY..MAX_SLOTS - 1, ``ep`` at most that length; the
        model's layers and experts, and ``ep`` against the slots, are checked by ``check``."""
        rows = table.tolist() if isinstance(table, np.ndarray) else table
        width = len(rows[0]) if isinstance(rows, Sequence) and rows and isinstance(rows[0], Sequence) else 0
        if not (isinstance(rows, Sequence) and 1 <= len(rows) <= MAX_MOE_LAYERS and 1 <= width <= MAX_SLOTS
                and all(isinstance(row, Sequence) and not isinstance(row, str) and len(row) == width for row in rows)):
            shape = f"{len(rows)} rows" if isinstance(rows, Sequence) else type(rows).__name__
            raise PlacementError(f"physical_to_logical must be a 2-D integer table of 1..{MAX_MOE_LAYERS} layers of "
                                 f"one width in 1..{MAX_SLOTS} slots, got {shape:.40}; {_REGENERATE}")
        for row in rows:
            if not all(map(_is_slot_id, row)):
                bad = next(v for v in row if not _is_slot_id(v))
                raise PlacementError(f"physical_to_logical must be a 2-D integer table of expert ids in "
                                     f"{EMPTY}..{MAX_SLOTS - 1}, got {bad!r:.40}; {_REGENERATE}")
        if isinstance(ep, bool) or not isinstance(ep, int | np.integer) or not 1 <= ep <= width:
            raise PlacementError(f"ep {ep!r:.40} must be in 1..{width} (the placement's slots per layer); "
                                 f"{_REGENERATE}")
        return cls(tuple(tuple(int(v) for v in row) for row in rows), int(ep))

    @property
    def layers(self) -> int:
        return len(self.physical_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical[0]) // self.ep

    def rank_experts(self, layer: int, rank: int) -> tuple[int, ...]:
        """The logical expert of each of rank ``rank``'s slots in MoE layer ``layer`` (``EMPTY`` for none)."""
        size = self.slots_per_rank
        return self.physical_to_logical[layer][rank * size: (rank + 1) * size]

    def slot_table(self, layer: int, experts: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """(logical_to_slot [E, R_max], replica_count [E]) of one layer: each expert's slots in slot order, padded
        by repeating its first slot (``route_to_replicas`` never reads the padding)."""
        slots: list[list[int]] = [[] for _ in range(experts)]
        for slot, expert in enumerate(self.physical_to_logical[layer]):
            if expert != EMPTY:
                slots[expert].append(slot)
        width = max(len(s) for s in slots)
        return tuple(tuple(s + [s[0]] * (width - len(s))) for s in slots), tuple(len(s) for s in slots)

    def check(self, moe_layers: int, experts: int, ep: int, model: str) -> None:
        """Refuse a placement that does not fit ``model`` (its MoE layers and routed experts) on ``ep`` ranks."""
        fix = "plan it for this model and --ep with moeforge eplb"
        if ep != self.ep:
            raise PlacementError(f"the placement is planned for --ep {self.ep}, the compile asks --ep {ep}; {fix}")
        if self.layers != moe_layers:
            raise PlacementError(f"the placement has {self.layers} MoE layers, {model} has {moe_layers}; {fix}")
        widths = {len(row) for row in self.physical_to_logical}
        if len(widths) != 1 or next(iter(widths)) % ep or next(iter(widths)) < experts:
            raise PlacementError(f"the placement's slot counts {sorted(widths)[:5]} are not one multiple of --ep {ep} "
                                 f"of at least the {experts} experts of {model}; {fix}")
        if next(iter(widths)) > MAX_SLOTS_PER_EXPERT * experts:  # each slot copies an expert's weights
            raise PlacementError(f"the placement has {next(iter(widths))} slots per MoE layer, over the "
                                 f"{MAX_SLOTS_PER_EXPERT} x {experts} experts of {model} = "
                                 f"{MAX_SLOTS_PER_EXPERT * experts} a compile takes (MAX_SLOTS_PER_EXPERT); {fix} "
                                 "with fewer --redundant slots")
        for layer, row in enumerate(self.physical_to_logical):
            held = {e for e in row if e != EMPTY}
            bad = [e for e in row if e != EMPTY and not 0 <= e < experts]
            if bad:
                raise PlacementError(f"MoE layer {layer} of the placement holds expert {bad[0]}, {model} has experts "
                                     f"0..{experts - 1}; {fix}")
            if len(held) != experts:
                missing = min(set(range(experts)) - held)
                raise PlacementError(f"MoE layer {layer} of the placement gives expert {missing} no slot: its tokens "
                                     f"would be lost; {fix}")

    def logical_counts(self, slot_counts: np.ndarray, experts: int) -> np.ndarray:
        """Per-slot counts [L_moe, N * S] -> per logical expert [L_moe, E] (replicas summed; ``EMPTY`` dropped)."""
        table = np.asarray(self.physical_to_logical)
        out = np.zeros((self.layers, experts), dtype=slot_counts.dtype)
        for layer in range(self.layers):
            held = table[layer] >= 0
            np.add.at(out[layer], table[layer][held], slot_counts[layer][held])
        return out

    def to_dict(self) -> dict[str, object]:
        return {"ep": self.ep, "slots_per_rank": self.slots_per_rank,
                "physical_to_logical": [list(row) for row in self.physical_to_logical]}


def _is_slot_id(value: object) -> bool:
    """A JSON integer (never a bool, a float such as 2.0 or 2.9, or a string) in EMPTY..MAX_SLOTS - 1."""
    return (type(value) is int or isinstance(value, np.integer)) and bool(EMPTY <= value < MAX_SLOTS)


def load_plan(path: str | Path) -> ExpertSlots:
    """The slots of the plan file ``moeforge eplb -o`` wrote (read strictly: its format, version and fields checked;
    the model's shapes by ``check``)."""
    where = expand_user(path)  # "~nouser/p.json" stays as written (Path.expanduser raises RuntimeError)
    if not os.path.lexists(where):
        raise PlacementError(f"placement plan {where} does not exist; write one with moeforge eplb STATS -o "
                             f"{where} --ep N --redundant R")
    source = f"placement plan {where}"
    try:
        data = json_object(read_json_file(where, what="placement plan"), source=source)
        if data.get("format") != PLAN_FORMAT:
            raise PlacementError(f"{where} is not an EPLB plan (format {PLAN_FORMAT!r} expected); write one with "
                                 "moeforge eplb")
        version = data.get("version")
        if type(version) is not int or version != PLAN_VERSION:
            raise PlacementError(f"{where}: plan version {version!r:.40} is not supported (this moeforge reads "
                                 f"version {PLAN_VERSION}); {_REGENERATE}")
        if "physical_to_logical" not in data:
            raise PlacementError(f"{where} is malformed (no 'physical_to_logical'); {_REGENERATE}")
        ep = json_int(data.get("ep"), source=source, field="ep", lo=1, hi=MAX_SLOTS)
        return ExpertSlots.from_array(data["physical_to_logical"], ep)
    except JsonFileError as exc:
        raise PlacementError(f"cannot read placement plan: {exc}; {_REGENERATE}") from None
    except PlacementError as exc:
        raise PlacementError(f"{where}: {exc}" if str(where) not in str(exc) else str(exc)) from None
