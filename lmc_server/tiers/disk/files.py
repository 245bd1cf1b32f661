"""The disk tier's files: one L2 object, one file under the tier's directory.

Layout::

    ROOT/lmc2/<space, 32 hex>/<first chunk-key byte, 2 hex>/<chunk key, 64 hex>

one file per L2 key (:func:`lmc_server.tiers.codec.l2_key`), holding the L2 value as is
(header with namespace hash, chunk key, length and XXH3 checksum, then the payload), so
the tier checks a file exactly as it checks a Redis value: a damaged, truncated or
foreign file is a miss and a counter, never served. The fan-out keeps directories
small (256 per namespace and layout).

:class:`DiskFiles` names the files (``path_of``, and its inverse ``key_of`` for the
index rebuild), reads and writes them whole in either layout
(:mod:`lmc_server.tiers.disk.layout`, through :mod:`lmc_server.tiers.disk.direct_io`) and removes
them. It decides nothing about capacity (the backend reserves a file's bytes in the
ledger before it asks for the write) and keeps no index. Everything but the naming,
``encode`` and ``release`` runs on the tier's I/O threads.

Invariants: a file is never written over by another value: a write that finds this
value there (its size and header prefix, :func:`holds`) writes nothing, one that finds
another value removes that file first; a file appears whole or not at all (written
under a temporary name, renamed into place); every file removed here leaves the ledger
with its bytes; ``direct`` is set at connect, before any I/O thread reads it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

from lmc_server.tiers import codec
from lmc_server.tiers.backend import SlotObject, Value
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk import layout as disk_layout
from lmc_server.tiers.disk.ledger import DiskLedger, remove_counted

#: A file longer than this is not read whole (no object is near it; a miss).
MAX_VALUE_BYTES = 1 << 30
#: Idle aligned buffers kept for reuse (reads and writes; see direct_io.BufferPool).
BUFFER_POOL_BYTES = 256 << 20


class DiskFiles:
    """The object files under ``base`` (``ROOT/lmc2``); removals counted in ``ledger``."""

    def __init__(self, base: str, ledger: DiskLedger) -> None:
        self.base = base
        self.ledger = ledger
        #: Whether files are read and written with ``O_DIRECT`` (probed at connect).
        self.direct = False
        self.buffers = direct_io.BufferPool(BUFFER_POOL_BYTES)
        #: leaf directories made (or found) by this process: not made again
        self._made: set[str] = set()

    # -- names -----------------------------------------------------------------------

    def path_of(self, key: bytes) -> str:
        if len(key) != len(
            codec.KEY_PREFIX
        ) + codec.SPACE_BYTES + codec.CHUNK_KEY_BYTES or not key.startswith(codec.KEY_PREFIX):
            raise ValueError("not an L2 key")
        rest = key[len(codec.KEY_PREFIX) :]
        space, chunk = rest[: codec.SPACE_BYTES].hex(), rest[codec.SPACE_BYTES :].hex()
        return os.path.join(self.base, space, chunk[:2], chunk)

    def key_of(self, directory: str, name: str) -> bytes | None:
        space = os.path.basename(os.path.dirname(directory))
        if len(name) != 2 * codec.CHUNK_KEY_BYTES or len(space) != 2 * codec.SPACE_BYTES:
            return None
        try:
            return codec.KEY_PREFIX + bytes.fromhex(space) + bytes.fromhex(name)
        except ValueError:
            return None

    def leaf_dirs(self) -> list[str]:
        """The directories files are in (``base/<space>/<2 hex>``), as found now."""
        out: list[str] = []
        try:
            spaces = [e.path for e in os.scandir(self.base) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return out
        for sp in spaces:
            try:
                out.extend(e.path for e in os.scandir(sp) if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
        return out

    # -- reads -----------------------------------------------------------------------

    def read(self, key: bytes) -> tuple[memoryview, int] | None:
        """The value in ``key``'s file (either layout) and the file's size."""
        data = direct_io.read_file(
            self.path_of(key), self.direct, MAX_VALUE_BYTES, self.buffers.take
        )
        if data is None:
            return None
        return disk_layout.value_of_file(data), len(data)

    def release(self, values: Sequence[Value | None]) -> None:
        for v in values:
            if isinstance(v, memoryview):
                self.buffers.give(v.obj)

    # -- writes ----------------------------------------------------------------------

    def encode(self, space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> memoryview:
        """Header and payload in one aligned buffer (one copy), written as is."""
        buf = self.buffers.take(codec.HEADER_BYTES + len(payload))
        n = codec.encode_into(memoryview(buf), space, chunk_key, mask, payload)
        return memoryview(buf)[:n]

    def write(self, key: bytes, value: Value) -> bool:
        view = memoryview(value)
        return self._to_path(
            key,
            lambda path: direct_io.write_file(path, view, self.direct),
            len(view),
            bytes(view[: codec.HEADER_PREFIX_BYTES]),
        )

    def _to_path(
        self, key: bytes, write: Callable[[str], None], file_bytes: int, prefix: bytes
    ) -> bool:
        """``write(path)`` for ``key``'s file, its directory made on first use; False
        (nothing written) when the file is there already with this value's size and
        header (another server sharing the directory, or this one earlier, wrote it)."""
        path = self.path_of(key)
        there = holds(path, file_bytes, prefix)
        if there:
            return False
        if there is None:  # another value under this key: never written over
            self.remove(key)
        directory = os.path.dirname(path)
        if directory not in self._made:
            os.makedirs(directory, mode=0o750, exist_ok=True)
            self._made.add(directory)
        try:
            write(path)
        except FileNotFoundError:  # the directory went (an operator cleaning up): once more
            os.makedirs(directory, mode=0o750, exist_ok=True)
            write(path)
        return True

    def write_slot(self, obj: SlotObject, aligned: bool) -> bool:
        """Write one object from its (pinned) slot, on one I/O thread: in the aligned
        layout straight from the slot (:mod:`lmc_server.tiers.disk.layout`), else copied
        with its header into an aligned buffer first (while this thread copies, the
        others' writes are in flight)."""
        if aligned:
            write = functools.partial(
                disk_layout.write_aligned,
                space=obj.space,
                chunk_key=obj.chunk_key,
                mask=obj.mask,
                payload=obj.payload,
                buffers=self.buffers,
            )
            prefix = codec.header_prefix(obj.space, obj.chunk_key, obj.mask, len(obj.payload))
            size = disk_layout.file_bytes(len(obj.payload), aligned=True)
            return self._to_path(obj.key, write, size, prefix)
        prefix = codec.header_prefix(obj.space, obj.chunk_key, obj.mask, len(obj.payload))
        if holds(self.path_of(obj.key), obj.value_bytes, prefix):
            return False  # (the copy is not made for nothing)
        value = self.encode(obj.space, obj.chunk_key, obj.mask, obj.payload)
        try:
            return self.write(obj.key, value)
        finally:
            self.buffers.give(value.obj)

    # -- removal ---------------------------------------------------------------------

    def remove(self, key: bytes) -> int:
        """Delete ``key``'s file (I/O thread); its bytes leave the ledger (0: none)."""
        path = self.path_of(key)
        size = remove_counted(path, direct_io.temporary_path(path))
        self.ledger.release(size)
        return size


def holds(path: str, file_bytes: int, prefix: bytes) -> bool | None:
    """Whether ``path`` is a file of ``file_bytes`` whose header starts with ``prefix``
    (the value to be written is there already): True; False when there is no file;
    None when there is another one (I/O thread)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    try:
        if st.st_size != file_bytes:
            return None
        with open(path, "rb", buffering=0) as f:
            return True if f.read(len(prefix)) == prefix else None
    except OSError:
        return None
