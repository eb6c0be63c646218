"""Slots of per-sequence recurrent state for hybrid models (Gated DeltaNet, short-convolution and
Mamba layers keep a fixed-size state per sequence instead of keys and values per token): which
running sequence holds which slot. Ids only; the backend owns the state tensors, as it owns KV."""

from __future__ import annotations

from collections.abc import Iterable


class StateSlots:
    """``num_slots`` slot ids handed out lowest first (so a lightly loaded server touches the
    same few slots' memory) and taken back when a sequence finishes, aborts or is preempted."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = set(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def acquire(self) -> int | None:
        """A free slot's id, now held; None when every slot is held."""
        if not self._free:
            return None
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not held")
        self._free.add(slot)

    def check(self, held: Iterable[int | None], expect_idle: bool = False) -> None:
        """AssertionError unless ``held`` (every holder's slot, None for none) are exactly the
        slots out of the free set, each held once."""
        slots = [s for s in held if s is not None]
        assert len(set(slots)) == len(slots), f"a state slot is held twice: {sorted(slots)}"
        assert not set(slots) & self._free, f"state slots held and free at once: {sorted(set(slots) & self._free)}"
        assert len(slots) + len(self._free) == self.num_slots, (
            f"{self.num_slots - len(self._free) - len(slots)} state slots are out but held by no sequence")
        assert not expect_idle or len(self._free) == self.num_slots, f"{self.num_used} state slots still held"
