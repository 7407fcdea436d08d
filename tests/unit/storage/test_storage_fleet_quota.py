"""QuotaSeal: a fleet quota sealed with the deployment's key opens to its limit (None: unlimited)
under that key or a key list that still holds it (rotation); a value edited, written without the
key, moved to another tenant or prefix, or sealed with another deployment's key is INVALID."""

from __future__ import annotations

from storage.auth import BlobKeys
from storage.redis.fleet_quota import INVALID, QuotaSeal

OURS = BlobKeys([b"\x11" * 32])
ROTATED = BlobKeys([b"\x22" * 32, b"\x11" * 32])
THEIRS = BlobKeys([b"\x33" * 32])


def test_a_sealed_quota_opens_to_its_limit_under_the_same_keys_or_a_rotation() -> None:
    seal = QuotaSeal(OURS, "kv:")
    assert seal.open("t", seal.seal("t", 1000)) == 1000
    assert seal.open("t", seal.seal("t", None).encode()) is None
    assert QuotaSeal(ROTATED, "kv:").open("t", seal.seal("t", 0)) == 0


def test_a_value_not_sealed_by_this_deployment_for_this_tenant_is_invalid() -> None:
    seal = QuotaSeal(OURS, "kv:")
    value = seal.seal("t", 1000)
    limit, key_id, mac = value.split(":")
    assert seal.open("t", "-1") == INVALID  # what a plain writer of the Redis sets
    assert seal.open("t", f"-1:{key_id}:{mac}") == INVALID  # the limit edited
    assert seal.open("u", value) == INVALID  # another tenant's value
    assert QuotaSeal(OURS, "other:").open("t", value) == INVALID  # another prefix
    assert QuotaSeal(THEIRS, "kv:").open("t", value) == INVALID
    for junk in (None, b"", "x", "1:zz:zz", f"{limit}:{key_id}", "-5:" + key_id + ":" + mac):
        assert seal.open("t", junk) == INVALID


def test_without_keys_values_are_plain_limits() -> None:
    seal = QuotaSeal(None, "kv:")
    assert seal.seal("t", 5) == "5" and seal.open("t", b"5") == 5
    assert seal.open("t", seal.seal("t", None)) is None
    assert seal.open("t", QuotaSeal(OURS, "kv:").seal("t", 5)) == INVALID
