"""A sandbox for model-written Python programs.

:meth:`Sandbox.run` runs one program in a separate process tree, in a fresh run directory that is
deleted afterwards, and returns a :class:`SandboxResult`. What it guarantees:

* **limits** (rlimits set in the child before it execs): CPU seconds, address space, processes of
  its uid, file size, open files, no core dumps; a **wall-clock limit** enforced by the parent,
  which then kills the whole process tree (and again by the launcher if the parent has died);
* **output**: stdout and stderr are read concurrently and kept up to ``max_output_bytes`` each,
  the rest is counted and discarded, so a flood cannot exhaust the parent's memory;
* **environment**: scrubbed (``PATH``, ``LANG``, ``LC_ALL``, ``HOME`` and ``TMPDIR`` = the run
  directory); nothing of the parent's environment is visible; the interpreter runs with
  ``-I -S -B`` (isolated mode: no ``PYTHON*`` variables, no site-packages, no script directory on
  ``sys.path``, no bytecode files);
* **clean-up**: when :meth:`Sandbox.run` returns, its directory is gone and (modes 1-3 below) no
  live process of the run is left; on timeout the whole tree is killed.

The isolation proper is the strongest the machine allows, chosen once per process by probing (a
trial run that *checks* each property from inside) and reported, never assumed, by
:attr:`Sandbox.isolation`. Three mechanisms apply on top of any mode where the machine has them:

* **minimal view** (``backend="bubblewrap"``, preferred; Debian's ``bubblewrap``): the program's
  root is an empty tmpfs holding only ``/usr`` and the top-level library directories (read-only),
  each interpreter's installation prefix with its ``site-packages`` covered by an empty tmpfs,
  a private ``/proc`` and minimal ``/dev``, and size-capped private tmpfs at ``/tmp``,
  ``/dev/shm`` and the run directory. Nothing of the project checkout, its ``.git``, any
  virtualenv, home directories, other runs, the host ``/tmp`` or host sockets exists there. The
  launcher runs as PID 1 of the run's namespaces (``--as-pid-1``), copies the staged files in
  and unmounts its own and the staging binds before the program starts.
* **tree limits** (:mod:`hetrl.envs._cgroup`): one cgroup per run below the caller's own, cgroup
  v2 or v1 (``memory`` and ``pids`` hierarchies): the memory of the whole process tree
  (anonymous, ``memfd`` and tmpfs pages, page cache; no swap) is capped at ``memory_mb`` and its
  tasks (processes and threads) at ``max_processes``; a program killed by the cgroup's OOM killer
  is reported as ``killed_reason="memory"``. Where no cgroup is writable (not root and nothing
  delegated) memory is bounded per process only: ``RLIMIT_AS`` does not count memfd or tmpfs
  pages, so a tree may hold up to ``max_processes`` x (``memory_mb`` + ``max_open_files`` x
  ``max_file_mb``), and the run directory's tmpfs at ``disk_mb``.
* **seccomp** (:mod:`hetrl.envs._seccomp`, libseccomp through ``pyseccomp``): ``ptrace``,
  ``mount`` and the new mount API, ``unshare``/``setns``/``clone`` with namespace flags,
  ``keyctl``/``add_key``/``request_key``, ``bpf``, ``perf_event_open``, ``io_uring``,
  ``userfaultfd`` and machine administration calls fail with ``EPERM``; installed by the launcher
  after ``no_new_privs``, immediately before the exec. Without libseccomp: not active.

The modes (the namespaces and the user the program runs as):

1. as root with ``bwrap`` or a usable ``unshare`` (util-linux): new network (loopback only), PID,
   mount, IPC and UTS namespaces; a dedicated uid per concurrent run (no groups, no
   capabilities, ``no_new_privs``). With bubblewrap the minimal view above; with ``unshare``
   every mount read-only except the run directory, which is a size-capped tmpfs (``disk_mb``),
   a private ``/proc``, and the ``hetrl`` package directory (which holds hidden tests) covered by
   an empty tmpfs; world-readable host files and host UNIX sockets stay reachable. Leaving PID 1
   of the namespace kills every process of the run.
2. not root but unprivileged user namespaces allowed (``bwrap --unshare-user`` or
   ``unshare -Urn``): the same namespaces inside a user namespace; the program keeps the caller's
   uid outside it, and has no capabilities inside (bounding set emptied, securebits locked); the
   process limit counts the run's user namespace only (Linux >= 5.14).
3. as root without namespaces: the dedicated uid and the limits only. The network is NOT
   isolated, world-writable directories (``/tmp``, ``/dev/shm``) are writable, nothing is hidden;
   clean-up by killing every process of the uid (and of the run's cgroup).
4. neither: limits and scrubbed environment; no process limit (it would count the caller's own
   processes); clean-up by process-group kill, which a program calling ``setsid`` escapes. The
   program runs as the caller. Pass ``require=`` to refuse to run in a weaker mode than needed.

On the development VM and in CI (root, Debian 12, Linux 6.18, bubblewrap 0.8, cgroup v1
``memory`` and ``pids``, libseccomp 2.5.4) mode 1 with bubblewrap, tree limits (v1) and seccomp is
active: every mechanism above, verified by the probe and attacked by ``tests/test_sandbox.py``.
``Sandbox(backend="unshare", cgroup=False, seccomp=False)`` is the isolation before bubblewrap
(kept for comparison). The tests also pass without bubblewrap (mode 1 with ``unshare``), skipping
the cases a configuration cannot protect and checking that the report says so. In an
unprivileged container (where seccomp usually forbids ``unshare``) expect mode 3 or 4.

Residual risk with every mechanism active: the kernel (a bug reachable through the allowed
system calls), the machine's CPU shared with other runs (bounded per run by the CPU and wall
limits only), and reading the standard library and ``/usr``. Nothing of the sandbox layer reads
host files into a result: ``stdout``/``stderr`` are the program's own output, and a
:class:`SandboxError` names paths and errors, never file contents.

Thread-safe: any number of threads may call :meth:`Sandbox.run` on one or many sandboxes.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import pathlib
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field

from hetrl.envs import _cgroup, _seccomp

log = logging.getLogger(__name__)

LAUNCHER = pathlib.Path(__file__).with_name("_launcher.py")
#: The program's file name inside the run directory.
MAIN = "main.py"
#: Interpreter flags of the sandboxed program: isolated mode, no site, no bytecode files.
PYTHON_FLAGS = ("-I", "-S", "-B")
#: Paths covered by an empty read-only tmpfs inside the sandbox: the installed ``hetrl`` package
#: (task data, hidden tests).
DEFAULT_HIDDEN = (str(pathlib.Path(__file__).resolve().parents[1]),)
#: Dedicated uids for sandboxed programs: ``UID_BASE + slot``, far above what distributions and
#: container runtimes allocate.
UID_BASE, UID_SLOTS = 2_000_000_000, 1024
_UNSHARE_FLAGS = ("--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child")
_MECHANISMS = ("network", "pid_namespace", "filesystem", "uid", "no_capabilities", "minimal_view", "tree_limits",
               "seccomp")
#: Isolation backends, strongest first; ``auto`` takes the strongest that works.
BACKENDS = ("bubblewrap", "unshare", "none")
#: Inside a bubblewrap sandbox: the launcher and the staged run files (unmounted before the program
#: starts).
_BWRAP_LAUNCHER, _BWRAP_STAGED = "/.sandbox/launcher.py", "/.sandbox/staged"
_BWRAP_FLAGS = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--as-pid-1")


class SandboxError(RuntimeError):
    """The sandbox itself failed (setup, not the program), or the required isolation is missing."""


class SandboxLimits(BaseModel):
    """Resource limits of one run. CPU time is per process (the wall limit bounds the tree)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_s: float = Field(default=2.0, gt=0)
    wall_s: float = Field(default=5.0, gt=0)
    memory_mb: int = Field(default=512, ge=32, description="address space (RLIMIT_AS) per process, and the "
                           "memory of the whole tree (cgroup: memfd and tmpfs pages included) where tree limits hold")
    max_processes: int = Field(default=32, ge=1, description="processes of the sandbox uid (and tasks of the tree "
                               "where tree limits hold)")
    max_file_mb: int = Field(default=16, ge=1)
    max_open_files: int = Field(default=64, ge=16)
    disk_mb: int = Field(default=64, ge=1, description="size of the run directory's tmpfs")
    max_output_bytes: int = Field(default=65_536, ge=1024, description="kept per stream")

    @property
    def cpu_limit_s(self) -> int:
        """``cpu_s`` rounded up to whole seconds (RLIMIT_CPU's unit); SIGKILL follows 1 s later."""
        return max(1, math.ceil(self.cpu_s))

    def rlimits(self, nproc: bool) -> dict[str, tuple[int, int]]:
        """The rlimits set in the child. ``RLIMIT_NPROC`` counts every process of the uid (within
        its user namespace), so it is only set when the run has a uid or a user namespace of its
        own."""
        cpu = self.cpu_limit_s
        limits = {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_AS": (self.memory_mb << 20,) * 2,
            "RLIMIT_FSIZE": (self.max_file_mb << 20,) * 2,
            "RLIMIT_NOFILE": (self.max_open_files,) * 2,
            "RLIMIT_CORE": (0, 0),
        }
        if nproc:
            limits["RLIMIT_NPROC"] = (self.max_processes,) * 2
        return limits


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run. ``returncode`` is the program's exit code, ``-N`` when signal N killed
    it, None when unknown (killed with its launcher). ``killed_reason``: None, ``"wall_time"``,
    ``"cpu_time"``, ``"file_size"``, ``"memory"`` (the tree's cgroup memory limit: the OOM killer),
    ``"signal:NAME"`` or ``"launcher_lost"``. Streams are decoded
    as UTF-8 (invalid bytes replaced) after truncation to the output cap."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    wall_s: float
    cpu_s: float | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


@dataclass(frozen=True)
class Isolation:
    """What the probe verified from inside a trial run (see the module docstring)."""

    mode: int
    network: bool
    pid_namespace: bool
    filesystem: bool
    private_proc: bool
    hidden_paths: tuple[str, ...]
    uid: bool
    user_namespace: bool
    no_capabilities: bool
    interpreter: str
    interpreter_version: str
    backend: str = "unshare"
    minimal_view: bool = False
    tree_limits: str | None = None
    seccomp: bool = False

    def active(self) -> set[str]:
        """The active mechanisms, by the names ``require=`` accepts."""
        return {name for name in _MECHANISMS if getattr(self, name)}

    def describe(self) -> str:
        def mark(flag: bool, yes: str, no: str) -> str:
            return yes if flag else no

        return "; ".join([
            f"mode {self.mode} ({self.backend})",
            mark(self.minimal_view, "view: minimal (interpreter, run directory, private /tmp)",
                 "view: the host filesystem"),
            mark(self.network, "network: private namespace, loopback only",
                 "network: NOT isolated (host network)"),
            mark(self.pid_namespace, "processes: private PID namespace", "processes: host PID namespace"),
            mark(self.filesystem, "filesystem: read-only except the run directory (tmpfs)",
                 "filesystem: NOT read-only (writable wherever the uid may write)"),
            mark(self.private_proc, "/proc: private", "/proc: host"),
            f"hidden: {list(self.hidden_paths) or 'none'}",
            mark(self.uid, "user: dedicated uid per run", "user: the caller's uid")
            + mark(self.user_namespace, " (in a user namespace)", ""),
            mark(self.no_capabilities, "capabilities: none", "capabilities: NOT dropped"),
            f"tree limits: {self.tree_limits} (memory incl. memfd/tmpfs, pids)" if self.tree_limits
            else "tree limits: NONE (memory per process only)",
            mark(self.seccomp, "seccomp: ptrace, mount, namespaces, keyctl, bpf, perf denied",
                 "seccomp: NONE"),
            f"interpreter: {self.interpreter} {' '.join(PYTHON_FLAGS)} (Python {self.interpreter_version})",
        ])

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class _Plan:
    """How runs are started: command prefix, what the launcher prepares, interpreters to try."""

    mode: int
    prefix: tuple[str, ...]
    mount: bool
    proc: bool
    own_uid: bool
    pythons: tuple[str, ...]
    backend: str = "unshare"
    cgroup: bool = False
    seccomp: bool = False

    @property
    def pid_ns(self) -> bool:
        return self.backend == "bubblewrap" or "--pid" in self.prefix

    @property
    def user_ns(self) -> bool:
        return "--user" in self.prefix or "--unshare-user" in self.prefix


def _interpreters() -> tuple[str, ...]:
    """Candidate interpreters for the program, most similar to ours first. The first one the
    sandbox uid can execute is used (ours may sit in a directory it cannot enter)."""
    found = [sys.executable, getattr(sys, "_base_executable", sys.executable), shutil.which("python3"),
             "/usr/bin/python3", "/usr/local/bin/python3"]
    out: list[str] = []
    for path in found:
        if path and os.path.exists(path):
            real = os.path.realpath(path)
            if real not in out:
                out.append(real)
    return tuple(out)


def _scrubbed_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": workdir, "TMPDIR": workdir}


def _uid_processes(uid: int) -> list[int]:
    """Live pids whose real, effective, saved or filesystem uid is ``uid``. Zombies are left out:
    they run nothing, and reaping them is up to their parent (here: the host's init)."""
    pids = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return pids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                fields = dict(line.split(b":", 1) for line in fh if line[:4] in (b"Stat", b"Uid:"))
        except (OSError, ValueError):
            continue
        state, uids = fields.get(b"State", b"").split(), fields.get(b"Uid", b"").split()
        if state and state[0] != b"Z" and str(uid).encode() in uids:
            pids.append(int(name))
    return pids


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    fields = fh.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(name))
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _UidPool:
    """Hands out dedicated uids, one per concurrent run, unique across processes too (an
    ``flock`` on a root-only lock file per uid). A uid whose processes cannot be removed is
    quarantined: never handed out again by this process."""

    def __init__(self, base: int, slots: int):
        self._base, self._slots = base, slots
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}
        self._quarantined: set[int] = set()
        self._next = 0
        self._dir = pathlib.Path(tempfile.gettempdir()) / f"hetrl-sandbox-uids-{os.geteuid()}"

    def _lock_dir(self) -> pathlib.Path:
        self._dir.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(self._dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SandboxError(f"uid lock directory {self._dir} is not a private directory of ours")
        return self._dir

    def acquire(self, sweep) -> int:
        with self._lock:
            directory = self._lock_dir()
            for i in range(self._slots):
                uid = self._base + (self._next + i) % self._slots
                if uid in self._held or uid in self._quarantined:
                    continue
                fd = os.open(directory / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                if _uid_processes(uid) and not sweep(uid):  # left over by a process that crashed
                    self._quarantined.add(uid)
                    os.close(fd)
                    continue
                self._held[uid] = fd
                self._next = (uid - self._base + 1) % self._slots
                return uid
        raise SandboxError("no free sandbox uid")

    def release(self, uid: int, clean: bool) -> None:
        with self._lock:
            fd = self._held.pop(uid)
            if not clean:
                self._quarantined.add(uid)
                log.error("sandbox uid %d still has processes; quarantined", uid)
            os.close(fd)


_UIDS = _UidPool(UID_BASE, UID_SLOTS)
_PROBE_LOCK = threading.Lock()
_PROBES: dict[tuple, tuple[_Plan, Isolation]] = {}

# Trusted probe program: reports, from inside a trial run, what it can observe.
_PROBE = r"""
import ctypes, json, os, socket, sys
ask = json.loads(sys.stdin.read())
hide = ask["hidden"]
r = {"python": sys.executable, "version": sys.version.split()[0], "uid": os.getuid(), "pid": os.getpid(),
     "ppid": os.getppid(),
     "ifaces": sorted(name for _, name in socket.if_nameindex())}
with open("/proc/self/status") as fh:
    status = dict(l.split(":", 1) for l in fh if ":" in l)
r["cap_eff"] = int(status["CapEff"].split()[0], 16)
r["seccomp_mode"] = int(status.get("Seccomp", "0").split()[0])
r["proc_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
r["hidden_visible"] = [p for p in hide if os.path.isdir(p) and os.listdir(p)]
r["secrets_visible"] = [p for p in ask["secrets"] if os.path.lexists(p)]
# the run directory's parent only where it is the host's (the marker there is visible)
dirs = ["/", "/usr", "/etc", "/var/tmp"] + [os.path.dirname(os.getcwd())] * os.path.lexists(ask["marker"])
r["write_outside"] = []
for d in dirs:
    try:
        open(os.path.join(d, ".hetrl-probe-%d" % os.getpid()), "x").close()
        os.unlink(os.path.join(d, ".hetrl-probe-%d" % os.getpid()))
        r["write_outside"].append(d)
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)  # last: it may succeed (no seccomp) and change the view
r["unshare_user"] = libc.unshare(0x10000000) == 0 or ctypes.get_errno()
print(json.dumps(r))
"""


def _prefixes(pythons: Iterable[str]) -> list[str]:
    """Installation prefixes of the candidate interpreters (the directory above ``bin``; ours:
    ``sys.base_prefix``, never a virtualenv)."""
    out = []
    for python in pythons:
        ours = python == os.path.realpath(sys.executable)
        prefix = os.path.realpath(sys.base_prefix) if ours else os.path.dirname(os.path.dirname(python))
        if prefix not in out:
            out.append(prefix)
    return out


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _bwrap_view(pythons: tuple[str, ...], hidden: tuple[str, ...]) -> list[str]:
    """bubblewrap arguments of the minimal view: ``/usr`` and the top-level library and binary
    directories (links where the host has links), each interpreter's prefix outside ``/usr`` with
    its ``site-packages`` covered by an empty tmpfs, and any hidden path inside them covered."""
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    bound = ["/usr"]
    for prefix in _prefixes(pythons):
        if not any(_within(prefix, b) for b in bound):
            args += ["--ro-bind", prefix, prefix]
            bound.append(prefix)
        lib = os.path.join(prefix, "lib")
        for name in sorted(os.listdir(lib)) if os.path.isdir(lib) else ():
            packages = os.path.join(lib, name, "site-packages")
            if name.startswith("python") and os.path.isdir(packages):
                args += ["--tmpfs", packages]
    for path in hidden:
        if os.path.isdir(path) and any(_within(path, b) for b in bound):
            args += ["--tmpfs", path]
    return args


def _secrets(hidden: tuple[str, ...], prefixes: list[str]) -> list[str]:
    """Host paths the minimal view must not show: the project checkout around the hidden
    directories (its ``.git``, its ``pyproject.toml``), our virtualenv, home directories' entries
    (except the way to an interpreter prefix), ``/run`` (host sockets)."""
    out = []
    for path in hidden:
        for parent in pathlib.Path(path).parents:
            out += [str(parent / ".git"), str(parent / "pyproject.toml")]
    if sys.prefix != sys.base_prefix:
        out.append(os.path.join(sys.prefix, "pyvenv.cfg"))
    for home in {os.path.expanduser("~"), "/home"}:
        try:
            names = os.listdir(home)
        except OSError:
            continue
        for name in names:
            entry = os.path.join(home, name)
            if not any(_within(p, entry) for p in prefixes):
                out.append(entry)
    out.append("/run")
    return sorted({p for p in out if os.path.lexists(p)})


def _plans(backend: str = "auto", cgroup: bool = True, seccomp: bool = True) -> list[_Plan]:
    """Candidate plans, strongest first (see the module docstring for the modes); ``backend``
    restricts them to one backend. ``cgroup``/``seccomp``: whether to ask for tree limits and
    the seccomp filter (each plan falls back to without them only when they are unavailable)."""
    root = os.geteuid() == 0
    unshare, bwrap = shutil.which("unshare"), shutil.which("bwrap")
    pythons = _interpreters()
    cg = cgroup and _cgroup.locate()[0] is not None
    sc = seccomp and _seccomp.compiled() is not None
    plans = []
    if bwrap and sys.platform.startswith("linux"):
        if root:
            plans += [_Plan(1, (bwrap, *_BWRAP_FLAGS), True, True, True, pythons, "bubblewrap", cg, sc)]
        plans += [_Plan(2, (bwrap, *_BWRAP_FLAGS, "--unshare-user"), True, True, False, pythons, "bubblewrap", cg, sc)]
    if unshare and sys.platform.startswith("linux"):
        if root:
            plans += [_Plan(1, (unshare, *_UNSHARE_FLAGS), True, proc, True, pythons, "unshare", cg, sc)
                      for proc in (True, False)]
        userns = (unshare, "--user", "--map-root-user", *_UNSHARE_FLAGS)
        plans += [_Plan(2, userns, True, proc, False, pythons, "unshare", cg, sc) for proc in (True, False)]
    plans.append(_Plan(3 if root else 4, (), False, False, root, pythons, "none", cg, sc))
    return [p for p in plans if backend in ("auto", p.backend)]


def _verify(plan: _Plan, hidden: tuple[str, ...]) -> tuple[_Plan, Isolation]:
    """Run the probe program under ``plan`` and return the plan pinned to the interpreter it
    found, with the isolation the probe observed from inside. SandboxError if the run fails."""
    with tempfile.NamedTemporaryFile(prefix="hetrl-probe-marker-") as marker:
        secrets = [*_secrets(hidden, _prefixes(plan.pythons)), marker.name]
        try:
            res = _Runner(plan, SandboxLimits(cpu_s=5, wall_s=10), hidden).run(
                _PROBE, json.dumps({"hidden": list(hidden), "secrets": secrets, "marker": marker.name}), {})
        except (SandboxError, OSError) as exc:
            raise SandboxError(f"mode {plan.mode} ({plan.backend}): {exc}") from exc
    lines = res.stdout.strip().splitlines()
    if not res.ok or not lines:
        raise SandboxError(f"mode {plan.mode} ({plan.backend}): rc={res.returncode} {res.killed_reason} "
                           f"{res.stderr.strip()[-300:]}")
    report = json.loads(lines[-1])
    iso = Isolation(
        mode=plan.mode,
        network=report["ifaces"] == ["lo"],
        pid_namespace=report["ppid"] == 1 and plan.pid_ns,
        filesystem=not report["write_outside"],
        private_proc=plan.proc and set(report["proc_pids"]) <= {1, report["pid"]},
        hidden_paths=tuple(p for p in hidden if os.path.isdir(p) and p not in report["hidden_visible"]),
        uid=plan.own_uid and report["uid"] != 0,
        user_namespace=plan.user_ns,
        no_capabilities=report["cap_eff"] == 0,
        interpreter=report["python"],
        interpreter_version=report["version"],
        backend=plan.backend,
        minimal_view=not report["secrets_visible"],
        tree_limits=_cgroup.locate()[1] if plan.cgroup else None,
        seccomp=plan.seccomp and report["seccomp_mode"] == 2 and report["unshare_user"] == errno.EPERM,
    )
    if report["secrets_visible"] and plan.backend == "bubblewrap":
        log.warning("sandbox: host paths visible in the minimal view: %s", report["secrets_visible"])
    return dataclasses.replace(plan, pythons=(report["python"],)), iso


def _degraded(plan: _Plan) -> list[_Plan]:
    """``plan``, then (should its trial run fail) the same without tree limits, then without the
    seccomp filter as well: a mechanism that fails here costs only itself."""
    out = [plan]
    if plan.cgroup:
        out.append(dataclasses.replace(plan, cgroup=False))
    if plan.seccomp:
        out.append(dataclasses.replace(out[-1], seccomp=False))
    return out


def _probe(hidden: tuple[str, ...], backend: str = "auto", cgroup: bool = True,
           seccomp: bool = True) -> tuple[_Plan, Isolation]:
    """The strongest plan whose trial run works, and what it verified. Cached per process."""
    key = (hidden, backend, cgroup, seccomp)
    with _PROBE_LOCK:
        if key not in _PROBES:
            failures = []
            for plan in (d for p in _plans(backend, cgroup, seccomp) for d in _degraded(p)):
                try:
                    _PROBES[key] = _verify(plan, hidden)
                    break
                except SandboxError as exc:
                    failures.append(f"{exc} (tree limits {plan.cgroup}, seccomp {plan.seccomp})")
            else:
                raise SandboxError(f"no sandbox mode works here (backend {backend}): " + " | ".join(failures))
            if failures:
                log.info("sandbox: stronger modes unavailable: %s", " | ".join(failures))
            iso = _PROBES[key][1]
            if backend == "auto" and (iso.mode > 1 or not iso.active() >= set(_MECHANISMS)):
                log.warning("sandbox isolation is weaker than mode 1 with every mechanism: %s", iso.describe())
        return _PROBES[key]


def _rmtree(path: str) -> None:
    """Remove a run directory, even if the program (running as the caller, modes 2 and 4) made
    parts of it unreadable. Called once every process of the run is gone; never follows links."""
    try:
        shutil.rmtree(path)
    except OSError:
        os.chmod(path, 0o700)
        for dirpath, dirs, _ in os.walk(path):
            for name in dirs:
                sub = os.path.join(dirpath, name)
                if not os.path.islink(sub):
                    os.chmod(sub, 0o700)
        shutil.rmtree(path)


class Sandbox:
    """Runs untrusted Python programs under :class:`SandboxLimits` with the isolation reported by
    :attr:`isolation`.

    ``require``: mechanism names (``network``, ``pid_namespace``, ``filesystem``, ``uid``,
    ``no_capabilities``, ``minimal_view``, ``tree_limits``, ``seccomp``) that must be active, else
    :class:`SandboxError` is raised at construction. ``hidden``: directories covered by an empty
    tmpfs (modes 1 and 2; under bubblewrap they are not in the view at all). ``backend``:
    ``"auto"`` (the strongest that works), or one of ``"bubblewrap"``, ``"unshare"`` (the
    isolation before bubblewrap), ``"none"``; ``cgroup``/``seccomp``: False turns the tree
    limits / the seccomp filter off (to measure what they cost).
    """

    def __init__(self, limits: SandboxLimits | None = None, *, require: Iterable[str] = (),
                 hidden: Iterable[str] = DEFAULT_HIDDEN, backend: str = "auto", cgroup: bool = True,
                 seccomp: bool = True):
        self.limits = limits or SandboxLimits()
        unknown = set(require) - set(_MECHANISMS)
        if unknown:
            raise ValueError(f"unknown isolation mechanisms {sorted(unknown)}; known: {_MECHANISMS}")
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"unknown sandbox backend {backend!r}; known: auto, {', '.join(BACKENDS)}")
        hidden = tuple(sorted(set(hidden)))
        plan, self._isolation = _probe(hidden, backend, cgroup, seccomp)
        missing = set(require) - self._isolation.active()
        if missing:
            raise SandboxError(f"required isolation {sorted(missing)} unavailable here: {self._isolation}")
        self._runner = _Runner(plan, self.limits, hidden)

    @property
    def isolation(self) -> Isolation:
        """The isolation every run of this sandbox gets, as verified by the probe."""
        return self._isolation

    def run(self, code: str, stdin: str = "", files: Mapping[str, str | bytes] | None = None) -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh directory that also holds ``files``
        (relative paths; sub-directories are created). The directory is the working directory and
        ``HOME``; it is not on ``sys.path`` (``-I``): programs importing sibling files add it."""
        return self._runner.run(code, stdin, files or {})


class _Runner:
    """Starts runs according to one plan (used by :class:`Sandbox` and by the probe)."""

    def __init__(self, plan: _Plan, limits: SandboxLimits, hidden: tuple[str, ...]):
        self._plan, self.limits, self._hidden = plan, limits, hidden

    def run(self, code: str, stdin: str, files: Mapping[str, str | bytes]) -> SandboxResult:
        staged = self._validate_files(files)
        uid = _UIDS.acquire(self._sweep) if self._plan.own_uid else None
        workdir = tempfile.mkdtemp(prefix="hetrl-sbx-")
        try:
            self._stage(workdir, code, staged, uid)
            return self._execute(workdir, stdin, uid)
        finally:
            if uid is not None:
                _UIDS.release(uid, self._wait_gone(uid, 0.5) or self._sweep(uid))
            _rmtree(workdir)

    # -- internals --------------------------------------------------------------------------

    def _validate_files(self, files: Mapping[str, str | bytes]) -> dict[str, bytes]:
        out = {}
        for name, content in files.items():
            parts = pathlib.PurePosixPath(name).parts
            if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in name:
                raise ValueError(f"sandbox file path must be relative and normalized: {name!r}")
            if name == MAIN:
                raise ValueError(f"{MAIN!r} is reserved for the program")
            out[name] = content.encode() if isinstance(content, str) else bytes(content)
        if sum(map(len, out.values())) > self.limits.disk_mb << 20:
            raise ValueError("sandbox files exceed disk_mb")
        return out

    def _stage(self, workdir: str, code: str, files: dict[str, bytes], uid: int | None) -> None:
        for name, data in {**files, MAIN: code.encode()}.items():
            path = pathlib.Path(workdir, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if uid is not None and not self._plan.mount:  # with a mount namespace the launcher copies
            for dirpath, dirs, names in os.walk(workdir):
                for name in dirs + names:
                    os.lchown(os.path.join(dirpath, name), uid, uid)
            os.chown(workdir, uid, uid)

    def _launch_cmd(self, cfg: dict) -> list[str]:
        python = os.path.realpath(sys.executable)
        if self._plan.backend != "bubblewrap":
            return [*self._plan.prefix, python, *PYTHON_FLAGS, str(LAUNCHER), json.dumps(cfg)]
        workdir, disk = cfg["workdir"], str(self.limits.disk_mb << 20)
        return [*self._plan.prefix, *_bwrap_view((python, *self._plan.pythons), self._hidden),
                "--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", disk, "--tmpfs", "/tmp",
                "--perms", "1777", "--size", disk, "--tmpfs", "/dev/shm",
                "--perms", "0700", "--size", disk, "--tmpfs", workdir,
                "--ro-bind", workdir, _BWRAP_STAGED, "--ro-bind", str(LAUNCHER), _BWRAP_LAUNCHER,
                "--remount-ro", "/", "--chdir", "/", python, *PYTHON_FLAGS, _BWRAP_LAUNCHER, json.dumps(cfg)]

    def _mount_cfg(self, workdir: str) -> dict | None:
        if not self._plan.mount:
            return None
        ns = {"parent_mnt_ns": os.stat("/proc/self/ns/mnt").st_ino}
        if self._plan.backend == "bubblewrap":
            return {**ns, "staged": _BWRAP_STAGED, "unmount": [_BWRAP_STAGED, _BWRAP_LAUNCHER]}
        return {**ns, "tmpfs_mb": self.limits.disk_mb, "tmpfs_inodes": 4096, "proc": self._plan.proc,
                "hide": list(self._hidden)}

    def _execute(self, workdir: str, stdin: str, uid: int | None) -> SandboxResult:
        group = None
        if self._plan.cgroup:
            manager = _cgroup.locate()[0]
            try:
                group = manager.group(self.limits.memory_mb << 20, self.limits.max_processes)
            except OSError as exc:
                raise SandboxError(f"cannot create the run's cgroup: {exc}") from exc
        try:
            return self._execute_in(workdir, stdin, uid, group)
        finally:
            if group is not None and not group.close():
                log.error("sandbox cgroup %s still has processes; left in place", group.dirs)

    def _execute_in(self, workdir: str, stdin: str, uid: int | None, group: "_cgroup.Group | None") -> SandboxResult:
        limits = self.limits
        status_r, status_w = os.pipe()
        cgroup_fds = list(group.fds) if group is not None else []
        program = _seccomp.compiled() if self._plan.seccomp else None
        cfg = {
            "mode": "run", "status_fd": status_w, "workdir": workdir, "uid": uid, "wall_s": limits.wall_s,
            "mount": self._mount_cfg(workdir), "cgroup_fds": cgroup_fds,
            "seccomp": program.hex() if program is not None else None,
            "rlimits": limits.rlimits(nproc=uid is not None or self._plan.user_ns),
            "pythons": list(self._plan.pythons), "argv": [*PYTHON_FLAGS, MAIN], "env": _scrubbed_env(workdir),
        }
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                self._launch_cmd(cfg), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(status_w, *cgroup_fds), cwd=workdir, env=_scrubbed_env(workdir), start_new_session=True)
        except OSError as exc:
            os.close(status_r)
            raise SandboxError(f"cannot start the sandbox: {exc}") from exc
        finally:
            os.close(status_w)
            if group is not None:
                group.close_fds()
        try:
            streams, truncated, timed_out = self._communicate(proc, stdin.encode(), status_r, start + limits.wall_s)
        finally:
            self._kill(proc)
            os.close(status_r)
        wall = time.monotonic() - start
        out, err, status_raw = streams
        status = self._parse_status(status_raw)
        if status is not None and "setup_error" in status:
            raise SandboxError(f"sandbox setup failed: {status['setup_error']}")
        returncode, reason, cpu = None, None, None
        if status is not None:
            cpu = status["cpu_s"]
            if "signal" in status:
                returncode = -status["signal"]
                reason = self._signal_reason(status["signal"], cpu)
                if status["signal"] == signal.SIGKILL and reason != "cpu_time" and group is not None \
                        and group.oom_kills() > 0:
                    reason = "memory"
            else:
                returncode = status["exit"]
        elif not timed_out:
            reason = "launcher_lost"
        if timed_out:
            reason = "wall_time"
        return SandboxResult(
            returncode=returncode, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
            timed_out=timed_out, killed_reason=reason, wall_s=wall, cpu_s=cpu,
            stdout_truncated=truncated[0], stderr_truncated=truncated[1])

    def _signal_reason(self, sig: int, cpu_s: float) -> str:
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= self.limits.cpu_limit_s - 0.05):
            return "cpu_time"
        if sig == signal.SIGXFSZ:
            return "file_size"
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            return f"signal:{sig}"

    @staticmethod
    def _parse_status(raw: bytes) -> dict | None:
        """The launcher's status (its last line), or the first setup error reported."""
        records = []
        for line in raw.decode("utf-8", "replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        records = [r for r in records if isinstance(r, dict)]
        errors = [r for r in records if "setup_error" in r]
        return errors[0] if errors else (records[-1] if records else None)

    def _communicate(self, proc: subprocess.Popen, stdin: bytes, status_r: int, deadline: float):
        """Feed stdin, read stdout/stderr (capped) and the launcher's status until the program is
        done or the deadline passes (then kill the tree). Returns ((out, err, status),
        (out_truncated, err_truncated), timed_out)."""
        cap = self.limits.max_output_bytes
        out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
        bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
        caps = {out_fd: cap, err_fd: cap, status_r: 1 << 16}
        totals = dict.fromkeys(bufs, 0)
        sel = selectors.DefaultSelector()
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        timed_out, stop_at, exited_at = False, None, None
        try:
            while sel.get_map():
                now = time.monotonic()
                if not timed_out and now >= deadline:
                    timed_out, stop_at = True, now + 1.0
                    self._kill(proc)  # the pipes close once the tree is gone
                if stop_at is not None and now >= stop_at:
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now >= exited_at + 0.25:
                    break  # descendants outside a PID namespace hold the pipes; they get killed next
                for key, _ in sel.select(max(0.0, min((stop_at or deadline) - now, 0.05))):
                    fd = key.fd
                    if fd == in_fd:
                        try:
                            written = os.write(fd, pending[:1 << 16])
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:  # the program does not read its stdin
                            written = len(pending)
                        pending = pending[written:]
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    totals[fd] += len(chunk)
                    room = caps[fd] - len(bufs[fd])
                    if room > 0:
                        bufs[fd] += chunk[:room]
        finally:
            sel.close()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if not stream.closed:
                    try:
                        stream.close()
                    except BrokenPipeError:
                        pass
        truncated = (totals[out_fd] > cap, totals[err_fd] > cap)
        return (bytes(bufs[out_fd]), bytes(bufs[err_fd]), bytes(bufs[status_r])), truncated, timed_out

    def _kill(self, proc: subprocess.Popen) -> None:
        """Kill the run's process tree and reap the launcher. With a PID namespace, SIGKILL its
        PID 1 (the launcher, the only child of ``unshare``) and wait for ``unshare``: it returns
        only after the kernel has killed every process of the namespace. Otherwise SIGKILL the
        process group (the dedicated uid is swept afterwards)."""
        if proc.poll() is None and self._plan.pid_ns:
            for pid in _children(proc.pid):
                _signal(pid, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    @staticmethod
    def _wait_gone(uid: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while _uid_processes(uid):
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True

    def _sweep(self, uid: int) -> bool:
        """Kill every process of ``uid`` (as that uid, ``kill(-1)``: atomic against forks) and
        wait until none is left. True when clean."""
        cfg = {"mode": "sweep", "uid": uid}
        try:
            subprocess.run([os.path.realpath(sys.executable), *PYTHON_FLAGS, str(LAUNCHER), json.dumps(cfg)],
                           env=_scrubbed_env("/"), timeout=10, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pass
        return self._wait_gone(uid, 2.0)
