"""Which logical expert each physical expert slot of an expert-parallel model holds: the part of an EPLB plan
(``moeforge/parallel/eplb.py``) that a compile and a runtime need.

``physical_to_logical`` [L_moe, N * S]: MoE layer ``l``'s slot ``p`` holds logical expert ``physical_to_logical[l][p]``
(``EMPTY``: no expert, zero weights that nothing routes to); rank ``r`` holds slots ``r * S .. (r + 1) * S - 1``. A
logical expert held by several slots is *replicated*: the router's choice of it goes to one replica
(``moeforge.model.moe.route_to_replicas``), so the outputs equal the unsharded model's.

Dimension letters: L_moe MoE layers, E logical (routed) experts, N expert-parallel ranks, S slots per rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeforge.core.errors import MoeforgeError

EMPTY = -1
PLAN_FORMAT = "moeforge-eplb-plan"  # the plan file ``moeforge eplb`` writes
PLAN_VERSION = 1


class PlacementError(MoeforgeError):
    """A placement that does not fit the model or the ranks; the message names the mismatch and the fix."""


@dataclass(frozen=True)
class ExpertSlots:
    """Slot -> logical expert per MoE layer, for ``ep`` ranks (see the module docstring)."""

    physical_to_logical: tuple[tuple[int, ...], ...]
    ep: int

    @classmethod
    def from_array(cls, table: object, ep: int) -> ExpertSlots:
        """From a [L_moe, N * S] integer table; shapes and ids are checked by ``check``."""
        array = np.asarray(table)
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            raise PlacementError(f"physical_to_logical must be a 2-D integer table, got shape {array.shape} of "
                                 f"{array.dtype}; regenerate the plan with moeforge eplb")
        return cls(tuple(tuple(int(v) for v in row) for row in array.tolist()), ep)

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
            raise PlacementError(f"the placement's slot counts {sorted(widths)} are not one multiple of --ep {ep} "
                                 f"of at least the {experts} experts of {model}; {fix}")
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


def load_plan(path: str | Path) -> ExpertSlots:
    """The slots of the plan file ``moeforge eplb -o`` wrote (its format and version checked; shapes by ``check``)."""
    where = Path(path).expanduser()
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlacementError(f"placement plan {where} does not exist; write one with moeforge eplb STATS -o "
                             f"{where} --ep N --redundant R") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlacementError(f"cannot read placement plan {where} ({exc}); regenerate it with moeforge eplb") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise PlacementError(f"{where} is not an EPLB plan (format {PLAN_FORMAT!r} expected); write one with "
                             "moeforge eplb")
    if data.get("version") != PLAN_VERSION:
        raise PlacementError(f"{where}: plan version {data.get('version')!r} is not supported (this moeforge reads "
                             f"version {PLAN_VERSION}); regenerate it with moeforge eplb")
    try:
        ep = int(data["ep"])
        table = data["physical_to_logical"]
    except (KeyError, TypeError, ValueError) as exc:
        raise PlacementError(f"{where} is malformed ({type(exc).__name__}: {exc}); regenerate it with moeforge eplb"
                             ) from None
    if ep < 1:
        raise PlacementError(f"{where}: ep {ep} must be >= 1; regenerate it with moeforge eplb")
    return ExpertSlots.from_array(table, ep)
