"""Shared spill on real Nodes, the shared-memory spill design's own benchmark: disk spill, memops'
shared spill without links, and with links and maps, on an all-pairs (O(n^2)) workload, in one run.

One sandbox of one real Node (a kubelet, containerd, pods in containers whose memory limits the kernel
enforces), with a swap file on and the Node's shared tmpfs at the operator's allowed host directory,
mounted as the chart's node DaemonSet mounts it (without ``noswap``, so its pages can reach swap).
For every set-up and case, a worker Deployment of ``--workers`` pods (Dask limit ``--dask-limit``,
container limit ``--container-limit``, one thread each) joins the sandbox's scheduler, then:

- blocks of ``--chunk-mib`` are made on the workers (numpy arrays of random floats, or pandas Series
  of Python strings: object dtype, pure-Python data), ``--fits-mib`` (less than the workers' targets
  together) or ``--spills-mib`` (more than their limits together) in all;
- one task per pair of blocks (i <= j) reads both whole (a dot product; for strings, every string's
  length), so that every worker needs most blocks, wherever they were made: the design's O(n^2) shape;
- the result is checked against the other set-ups' (the same blocks, the same sum).

Set-ups: ``disk``: no MemoryPolicy, the workers spill to an emptyDir on the Node's disk (the anchor);
``tmpfs``: a MemoryPolicy with ``sharedSpill: {medium: Node, links: false}``, every worker of the Node
spilling into the one tmpfs, fetches and reads as stock Dask; ``links``: the same with links and maps
(same-node fetches of spilled keys by hardlink, reads of them as memory maps). Targets: 0.6 (Dask's
default) and 0 (written 0.001: Dask reads 0 as "no target"), the design's cure for a key held both in
private memory and in the tmpfs.

Figures: wall seconds from the first block to the last pair; peak RAM, the highest sum over the worker
containers' cgroups of their anonymous pages (private) and their tmpfs pages (shared; the kernel
charges a tmpfs page once, to the pod that wrote it, however many workers link or map it; a disk
spill's page cache is not counted: the kernel can drop it); swap at its highest (the containers' pages
in swap); bytes the workers wrote to each other for fetches (their comms' own count; a link is a few
hundred bytes), and keys sent by link.

    python bench/shared_spill_nodes.py                    # the table in docs/performance.md
    python bench/shared_spill_nodes.py --setups disk links --cases numpy-fits-0.6
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchkit
import distributed
import shared_spill
import yaml
from memops_sandbox import common as sandbox
from memops_sandbox import nodes as real_nodes

MIB = 2**20
SPILL_ROOT = "/var/lib/memops/spill"
"""The host directory the sandbox's operator is allowed for shared spill (the chart's sharedSpill.hostRoots)."""
APP = "pairs"
SETUPS = ("disk", "tmpfs", "links")
TARGETS = {"0.6": "0.6", "0": "0.001"}
"""A target as the design writes it -> as Dask is given it (Dask reads 0 as no target at all)."""
CASES = tuple(
    f"{kind}-{size}-{target}"
    for kind, size in (("numpy", "fits"), ("numpy", "spills"), ("strings", "fits"))
    for target in TARGETS
)
LINKS_PLUGIN = "memops_links"


@dataclass(frozen=True)
class Shape:
    workers: int
    dask_limit: int
    container_limit: int
    size_limit: int
    chunk: int
    fits: int
    spills: int


@dataclass
class Row:
    setup: str
    case: str
    seconds: float
    idle: int  # private plus shared of the idle workers, before the first block
    peak: int  # private plus shared, at the highest sum
    private: int  # at that moment
    shared: int
    swap: int  # the highest
    network: int
    linked: int
    result: float
    complaint: str = ""


def deployment(address: str, setup: str, target: str, shape: Shape) -> dict[str, Any]:
    """The sandbox's worker Deployment as users write it, under ``APP``, with Dask's own limit under
    the container's (room for the spilled pages that the kernel charges to the pod)."""
    body = copy.deepcopy(sandbox.worker_deployment(address, 0, image=sandbox.DASK_IMAGE))
    body["metadata"]["name"] = APP
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": APP}
    template = body["spec"]["template"]
    template["metadata"]["labels"] = {"app": APP}
    [container] = template["spec"]["containers"]
    args = container["args"]
    args[args.index("--memory-limit") + 1] = f"{shape.dask_limit // MIB}MiB"
    container["resources"] = {"limits": {"memory": f"{shape.container_limit // MIB}Mi"}, "requests": {"cpu": "50m"}}
    container["env"] = [
        *container["env"],
        {"name": "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET", "value": TARGETS[target]},
        {"name": "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH", "value": "1000000"},
    ]
    if setup == "disk":
        template["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
        container["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
        container["env"].append({"name": "DASK_TEMPORARY_DIRECTORY", "value": "/scratch"})
    return dict(body)


def policy(address: str, setup: str, shape: Shape) -> dict[str, Any]:
    spill = {"medium": "Node", "hostPath": SPILL_ROOT, "sizeLimit": f"{shape.size_limit // MIB}Mi"}
    if setup == "tmpfs":
        spill["links"] = False
    return benchkit.memory_policy(APP, address, workload=APP, sharedSpill=spill)


@contextlib.contextmanager
def node_tmpfs(size: str) -> Iterator[Path]:
    """What the chart's node DaemonSet does on a selected Node: a tmpfs at the allowed host
    directory (nosuid, nodev, noexec, without noswap); unmounted on exit."""
    root = Path(SPILL_ROOT)
    root.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=2770,nosuid,nodev,noexec"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "memops-spill", str(root)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def make_block(i: int, nbytes: int, kind: str) -> Any:
    import numpy

    rng = numpy.random.default_rng(i)
    if kind == "numpy":
        return rng.random(nbytes // 8)
    import pandas

    # About nbytes of text, as Python strings (object dtype): pure-Python data.
    return pandas.Series([f"{v:016x}" * 3 for v in rng.integers(0, 2**62, nbytes // 48)], dtype=object)


def pair(x: Any, y: Any) -> float:
    import numpy

    if isinstance(x, numpy.ndarray):
        return float(numpy.dot(x, y))
    return float(x.str.len().sum() + y.str.len().sum())


class Sampler(shared_spill.Periodic):
    """The worker containers' memory cgroups, sampled every ``period`` seconds: the highest sum of
    private plus shared pages (and its parts then), and the highest swap."""

    def __init__(self, cgroups: Sequence[Path], period: float = 0.1):
        super().__init__(period)
        self.cgroups = cgroups
        self.idle: int | None = None
        self.peak = self.private = self.shared = self.swap = 0

    def take(self) -> None:
        private = shared = swap = 0
        for cgroup in self.cgroups:
            with contextlib.suppress(OSError):
                found = real_nodes.memory_stat(cgroup)
                private, shared, swap = private + found["anon"], shared + found["shmem"], swap + found["swap"]
        if self.idle is None:
            self.idle = private + shared
        if private + shared > self.peak:
            self.peak, self.private, self.shared = private + shared, private, shared
        self.swap = max(self.swap, swap)


def outgoing(dask_worker: Any) -> tuple[int, int]:
    log = dask_worker.transfer_outgoing_log
    return sum(int(e["compressed"]) for e in log), sum(len(e.get("linked", ())) for e in log)


def has_links(dask_worker: Any, name: str = LINKS_PLUGIN) -> bool:
    plugin = dask_worker.plugins.get(name)
    return plugin is not None and getattr(getattr(plugin, "links", None), "status", "") == "Active"


def pods(box: benchkit.Sandbox) -> list[dict[str, Any]]:
    listed = benchkit.kubectl(box.env, "get", "pods", "-l", f"app={APP}", "-o", "json")
    found: list[dict[str, Any]] = json.loads(listed)["items"]
    return found


def wait(what: str, check: Any, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def measure(box: benchkit.Sandbox, setup: str, case: str, shape: Shape) -> Row:
    kind, size, target = case.split("-")
    total = shape.fits if size == "fits" else shape.spills
    blocks_count = max(2, total // shape.chunk)
    body = deployment(box.address, setup, target, shape)
    benchkit.kubectl(box.env, "apply", "-f", "-", stdin=yaml.safe_dump(body))
    benchkit.kubectl(box.env, "scale", f"deployment/{APP}", f"--replicas={shape.workers}")
    try:
        with distributed.Client(box.address, timeout=30) as client:
            client.wait_for_workers(shape.workers, timeout=180)
            running = wait(
                "the workers' pods",
                lambda: (
                    (found := [p for p in pods(box) if p["status"].get("containerStatuses")])
                    and len(found) == shape.workers
                    and found
                ),
            )
            if setup != "disk":
                spilled_to = {p["metadata"].get("annotations", {}).get("memops.dev/shared-spill") for p in running}
                if spilled_to != {"Node"}:
                    raise RuntimeError(f"the webhook gave the pods {spilled_to}, not the Node's tmpfs")
            if setup == "links":
                wait("the links plugin on every worker", lambda: all(client.run(has_links).values()), timeout=120)
            elif any(client.run(has_links).values()):
                raise RuntimeError(f"{setup}: a worker runs the links plugin")
            cgroups = [
                real_nodes.memory_cgroup(real_nodes.container_pid(p["status"]["containerStatuses"][0]["containerID"]))
                for p in running
            ]
            with Sampler(cgroups) as sampler:
                wait("a first sample", lambda: sampler.idle is not None, timeout=10)
                start = time.perf_counter()
                blocks = client.map(make_block, range(blocks_count), nbytes=shape.chunk, kind=kind, pure=False)
                distributed.wait(blocks)
                pairs = [
                    client.submit(pair, blocks[i], blocks[j], pure=False)
                    for i in range(blocks_count)
                    for j in range(i, blocks_count)
                ]
                result = math.fsum(client.gather(pairs))
                seconds = time.perf_counter() - start
            sent = client.run(outgoing).values()
            del blocks, pairs
            return Row(
                setup,
                case,
                seconds,
                sampler.idle or 0,
                sampler.peak,
                sampler.private,
                sampler.shared,
                sampler.swap,
                sum(n for n, _ in sent),
                sum(k for _, k in sent),
                result,
            )
    finally:
        benchkit.kubectl(box.env, "scale", f"deployment/{APP}", "--replicas=0")
        wait("the workers gone", lambda: not pods(box))


def run(shape: Shape, setups: Sequence[str], cases: Sequence[str], swap: str) -> list[Row]:
    settings = ["--set", f"sharedSpill.hostRoots=[{SPILL_ROOT}]"]
    rows: list[Row] = []
    with node_tmpfs(f"{2 * shape.workers * shape.size_limit // MIB}m") as root:
        with benchkit.running_sandbox(1, "--nodes", "1", "--swap", swap, *settings) as box:
            benchkit.kubectl(box.env, "scale", "deployment/dask-worker", "--replicas=0")  # only ours join
            # The plugin, once installed on the scheduler, goes to every worker that joins it: the
            # set-ups without it run first.
            for setup in sorted(setups, key=SETUPS.index):
                if setup != "disk":
                    applied = yaml.safe_dump(policy(box.address, setup, shape))
                    benchkit.kubectl(box.env, "apply", "-f", "-", stdin=applied)
                for case in cases:
                    row = measure(box, setup, case, shape)
                    rows.append(row)
                    print(f"{setup} {case}: {row}", flush=True)
                    for leftover in root.glob(f"default/{APP}/*"):  # a worker that did not clean up
                        subprocess.run(["rm", "-rf", str(leftover)], check=False)
                if setup != "disk":
                    benchkit.kubectl(box.env, "delete", "mempol", APP, "--wait=true")
    return rows


def table(rows: Sequence[Row], shape: Shape) -> None:
    print(
        f"\n{shape.workers} workers on one real Node, Dask limit {shape.dask_limit // MIB} MiB each, container"
        f" limit {shape.container_limit // MIB} MiB, sizeLimit {shape.size_limit // MIB} MiB; blocks of"
        f" {shape.chunk // MIB} MiB; fits {shape.fits // MIB} MiB, spills {shape.spills // MIB} MiB\n"
    )
    print(
        "| case | set-up | seconds | time / disk | peak RAM MiB | peak / disk | idle MiB | above idle / disk |"
        " private MiB | shared MiB | swap MiB | network MiB | keys linked |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    anchors = {r.case: r for r in rows if r.setup == "disk"}
    for r in sorted(rows, key=lambda r: (CASES.index(r.case), SETUPS.index(r.setup))):
        anchor = anchors.get(r.case)
        time_ratio = f"{r.seconds / anchor.seconds:.2f}" if anchor else "-"
        peak_ratio = f"{r.peak / anchor.peak:.2f}" if anchor and anchor.peak else "-"
        grown = anchor.peak - anchor.idle if anchor else 0
        above = f"{(r.peak - r.idle) / grown:.2f}" if grown > 0 else "-"
        print(
            f"| {r.case} | {r.setup} | {r.seconds:.1f} | {time_ratio} | {r.peak / MIB:.0f} | {peak_ratio} |"
            f" {r.idle / MIB:.0f} | {above} |"
            f" {r.private / MIB:.0f} | {r.shared / MIB:.0f} | {r.swap / MIB:.0f} | {r.network / MIB:.0f} |"
            f" {r.linked} |"
        )
    for case in {r.case for r in rows}:
        results = {r.setup: r.result for r in rows if r.case == case}
        if not all(math.isclose(v, next(iter(results.values())), rel_tol=1e-9) for v in results.values()):
            print(f"- {case}: the set-ups disagree on the result: {results}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dask-limit-mib", type=int, default=1536)
    parser.add_argument("--container-limit-mib", type=int, default=3584)
    parser.add_argument("--size-limit-mib", type=int, default=2048, help="sharedSpill.sizeLimit: a worker pod's spill")
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--fits-mib", type=int, default=768, help="under each worker's target: no spill needed")
    parser.add_argument("--spills-mib", type=int, default=2048, help="over each worker's target")
    parser.add_argument("--swap", default="4Gi", help="the sandbox's swap file")
    args = parser.parse_args(argv)
    # The scheduler tells the client each result's type, pickled; this process needs no pandas, and
    # would log every Series block's type as a failure to unpickle it.
    logging.getLogger("distributed.protocol.pickle").setLevel(logging.WARNING)
    shape = Shape(
        args.workers,
        args.dask_limit_mib * MIB,
        args.container_limit_mib * MIB,
        args.size_limit_mib * MIB,
        args.chunk_mib * MIB,
        args.fits_mib * MIB,
        args.spills_mib * MIB,
    )
    table(run(shape, args.setups, args.cases, args.swap), shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
