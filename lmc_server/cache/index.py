"""The L1 index: keys to object slots, the hit rule, store and retrieve bookkeeping.

One :class:`L1Index` per server, driven from the event-loop thread only. It never
copies bytes: a store is ``reserve_store`` (slots become WRITING, a copy plan comes
back) then, once the transfer engine reports the copy complete, ``commit_store`` or
``abort_store``. A retrieve is ``pin_retrieve`` (objects pinned, plan back) then
``unpin_retrieve``. So a half-written object is never visible, and an object being
read is never evicted.

Keys. A key is ``namespace id (4 bytes) | chunk digest (32 bytes)``, looked up in the
partition of the object group's layout; a non-empty cache salt replaces the digest by
``blake2b(digest, key=salt)``. Namespaces with the same layout share a partition's
slots but never a key.

Hit rule (:meth:`L1Index.lookup`). A prefix of ``k`` chunks hits when every object
group with full-prefix sections has chunks ``0..k-1`` committed, and every sliding
window W has its sections present for the last ``ceil(W / chunk_size)`` chunks of the
prefix. The largest such ``k`` is reported, and a lease pins exactly the objects a
retrieve of that prefix reads.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from lmc_server.cache.counters import CacheStats
from lmc_server.cache.eviction import make_policy
from lmc_server.cache.layout import (
    ObjectGroupLayout,
    RegistrationLayout,
    RunCopy,
    plan_copies,
    section_block_ids,
)
from lmc_server.cache.leases import Lease, LeaseTable
from lmc_server.cache.pool import COMMITTED, Partition, SlabPool
from lmc_server.cache.status import ChunkStatus

DIGEST_BYTES = 32
MAX_SALT_BYTES = 256
#: How many of another partition's coldest objects are tried as the way to a slab it
#: could give back (the slab holding one of them must hold nothing hotter).
DONOR_CANDIDATES = 8
#: A partition gives a slab to another only if its coldest object is at least this many
#: times older (in index ticks) than the other's own victim.
DONOR_AGE_RATIO = 2


@dataclass(frozen=True, slots=True)
class CacheView:
    """What one registration sees: its namespace and one partition per object group."""

    ns_prefix: bytes
    layout: RegistrationLayout
    partitions: tuple[Partition, ...]


@dataclass(slots=True, eq=False)
class StoreTicket:
    """A store in flight: reserved slots (WRITING) and the copies that fill them.

    ``statuses[og]`` holds one :class:`ChunkStatus` per chunk; reserved chunks say
    ``OK`` provisionally and become ``FAILED`` if the copy is aborted.
    """

    statuses: list[np.ndarray]
    reserved: list[Reservation]
    copies: list[RunCopy]
    nbytes: int
    done: bool = False


@dataclass(frozen=True, slots=True)
class Reservation:
    """Slots reserved in one object group's partition: chunk index, slot, section mask."""

    og_index: int
    part: Partition
    chunks: array
    slots: array
    masks: array


@dataclass(slots=True, eq=False)
class RetrieveTicket:
    """A retrieve in flight: the objects it pinned and the copies that read them."""

    statuses: list[np.ndarray]
    pinned: list[tuple[Partition, array]]
    copies: list[RunCopy]
    nbytes: int
    objects: int
    done: bool = False


def _split(digests: bytes) -> list[bytes]:
    if len(digests) % DIGEST_BYTES:
        raise ValueError(f"digests must be a multiple of {DIGEST_BYTES} bytes")
    return [digests[i:i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES)]


def _plan(og: ObjectGroupLayout, part: Partition, chunks: array, slots: array,
          sections: list[np.ndarray], group_ids: dict[int, np.ndarray],
          out: list[RunCopy]) -> int:
    """Append the copies of ``chunks`` (held in ``slots``) to ``out``; returns their bytes.

    ``sections[bit][i]`` says whether section ``bit`` of chunk ``i`` is copied.
    """
    nbytes = 0
    offsets = part.offsets(np.frombuffer(slots, dtype=np.int32))
    chunk_idx = np.frombuffer(chunks, dtype=np.int32)
    for bit, sec in enumerate(og.sections):
        sel = sections[bit][chunk_idx]
        if not sel.any():
            continue
        ids = section_block_ids(sec, group_ids[sec.group_index])[chunk_idx[sel]]
        for c in plan_copies(sec, ids, offsets[sel]):
            out.append(c)
            nbytes += c.nbytes
    return nbytes


class L1Index:
    """Partitions, namespaces, leases and counters of the whole L1 tier."""

    def __init__(self, pool: SlabPool, policy: str = "LRU") -> None:
        make_policy(policy)  # validate the name early
        self.pool = pool
        self.policy_name = policy
        self.partitions: dict[bytes, Partition] = {}
        self._namespaces: dict[str, int] = {}
        self.leases = LeaseTable()
        self.stats = CacheStats()
        self.tick = 0

    # -- registration -----------------------------------------------------------------

    def view(self, namespace: str, layout: RegistrationLayout) -> CacheView:
        """Intern ``namespace`` and get (or create) a partition per object group."""
        ns_id = self._namespaces.setdefault(namespace, len(self._namespaces) + 1)
        parts = tuple(self._partition(og) for og in layout.object_groups)
        return CacheView(ns_prefix=ns_id.to_bytes(4, "little"), layout=layout, partitions=parts)

    def _partition(self, og: ObjectGroupLayout) -> Partition:
        part = self.partitions.get(og.fingerprint)
        if part is None:
            part = Partition(len(self.partitions), og.fingerprint, og.name, og.object_bytes,
                             self.pool, make_policy(self.policy_name))
            self.partitions[og.fingerprint] = part
        return part

    def keys(self, view: CacheView, digests: bytes, salt: bytes = b"") -> list[bytes]:
        """The index keys of a run of chunk digests (32 bytes each)."""
        if len(salt) > MAX_SALT_BYTES:
            raise ValueError(f"cache salt longer than {MAX_SALT_BYTES} bytes")
        prefix = view.ns_prefix
        if not salt:
            if len(digests) % DIGEST_BYTES:
                raise ValueError(f"digests must be a multiple of {DIGEST_BYTES} bytes")
            return [prefix + digests[i:i + DIGEST_BYTES]
                    for i in range(0, len(digests), DIGEST_BYTES)]
        key = hashlib.blake2b(salt, digest_size=32).digest() if len(salt) > 64 else salt
        return [prefix + hashlib.blake2b(d, key=key, digest_size=32).digest()
                for d in _split(digests)]

    # -- lookup -------------------------------------------------------------------------

    def _committed(self, part: Partition, key: bytes) -> int:
        slot = part.keys.get(key, -1)
        if slot >= 0 and part.state[slot] != COMMITTED:
            return -1
        return slot

    def _window_needs(self, view: CacheView, k: int) -> list[tuple[int, int, int]]:
        """``(og index, first chunk, section mask)`` the window sections need at end k."""
        out = []
        for og in view.layout.object_groups:
            needs: dict[int, int] = {}
            for bit, sec in enumerate(og.sections):
                if sec.is_window:
                    first = max(0, k - view.layout.windows[sec.window_tokens])
                    needs[first] = needs.get(first, 0) | (1 << bit)
            for first, mask in needs.items():
                out.append((og.index, first, mask))
        return out

    def _slots(self, part: Partition, keys: list[bytes]) -> np.ndarray:
        """Committed slot of each key, or -1 (one C-level dict pass, then numpy)."""
        slots = np.array(list(map(part.keys.get, keys, repeat(-1))), dtype=np.int64)
        present = slots >= 0
        if present.any():
            state = np.frombuffer(part.state, dtype=np.int8)
            present[present] = state[slots[present]] == COMMITTED
            slots[~present] = -1
        return slots

    def hit_chunks(self, view: CacheView, keys: list[bytes]) -> tuple[int, list[np.ndarray]]:
        """Length of the longest hit prefix, and per object group the slots found.

        ``slots[og][i]`` is the committed slot of chunk ``i`` or -1. Object groups with
        full sections are resolved for every chunk; window-only object groups only for
        the chunks the window rule looks at (filled lazily, -1 elsewhere).
        """
        n = len(keys)
        limit = n
        slots: list[np.ndarray] = []
        for og, part in zip(view.layout.object_groups, view.partitions, strict=True):
            if og.has_full:
                found = self._slots(part, keys)
                missing = np.flatnonzero(found < 0)
                if missing.size:
                    limit = min(limit, int(missing[0]))
            else:
                found = np.full(n, -2, dtype=np.int64)  # -2: not looked up yet
            slots.append(found)
        for k in range(limit, 0, -1):
            if self._window_ok(view, keys, slots, k):
                return k, slots
        return 0, slots

    def _window_ok(self, view: CacheView, keys: list[bytes], slots: list[np.ndarray],
                   k: int) -> bool:
        for og_index, first, mask in self._window_needs(view, k):
            part = view.partitions[og_index]
            row = slots[og_index]
            for i in range(first, k):
                s = int(row[i])
                if s == -2:
                    s = self._committed(part, keys[i])
                    row[i] = s
                if s < 0 or (part.mask[s] & mask) != mask:
                    return False
        return True

    def _needed_slots(self, view: CacheView, slots: list[np.ndarray],
                      k: int) -> list[tuple[Partition, array]]:
        """Slots a retrieve of the ``k``-chunk prefix reads, per partition."""
        out = []
        for og, part in zip(view.layout.object_groups, view.partitions, strict=True):
            if og.has_full:
                first = 0
            else:
                first = min(max(0, k - view.layout.windows[s.window_tokens])
                            for s in og.sections)
            out.append((part, array("i", slots[og.index][first:k].astype(np.int32).tobytes())))
        return out

    def lookup(self, view: CacheView, keys: list[bytes], owner: int, lease_ttl_s: float,
               now_s: float, take_lease: bool = True) -> tuple[int, Lease | None]:
        """Longest hit prefix (in chunks) and, if asked and non-empty, a lease on it."""
        self.tick += 1
        k, slots = self.hit_chunks(view, keys)
        self.stats.lookups += 1
        self.stats.lookup_chunks += len(keys)
        self.stats.hit_chunks += k
        if k == 0:
            return 0, None
        pins = self._needed_slots(view, slots, k)
        for part, ss in pins:
            part.touch_prefix(ss, self.tick)
        if not take_lease:
            return k, None
        self.stats.leases_taken += 1
        return k, self.leases.take(owner, now_s + lease_ttl_s, k, pins)

    # -- allocation ---------------------------------------------------------------------

    def alloc_slots(self, part: Partition, m: int) -> list[int]:
        """Up to ``m`` free slots of ``part`` for a caller that fills them itself (the
        L2 prefetch): see :meth:`_alloc_many`. The caller reserves, commits or aborts
        each slot through the partition, so a half-written object is never visible."""
        return self._alloc_many(part, m)

    def _alloc_many(self, part: Partition, m: int) -> list[int]:
        """Up to ``m`` free slots in ``part``: free list, new slabs, a colder partition's
        slab, own victims (fewer only when nothing else can be evicted).

        Another partition gives a slab back only if its coldest object is at least
        ``DONOR_AGE_RATIO`` times older than this partition's victim and every object in
        that slab was last used before this partition's victim: moving a slab never
        evicts anything hotter than what plain eviction here would. A partition with
        nothing to evict (new, or all pinned) takes any slab free of pins and writers.
        Once no partition qualifies, the rest of the batch evicts here without asking
        again (the donors' ages do not change within one request).
        """
        out: list[int] = []
        donors_tried = False
        while len(out) < m:
            slot = part.pop_free()
            if slot is not None:
                out.append(slot)
                continue
            slab = self.pool.take(part.pid)
            if slab is not None:
                part.add_slab(slab)
                continue
            if not donors_tried:
                if self._take_donor_slab(part):
                    continue
                donors_tried = True
            own = part.policy.peek()
            if own is None:
                break
            part.evict(own)
            self.stats.evictions += 1
            self.stats.evicted_bytes += part.object_bytes
        return out

    def _take_donor_slab(self, part: Partition) -> bool:
        """Move a slab from a much colder partition to ``part``; whether one moved."""
        own = part.policy.peek()
        own_tick = part.tick[own] if own is not None else math.inf
        # Only a partition whose coldest object is much older than ours is worth a look:
        # partitions written in step (full and window objects of the same chunks) age
        # alike, and scanning their slabs on every eviction would be wasted work.
        donor_tick = (self.tick - DONOR_AGE_RATIO * (self.tick - own_tick)
                      if own is not None else math.inf)
        donor: tuple[Partition, int] | None = None
        for other in self.partitions.values():
            if other is part:
                continue
            for v in other.policy.first(DONOR_CANDIDATES):
                if other.tick[v] >= donor_tick:
                    break
                seg = other.releasable_segment(v, colder_than=own_tick)
                if seg is not None:
                    donor, donor_tick = (other, seg), other.tick[v]
                    break
        if donor is None:
            return False
        n, nbytes = donor[0].release_segment(donor[1])
        self.stats.evictions += n
        self.stats.evicted_bytes += nbytes
        self.stats.slabs_moved += 1
        slab = self.pool.take(part.pid)
        assert slab is not None
        part.add_slab(slab)
        return True

    # -- store --------------------------------------------------------------------------

    def reserve_store(self, view: CacheView, keys: list[bytes],
                      group_ids: dict[int, np.ndarray]) -> StoreTicket:
        """Reserve a WRITING slot for every storable (object group, chunk).

        ``group_ids[g]`` is engine group ``g``'s ``(chunks, blocks_per_chunk)`` block ids,
        already bounds-checked, ``-1`` where the engine no longer has the block.
        """
        self.tick += 1
        n = len(keys)
        statuses: list[np.ndarray] = []
        reserved: list[Reservation] = []
        copies: list[RunCopy] = []
        nbytes = 0
        for og, part in zip(view.layout.object_groups, view.partitions, strict=True):
            st = np.full(n, ChunkStatus.NOT_AVAILABLE, dtype=np.uint8)
            avail: list[np.ndarray] = []
            full_ok = np.ones(n, dtype=bool)
            for sec in og.sections:
                ok = np.asarray(
                    (section_block_ids(sec, group_ids[sec.group_index]) >= 0).all(axis=1))
                avail.append(ok)
                if not sec.is_window:
                    full_ok &= ok
            any_window = np.zeros(n, dtype=bool)
            for sec, ok in zip(og.sections, avail, strict=True):
                if sec.is_window:
                    any_window |= ok
            storable = full_ok if og.has_full else any_window
            fresh: list[int] = []
            fresh_keys: set[bytes] = set()
            get = part.keys.get
            for i in np.flatnonzero(storable).tolist():
                key = keys[i]
                existing = get(key)
                if existing is not None:
                    committed = part.state[existing] == COMMITTED
                    st[i] = ChunkStatus.EXISTS if committed else ChunkStatus.IN_PROGRESS
                    if committed:
                        part.touch(existing, self.tick)
                    continue
                if key in fresh_keys:  # the same digest twice in one request
                    st[i] = ChunkStatus.IN_PROGRESS
                    continue
                fresh.append(i)
                fresh_keys.add(key)
            # Slots in ascending order along the chunks: victims of one older request are
            # neighbours in the pool, so the request's objects land in a few contiguous
            # runs (one DMA each) instead of one run per object in descending order.
            slots = array("i", sorted(self._alloc_many(part, len(fresh))))
            if len(slots) < len(fresh):
                st[fresh[len(slots):]] = ChunkStatus.NO_SPACE
                self.stats.alloc_failures["no_space"] = (
                    self.stats.alloc_failures.get("no_space", 0) + len(fresh) - len(slots))
                del fresh[len(slots):]
            bits = np.zeros(n, dtype=np.uint8)
            for bit, ok in enumerate(avail):
                bits |= ok.astype(np.uint8) << bit
            chunks = array("i", fresh)
            masks = array("B", bits[fresh].tobytes())
            for i, slot in zip(fresh, slots, strict=True):
                part.reserve(keys[i], slot, self.tick)
            st[fresh] = ChunkStatus.OK
            statuses.append(st)
            if not chunks:
                continue
            reserved.append(Reservation(og.index, part, chunks, slots, masks))
            nbytes += _plan(og, part, chunks, slots, avail, group_ids, copies)
        return StoreTicket(statuses=statuses, reserved=reserved, copies=copies, nbytes=nbytes)

    def commit_store(self, ticket: StoreTicket) -> None:
        """The copy completed: every reserved object becomes visible."""
        assert not ticket.done, "store ticket finished twice"
        ticket.done = True
        for r in ticket.reserved:
            for i in range(len(r.slots) - 1, -1, -1):  # chunk 0 ends most recent
                r.part.commit(r.slots[i], r.masks[i])
            self.stats.stored_objects += len(r.slots)
            self.stats.stored_bytes += len(r.slots) * r.part.object_bytes

    def abort_store(self, ticket: StoreTicket) -> None:
        """The copy failed or its writer is gone: free every reserved slot."""
        assert not ticket.done, "store ticket finished twice"
        ticket.done = True
        for r in ticket.reserved:
            st = ticket.statuses[r.og_index]
            for i, s in zip(r.chunks, r.slots, strict=True):
                r.part.abort(s)
                st[i] = ChunkStatus.FAILED
            self.stats.alloc_failures["aborted"] = (
                self.stats.alloc_failures.get("aborted", 0) + len(r.slots))

    # -- retrieve -----------------------------------------------------------------------

    def pin_retrieve(self, view: CacheView, keys: list[bytes],
                     group_ids: dict[int, np.ndarray],
                     prefix_ends: list[int] | None = None) -> RetrieveTicket:
        """Pin what a retrieve of these chunks (a prefix ending at the last) reads.

        Full sections are read for every chunk, window sections only for the chunks
        in their window at the end of each prefix (``prefix_ends``: exclusive chunk
        ends of the prefixes batched in one request; default one prefix). Blocks with
        id ``-1`` are left untouched.
        """
        self.tick += 1
        n = len(keys)
        bounds = list(zip([0, *(prefix_ends or [n])[:-1]], prefix_ends or [n], strict=True))
        statuses: list[np.ndarray] = []
        pinned: list[tuple[Partition, array]] = []
        copies: list[RunCopy] = []
        nbytes = objects = 0
        for og, part in zip(view.layout.object_groups, view.partitions, strict=True):
            st = np.full(n, ChunkStatus.SKIPPED, dtype=np.uint8)
            need = np.zeros((len(og.sections), n), dtype=bool)
            for bit, sec in enumerate(og.sections):
                if sec.is_window:
                    w = view.layout.windows[sec.window_tokens]
                    for lo, hi in bounds:
                        need[bit, max(lo, hi - w):hi] = True
                else:
                    need[bit, :] = True
                need[bit] &= (section_block_ids(sec, group_ids[sec.group_index]) >= 0).any(1)
            cand = np.flatnonzero(need.any(axis=0))
            get = part.keys.get
            found = np.array([get(keys[i], -1) for i in cand.tolist()], dtype=np.int64)
            want = (need[:, cand].astype(np.uint8)
                    << np.arange(len(og.sections), dtype=np.uint8)[:, None]).sum(
                        axis=0, dtype=np.uint8)
            hit = found >= 0
            if hit.any():  # (a partition may have no slots at all yet)
                at = np.maximum(found, 0)
                hit &= ((np.frombuffer(part.state, dtype=np.int8)[at] == COMMITTED)
                        & ((np.frombuffer(part.mask, dtype=np.uint8)[at] & want) == want))
            missed = cand[~hit]
            st[missed] = ChunkStatus.MISS
            need[:, missed] = False
            chunks = array("i", cand[hit].tolist())
            slots = array("i", found[hit].tolist())
            for s in slots:
                part.pin(s)  # pinned objects leave the eviction order: no touch needed
            np.frombuffer(part.tick, dtype=np.int64)[found[hit]] = self.tick
            st[cand[hit]] = ChunkStatus.OK
            statuses.append(st)
            if not chunks:
                continue
            pinned.append((part, slots))
            objects += len(slots)
            nbytes += _plan(og, part, chunks, slots, list(need), group_ids, copies)
        return RetrieveTicket(statuses=statuses, pinned=pinned, copies=copies, nbytes=nbytes,
                              objects=objects)

    def unpin_retrieve(self, ticket: RetrieveTicket, ok: bool) -> None:
        """The copy finished (or failed: every pinned chunk then reports FAILED)."""
        assert not ticket.done, "retrieve ticket finished twice"
        ticket.done = True
        for part, slots in ticket.pinned:
            for s in reversed(slots):
                part.unpin(s)
        if ok:
            self.stats.retrieved_objects += ticket.objects
            self.stats.retrieved_bytes += ticket.nbytes
        else:
            for st in ticket.statuses:
                st[st == ChunkStatus.OK] = ChunkStatus.FAILED

    # -- leases and housekeeping -----------------------------------------------------------

    def release(self, lease_id: int) -> bool:
        released = self.leases.release(lease_id) is not None
        self.stats.leases_released += released
        return released

    def expire_leases(self, now_s: float) -> int:
        n = len(self.leases.expire(now_s))
        self.stats.leases_expired += n
        return n

    def drop_owner(self, owner: int) -> int:
        """Release the leases of a session that went away."""
        n = self.leases.release_owner(owner)
        self.stats.leases_released += n
        return n

    def clear(self) -> int:
        """Evict every committed, unpinned object; give fully free slabs back."""
        n = 0
        for part in self.partitions.values():
            while (v := part.policy.peek()) is not None:
                part.evict(v)
                n += 1
            for seg, slab in enumerate(part.segments):
                if slab < 0:
                    continue
                first = seg * part.slots_per_slab
                if all(part.state[s] == 0 for s in range(first, first + part.slots_per_slab)):
                    part.release_segment(seg)
        return n

    def check(self) -> None:
        """Every partition's invariants, and pins == lease pins + in-flight reads."""
        for part in self.partitions.values():
            part.check()
