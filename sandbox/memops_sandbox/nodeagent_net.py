"""A pod's own address, as its processes see it: what its network namespace would give them.

On a cluster each pod has a network namespace whose one interface carries the pod's IP, so a
program that asks "which of my addresses reaches the scheduler?" gets the pod's IP. That is how
``dask worker`` without ``--host`` finds its address (distributed's ``get_ip``: a UDP socket
connected towards the scheduler, then ``getsockname``), for the Nanny and for every worker
process of ``--nworkers 2``. The node agent's pods share this machine's network, where that
question answers 127.0.0.1 for every pod; here the kernel's answer is emulated instead: a
``sitecustomize`` on the pod's ``PYTHONPATH`` binds such a socket to the pod's IP (its loopback
address) before it connects, so that the route lookup answers the pod's IP, as in its namespace.

Only what differs is emulated: UDP sockets (a route lookup sends nothing), towards the pods'
loopback network, not yet bound. TCP connections keep the machine's source address; no program
memops relies on reads it. Python processes only: the sandbox's containers are Dask's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

POD_IP_ENV = "MEMOPS_SANDBOX_POD_IP"
"""The pod's IP, for the ``sitecustomize`` below: the agent sets it in every process of the pod."""

SITECUSTOMIZE = f'''"""The node agent's pod network: a route lookup from this pod answers the pod's IP."""

import os
import socket


def _install(pod_ip):
    connect = socket.socket.connect

    def connect_from_the_pod(self, address):
        if (
            self.type == socket.SOCK_DGRAM
            and self.family == socket.AF_INET
            and isinstance(address, tuple)
            and (str(address[0]).startswith("127.") or address[0] == "localhost")
        ):
            try:
                if self.getsockname() == ("0.0.0.0", 0):
                    self.bind((pod_ip, 0))
            except OSError:
                pass  # the address is gone: the machine's answer, as before
        return connect(self, address)

    socket.socket.connect = connect_from_the_pod


if os.environ.get("{POD_IP_ENV}"):
    _install(os.environ["{POD_IP_ENV}"])
'''


def write_site(directory: Path) -> Path:
    """The directory holding the ``sitecustomize``, written (again) so that it is this agent's."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sitecustomize.py"
    if not path.exists() or path.read_text() != SITECUSTOMIZE:
        path.write_text(SITECUSTOMIZE)
    return directory


def pod_env(environ: Mapping[str, str], *, site: Path, pod_ip: str) -> dict[str, str]:
    """What a process of the pod gets on top of ``environ`` (the container's own environment
    included): the ``sitecustomize``'s directory first on ``PYTHONPATH``, and the pod's IP. A
    ``PYTHONPATH`` of the container's own comes after it."""
    path = os.pathsep.join(p for p in (str(site), environ.get("PYTHONPATH", "")) if p)
    return {**environ, "PYTHONPATH": path, POD_IP_ENV: pod_ip}
