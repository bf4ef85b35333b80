"""The spill owner: a sidecar that allocates a worker's spill files, so that the kernel charges
their pages to the sidecar's memory cgroup and not to the worker's (``sharedSpill.swap: SpillOnly``).

A tmpfs page is charged to the memory cgroup of the process that allocates it, and the charge
stays there whoever writes, reads, maps or links the page afterwards. The worker (through
:func:`allocate`, called by :class:`memops.worker.maps.MappedFile` before it writes a spill
file) creates the file empty and hands its open descriptor to the owner over a Unix socket in a
pod-private directory; the owner fallocates the file's size on that descriptor and answers; the
worker then writes its bytes into pages that already exist, which charges nothing more. The owner's
container is Burstable (a request below its limit), so under the kubelet's LimitedSwap its pages
may reach swap; the worker container's request equals its limit, so the kubelet never swaps it.

What the owner takes from the worker is one 8-byte size and one descriptor per connection; it
checks that the descriptor is an empty regular file on the spill volume's own filesystem, opened
for writing, and that the size fits what its own cgroup has left (else it refuses, and the worker
writes the file itself, as without an owner). It never opens a path a peer names, and runs nothing.

Stdlib only: the sidecar runs this file's source with the worker image's ``python -c``, and the
worker imports it through :mod:`memops.worker.maps` (sent by value to a stock Dask image).
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import stat
import struct
import sys

SOCKET_ENV = "MEMOPS_SPILL_OWNER"
"""The worker's environment: the owner's socket; unset, the worker writes its spill files itself."""
SIZE = "!Q"
"""The request: the file's size, 8 bytes (a format of ``struct``, not a ``Struct``: sent by value)."""
SIZE_BYTES = struct.calcsize(SIZE)
TIMEOUT = 5.0
MARGIN = 32 * 2**20
"""What the owner keeps free of its own limit for its Python process, beside the spill."""
OK = b"ok"
REPLY_BYTES = 200


def allocate(socket_path: str, fd: int, size: int, timeout: float = TIMEOUT) -> str:
    """Have the owner at ``socket_path`` allocate ``size`` bytes of the file open at ``fd``: ``""``
    when done, else why not (the caller writes the file itself)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(socket_path)
            socket.send_fds(conn, [struct.pack(SIZE, size)], [fd])
            reply = conn.recv(REPLY_BYTES)
    except OSError as error:
        return f"the spill owner did not answer: {error}"
    return "" if reply == OK else reply.decode("utf-8", "replace") or "the spill owner closed the connection"


def _cgroup_room() -> int | None:
    """What the owner's own memory cgroup can still take (cgroup v2, then v1), or None unknown."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f:
                limit_text = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        return int(limit_text) - usage
    return None


def grant(message: bytes, fds: list[int], device: int, room: int | None) -> bytes:
    """The answer to one request: allocate and say ``ok``, or say why not."""
    if len(message) != SIZE_BYTES or len(fds) != 1:
        return b"a request is one 8-byte size and one descriptor"
    (size,) = struct.unpack(SIZE, message)
    fd = fds[0]
    try:
        st = os.fstat(fd)
        flags = _access_mode(fd)
    except OSError as error:
        return f"the descriptor cannot be read: {error.strerror}".encode()
    if not stat.S_ISREG(st.st_mode) or st.st_dev != device:
        return b"the descriptor is not a regular file on the spill volume"
    if st.st_size != 0:
        return b"the file is not empty"
    if flags == os.O_RDONLY:
        return b"the descriptor is not open for writing"
    if room is None:
        return b"the owner cannot read its own memory cgroup"
    if size > room - MARGIN:
        return f"the owner's memory limit has {max(room - MARGIN, 0)} bytes left, not {size}".encode()
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        return f"fallocate: {error.strerror}".encode()
    return OK


def _access_mode(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE


def serve(socket_path: str, spill_directory: str) -> None:
    """Answer the workers of this pod until SIGTERM (as a container's first process, the default
    action of SIGTERM would be ignored, and the pod would wait out its grace period)."""
    signal.signal(signal.SIGTERM, _exit)
    device = os.stat(spill_directory).st_dev
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(socket_path)
        os.chmod(socket_path, 0o666)  # the worker may run as another user; the directory is the pod's
        server.listen(64)
        print(f"memops spill owner: allocating for {spill_directory} at {socket_path}", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                fds: list[int] = []
                try:
                    conn.settimeout(TIMEOUT)
                    message, fds, _, _ = socket.recv_fds(conn, SIZE_BYTES, 1)
                    conn.sendall(grant(message, fds, device, _cgroup_room()))
                except OSError:
                    pass
                finally:
                    for fd in fds:
                        os.close(fd)


def _exit(signum: int, frame: object) -> None:
    sys.exit(0)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
