"""Slots of per-sequence recurrent state for hybrid models (Gated DeltaNet, short-convolution and
Mamba layers keep a fixed-size state per sequence instead of keys and values per token): which
running sequence holds which slot. Ids only; the backend owns the state tensors, as it owns KV."""

from __future__ import annotations

from collections import OrderedDict
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


class StateSnapshots:
    """Saved recurrent states at block boundaries, keyed like the prefix cache (the hash of the
    block chain that ends at that boundary), so a request whose prompt shares the prefix resumes
    from the saved state instead of recomputing it. ``num_snapshots`` ids; a save reserves one
    (taking the least recently used saved state when none is free) and is committed under its hash
    once the step that writes it has run, or cancelled."""

    def __init__(self, num_snapshots: int) -> None:
        if num_snapshots < 1:
            raise ValueError(f"need at least one snapshot, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self._saved: OrderedDict[int, int] = OrderedDict()  # chain hash -> id, least recently used first
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._pending: set[int] = set()

    @property
    def num_saved(self) -> int:
        return len(self._saved)

    def has(self, chain_hash: int) -> bool:
        return chain_hash in self._saved

    def take(self, chain_hash: int) -> int | None:
        """The id of the state saved under ``chain_hash`` (now the most recently used), or None."""
        sid = self._saved.get(chain_hash)
        if sid is not None:
            self._saved.move_to_end(chain_hash)
        return sid

    def reserve(self) -> int | None:
        """An id to save a state into: a free one, else the least recently used saved one's
        (forgotten now); None when every id waits for a step already."""
        if self._free:
            sid = self._free.pop()
        elif self._saved:
            _, sid = self._saved.popitem(last=False)
        else:
            return None
        self._pending.add(sid)
        return sid

    def commit(self, chain_hash: int, sid: int) -> None:
        """The step that saved into ``sid`` ran: its state is the one at the end of ``chain_hash``'s
        chain (an id whose chain is saved already goes back to the free list)."""
        self._pending.remove(sid)
        if chain_hash in self._saved:
            self._free.append(sid)
        else:
            self._saved[chain_hash] = sid

    def drop(self, chain_hash: int) -> None:
        """Forget the state saved under ``chain_hash`` (if any): its id is free again."""
        sid = self._saved.pop(chain_hash, None)
        if sid is not None:
            self._free.append(sid)

    def cancel(self, sid: int) -> None:
        self._pending.remove(sid)
        self._free.append(sid)

    def check(self, expect_idle: bool = False) -> None:
        """AssertionError unless every id is exactly one of free, saved or pending."""
        ids = [*self._free, *self._saved.values(), *self._pending]
        assert sorted(ids) == list(range(self.num_snapshots)), f"snapshot ids out of order: {sorted(ids)}"
        assert not expect_idle or not self._pending, f"snapshots still pending: {sorted(self._pending)}"
