"""Memory and process limits for a sandboxed run's whole process tree, through Linux cgroups.

One cgroup per run, created below the cgroup the caller itself is in (so whatever limits the
caller has keep applying): ``<own cgroup>/hetrl-sandbox-<pid>/run-<pid>-<n>``. Its memory limit
counts everything the tree's processes are charged for (anonymous memory, ``memfd`` and tmpfs
pages, page cache, kernel memory) and swap is not allowed; its pids limit counts processes and
threads. The
launcher's child joins the run's cgroup through a ``cgroup.procs`` file descriptor opened here,
before it drops its privileges; everything it starts inherits the cgroup.

Both hierarchies are supported: cgroup v2 (one directory, ``memory.max``, ``memory.swap.max``,
``pids.max``; usable when the caller's cgroup already delegates ``memory`` and ``pids`` to its
children or is the root, where they can be enabled) and cgroup v1 (separate ``memory`` and
``pids`` hierarchies, ``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` where swap is
accounted, ``pids.max``). v2 is preferred. Where neither is writable (not root, no delegation)
:func:`locate` returns None and the sandbox reports ``tree_limits`` inactive: memory is then
bounded only per process (``RLIMIT_AS``, ``RLIMIT_FSIZE`` per file, ``RLIMIT_NOFILE`` files).
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass

REQUIRED = ("memory", "pids")


@dataclass(frozen=True)
class Layout:
    """Where the caller's cgroups are: ``version`` 2 with ``dirs == (dir,)``, or 1 with
    ``dirs == (memory_dir, pids_dir)``. ``enable``: v2 controllers still to be switched on in
    ``dirs[0]/cgroup.subtree_control`` (only ever at a hierarchy's root)."""

    version: int
    dirs: tuple[str, ...]
    enable: tuple[str, ...] = ()


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root within the hierarchy, mount point, super options) of each cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        unescape = lambda s: s.replace("\\040", " ")  # noqa: E731  (mountinfo octal-escapes spaces)
        out.append((tail[0], unescape(fields[3]), unescape(fields[4]), set(tail[2].split(","))))
    return out


def _join(mount_point: str, mount_root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy rooted at ``mount_root``;
    None when the path lies outside what is mounted."""
    rel = os.path.relpath(path, mount_root)
    if rel == ".":
        return mount_point
    if rel.startswith(".."):
        return None
    return os.path.join(mount_point, rel)


def candidates(self_cgroup: str, mountinfo: str, read=None) -> list[Layout]:
    """The layouts that could host the runs' cgroups, v2 first; pure path logic over the texts of
    ``/proc/self/cgroup`` and ``/proc/self/mountinfo``. ``read(path)`` returns a file's text or
    None (default: read the file); it is asked for v2's ``cgroup.controllers`` and
    ``cgroup.subtree_control`` only. Writability is checked by :func:`locate`."""
    read = read or _read
    paths_v1: dict[str, str] = {}
    path_v2 = None
    for line in self_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            path_v2 = path
        for name in controllers.split(","):
            if name:
                paths_v1[name] = path
    out: list[Layout] = []
    mounts = _mounts(mountinfo)
    if path_v2 is not None:
        for fstype, root, point, _ in mounts:
            if fstype != "cgroup2":
                continue
            d = _join(point, root, path_v2)
            if d is None:
                continue
            available = (read(os.path.join(d, "cgroup.controllers")) or "").split()
            if not set(REQUIRED) <= set(available):
                continue
            enabled = (read(os.path.join(d, "cgroup.subtree_control")) or "").split()
            missing = tuple(c for c in REQUIRED if c not in enabled)
            if missing and path_v2 != "/":
                continue  # enabling them would need this cgroup to hold no processes (ours)
            out.append(Layout(2, (d,), missing))
            break
    v1 = {}
    for fstype, root, point, opts in mounts:
        for name in REQUIRED:
            if fstype == "cgroup" and name in opts and name in paths_v1 and name not in v1:
                d = _join(point, root, paths_v1[name])
                if d is not None:
                    v1[name] = d
    if len(v1) == len(REQUIRED):
        out.append(Layout(1, tuple(v1[name] for name in REQUIRED)))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


class Group:
    """One run's cgroup(s). ``fds``: ``cgroup.procs`` opened for writing, for the launcher's child
    to join (write ``0``). Call :meth:`close` once the run is over: it kills what is left in the
    group, waits until it is empty and removes it."""

    def __init__(self, manager: "Manager", dirs: tuple[str, ...]):
        self._manager, self.dirs = manager, dirs
        self.fds = tuple(os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC) for d in dirs)

    def oom_kills(self) -> int:
        """How many processes of the group the OOM killer has killed."""
        name = "memory.events" if self._manager.layout.version == 2 else "memory.oom_control"
        for line in (_read(os.path.join(self.dirs[0], name)) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            out.update(int(p) for p in (_read(os.path.join(d, "cgroup.procs")) or "").split())
        return sorted(out)

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = ()

    def close(self, timeout: float = 5.0) -> bool:
        """Kill every process in the group, wait until it is empty, remove it. True when removed."""
        self.close_fds()
        end = time.monotonic() + timeout
        kill_file = os.path.join(self.dirs[0], "cgroup.kill")
        while True:
            left = self.pids()
            if not left:
                break
            if self._manager.layout.version == 2 and os.path.exists(kill_file):
                _write(kill_file, "1")
            else:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        removed = True
        for d in self.dirs:
            for _ in range(100):  # rmdir fails with EBUSY for a moment after the last exit
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
            else:
                removed = False
        return removed


class Manager:
    """Creates the per-run groups under ``<own cgroup>/hetrl-sandbox-<pid>`` (removed at exit)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._ids = itertools.count()
        self._lock = threading.Lock()
        name = f"hetrl-sandbox-{os.getpid()}"
        for d in layout.dirs:
            _remove_stale(d)
        if layout.enable:
            _write(os.path.join(layout.dirs[0], "cgroup.subtree_control"), " ".join(f"+{c}" for c in layout.enable))
        self.parents = tuple(os.path.join(d, name) for d in layout.dirs)
        for p in self.parents:
            os.makedirs(p, exist_ok=True)
        if layout.version == 2:
            _write(os.path.join(self.parents[0], "cgroup.subtree_control"), " ".join(f"+{c}" for c in REQUIRED))
        atexit.register(self._remove_parents)

    def group(self, memory_bytes: int, max_pids: int) -> Group:
        """A fresh group with these limits (memory without swap; pids counts threads too)."""
        with self._lock:
            n = next(self._ids)
        # the pid too: a forked child shares the parents and the counter's state
        dirs = tuple(os.path.join(p, f"run-{os.getpid()}-{n}") for p in self.parents)
        for d in dirs:
            os.mkdir(d, 0o700)
        try:
            if self.layout.version == 2:
                d = dirs[0]
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_pids))
            else:
                mem, pids = dirs
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                _write(os.path.join(pids, "pids.max"), str(max_pids))
            return Group(self, dirs)
        except BaseException:
            for d in dirs:
                os.rmdir(d)
            raise

    def _remove_parents(self) -> None:
        for p in self.parents:
            try:
                os.rmdir(p)
            except OSError:
                pass


def _remove_stale(base: str) -> None:
    """Remove empty ``hetrl-sandbox-<pid>`` groups left by processes that are gone."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if name.startswith("hetrl-sandbox-") and name[14:].isdigit() and not os.path.exists(f"/proc/{name[14:]}"):
            parent = os.path.join(base, name)
            for sub in _listdirs(parent) + [parent]:
                try:
                    os.rmdir(sub)
                except OSError:
                    pass


def _listdirs(d: str) -> list[str]:
    try:
        return [os.path.join(d, n) for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))]
    except OSError:
        return []


_MANAGER_LOCK = threading.Lock()
_MANAGER: list[Manager | None] = []
_REASON: list[str] = []


def locate() -> tuple[Manager | None, str]:
    """The process-wide manager of the first usable layout, or None, with the reason in words."""
    with _MANAGER_LOCK:
        if not _MANAGER:
            manager, reason = None, ""
            self_cgroup, mountinfo = _read("/proc/self/cgroup"), _read("/proc/self/mountinfo")
            layouts = candidates(self_cgroup or "", mountinfo or "")
            failures = []
            for layout in layouts:
                if not all(os.access(d, os.W_OK) for d in layout.dirs):
                    failures.append(f"cgroup v{layout.version} at {list(layout.dirs)} is not writable")
                    continue
                try:
                    manager = Manager(layout)
                    reason = f"cgroup v{layout.version}"
                    break
                except OSError as exc:
                    failures.append(f"cgroup v{layout.version}: {exc}")
            if manager is None:
                reason = "; ".join(failures) or "no cgroup hierarchy with memory and pids controllers"
            _MANAGER.append(manager)
            _REASON.append(reason)
        return _MANAGER[0], _REASON[0]
