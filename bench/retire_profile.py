"""Where the time of a stock ``retire_workers`` goes: py-spy on the scheduler and the workers.

Retires one worker holding SIZE of unique data (stock ``retire_workers``, the path memops drives)
while ``py-spy record`` samples the scheduler, the retiring worker and every recipient, then
prints per process and thread how busy it was and in which functions, next to what the
recipients' own transfer logs say (messages, bytes per message, time on the wire). ptrace must
be allowed; py-spy runs with ``--nonblocking``, so the processes are never paused.

    python bench/retire_profile.py --output bench/results/retire_profile.txt
    python bench/retire_profile.py --key-kib 64 --output bench/results/retire_profile_64k.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchkit
import distributed
import throughput

RATE = 100  # py-spy samples per second


def _pid(dask_worker: Any = None) -> int:
    return os.getpid()


def _transfer_log(dask_worker: Any = None) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in entry.items() if k != "keys"} | {"nkeys": len(entry["keys"])}
        for entry in dask_worker.transfer_incoming_log
    ]


def pyspy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: python -m pip install py-spy")
    return found


GENERIC = re.compile(
    r"^(spawn_main|_main|<module>|main|run_cli|BaseProcess\.|WorkerProcess\._run|AsyncProcess\._run|BaseEventLoop\."
    r"|Runner\.run|asyncio_run|Handle\._run|Thread\.|_worker |Command\.|Group\.|Context\.)"
)


def summarize(path: Path, top: int = 12) -> list[str]:
    """Where the busy samples of each thread were: threads, functions inclusive, functions self."""
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        thread, *frames = stack.split(";")
        threads[thread.rpartition(":")[2].strip() or thread] += count
        total += count
        for frame in {_short(f) for f in frames}:
            if not GENERIC.match(frame):
                inclusive[frame] += count
        if frames:
            leaf[_short(frames[-1])] += count
    share = ", ".join(f"{name} {100 * count / max(total, 1):.0f}%" for name, count in threads.most_common(4))
    lines = [f"  busy samples: {total} ({share})", "  inclusive (share of busy samples; event-loop frames left out):"]
    lines += [f"    {100 * count / max(total, 1):5.1f}%  {frame}" for frame, count in inclusive.most_common(top)]
    lines.append("  self:")
    lines += [f"    {100 * count / max(total, 1):5.1f}%  {frame}" for frame, count in leaf.most_common(top)]
    return lines


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds spent by every process on the machine so far (not idle, not iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _short(frame: str) -> str:
    """``function (path/to/site-packages/pkg/module.py:123)`` -> ``function (pkg/module.py:123)``."""
    return re.sub(
        r"\((?:[^()]*/)?((?:site-packages|lib/python[0-9.]+)/)?([^()/]+/)?([^()/]+\.py):(\d+)\)", r"(\2\3:\4)", frame
    )


def transfer_summary(logs: dict[str, list[dict[str, Any]]], since: float, sender: str) -> list[str]:
    lines = []
    for address, entries in logs.items():
        mine = [e for e in entries if e["who"] == sender and e["start"] >= since - 1]
        if not mine:
            continue
        span = max(e["stop"] for e in mine) - min(e["start"] for e in mine)
        wire = sum(e["duration"] for e in mine)
        size = sum(e["total"] for e in mine)
        lines.append(
            f"  recipient {address}: {len(mine)} messages, {sum(e['nkeys'] for e in mine)} keys,"
            f" {size / len(mine) / 2**20:.1f} MiB per message; first request -> last reply {span:.2f} s,"
            f" of which waiting on get_data {wire:.2f} s ({100 * wire / max(span, 1e-9):.0f}%);"
            f" {size / 2**30 / max(wire, 1e-9):.2f} GiB/s while waiting"
        )
    return lines


def profile(size_mib: int, key_kib: int, out: list[str]) -> None:
    scenario = throughput.Scenario(size_mib * throughput.MIB, key_kib * 1024, 1)
    spy = pyspy()
    memory = throughput.sandbox_memory([scenario])
    # py-spy follows the processes by the pids they report (os.getpid()): the node agent's pods are
    # processes of this machine, a container's pids are its own namespace's.
    with benchkit.running_sandbox(
        throughput.WORKERS, "--worker-memory", memory, "--no-operator", real_nodes=False
    ) as box:
        with distributed.Client(box.address, timeout=30) as client:
            throughput.start(client)
            bench = throughput.Bench(client, box)
            retiring, data, _ = bench.loaded(scenario, "tp-profile")
            by_pod = benchkit.workers(client)
            sender = by_pod[retiring[0]]
            pids: dict[str, int] = client.run(_pid)
            targets = {"scheduler": int((box.state / "scheduler.pid").read_text())}
            targets |= {
                ("retiring worker " if a == sender else "recipient ") + a: pid for a, pid in sorted(pids.items())
            }
            folder = Path(tempfile.mkdtemp(prefix="memops-profile-"))
            options = ["--rate", str(RATE), "--nonblocking", "--threads", "--format", "raw"]
            spies = {
                label: subprocess.Popen(
                    [spy, "record", "--pid", str(pid), *options, "--output", str(folder / f"{pid}.txt")],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                for label, pid in targets.items()
            }
            time.sleep(1.0)  # py-spy attached
            throughput.collect(client)
            cpu_before = {label: cpu_seconds(pid) for label, pid in targets.items()}
            machine_before = machine_busy_seconds()
            started = time.time()
            client.retire_workers(workers=[sender], close_workers=True)
            returned = time.time()
            machine = machine_busy_seconds() - machine_before
            cpu = {
                label: cpu_seconds(pid) - cpu_before[label] if Path(f"/proc/{pid}").exists() else float("nan")
                for label, pid in targets.items()
            }
            for process in spies.values():
                process.send_signal(signal.SIGINT)
            for process in spies.values():
                process.wait(60)
            first, last = throughput.drain_window(throughput.collect(client), started, "tp-profile")
            logs: dict[str, list[dict[str, Any]]] = client.run(_transfer_log)
            throughput.check_kept(client, data, [sender])
    moved = scenario.keys * scenario.key_size / 2**30
    out += [
        f"== stock retire_workers of one worker holding {scenario.label.split(',')[0]}"
        f" ({scenario.keys} keys); {throughput.WORKERS} workers, memory limit {memory}",
        f"call -> first byte in flight {first - started:.3f} s; drain (first byte -> last key in memory)"
        f" {last - first:.3f} s = {moved / (last - first):.2f} GiB/s; last key -> call returned {returned - last:.3f} s"
        " (sampled by py-spy, so a little slower than unobserved)",
        "",
        f"CPU seconds from the call to its return ({returned - started:.2f} s, {os.cpu_count()} cores):"
        f" whole machine {machine:.2f}, of which "
        + ", ".join(f"{label.split(' tcp')[0]} {seconds:.2f}" for label, seconds in cpu.items())
        + " (nan: the process had exited before it was read)",
        "",
        "Recipients' transfer logs (Worker.transfer_incoming_log):",
        *transfer_summary(logs, started, sender),
        "",
    ]
    for label, pid in targets.items():
        out.append(f"{label} (pid {pid}), py-spy from 1 s before the call to its return:")
        out += summarize(folder / f"{pid}.txt")
        out.append("")
    shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--key-kib", type=int, default=16384)
    parser.add_argument("--output", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    out: list[str] = []
    profile(args.size_mib, args.key_kib, out)
    text = "\n".join(out) + "\n"
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
