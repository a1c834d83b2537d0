"""The KV-event wire as a router reads it: every message checked, a bad one a ``BadMessage``
with the reason it is counted under, never another exception."""

from __future__ import annotations

import msgpack
import pytest

from serve_app.kvcache.events import (
    CLEARED,
    REMOVED,
    STORED,
    BadMessage,
    EngineLoad,
    encode,
    parse_event,
    parse_snapshot,
)
from tests.kvcache.peers import event, snapshot


def test_a_good_event_is_read_whole():
    raw = event(7, 3, [1, 2], accepted=["req-1-1"])
    batch = parse_event(raw)
    assert (batch.epoch, batch.seq, batch.ops, batch.accepted) == (
        7,
        3,
        [(STORED, [1, 2])],
        ["req-1-1"],
    )
    assert batch.load == EngineLoad()


def test_every_op_kind_is_read():
    ops = [[STORED, [1]], [REMOVED, [1]], [CLEARED]]
    assert parse_event(event(1, 1, ops=ops)).ops == [(STORED, [1]), (REMOVED, [1]), (CLEARED, [])]


def test_a_message_from_before_the_version_field_is_version_one():
    payload = msgpack.unpackb(event(1, 1, [5]))
    del payload["v"]
    assert parse_event(encode(payload)).ops == [(STORED, [5])]


def test_a_newer_replicas_extra_load_fields_are_ignored():
    load = {"backlog": 4, "slots": 8, "kv_usage": 0.5}
    assert parse_event(event(1, 1, load=load)).load == EngineLoad(backlog=4, slots=8)


BAD_EVENTS = {
    "not msgpack": (b"\xc1\xc1", "malformed"),
    "truncated": (event(1, 1, [1, 2, 3])[:-3], "malformed"),
    "a list": (encode([1, 2, 3]), "malformed"),
    "a newer version": (event(1, 1, v=2), "version"),
    "a version that is not a number": (event(1, 1, v="1"), "version"),
    "no epoch": (event(None, 1), "malformed"),
    "a negative seq": (event(1, -1), "malformed"),
    "a seq that is a bool": (event(1, True), "malformed"),
    "ops not a list": (event(1, 1, ops={"s": [1]}), "malformed"),
    "an unknown op": (event(1, 1, ops=[["x", [1]]]), "malformed"),
    "an empty op": (event(1, 1, ops=[[]]), "malformed"),
    "hashes that are not ints": (event(1, 1, ops=[[STORED, ["a"]]]), "malformed"),
    "hashes that are not a list": (event(1, 1, ops=[[STORED, 5]]), "malformed"),
    "accepted not ids": (event(1, 1, accepted=[1]), "malformed"),
    "no ts": (event(1, 1, ts="now"), "malformed"),
    "a ts that is no time": (event(1, 1, ts=float("inf")), "malformed"),
    "no load": (event(1, 1, load=None), "malformed"),
    "a load that is not counts": (event(1, 1, load={"backlog": "many"}), "malformed"),
    "no slots": (event(1, 1, load={"slots": 0}), "malformed"),
}


@pytest.mark.parametrize("case", BAD_EVENTS)
def test_a_bad_event_is_refused_with_its_reason(case):
    raw, reason = BAD_EVENTS[case]
    with pytest.raises(BadMessage) as caught:
        parse_event(raw)
    assert caught.value.reason == reason


def test_a_snapshot_is_read_into_a_set_cut_to_the_index_bound():
    snap = parse_snapshot(snapshot(9, 4, [3, 1, 2, 2]), max_blocks=3)
    assert (snap.epoch, snap.seq, snap.load) == (9, 4, EngineLoad())
    assert snap.blocks == {1, 2, 3}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"junk", "malformed"),
        (snapshot(1, 1, v=2), "version"),
        (encode({"epoch": 1, "seq": 1, "blocks": "all of them", "load": {}}), "malformed"),
        (snapshot(1, 1, blocks=[[1, 2]]), "malformed"),  # unhashable: no set to build
        (snapshot(1, 1, load=[]), "malformed"),
    ],
)
def test_a_bad_snapshot_is_refused_with_its_reason(raw, reason):
    with pytest.raises(BadMessage) as caught:
        parse_snapshot(raw, max_blocks=100)
    assert caught.value.reason == reason
