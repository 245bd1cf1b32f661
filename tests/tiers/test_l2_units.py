"""The L2 pieces that need no store: value codec, URL and credential rules, config."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from click.testing import CliRunner

from lmc_server.cli.main import cli
from lmc_server.config import Config, ConfigError
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.tiers import codec
from lmc_server.tiers.poolview import PoolView, PoolViewError
from lmc_server.tiers.url import L2ConfigError, parse_l2_url, read_password
from lmc_server.transfer.null import NullHostPool

SPACE = codec.space_of("model=x;kv_dtype=fp8;arch=sm90;world=1;rank=replicated", b"f" * 16, 256)
CHUNK_KEY = bytes(range(32))


def value(payload: bytes = b"kv" * 500, mask: int = 3) -> bytes:
    return codec.encode_value(SPACE, CHUNK_KEY, mask, memoryview(payload))


def test_value_round_trip() -> None:
    v = value()
    assert codec.check_header(v, SPACE, CHUNK_KEY, 1000) == (3, None)
    assert codec.check_payload(v)
    assert bytes(codec.payload(v)) == b"kv" * 500


def test_space_separates_every_namespace_field_layout_and_chunk_size() -> None:
    base = ("model=x;kv_dtype=fp8;arch=sm90;world=1;rank=replicated", b"f" * 16, 256)
    variants = [
        ("model=y;kv_dtype=fp8;arch=sm90;world=1;rank=replicated", b"f" * 16, 256),
        ("model=x;kv_dtype=fp8;arch=sm100;world=1;rank=replicated", b"f" * 16, 256),
        ("model=x;kv_dtype=fp8;arch=sm90;world=1;rank=0", b"f" * 16, 256),
        ("model=x;kv_dtype=fp8;arch=sm90;world=8;rank=replicated", b"f" * 16, 256),
        (base[0], b"g" * 16, 256),
        (base[0], b"f" * 16, 512),
    ]
    spaces = {codec.space_of(*base)} | {codec.space_of(*v) for v in variants}
    assert len(spaces) == len(variants) + 1


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda v: v[:40], codec.Invalid.TRUNCATED),
        (lambda v: v[:-1], codec.Invalid.TRUNCATED),
        (lambda v: v + b"x", codec.Invalid.TRUNCATED),
        (lambda v: b"XXXX" + v[4:], codec.Invalid.BAD_MAGIC),
        (lambda v: v[:4] + bytes([codec.FORMAT_VERSION + 1]) + v[5:], codec.Invalid.VERSION),
        (lambda v: v[:8] + bytes(16) + v[24:], codec.Invalid.FOREIGN),
        (lambda v: v[:24] + bytes(32) + v[56:], codec.Invalid.FOREIGN),
    ],
)
def test_damaged_headers_are_refused(damage: object, reason: codec.Invalid) -> None:
    assert callable(damage)
    assert codec.check_header(damage(value()), SPACE, CHUNK_KEY, 1000) == (0, reason)


def test_wrong_length_is_refused_even_with_a_consistent_header() -> None:
    assert codec.check_header(value(b"x" * 999), SPACE, CHUNK_KEY, 1000) == (
        0,
        codec.Invalid.LENGTH,
    )


def test_every_single_bit_flip_in_payload_or_mask_fails_the_checksum() -> None:
    v = bytearray(value(bytes(np.random.default_rng(0).integers(0, 256, 300, np.uint8))))
    for pos in [5, *range(codec.HEADER_BYTES, len(v), 7)]:
        for bit in (0, 7):
            w = bytearray(v)
            w[pos] ^= 1 << bit
            assert not codec.check_payload(bytes(w)), (pos, bit)


def test_checksum_covers_every_header_byte() -> None:
    v = value()
    assert codec.check_payload(v)
    for pos in range(codec.HEADER_BYTES - 8):  # all but the checksum field itself
        w = bytearray(v)
        w[pos] ^= 0x10
        assert not codec.check_payload(bytes(w)), pos


def test_a_value_of_format_version_1_is_refused_as_version() -> None:
    """Version 1 (crc32, a 4-byte checksum field) is never parsed with today's layout."""
    import struct

    payload = b"p" * 1000
    head = bytearray(
        struct.pack("<4sBBH16s32sQI", codec.MAGIC, 1, 1, 0, SPACE, CHUNK_KEY, len(payload), 0)
    )
    struct.pack_into("<I", head, len(head) - 4, zlib.crc32(payload, zlib.crc32(head)))
    old = bytes(head) + payload
    assert codec.check_header(old, SPACE, CHUNK_KEY, 1000) == (0, codec.Invalid.VERSION)


# -- URL, credentials, configuration ---------------------------------------------------


def test_urls() -> None:
    assert parse_l2_url("redis://kvstore:6379/0").kind == "redis"
    assert not parse_l2_url("redis://kvstore:6379/0").tls
    assert parse_l2_url("rediss://kvstore:6380/0").tls
    assert parse_l2_url("valkey://kv:6379").kind == "redis"
    assert parse_l2_url("valkeys://kv:6379").tls
    assert parse_l2_url("redis://default@kv:6379/0").kind == "redis"  # user, no password
    assert (
        parse_l2_url("mooncake://master:50051?metadata=http://m:8080/metadata").kind == "mooncake"
    )
    for bad in ("kvstore:6379", "http://kv:80", "redis://", "redis://kv:99999"):
        with pytest.raises(L2ConfigError):
            parse_l2_url(bad)


def test_password_in_url_is_refused_and_names_the_alternatives() -> None:
    with pytest.raises(L2ConfigError, match="LMCACHE_L2_PASSWORD"):
        parse_l2_url("redis://user:hunter2@kv:6379/0")
    with pytest.raises(L2ConfigError, match="password"):
        parse_l2_url("rediss://:hunter2@kv:6379/0")


def test_password_from_env_or_file(tmp_path: os.PathLike[str]) -> None:
    assert read_password("", {"LMCACHE_L2_PASSWORD": "s3"}) == "s3"
    assert read_password("", {}) is None
    f = os.path.join(tmp_path, "pw")
    with open(f, "w") as fh:
        fh.write("from-file\nignored\n")
    assert read_password(f, {"LMCACHE_L2_PASSWORD": "env"}) == "from-file"
    with pytest.raises(L2ConfigError, match="cannot read"):
        read_password(os.path.join(tmp_path, "missing"))
    open(f, "w").close()
    with pytest.raises(L2ConfigError, match="empty"):
        read_password(f)


def test_config_refuses_l2_on_the_null_backend() -> None:
    with pytest.raises(ConfigError, match="null"):
        Config(backend="null", l2_url="redis://127.0.0.1:6379/0").check()
    with pytest.raises(PoolViewError, match="null"):
        PoolView(NullHostPool(1 << 20, 1 << 20), "null")


def test_cli_refuses_a_password_on_the_command_line() -> None:
    res = CliRunner().invoke(
        cli,
        [
            "server",
            "--backend",
            "cpu",
            "--l1-size-gb",
            "0.0625",
            "--slab-size-mb",
            "16",
            "--l2",
            "redis://:hunter2@127.0.0.1:6379/0",
        ],
    )
    assert res.exit_code == 2
    assert "LMCACHE_L2_PASSWORD" in res.output and "hunter2" not in res.output


def test_lookup_result_wire_format_is_unchanged_without_pending_chunks() -> None:
    plain = encode(m.LookupResult(req_id=1, hit_chunks=3, lease_id=7, lease_ttl_s=30.0))
    assert b"l2_pending_chunks" not in plain
    back = decode_reply(plain)
    assert isinstance(back, m.LookupResult) and back.l2_pending_chunks == 0
    pending = decode_reply(encode(m.LookupResult(req_id=1, hit_chunks=0, l2_pending_chunks=5)))
    assert isinstance(pending, m.LookupResult) and pending.l2_pending_chunks == 5
