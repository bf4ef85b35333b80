"""Replication targets against stock Dask, side by side in one run, on real processes.

Each scenario starts a real scheduler (in this process) and real workers (``dask worker``: a
nanny and its worker, each pair in its own session), and SIGKILLs whole sessions: a pod lost
without notice (spot preemption, an OOM kill of the node): no drain, no preStop. The scheduler's
Active Memory Manager runs ReduceReplicas every 2 s, its default, throughout.

1. Target held: keys under a prefix rule (``replicas: 2``) reach two copies and stay there while
   ReduceReplicas runs; unruled keys that ``client.replicate`` copied go back to one. Then one
   worker holding copies is SIGKILLed: how long until every ruled key has two copies again.
2. Spot loss: scattered data (which nothing can recompute) placed on the two "spot" workers of
   five; both SIGKILLed. Columns: a pod rule marking them (``replicas: 2``); no rule (stock Dask);
   ``client.replicate(n=2)`` just before the kill (stock Dask's one-shot answer). Keys that
   survive, and the memory spent on extra copies when the kill came.
3. Persisted intermediates: a persisted ``load-parquet`` stage, then one worker SIGKILLed and a
   reduction over the stage computed: load tasks run again, with and without a prefix rule.
4. Pod annotation writes per minute at 200 workers: the operator's own batching
   (:func:`memops.decisions.replication_plan.plan_annotations`) over 10 minutes of policy passes every 2 s,
   with each worker's figures drifting (a few percent a pass, and now and then a jump as tasks
   land or keys are released), against a write on every pass in which a figure changed. Counted
   from the merge-patches that the function plans, one per pod written; the API server is not
   involved.

    python bench/replication.py            # the table in docs/performance.md
    python bench/replication.py --small    # the small pass CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import dask
import distributed
from distributed import Client, LocalCluster
from memops_sandbox import dask_direct

from memops.decisions import replication_plan

OPTIONS = ("--no-dashboard", "--death-timeout", "30")
DASK = str(Path(sys.executable).with_name("dask"))
OWNER = "bench/replication"
MiB = 2**20


class Workers:
    """``dask worker`` processes, each in its own session (nanny and worker killed together)."""

    def __init__(self, scheduler: str):
        self.scheduler = scheduler
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, memory_limit: str) -> None:
        command = [DASK, "worker", self.scheduler, "--name", name, "--nthreads", "1", "--memory-limit", memory_limit]
        self.processes[name] = subprocess.Popen(
            [*command, *OPTIONS],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kill(self, name: str) -> None:
        process = self.processes.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)

    def close(self) -> None:
        for name in list(self.processes):
            self.kill(name)


@contextlib.asynccontextmanager
async def cluster(names: Sequence[str], memory_limit: str) -> AsyncIterator[tuple[Client, Workers]]:
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": True}):
        async with LocalCluster(n_workers=0, processes=True, dashboard_address=None, asynchronous=True) as local:
            workers = Workers(local.scheduler_address)
            try:
                for name in names:
                    workers.spawn(name, memory_limit)
                async with Client(local, asynchronous=True) as client:
                    await client.wait_for_workers(len(names), timeout=120)
                    yield client, workers
            finally:
                workers.close()


CALL_SECONDS = 60
"""A call's bound here: generous, since the benchmarks' small pass runs beside CI's tests."""


async def addresses(client: Client) -> dict[str, str]:
    info = await client.scheduler.identity()
    return {str(w["name"]): a for a, w in info["workers"].items()}


async def configure(client: Client, rules: dict[str, Any] | None) -> dict[str, Any] | None:
    # The bench measures what a rule saves, not the call: its first call installs the agent, which
    # took over 5 s (the client's default) on a loaded two-core CI machine.
    return await dask_direct.configure_replication(
        client.scheduler.address, rules=rules, places={}, owner=OWNER, timeout=CALL_SECONDS
    )


async def poll(predicate: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    try:
        async with asyncio.timeout(timeout):
            while not (value := await predicate()):  # noqa: ASYNC110 (polling the scheduler, bounded)
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise SystemExit(f"timed out after {timeout}s waiting for {what}") from None
    return value


async def who_has(client: Client, keys: list[str]) -> dict[str, tuple[str, ...]]:
    result: dict[str, tuple[str, ...]] = await client.scheduler.who_has(keys=keys)
    return result


async def extra_bytes(client: Client, keys: list[str], size: int) -> int:
    return sum(max(len(h) - 1, 0) for h in (await who_has(client, keys)).values()) * size


# -- 1. target held -------------------------------------------------------------------------------


async def target_held(keys: int, size: int) -> dict[str, Any]:
    async with cluster(["w0", "w1", "w2", "w3"], "512MiB") as (client, workers):
        ruled = [client.submit(os.urandom, size, key=f"load-parquet-{i}") for i in range(keys)]
        unruled = [client.submit(os.urandom, size, key=f"other-{i}") for i in range(keys)]
        await distributed.wait(ruled + unruled)
        await client.replicate(unruled, n=2)
        ruled_keys, unruled_keys = [str(f.key) for f in ruled], [str(f.key) for f in unruled]
        started = time.monotonic()
        await configure(client, {"keys": [{"prefix": "load-parquet", "replicas": 2}], "maxReplicatedFraction": 0.5})

        async def settled() -> bool:
            placed = await who_has(client, ruled_keys + unruled_keys)
            return all(len(placed[k]) == 2 for k in ruled_keys) and all(len(placed[k]) == 1 for k in unruled_keys)

        await poll(settled, 60, "ruled keys at 2, unruled at 1")
        reached = time.monotonic() - started
        # Held through several ReduceReplicas cycles (2 s each): never fewer than 2, never more.
        held_until = time.monotonic() + 6
        while time.monotonic() < held_until:
            placed = await who_has(client, ruled_keys)
            assert all(len(placed[k]) == 2 for k in ruled_keys), placed
            await asyncio.sleep(0.2)
        figures = await configure(client, {"keys": [{"prefix": "load-parquet", "replicas": 2}]})
        names = {a: n for n, a in (await addresses(client)).items()}
        placed = await who_has(client, ruled_keys)
        victim = names[placed[ruled_keys[0]][0]]
        lost = sum(1 for k in ruled_keys if any(names.get(h) == victim for h in placed[k]))
        workers.kill(victim)
        killed = time.monotonic()

        async def restored() -> bool:
            now = await who_has(client, ruled_keys)
            alive = set(names) - {a for a, n in names.items() if n == victim}
            return all(len(now[k]) == 2 and set(now[k]) <= alive for k in ruled_keys)

        await poll(restored, 60, "two copies again")
        return {
            "reached_s": reached,
            "restored_s": time.monotonic() - killed,
            "copies_lost": lost,
            "vetoed": figures["vetoed"] if figures else 0,
        }


# -- 2. spot loss ---------------------------------------------------------------------------------


async def spot_loss(column: str, keys: int, size: int) -> dict[str, Any]:
    async with cluster(["spot-0", "spot-1", "od-0", "od-1", "od-2"], "1GiB") as (client, workers):
        names = await addresses(client)
        spot = [names["spot-0"], names["spot-1"]]
        futures = await client.scatter([os.urandom(size) for _ in range(keys)], workers=spot, hash=False)
        keys_ = [str(f.key) for f in futures]
        if column == "memops rule":
            await configure(client, {"pods": [{"workers": spot, "replicas": 2}], "maxReplicatedFraction": 0.5})

            async def off_spot() -> bool:
                return all(any(h not in spot for h in hs) for hs in (await who_has(client, keys_)).values())

            await poll(off_spot, 120, "a copy of each key off the spot pods")
        elif column == "client.replicate":
            await client.replicate(futures, n=2)
        spent = await extra_bytes(client, keys_, size)
        for name in ("spot-0", "spot-1"):
            workers.kill(name)
        await poll(lambda: _count_is(client, 3), 60, "spot workers gone")
        placed = await who_has(client, keys_)
        return {"survived": sum(1 for hs in placed.values() if hs), "keys": keys, "spent": spent}


async def _count_is(client: Client, count: int) -> bool:
    return len(await addresses(client)) == count


# -- 3. persisted intermediates -------------------------------------------------------------------


def load(i: int, size: int, log: str) -> bytes:
    with open(log, "a") as f:  # one line per run of the task, across processes
        f.write(f"{i}\n")
    time.sleep(0.05)
    return os.urandom(size)


async def persisted(rule: bool, keys: int, size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        log = str(Path(tmp) / "runs")
        async with cluster(["w0", "w1", "w2", "w3"], "512MiB") as (client, workers):
            stage = [client.submit(load, i, size, log, key=f"load-parquet-{i}") for i in range(keys)]
            await distributed.wait(stage)
            if rule:
                await configure(client, {"keys": [{"prefix": "load-parquet", "replicas": 2}]})
                stage_keys = [str(f.key) for f in stage]

                async def doubled() -> bool:
                    return all(len(h) == 2 for h in (await who_has(client, stage_keys)).values())

                await poll(doubled, 60, "two copies of the stage")
            runs_before = len(Path(log).read_text().splitlines())
            workers.kill("w0")
            total = client.submit(lambda *parts: sum(len(p) for p in parts), *stage, key="total-0")
            assert await total == keys * size
            return {"recomputed": len(Path(log).read_text().splitlines()) - runs_before}


# -- 4. annotation writes ------------------------------------------------------------------------


def annotation_writes(workers: int = 200, minutes: int = 10, seed: int = 0) -> dict[str, float]:
    """Writes per minute: batched (memops) and on every pass in which a figure changed (naive)."""
    rng = random.Random(seed)
    pods: dict[str, dict[str, str]] = {f"w-{i}": {} for i in range(workers)}  # each pod's annotations
    unique = {p: rng.randint(100, 2000) * MiB for p in pods}
    shared = {p: rng.randint(0, 500) * MiB for p in pods}
    under = dict.fromkeys(pods, 0)
    batched = naive = 0
    passes = int(minutes * 60 / 2)
    for n in range(passes):
        now = 1_000_000.0 + 2 * n
        for p in pods:
            jump = rng.random()
            factor = 1.5 if jump < 0.005 else 0.6 if jump < 0.01 else 1 + rng.gauss(0, 0.03)
            unique[p] = max(0, int(unique[p] * factor))
            shared[p] = max(0, int(shared[p] * (1 + rng.gauss(0, 0.03))))
            if rng.random() < 0.01:
                under[p] = rng.choice((0, 0, 1, 3))
        figures = {p: replication_plan.PodFigures(unique[p], shared[p], 2, under[p]) for p in pods}
        naive += sum(1 for p in pods if figures[p].annotations().items() - pods[p].items())
        patches = replication_plan.plan_annotations(pods, figures, now)
        batched += len(patches)
        for p, values in patches.items():
            pods[p] = {**pods[p], **values}
    return {"batched": batched / minutes, "naive": naive / minutes, "workers": workers}


def table(
    held: dict[str, Any],
    spot: dict[str, dict[str, Any]],
    persist: dict[str, int],
    size: int,
    writes: dict[str, float],
) -> str:
    lines = [
        f"Replication targets vs stock Dask (real scheduler and dask-worker processes; keys of {size // MiB} MiB)",
        "",
        f"Target held: ruled keys at 2 copies {held['reached_s']:.1f} s after the rule, held while ReduceReplicas ran"
        f" ({held['vetoed']} of its drops of ruled keys withheld); unruled keys back at 1.",
        f"SIGKILL of a worker holding {held['copies_lost']} copies: target restored in {held['restored_s']:.1f} s.",
        "",
        "| spot pods SIGKILLed (no drain) | memops pod rule | no rule (stock) | client.replicate(n=2) (stock) |",
        "| --- | --- | --- | --- |",
        "| keys that survived | " + " | ".join(f"{spot[c]['survived']} / {spot[c]['keys']}" for c in COLUMNS) + " |",
        "| memory on extra copies at the kill | "
        + " | ".join(f"{spot[c]['spent'] / MiB:.0f} MiB" for c in COLUMNS)
        + " |",
        "",
        "| persisted stage, one worker SIGKILLed | with a prefix rule | without |",
        "| --- | --- | --- |",
        f"| load tasks run again | {persist['rule']} | {persist['none']} |",
        "",
        f"Pod annotation writes at {writes['workers']} workers, passes every 2 s: {writes['batched']:.0f} a minute"
        f" batched (at most one per pod per 30 s, when a figure moved by 10% and 1 MiB) vs {writes['naive']:.0f}"
        " on every change.",
    ]
    return "\n".join(lines)


COLUMNS = ("memops rule", "no rule", "client.replicate")


async def run(keys: int, size: int) -> str:
    held = await target_held(keys, size)
    spot = {c: await spot_loss(c, keys, size) for c in COLUMNS}
    persist = {
        "rule": (await persisted(True, keys, size))["recomputed"],
        "none": (await persisted(False, keys, size))["recomputed"],
    }
    return table(held, spot, persist, size, annotation_writes())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer, smaller keys (CI)")
    args = parser.parse_args(argv)
    keys, size = (8, MiB) if args.small else (40, 4 * MiB)
    print(asyncio.run(run(keys, size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
