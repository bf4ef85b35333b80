"""What a request to the API server costs: memops' client against ``kubernetes_asyncio``'s own.

memops takes its credentials from ``kubernetes_asyncio``'s configuration loader but sends its
requests with its own small client (:class:`memops.clients.kube.Kube`: paths, JSON dicts, ApiError). The
library's generated client (``CoreV1Api`` on its ``ApiClient``, aiohttp underneath too) would be
the alternative. Both, with the same credentials, on the same upstream API server
(``memops-sandbox plane``), interleaved round by round so that a loaded machine slows both alike:

- anchor: the library's client, deserializing into its models as its callers get them;
- memops' client.

Each round: a GET of one ConfigMap and a LIST of a namespace's ``--objects`` ConfigMaps. The
figures are the median milliseconds of each, and the ratio memops / library (below 1: memops'
is cheaper).

    python bench/kube_client.py                # 200 rounds, 50 ConfigMaps
    python bench/kube_client.py --rounds 50    # a quick pass
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as library
from kubernetes_asyncio import config as library_config
from memops_sandbox import upstream

from memops.clients import kube

NAMESPACE = "bench"


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000


async def measure(kubeconfig: Path, rounds: int, objects: int) -> dict[str, float]:
    memops_client = kube.Kube(kube.load_connection(str(kubeconfig)))
    configuration = library.Configuration()
    await library_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    api_client = library.ApiClient(configuration)
    core = library.CoreV1Api(api_client)
    try:
        await memops_client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": NAMESPACE}})
        configmaps = kube.resource_path("", "v1", "configmaps", NAMESPACE)
        for index in range(objects):
            data = {f"key-{key}": "x" * 64 for key in range(8)}
            await memops_client.request("POST", configmaps, body={"metadata": {"name": f"cm-{index}"}, "data": data})
        one = kube.resource_path("", "v1", "configmaps", NAMESPACE, "cm-0")
        samples: dict[str, list[float]] = {"library get": [], "memops get": [], "library list": [], "memops list": []}
        for _ in range(rounds):
            samples["library get"].append(await timed(lambda: core.read_namespaced_config_map("cm-0", NAMESPACE)))
            samples["memops get"].append(await timed(lambda: memops_client.get(one)))
            samples["library list"].append(await timed(lambda: core.list_namespaced_config_map(NAMESPACE)))
            samples["memops list"].append(await timed(lambda: memops_client.list(configmaps)))
        return {name: statistics.median(values) for name, values in samples.items()}
    finally:
        await memops_client.close()
        await api_client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--objects", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memops-bench-") as directory:
        process = upstream.launch_plane(Path(directory) / "plane")
        try:
            medians = asyncio.run(measure(Path(directory) / "plane" / "kubeconfig", args.rounds, args.objects))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    for verb in ("get", "list"):
        library_ms, memops_ms = medians[f"library {verb}"], medians[f"memops {verb}"]
        print(
            f"{verb:4}  library {library_ms:7.2f} ms  memops {memops_ms:7.2f} ms  "
            f"ratio memops/library {memops_ms / library_ms:.2f}"
        )


if __name__ == "__main__":
    main()
