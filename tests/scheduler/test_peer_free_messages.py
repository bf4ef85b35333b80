"""What the operator says of a scheduler's address quotes nothing that the peer chose.

Anyone who may write ``spec.scheduler.address`` reads the status that the operator writes about
it. If a closed port, a silent one, a TLS failure, an SSH banner and an HTTP server read
differently there, the operator is a port scanner and a banner reader into the cluster's
network for them. So everything that is not a Dask scheduler reads the same, with the same
reason, and names no number and no text of the peer; what happened goes to the operator's log.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

import pytest
from memops_sandbox import dask_direct

from memops.clients import daskrpc
from memops.controllers import retirement
from tests.scheduler import hostile

CALLS: dict[str, Callable[[str], Awaitable[object]]] = {
    "ping": lambda a: dask_direct.ping(a, timeout=1),
    "fetch_snapshot": lambda a: dask_direct.fetch_snapshot(a, timeout=1),
    "retire_workers": lambda a: dask_direct.retire_workers(a, ["tcp://127.0.0.1:2"], timeout=1),
}


@pytest.mark.parametrize("name", CALLS)
async def test_whatever_is_not_a_scheduler_reads_the_same(name: str, caplog: pytest.LogCaptureFixture) -> None:
    said: dict[str, tuple[str, str, str]] = {}
    for peer in hostile.PEERS:
        async with hostile.not_a_scheduler(peer) as address:
            with caplog.at_level(logging.INFO, logger="memops.clients.daskrpc"):
                with pytest.raises(daskrpc.SchedulerUnreachable) as raised:
                    await CALLS[name](address)
        exc = raised.value
        # Not SchedulerMisbehaved for some of them: the status' reason would tell them apart.
        reason, message, _ = retirement._explain(exc)
        said[peer] = (type(exc).__name__, reason, message.replace(address, "<address>"))
        assert not re.search(r"\d", str(exc).replace(address, "")), f"{peer}: {exc}"
        assert address in caplog.text, "what happened is in the operator's log"
        caplog.clear()
    assert len(set(said.values())) == 1, said
    assert "unreachable" in next(iter(said.values()))[2]


async def test_an_error_text_goes_to_the_log_not_to_the_status(caplog: pytest.LogCaptureFixture) -> None:
    """A peer's error text is its own words: the tenancy check has not vouched for it yet."""
    banner = "nginx/1.25.3 on 10.0.0.7:4242"
    async with hostile.raising(banner) as address:
        with caplog.at_level(logging.INFO, logger="memops.clients.daskrpc"):
            with pytest.raises(daskrpc.SchedulerMisbehaved) as raised:
                await dask_direct.fetch_snapshot(address, timeout=5)
    message = retirement._explain(raised.value)[1]
    # Without the peer's own address, whose port may hold those digits too.
    assert "nginx" not in message and "4242" not in message.replace(address, ""), message
    assert "an error from a handler that every Dask scheduler serves" in message, message
    assert banner in caplog.text, "the peer's text is in the operator's log"


@pytest.mark.parametrize("size", [2**31 + 7, 123_456_789])
async def test_a_size_that_the_peer_declared_is_never_quoted(size: int) -> None:
    """After the handshake a reply over the limit is refused naming the limit, not what it declared."""
    async with hostile.bombing("identity", "maps", size) as address:
        with pytest.raises(daskrpc.SchedulerMisbehaved) as raised:
            await dask_direct.ping(address, timeout=5)
    assert str(size) not in str(raised.value), raised.value
    assert "over this call's limit" in str(raised.value)
