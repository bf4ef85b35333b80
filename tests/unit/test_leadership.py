"""Which replica acts, from Kopf's peering record, and when the gate's Lease is free: pure."""

from __future__ import annotations

import datetime

import pytest

from memops.decisions import leadership

NOW = datetime.datetime(2026, 11, 29, 6, 0, tzinfo=datetime.UTC)
NOW_TEXT = leadership.micro_time(NOW)
FUTURE_TEXT = leadership.micro_time(NOW + datetime.timedelta(days=365))
SKEWED_TEXT = leadership.micro_time(NOW + datetime.timedelta(seconds=3))
"""A replica whose clock is 3 s ahead: its hold is real."""


def _peer(priority: object, seen: datetime.datetime = NOW, lifetime: object = 15) -> dict[str, object]:
    return {"priority": priority, "lastseen": leadership.micro_time(seen), "lifetime": lifetime}


def test_the_older_replica_has_the_higher_priority() -> None:
    older = leadership.start_priority(NOW - datetime.timedelta(milliseconds=1))
    assert older > leadership.start_priority(NOW) > 0


def test_a_replica_leads_unless_a_live_peer_is_as_high() -> None:
    me = leadership.start_priority(NOW)
    assert leadership.leads(None, "a", me, NOW), "no peer has written"
    assert leadership.leads({"a": _peer(me)}, "a", me, NOW), "its own record"
    assert leadership.leads({"a": _peer(me), "b": _peer(me - 1)}, "a", me, NOW)
    assert not leadership.leads({"b": _peer(me + 1)}, "a", me, NOW), "an older peer acts"
    assert not leadership.leads({"b": _peer(me)}, "a", me, NOW), "the same priority pauses both (Kopf)"
    dead = _peer(me + 1, NOW - datetime.timedelta(seconds=16))
    assert leadership.leads({"b": dead}, "a", me, NOW), "a peer past its lifetime is dead"


@pytest.mark.parametrize(
    "status",
    [
        [],
        {"b": "live"},
        {"b": _peer("high")},
        {"b": _peer(1, lifetime="15")},
        {"b": {"priority": 1, "lastseen": "yesterday", "lifetime": 15}},
        {"b": {"priority": 1, "lastseen": "9" * 100, "lifetime": 15}},
    ],
)
def test_a_record_that_cannot_be_read_pauses(status: object) -> None:
    assert not leadership.leads(status, "a", leadership.start_priority(NOW), NOW)


def test_a_lease_is_free_when_unheld_held_by_the_asker_or_expired() -> None:
    held = leadership.lease_spec("a", NOW, seconds=10)
    assert leadership.lease_free({}, "b", NOW)
    assert leadership.lease_free({"holderIdentity": ""}, "b", NOW)
    assert leadership.lease_free(held, "a", NOW)
    assert not leadership.lease_free(held, "b", NOW + datetime.timedelta(seconds=9))
    assert leadership.lease_free(held, "b", NOW + datetime.timedelta(seconds=11))


ONE_SECOND = datetime.timedelta(seconds=1)


@pytest.mark.parametrize(
    ("spec", "later", "free"),
    [
        pytest.param({"holderIdentity": "t"}, 0, True, id="no-renewal-time"),
        pytest.param("held", 0, True, id="not-a-map"),
        pytest.param({"holderIdentity": "t", "renewTime": "soon", "leaseDurationSeconds": 10}, 0, True, id="bad-time"),
        pytest.param({"holderIdentity": "t", "renewTime": NOW_TEXT, "leaseDurationSeconds": "9"}, 0, True, id="text"),
        pytest.param({"holderIdentity": "t", "renewTime": NOW_TEXT, "leaseDurationSeconds": True}, 0, True, id="bool"),
        pytest.param(
            {"holderIdentity": "t", "renewTime": NOW_TEXT, "leaseDurationSeconds": 10**9}, 9, False, id="long-within"
        ),
        pytest.param(
            {"holderIdentity": "t", "renewTime": NOW_TEXT, "leaseDurationSeconds": 10**9}, 11, True, id="long-capped"
        ),
        pytest.param(
            {"holderIdentity": "t", "renewTime": NOW_TEXT, "leaseDurationSeconds": -5}, 1, True, id="negative"
        ),
        pytest.param(
            {"holderIdentity": "t", "renewTime": FUTURE_TEXT, "leaseDurationSeconds": 10}, 0, True, id="future"
        ),
        pytest.param(
            {"holderIdentity": "t", "renewTime": SKEWED_TEXT, "leaseDurationSeconds": 10}, 0, False, id="skewed"
        ),
    ],
)
def test_a_forged_lease_holds_nothing_longer_than_memops_writes(spec: object, later: int, free: bool) -> None:
    """A tenant who may write Leases forges the gate's: it never holds past LEASE_SECONDS from a
    renewal no later than LEASE_SECONDS from now, and one that cannot be read holds nothing (else
    every eviction of the policy's workers, a node's drain included, is refused while it says)."""
    assert leadership.lease_free(spec, "b", NOW + later * ONE_SECOND) is free


def test_a_lease_name_is_a_valid_name_for_any_namespace_and_policy() -> None:
    assert leadership.lease_name("ns", "p") == "memops-gate-ns.p"
    long = "a" * 253
    assert len(leadership.lease_name("n" * 63, long)) <= 253
    assert leadership.lease_name("ns", long) != leadership.lease_name("ns", "a" * 252 + "b")
    assert leadership.lease_name("ns", long) != leadership.lease_name("other", long)
