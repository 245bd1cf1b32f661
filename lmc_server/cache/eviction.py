"""Eviction policies over a partition's object slots.

A policy only ever holds *evictable* slots: committed and not pinned by a lease or an
in-flight read. The partition adds a slot when it becomes evictable and removes it when
it gets pinned or freed, so :meth:`EvictionPolicy.pop_victim` is O(1) and never has to
skip over pinned objects. Adding a policy is one subclass registered in
:data:`POLICIES`; ``tests/test_eviction.py`` runs one contract suite over every class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from typing import ClassVar

_NIL = -1


class EvictionPolicy(ABC):
    """Orders evictable slots ``0 <= slot < capacity`` by how soon to evict them."""

    name: ClassVar[str]

    @abstractmethod
    def grow(self, capacity: int) -> None:
        """Allow slots up to ``capacity - 1``; capacity never shrinks."""

    @abstractmethod
    def add(self, slot: int) -> None:
        """``slot`` became evictable (just committed or unpinned): it is most recent."""

    @abstractmethod
    def remove(self, slot: int) -> None:
        """``slot`` is no longer evictable (pinned or freed). Must be present."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """``slot`` was used while evictable. Must be present."""

    @abstractmethod
    def pop_victim(self) -> int | None:
        """Remove and return the slot to evict first, or ``None`` when empty."""

    @abstractmethod
    def peek(self) -> int | None:
        """The slot :meth:`pop_victim` would return, without removing it."""

    @abstractmethod
    def __contains__(self, slot: int) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


class _LinkedOrder(EvictionPolicy):
    """A doubly linked list threaded through two int arrays, head = evict first.

    Hand-made rather than an ``OrderedDict`` so that membership costs 9 bytes per slot
    (two int32 links and a flag) and no Python object is allocated per operation.
    Invariant: ``slot in self`` iff ``self._in[slot]``, and the list from ``_head``
    following ``_next`` visits exactly those slots, ending at ``_tail``.
    """

    def __init__(self, capacity: int = 0) -> None:
        self._prev = array("i")
        self._next = array("i")
        self._in = array("b")
        self._head = _NIL
        self._tail = _NIL
        self._len = 0
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        extra = capacity - len(self._in)
        if extra > 0:
            self._prev.extend([_NIL] * extra)
            self._next.extend([_NIL] * extra)
            self._in.extend([0] * extra)

    def _append(self, slot: int) -> None:
        assert not self._in[slot], f"slot {slot} is already in the {self.name} order"
        self._prev[slot] = self._tail
        self._next[slot] = _NIL
        if self._tail == _NIL:
            self._head = slot
        else:
            self._next[self._tail] = slot
        self._tail = slot
        self._in[slot] = 1
        self._len += 1

    def _unlink(self, slot: int) -> None:
        assert self._in[slot], f"slot {slot} is not in the {self.name} order"
        p, n = self._prev[slot], self._next[slot]
        if p == _NIL:
            self._head = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail = p
        else:
            self._prev[n] = p
        self._in[slot] = 0
        self._len -= 1

    def add(self, slot: int) -> None:
        self._append(slot)

    def remove(self, slot: int) -> None:
        self._unlink(slot)

    def pop_victim(self) -> int | None:
        if self._head == _NIL:
            return None
        slot = self._head
        self._unlink(slot)
        return slot

    def peek(self) -> int | None:
        return None if self._head == _NIL else self._head

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self._in) and bool(self._in[slot])

    def __len__(self) -> int:
        return self._len

    def order(self) -> list[int]:
        """Slots from first to last victim (for tests and debugging; O(n))."""
        out: list[int] = []
        s = self._head
        while s != _NIL:
            out.append(s)
            s = self._next[s]
        return out


class LRUPolicy(_LinkedOrder):
    """Least recently used first: a touch moves the slot to the back."""

    name = "LRU"

    def touch(self, slot: int) -> None:
        self._unlink(slot)
        self._append(slot)


class FIFOPolicy(_LinkedOrder):
    """First in, first out: the order objects became evictable; touches are ignored.

    Note that unpinning re-adds a slot at the back, so an object that was leased and
    released counts as newly inserted.
    """

    name = "FIFO"

    def touch(self, slot: int) -> None:
        assert self._in[slot], f"slot {slot} is not in the FIFO order"


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRUPolicy, FIFOPolicy)}


def make_policy(name: str, capacity: int = 0) -> EvictionPolicy:
    """Instantiate a policy by its ``--eviction-policy`` name (case-insensitive)."""
    try:
        cls = POLICIES[name.upper()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
    return cls(capacity)  # type: ignore[call-arg]
