"""Redis Cluster routing logic without a server: seed URLs, the slot of a key (hash tags), the
slot map from a CLUSTER SLOTS reply, MOVED/ASK replies, and the config's cluster checks."""

from __future__ import annotations

import pydantic
import pytest

from storage.redis.cluster import SLOTS, Node, Redirect, SlotMap, node_url, parse_redirect, seed_urls, url_db
from storage.redis.config import RedisAdapterConfig


def test_seed_urls_keep_credentials_database_and_options() -> None:
    assert seed_urls("redis://:pw@a:7101,b:7102/0?socket_keepalive=true") == [
        "redis://:pw@a:7101/0?socket_keepalive=true",
        "redis://:pw@b:7102/0?socket_keepalive=true",
    ]
    assert seed_urls("redis://127.0.0.1:6379/3") == ["redis://127.0.0.1:6379/3"]
    assert seed_urls("unix:///run/redis.sock") == ["unix:///run/redis.sock"]
    with pytest.raises(ValueError, match="empty seed"):
        seed_urls("redis://a:1,,b:2/0")


def test_node_url_and_url_db() -> None:
    assert node_url("rediss://u:p@a:7101/0", Node("10.0.0.2", 7102)) == "rediss://u:p@10.0.0.2:7102/0"
    assert node_url("redis://a:7101/0", Node("::1", 7103)) == "redis://[::1]:7103/0"
    assert (
        url_db("redis://a:1/0"),
        url_db("redis://a:1"),
        url_db("redis://a:1/5"),
        url_db("redis://a:1?db=2"),
    ) == (
        0,
        0,
        5,
        2,
    )


def test_hash_tags_put_keys_on_one_slot() -> None:
    assert SlotMap.slot(b"{user1000}.following") == SlotMap.slot(b"{user1000}.followers")
    assert SlotMap.slot(b"123456789") == 12739  # the CRC16 check value of the Redis spec
    assert SlotMap.slot(b"foo{bar}{zap}") == SlotMap.slot(b"bar")  # the first tag counts
    assert SlotMap.slot(b"foo{{bar}}zap") == SlotMap.slot(b"{bar")
    assert SlotMap.slot(b"foo{}{bar}") != SlotMap.slot(b"bar")  # an empty tag: the whole key


def test_slot_map_from_cluster_slots_and_moved() -> None:
    reply = [
        [0, 5460, [b"127.0.0.1", 7101, b"id1", {}]],
        [5461, 10922, [b"", 7102, b"id2"]],  # a node that does not know its address
        [10923, 16383, [b"127.0.0.1", 7103, b"id3"], [b"127.0.0.1", 7203, b"replica"]],
    ]
    slots = SlotMap.from_reply(reply, "10.9.9.9")
    assert slots.owner(0) == Node("127.0.0.1", 7101)
    assert slots.owner(6000) == Node("10.9.9.9", 7102)
    assert slots.owner(SLOTS - 1) == Node("127.0.0.1", 7103)
    assert slots.nodes == [Node("10.9.9.9", 7102), Node("127.0.0.1", 7101), Node("127.0.0.1", 7103)]
    slots.move(0, Node("127.0.0.1", 7103))
    assert slots.owner(0) == Node("127.0.0.1", 7103)
    partial = SlotMap.from_reply([[0, 99, [b"h", 1, b"x"]]], "h")
    assert partial.owner(100) is None  # an uncovered slot: its keys fail, nothing hangs


def test_redirect_replies() -> None:
    assert parse_redirect("MOVED 3999 127.0.0.1:7102") == Redirect(False, 3999, Node("127.0.0.1", 7102))
    assert parse_redirect("redis: ASK 1 10.0.0.1:7101") == Redirect(True, 1, Node("10.0.0.1", 7101))
    assert parse_redirect("redis: OOM command not allowed") is None


def test_config_checks_cluster_settings() -> None:
    assert RedisAdapterConfig().cluster == "auto"
    assert RedisAdapterConfig(url="redis://a:1,b:2/0", cluster=True).cluster is True
    with pytest.raises(pydantic.ValidationError, match="database 0 only"):
        RedisAdapterConfig(url="redis://a:1/4", cluster=True)
    with pytest.raises(pydantic.ValidationError, match="need cluster mode"):
        RedisAdapterConfig(url="redis://a:1,b:2/0", cluster=False)
