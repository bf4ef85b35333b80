"""The programs of this machine that real Nodes call, installed where they are missing.

The Nodes' containerd runs containers with the machine's ``runc``; kube-proxy (iptables mode)
and the CNI ``portmap`` plugin call ``iptables`` and ``conntrack``; the sandbox makes each Node's
bridge with ``ip``. Run as root where apt-get (Debian, Ubuntu) or dnf (Fedora, RHEL) is, the
sandbox installs the missing ones itself, saying so in one line; anywhere else it stops with the
command to run. One process installs at a time (a file lock under the cache: ``memops sandbox``,
``memops-sandbox build`` and the tests may all get here at once); the others wait for it, then find
the programs there.

The pure parts (:func:`missing`, :func:`package_manager`, :func:`install_steps`, :func:`command`,
:func:`announcement`, :func:`refusal`) take the search path and the facts of the machine as
arguments; :func:`ensure` puts them together.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

APT = "apt-get"
DNF = "dnf"
PROGRAMS = ("runc", "iptables", "conntrack", "ip")
"""What real Nodes call, in the order the packages are named."""
PACKAGES = {
    APT: {"runc": "runc", "iptables": "iptables", "conntrack": "conntrack", "ip": "iproute2"},
    DNF: {"runc": "runc", "iptables": "iptables", "conntrack": "conntrack-tools", "ip": "iproute"},
}
"""Each package manager's package for each program of :data:`PROGRAMS`."""
WHY = (
    "real Nodes run containers with runc and make their bridges with ip;"
    " kube-proxy and the CNI portmap plugin call iptables and conntrack"
)

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


class Missing(RuntimeError):
    """A program of :data:`PROGRAMS` is missing and cannot be installed here (not root, no
    apt-get or dnf, or the install failed): the message says which, and what to run."""


def missing(search_path: str | None = None) -> list[str]:
    """The programs of :data:`PROGRAMS` not on ``search_path`` (default ``$PATH``)."""
    return [program for program in PROGRAMS if shutil.which(program, path=search_path) is None]


def package_manager(search_path: str | None = None) -> str | None:
    """apt-get, else dnf, on ``search_path``; None where neither is."""
    return next((manager for manager in (APT, DNF) if shutil.which(manager, path=search_path)), None)


def packages(manager: str, programs: Sequence[str] = PROGRAMS) -> list[str]:
    return [PACKAGES[manager][program] for program in programs]


def install_steps(manager: str, names: Sequence[str]) -> list[list[str]]:
    """The commands that install ``names`` (packages) with ``manager``, without a question."""
    if manager == APT:
        return [
            [APT, "update", "-qq"],
            # Waits for another apt or dpkg (an unattended upgrade) instead of failing at once.
            [APT, "install", "-y", "-qq", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", *names],
        ]
    return [[DNF, "install", "-y", "-q", *names]]


def command(manager: str = APT) -> str:
    """The shell command that installs every package real Nodes need with ``manager``: what to
    run by hand (README.md names the same packages)."""
    names = " ".join(packages(manager))
    if manager == APT:
        return f"apt-get update && apt-get install -y --no-install-recommends {names}"
    return f"dnf install -y {names}"


def announcement(manager: str, names: Sequence[str]) -> str:
    """The one line said before installing ``names`` (packages) with ``manager``."""
    return f"memops sandbox: installing {' '.join(names)} with {manager} ({WHY})"


def refusal(absent: Sequence[str], manager: str | None) -> str:
    """Why ``absent`` (programs) are not installed here: no apt-get or dnf (``manager`` None), or
    not root; and the command to run instead."""
    need = f"real Nodes need {', '.join(absent)} on PATH"
    if manager is None:
        return (
            f"{need}, and there is no apt-get or dnf here to install them: install {', '.join(PROGRAMS)}"
            f" with this system's packages (on Debian: `{command(APT)}`)"
        )
    return f"{need}: run the sandbox as root (it installs them itself), or run `{command(manager)}` as root"


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, check=False)


def ensure(
    lock: Path,
    *,
    stream: TextIO = sys.stderr,
    search_path: str | None = None,
    root: bool | None = None,
    run: Runner = _run,
) -> None:
    """Every program of :data:`PROGRAMS` on ``search_path``: the missing ones installed first,
    where this process is root (``root``, default: its effective uid) and apt-get or dnf is there,
    under the file lock ``lock`` (a process that finds it held waits, then sees what the other
    installed). Else :class:`Missing`, with the command to run."""
    absent = missing(search_path)
    if not absent:
        return
    manager = package_manager(search_path)
    root = os.geteuid() == 0 if root is None else root
    if manager is None or not root:
        raise Missing(refusal(absent, manager))
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            absent = missing(search_path)  # another process may have installed them meanwhile
            if absent:
                _install(manager, absent, stream, search_path, run)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _install(manager: str, absent: list[str], stream: TextIO, search_path: str | None, run: Runner) -> None:
    names = packages(manager, absent)
    print(announcement(manager, names), file=stream, flush=True)
    for argv in install_steps(manager, names):
        done = run(argv)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
            failed = f"`{' '.join(argv)}` failed (exit {done.returncode})"
            raise Missing(f"{failed}:\n{tail}\ninstall them by hand (`{command(manager)}`)")
    still = missing(search_path)
    if still:
        raise Missing(f"{', '.join(still)} still not on PATH after `{manager} install {' '.join(names)}`")
