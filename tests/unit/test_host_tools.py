"""The sandbox installs the programs real Nodes call (runc, iptables, conntrack, ip) where they are
missing, as root with apt-get or dnf, one process at a time; elsewhere it says what to run. Programs
and package managers are empty executables in a directory of the test's, and the installer is a
function of the test's: nothing is installed."""

from __future__ import annotations

import io
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from memops_sandbox import host_tools
from memops_sandbox.host_tools import APT, DNF

ROOT = Path(__file__).resolve().parents[2]


def executables(directory: Path, *names: str) -> str:
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_text("#!/bin/sh\n")
        (directory / name).chmod(0o755)
    return str(directory)


class Installer:
    """Stands for apt-get and dnf: records each command; an install makes the programs it names."""

    def __init__(self, directory: Path, *, fail: str = "", delay: float = 0) -> None:
        self.directory = directory
        self.fail = fail
        self.delay = delay
        self.commands: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        with self.lock:
            self.commands.append(list(argv))
        time.sleep(self.delay)
        if self.fail and self.fail in argv:
            return subprocess.CompletedProcess(list(argv), 100, "", "E: Unable to locate package conntrack\n")
        if "install" in argv:
            programs = {
                package: program for names in host_tools.PACKAGES.values() for program, package in names.items()
            }
            executables(self.directory, *(programs[name] for name in argv if name in programs))
        return subprocess.CompletedProcess(list(argv), 0, "", "")


def test_the_missing_programs_are_those_not_on_the_path(tmp_path: Path) -> None:
    assert host_tools.missing(executables(tmp_path / "bin", "runc", "ip")) == ["iptables", "conntrack"]
    assert host_tools.missing(executables(tmp_path / "bin", "iptables", "conntrack")) == []
    assert host_tools.missing(str(tmp_path / "nowhere")) == list(host_tools.PROGRAMS)


@pytest.mark.parametrize(("managers", "chosen"), [((APT, DNF), APT), ((APT,), APT), ((DNF,), DNF), ((), None)], ids=str)
def test_apt_get_is_chosen_before_dnf(tmp_path: Path, managers: tuple[str, ...], chosen: str | None) -> None:
    assert host_tools.package_manager(executables(tmp_path / "bin", *managers)) == chosen


def test_each_manager_installs_its_own_packages_without_a_question() -> None:
    assert host_tools.packages(APT) == ["runc", "iptables", "conntrack", "iproute2"]
    assert host_tools.packages(DNF, ["conntrack", "ip"]) == ["conntrack-tools", "iproute"]
    update, install = host_tools.install_steps(APT, ["runc", "conntrack"])
    assert update == ["apt-get", "update", "-qq"]
    assert install[:2] == ["apt-get", "install"] and install[-2:] == ["runc", "conntrack"]
    assert {"-y", "--no-install-recommends"} <= set(install)
    assert host_tools.install_steps(DNF, ["conntrack-tools"]) == [["dnf", "install", "-y", "-q", "conntrack-tools"]]


def test_the_command_to_run_by_hand_names_every_package() -> None:
    assert host_tools.command(APT) == (
        "apt-get update && apt-get install -y --no-install-recommends runc iptables conntrack iproute2"
    )
    assert host_tools.command(DNF) == "dnf install -y runc iptables conntrack-tools iproute"


def test_the_install_is_said_in_one_line_with_its_reason() -> None:
    line = host_tools.announcement(APT, ["runc", "iptables", "conntrack"])
    assert line.startswith("memops sandbox: installing runc iptables conntrack with apt-get (")
    assert "run containers with runc" in line
    assert "kube-proxy and the CNI portmap plugin call iptables and conntrack" in line
    assert "\n" not in line


def test_not_root_says_the_command_to_run_as_root() -> None:
    message = host_tools.refusal(["conntrack"], APT)
    assert message.startswith("real Nodes need conntrack on PATH: run the sandbox as root (it installs them itself)")
    assert f"run `{host_tools.command(APT)}` as root" in message
    assert f"`{host_tools.command(DNF)}`" in host_tools.refusal(["runc"], DNF)


def test_without_apt_get_or_dnf_it_says_what_to_install() -> None:
    message = host_tools.refusal(["runc", "iptables"], None)
    assert message.startswith("real Nodes need runc, iptables on PATH, and there is no apt-get or dnf here")
    assert "no apt-get or dnf" in message and "install runc, iptables, conntrack, ip" in message
    assert f"(on Debian: `{host_tools.command(APT)}`)" in message


def test_the_readme_names_the_packages_the_sandbox_installs() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`{' '.join(host_tools.packages(APT))}`" in readme


def test_nothing_runs_when_nothing_is_missing(tmp_path: Path) -> None:
    path = executables(tmp_path / "bin", *host_tools.PROGRAMS)
    installer = Installer(tmp_path / "bin")
    host_tools.ensure(tmp_path / "lock", search_path=path, root=False, run=installer)
    assert installer.commands == [] and not (tmp_path / "lock").exists()


@pytest.mark.parametrize(("root", "managers"), [(False, (APT,)), (True, ())], ids=["not-root", "no-manager"])
def test_what_cannot_be_installed_here_is_refused_with_the_command(
    tmp_path: Path, root: bool, managers: tuple[str, ...]
) -> None:
    path = executables(tmp_path / "bin", "runc", "ip", *managers)
    installer = Installer(tmp_path / "bin")
    with pytest.raises(host_tools.Missing, match="real Nodes need iptables, conntrack on PATH") as raised:
        host_tools.ensure(tmp_path / "lock", search_path=path, root=root, run=installer)
    assert host_tools.command(APT) in str(raised.value)
    assert installer.commands == []


@pytest.mark.parametrize("manager", [APT, DNF])
def test_as_root_the_missing_packages_are_installed_after_one_line(tmp_path: Path, manager: str) -> None:
    path = executables(tmp_path / "bin", "runc", "ip", manager)
    installer, stream = Installer(tmp_path / "bin"), io.StringIO()
    host_tools.ensure(tmp_path / "cache" / "lock", stream=stream, search_path=path, root=True, run=installer)
    names = host_tools.packages(manager, ["iptables", "conntrack"])
    assert installer.commands == host_tools.install_steps(manager, names)
    assert stream.getvalue() == host_tools.announcement(manager, names) + "\n"
    assert host_tools.missing(path) == []


def test_two_at_once_install_once(tmp_path: Path) -> None:
    path = executables(tmp_path / "bin", "runc", "iptables", "ip", APT)
    installer, stream = Installer(tmp_path / "bin", delay=0.2), io.StringIO()
    errors: list[BaseException] = []

    def ensure() -> None:
        try:
            host_tools.ensure(tmp_path / "lock", stream=stream, search_path=path, root=True, run=installer)
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=ensure) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert installer.commands == host_tools.install_steps(APT, ["conntrack"])
    assert stream.getvalue().count("installing conntrack") == 1


def test_a_failed_install_says_what_failed_and_what_to_run(tmp_path: Path) -> None:
    path = executables(tmp_path / "bin", "runc", "iptables", "ip", APT)
    installer = Installer(tmp_path / "bin", fail="install")
    with pytest.raises(host_tools.Missing) as raised:
        host_tools.ensure(tmp_path / "lock", stream=io.StringIO(), search_path=path, root=True, run=installer)
    message = str(raised.value)
    assert "failed (exit 100)" in message and "Unable to locate package conntrack" in message
    assert host_tools.command(APT) in message
