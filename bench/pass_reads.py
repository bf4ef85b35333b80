"""What a MemoryPolicy pass' reads of the scheduler cost: one connection against two.

A pass reads the workers (``identity``) and, once the tenancy check vouches for them, the
preStop drains' figures from memops' agent. Two ways, on the same scheduler, interleaved round
by round so that a loaded machine slows both alike:

- two connections (anchor): ``fetch_snapshot`` of the workers, then ``drain_status`` on a
  connection of its own, as a pass read them before;
- one connection: ``daskrpc.vetted`` and a snapshot with ``drains`` on it, as a pass reads them now.

A real scheduler with real worker processes (a local cluster), over ``tcp://`` and ``tls://``
(where a connection costs a TLS handshake too), with a few finished drains in the agent. The
figure is the median seconds of a pass' reads, and the ratio of the two in the same run.

    python bench/pass_reads.py               # 300 rounds a protocol
    python bench/pass_reads.py --rounds 50   # a quick pass
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from distributed import Client, LocalCluster
from distributed.security import Security
from memops_sandbox import dask_direct

from memops.clients import daskrpc
from memops.decisions import snapshots, tenancy


async def vouch(workers: Sequence[snapshots.WorkerInfo]) -> tenancy.Verdict:
    return tenancy.Verdict(tenancy.Reason.TENANT, "")  # the tenancy check, from its cache: no API request


async def measure(protocol: str, rounds: int) -> dict[str, Any]:
    security = Security.temporary() if protocol == "tls://" else None
    extra: dict[str, Any] = {"security": security} if security is not None else {}
    async with LocalCluster(
        n_workers=4,
        processes=True,
        threads_per_worker=1,
        dashboard_address=None,
        asynchronous=True,
        protocol=protocol,
        **extra,
    ) as local:
        async with Client(local, asynchronous=True, **extra):
            address = local.scheduler_address
            client_security = (
                daskrpc.security_from_pem(security.tls_ca_file, security.tls_client_cert, security.tls_client_key)
                if security is not None
                else None
            )
            # Finished drains in the agent, as a policy's scheduler holds after a few preStop hooks.
            workers = sorted(local.scheduler.workers)[:3]
            await dask_direct.start_drain(address, workers, deadline=5, close_workers=False, security=client_security)
            times: dict[str, list[float]] = {"two": [], "one": []}
            for _ in range(rounds):
                started = time.perf_counter()
                await dask_direct.fetch_snapshot(address, security=client_security, keys=False, processing=False)
                await dask_direct.drain_status(address, security=client_security)
                times["two"].append(time.perf_counter() - started)
                started = time.perf_counter()
                async with daskrpc.vetted(address, vouch=vouch, security=client_security) as scheduler:
                    await scheduler.snapshot(keys=False, processing=False, drains=True)
                times["one"].append(time.perf_counter() - started)
    two, one = statistics.median(times["two"]), statistics.median(times["one"])
    return {"protocol": protocol, "two": two, "one": one, "ratio": one / two}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    print("| protocol | two connections (anchor), ms | one connection, ms | one / two |")
    print("|---|---:|---:|---:|")
    for protocol in ("tcp://", "tls://"):
        row = asyncio.run(measure(protocol, args.rounds))
        print(f"| {protocol} | {row['two'] * 1000:.2f} | {row['one'] * 1000:.2f} | {row['ratio']:.2f} |")


if __name__ == "__main__":
    main()
