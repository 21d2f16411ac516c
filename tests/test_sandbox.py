"""Acceptance tests of the code sandbox (hetrl.envs.sandbox): each case attacks one protection and
fails if that protection is removed; the parent (this test process) must survive all of them.

Where the machine allows namespaces (a working ``unshare``, as root or in a user namespace,
checked here independently of the sandbox), the sandbox must use them; elsewhere the cases that
need them are skipped with the reason, and the isolation report must say what is missing. The
same holds for bubblewrap (the minimal view), writable cgroups (tree limits) and libseccomp (the
seccomp filter); `make test` installs bubblewrap where it can.
"""

import concurrent.futures
import ctypes.util
import dataclasses
import errno
import json
import os
import pathlib
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from hetrl.envs import sandbox as sb
from hetrl.envs.sandbox import Sandbox, SandboxError, SandboxLimits

REPO = pathlib.Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, max_processes=16, max_output_bytes=8192)


def _expected_mode() -> int:
    """1: root with namespaces; 2: namespaces inside a user namespace; 3/4: none (root / not)."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    if unshare is not None:
        for mode, extra in ((1, []), (2, ["--user", "--map-root-user"])):
            cmd = [unshare, *extra, "--net", "--pid", "--mount", "--ipc", "--fork", "true"]
            if (mode == 2 or root) and subprocess.run(cmd, capture_output=True).returncode == 0:
                return mode
    return 3 if root else 4


def _has_bwrap() -> bool:
    bwrap = shutil.which("bwrap")
    extra = [] if os.geteuid() == 0 else ["--unshare-user"]
    return bwrap is not None and subprocess.run(
        [bwrap, *extra, "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "true"], capture_output=True
    ).returncode == 0


def _has_cgroups() -> bool:
    """Root, with the memory and pids controllers enabled (v1 or v2)."""
    try:
        with open("/proc/cgroups") as fh:
            enabled = {f[0] for f in (line.split() for line in fh if not line.startswith("#")) if f[3] == "1"}
    except OSError:
        return False
    return os.geteuid() == 0 and {"memory", "pids"} <= enabled


MODE = _expected_mode()
HAS_BWRAP, HAS_CGROUPS, HAS_SECCOMP = _has_bwrap(), _has_cgroups(), ctypes.util.find_library("seccomp") is not None
needs_ns = pytest.mark.skipif(MODE > 2, reason="needs a working `unshare` (namespaces)")
needs_bwrap = pytest.mark.skipif(
    not HAS_BWRAP, reason="bubblewrap absent or not working: the fallback (unshare namespaces, the host filesystem "
    "read-only) is active; `apt-get install bubblewrap` (make test does it as root)")
needs_cgroups = pytest.mark.skipif(
    not HAS_CGROUPS, reason="no writable cgroup with memory+pids (not root?): tree limits fall back to per-process "
    "rlimits")
needs_seccomp = pytest.mark.skipif(not HAS_SECCOMP, reason="libseccomp absent: no seccomp filter")


def _needs_process_limit(box: Sandbox) -> None:
    # RLIMIT_NPROC needs a uid or a user namespace of the run's own (modes 1-3); without one a
    # fork bomb would run as the caller, so the case is not attempted.
    if not (box.isolation.uid or box.isolation.user_namespace):
        pytest.skip(f"no process limit in this isolation mode: {box.isolation}")


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return Sandbox(LIMITS)


def run_json(box: Sandbox, code: str, **kw) -> dict:
    res = box.run(code, **kw)
    assert res.ok, (res.returncode, res.killed_reason, res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_isolation_is_reported_and_full_where_possible(box):
    iso = box.isolation
    assert f"mode {iso.mode}" in iso.describe()
    assert iso.mode == MODE
    assert iso.backend == ("bubblewrap" if HAS_BWRAP else "unshare" if MODE <= 2 else "none")
    assert f"({iso.backend})" in iso.describe()
    assert bool(iso.tree_limits) == (HAS_CGROUPS and MODE <= 3) and iso.seccomp == HAS_SECCOMP
    if MODE <= 2:
        full = {"network", "pid_namespace", "filesystem", "uid", "no_capabilities"}
        full |= {name for name, has in (("minimal_view", HAS_BWRAP), ("tree_limits", HAS_CGROUPS),
                                         ("seccomp", HAS_SECCOMP)) if has}
        assert iso.active() == (full if MODE == 1 else full - {"uid"})
        assert iso.private_proc and str(REPO / "src" / "hetrl") in iso.hidden_paths
        assert iso.user_namespace == (MODE == 2)
        Sandbox(LIMITS, require=["network", "filesystem"])
    else:
        assert "NOT" in iso.describe()
        with pytest.raises(SandboxError):
            Sandbox(LIMITS, require=["network"])
    with pytest.raises(ValueError):
        Sandbox(LIMITS, require=["teleportation"])


@pytest.mark.skipif(os.geteuid() != 0, reason="mode 3 (uid drop without namespaces) needs root")
def test_weaker_mode_is_reported_as_weaker():
    plan = next(p for p in sb._plans() if p.mode == 3)
    _, iso = sb._verify(plan, sb.DEFAULT_HIDDEN)
    assert iso.uid and not iso.network and not iso.filesystem and not iso.pid_namespace and not iso.minimal_view
    assert iso.hidden_paths == ()
    assert "network: NOT isolated" in iso.describe() and "view: the host filesystem" in iso.describe()


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="as non-root this is the plan the sandbox itself chooses")
def test_bubblewrap_in_a_user_namespace_as_unprivileged_machines_run_it():
    """Mode 2 (what a non-root machine gets), exercised here as root: no uid of its own, the
    launcher works inside a user namespace, the view is still minimal and read-only."""
    plan = next(p for p in sb._plans("bubblewrap") if p.mode == 2)
    pinned, iso = sb._verify(plan, sb.DEFAULT_HIDDEN)
    assert iso.user_namespace and not iso.uid and iso.minimal_view and iso.filesystem and iso.no_capabilities
    assert iso.seccomp == HAS_SECCOMP
    res = sb._Runner(pinned, LIMITS, sb.DEFAULT_HIDDEN).run(
        "import os\nprint(open('d/f.txt').read())\nopen('/x', 'w')", "", {"d/f.txt": "staged"})
    assert res.stdout == "staged\n" and "Read-only file system" in res.stderr


@needs_ns
def test_the_previous_isolation_stays_selectable():
    old = Sandbox(LIMITS, backend="unshare", cgroup=False, seccomp=False).isolation
    assert old.backend == "unshare" and old.mode == MODE
    assert not ({"minimal_view", "tree_limits", "seccomp"} & old.active())
    assert "tree limits: NONE" in old.describe() and "seccomp: NONE" in old.describe()
    with pytest.raises(ValueError, match="backend"):
        Sandbox(LIMITS, backend="docker")


def test_runs_a_program_with_stdin_and_files(box):
    code = "import sys\nsys.path.insert(0, '.')\nfrom pkg.mod import f\nprint(f(sys.stdin.read()))"
    res = box.run(code, stdin="abc", files={"pkg/__init__.py": "", "pkg/mod.py": "def f(s):\n    return s[::-1]\n"})
    assert res.ok and res.stdout == "cba\n" and res.stderr == ""
    for bad in ("../x.py", "/etc/x", "a/../../b", "main.py", ""):
        with pytest.raises(ValueError):
            box.run("pass", files={bad: "x"})


def test_infinite_loop_is_killed_at_the_cpu_limit():
    box = Sandbox(LIMITS.model_copy(update={"wall_s": 20}))  # a generous wall limit: CPU must act
    res = box.run("while True:\n    pass")
    assert res.killed_reason == "cpu_time" and res.returncode != 0
    # the kernel checks RLIMIT_CPU against the scheduler's exact runtime, while rusage's user+sys
    # time is tick-sampled: on a loaded machine it reads up to ~15% low (0.89 s seen for a 1 s limit)
    assert 0.75 * LIMITS.cpu_limit_s <= res.cpu_s <= LIMITS.cpu_limit_s + 1.1 and res.wall_s < 20


def test_sleeper_is_killed_at_the_wall_limit(box):
    res = box.run("import time\nprint('start', flush=True)\ntime.sleep(60)")
    assert res.timed_out and res.killed_reason == "wall_time" and res.stdout == "start\n"
    assert LIMITS.wall_s <= res.wall_s < LIMITS.wall_s + 1.5


def test_process_limit_caps_forking(box):
    _needs_process_limit(box)
    code = """
import os, time, json
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError as exc:
        err = exc.errno
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
print(json.dumps({"forked": n, "errno": err}))
"""
    out = run_json(box, code)
    assert out["errno"] == errno.EAGAIN and out["forked"] < LIMITS.max_processes


def test_fork_bomb_is_contained_and_cleaned_up(box):
    _needs_process_limit(box)
    code = """
import os
print(os.getuid(), flush=True)
while True:
    try:
        if os.fork() == 0:
            os.setsid()  # try to escape the process group
    except OSError:
        pass
"""
    res = box.run(code)
    assert res.killed_reason in ("wall_time", "cpu_time")
    if box.isolation.uid:
        uid = int(res.stdout.split()[0])
        assert uid != os.getuid() and sb._uid_processes(uid) == []
    assert box.run("print('alive')").stdout == "alive\n"


def test_memory_hog_fails_under_the_memory_limit(box):
    res = box.run("x = bytearray(1 << 30)\nprint('allocated 1 GiB')")
    assert res.returncode != 0 and "allocated" not in res.stdout
    assert "MemoryError" in res.stderr or res.killed_reason is not None
    assert box.run("x = bytearray(32 << 20)\nprint(len(x))").stdout == f"{32 << 20}\n"


def test_file_size_limit():
    box = Sandbox(LIMITS.model_copy(update={"max_file_mb": 1}))
    res = box.run("open('big', 'wb').write(b'x' * (4 << 20))")
    assert res.returncode != 0 and "File too large" in res.stderr


@needs_ns
def test_cannot_write_outside_its_directory(box):
    tag = uuid.uuid4().hex
    targets = [f"/tmp/hetrl-escape-{tag}", str(REPO / f"escape-{tag}"), f"/root/escape-{tag}",
               f"/dev/shm/escape-{tag}", f"/var/tmp/escape-{tag}", f"/usr/escape-{tag}", f"/escape-{tag}"]
    private = {f"/tmp/hetrl-escape-{tag}", f"/dev/shm/escape-{tag}"} if box.isolation.minimal_view else set()
    code = f"""
import json, os
out = {{}}
for path in {targets!r} + ["inside.txt"]:
    try:
        with open(path, "w") as fh:
            fh.write("x")
        out[path] = "written"
    except OSError as exc:
        out[path] = exc.errno
print(json.dumps(out))
"""
    out = run_json(box, code)
    assert out.pop("inside.txt") == "written"
    assert all(out.pop(t) == "written" for t in private)  # the run's own /tmp and /dev/shm
    assert all(v in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT) for v in out.values()), out
    assert not any(os.path.exists(t) for t in targets)


@needs_ns
def test_no_network(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    code = f"""
import json, socket
out = {{}}
for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
    try:
        socket.create_connection((host, port), timeout=1).close()
        out[host] = "connected"
    except OSError as exc:
        out[host] = exc.errno
print(json.dumps(out))
"""
    try:
        out = run_json(box, code)
        assert select.select([server], [], [], 0.2)[0] == [], "the sandbox reached the parent's port"
    finally:
        server.close()
    # bubblewrap brings up a loopback of the run's own (refused); unshare leaves it down (unreachable)
    assert out.pop("127.0.0.1") in (errno.ENETUNREACH, errno.ECONNREFUSED)
    assert set(out.values()) == {errno.ENETUNREACH}, out


def test_parent_environment_is_invisible(box, monkeypatch):
    secret = "hetrl-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("HETRL_TEST_SECRET", secret)
    code = f"""
import glob, json, os
print(json.dumps(dict(os.environ)))
for path in glob.glob("/proc/*/environ") + ["/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ"]:
    try:
        print(path, open(path, "rb").read())
    except OSError as exc:
        print(path, exc)
"""
    res = box.run(code)
    assert res.ok and "PATH" in res.stdout
    env = json.loads(res.stdout.splitlines()[0])
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR"} and secret not in str(env)
    if box.isolation.uid or box.isolation.private_proc:  # else /proc/<parent>/environ is readable
        assert secret not in res.stdout and secret not in res.stderr


@needs_ns
def test_hidden_task_data_and_privileges(box):
    code = f"""
import json, os
out = {{"uid": os.getuid(), "listing": os.listdir({str(REPO / 'src' / 'hetrl')!r})}}
with open("/proc/self/status") as fh:
    out["cap_eff"] = next(l for l in fh if l.startswith("CapEff:")).split()[1]
try:
    os.setuid(0)
    out["setuid"] = "ok"
except OSError as exc:
    out["setuid"] = exc.errno
print(json.dumps(out))
"""
    out = run_json(box, code.replace('"listing": os.listdir(', '"listing": os.path.isdir(') if HAS_BWRAP else code)
    assert out["listing"] in ([], False) and int(out["cap_eff"], 16) == 0
    if MODE == 1:
        assert out["uid"] != 0 and out["setuid"] == errno.EPERM


def test_large_output_is_truncated(box):
    res = box.run("import sys\nfor _ in range(200):\n    sys.stdout.write('y' * 65536)\nsys.stderr.write('e' * 100000)")
    assert res.ok and res.stdout_truncated and res.stderr_truncated
    assert res.stdout == "y" * LIMITS.max_output_bytes and len(res.stderr) == LIMITS.max_output_bytes


def test_concurrent_runs_in_threads(box):
    code = "import os, sys\nn = int(sys.stdin.read())\nprint(n * n, open('data.txt').read(), os.getuid())"

    def one(i: int):
        return i, box.run(code, stdin=str(i), files={"data.txt": f"item-{i}"})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    uids = set()
    for i, res in results:
        assert res.ok, res
        square, item, uid = res.stdout.split()
        assert (int(square), item) == (i * i, f"item-{i}")
        uids.add(uid)
    if box.isolation.uid:
        assert len(uids) > 1  # dedicated uids, not one shared by concurrent runs


def test_run_directory_is_removed(box):
    res = box.run("import os\nopen('f.txt', 'w').write('x')\nos.mkdir('d')\nos.chmod('d', 0)\nprint(os.getcwd())")
    workdir = res.stdout.strip()
    assert res.ok and workdir.startswith(os.path.realpath(os.path.dirname(workdir)))
    assert not os.path.exists(workdir)
    res = box.run("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(60)")
    assert res.timed_out and not os.path.exists(res.stdout.strip())


def test_failed_setup_is_an_error_and_runs_nothing(tmp_path):
    # Asked to prepare mounts without a mount namespace, the launcher refuses (fails closed).
    marker = tmp_path / "ran"
    plan = sb._Plan(1, (), True, False, False, sb._interpreters())
    with pytest.raises(SandboxError, match="mount namespace"):
        sb._Runner(plan, LIMITS, ()).run(f"open({str(marker)!r}, 'w')", "", {})
    assert not marker.exists()


# -- the minimal view, tree limits and the seccomp filter ----------------------------------------

_READ_SECRETS = """
import json, os, sys
out = {}
for path in json.loads(sys.stdin.read()):
    try:
        if os.path.isdir(path):  # its markers and its size: a host /tmp can list more than the output cap holds
            names = os.listdir(path)
            out[path] = sorted(n for n in names if n.startswith("hetrl-host-secret-")) + [f"<{len(names)} entries>"]
        else:
            with open(path, "rb") as fh:
                out[path] = fh.read(200).decode("utf-8", "replace")
    except OSError as exc:
        out[path] = exc.errno
print(json.dumps(out))
"""


def _secret_paths(marker: str) -> list[str]:
    """What an answer would read to forge a reward or learn about the host: the checkout, its .git,
    the task definitions, the virtualenvs, home directories, the host's /tmp."""
    paths = [str(REPO / ".git"), str(REPO / ".git" / "HEAD"), str(REPO / "pyproject.toml"),
             str(REPO / "src" / "hetrl" / "envs" / "tasks_synthetic.py"), str(REPO / "tests"),
             os.path.join(sys.prefix, "pyvenv.cfg"), "/work/main/.venv/pyvenv.cfg", "/work/main/.git/HEAD",
             "/home", os.path.expanduser("~/.bashrc"), marker, os.path.dirname(marker)]
    return [p for p in paths if os.path.lexists(p)]


@needs_bwrap
def test_project_venv_home_and_host_tmp_are_invisible(box):
    with tempfile.NamedTemporaryFile(prefix="hetrl-host-secret-") as marker:
        paths = _secret_paths(marker.name)
        assert len(paths) >= 5
        out = run_json(box, _READ_SECRETS, stdin=json.dumps(paths))
        tmp = out.pop(os.path.dirname(marker.name))
        assert os.path.basename(marker.name) not in tmp  # a private /tmp, not the host's
        home = os.path.expanduser("~/.bashrc")  # its directory may exist on the way to the interpreter
        assert out.pop(home, errno.ENOENT) in (errno.ENOENT, errno.EACCES)
        assert all(v == errno.ENOENT for v in out.values()), out
        # the same attack against the previous isolation reads the checkout (what the view closes)
        if MODE == 1:
            old = run_json(Sandbox(LIMITS, backend="unshare", cgroup=False, seccomp=False), _READ_SECRETS,
                           stdin=json.dumps(paths))
            assert isinstance(old[str(REPO / "pyproject.toml")], str)


@needs_bwrap
def test_other_runs_are_invisible(box):
    """A concurrent run's files (here: its staged copy on the host) cannot be read."""
    code = "import os, sys, time\nprint(os.getcwd(), flush=True)\ntime.sleep(1.5)"
    secret = "other run's secret " + uuid.uuid4().hex
    tmp = pathlib.Path(tempfile.gettempdir())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(box.run, code, "", {"answer.txt": secret})
        paths = []
        for _ in range(200):  # wait until the first run's staged copy exists on the host
            paths = [str(p) for p in tmp.glob("hetrl-sbx-*/answer.txt") if p.read_text() == secret]
            if paths:
                break
            select.select([], [], [], 0.01)
        out = run_json(box, _READ_SECRETS, stdin=json.dumps(paths))
        first.result()
    assert len(paths) == 1 and out == {paths[0]: errno.ENOENT}, out


def test_host_unix_sockets_are_unreachable(box):
    """A world-writable UNIX socket on the host (path and abstract) cannot be connected to."""
    if not (box.isolation.minimal_view and box.isolation.network):
        pytest.skip(f"host sockets are reachable by path without the minimal view: {box.isolation}")
    directory = tempfile.mkdtemp(prefix="hetrl-sock-")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "s")
    servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    abstract = "\0hetrl-test-" + uuid.uuid4().hex
    try:
        servers[0].bind(path)
        os.chmod(path, 0o777)
        servers[1].bind(abstract)
        for s in servers:
            s.listen(4)
        code = f"""
import json, socket
out = {{}}
for name, addr in (("path", {path!r}), ("abstract", {abstract!r})):
    try:
        socket.socket(socket.AF_UNIX).connect(addr)
        out[name] = "connected"
    except OSError as exc:
        out[name] = exc.errno
print(json.dumps(out))
"""
        out = run_json(box, code)
        assert select.select(servers, [], [], 0.2)[0] == [], "the sandbox reached a host socket"
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(directory)
    assert out == {"path": errno.ENOENT, "abstract": errno.ECONNREFUSED}, out


_HOLD = """
import json, os, sys
kind, chunk, target = sys.argv[1] if len(sys.argv) > 1 else {kind!r}, 8 << 20, {target}
held, keep = 0, []
while held < target:
    try:
        if kind == "memfd":
            fd = os.memfd_create("x")
            os.write(fd, b"x" * chunk)
            keep.append(fd)
        else:
            d = ("/tmp", "/dev/shm", ".")[len(keep) % 3]
            with open(os.path.join(d, "f%d" % len(keep)), "wb") as fh:
                fh.write(b"x" * chunk)
            keep.append(d)
    except OSError as exc:
        print("error", exc.errno, flush=True)
        break
    held += chunk
    print(held >> 20, flush=True)
"""


@needs_cgroups
@pytest.mark.parametrize("kind", ["memfd", "tmpfs"])
def test_memfd_and_tmpfs_pages_count_against_the_memory_limit(kind):
    """memfd and tmpfs pages are not address space (RLIMIT_AS does not see them): the tree's
    cgroup must, so the run cannot hold 3x its memory limit."""
    limits = LIMITS.model_copy(update={"memory_mb": 96, "disk_mb": 512, "max_open_files": 128, "wall_s": 15})
    box = Sandbox(limits)
    assert box.isolation.tree_limits
    res = box.run(_HOLD.format(kind=kind, target=3 * 96 << 20))
    held = [int(line) for line in res.stdout.split() if line.isdigit()]
    assert max(held, default=0) <= 96, (held[-1:], res.killed_reason, res.stderr[-300:])
    assert res.killed_reason == "memory" or "error" in res.stdout


@needs_cgroups
def test_a_failing_mechanism_costs_only_itself(monkeypatch, tmp_path):
    """Where joining the run's cgroup fails (here: its descriptor writes to /dev/full), the launcher
    refuses to run the program and the probe settles for the plan without tree limits."""
    real = sb._cgroup.Manager.group

    def broken(self, memory_bytes, max_pids):
        group = real(self, memory_bytes, max_pids)
        group.close_fds()
        group.fds = (os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC),)
        return group

    monkeypatch.setattr(sb._cgroup.Manager, "group", broken)
    box = Sandbox(LIMITS, hidden=[str(tmp_path)])  # a key of its own in the probe cache
    assert box.isolation.tree_limits is None and "tree limits: NONE" in box.isolation.describe()
    assert box.isolation.seccomp == HAS_SECCOMP and box.isolation.mode == MODE
    assert box.run("print('ran')").stdout == "ran\n"
    with pytest.raises(SandboxError, match="tree_limits"):
        Sandbox(LIMITS, hidden=[str(tmp_path)], require=["tree_limits"])


@needs_cgroups
def test_tree_memory_is_capped():
    """Each child stays under the per-process limit; together they may not exceed memory_mb."""
    box = Sandbox(LIMITS.model_copy(update={"memory_mb": 128, "wall_s": 15}))  # reclaim is slow on a busy machine
    code = """
import json, os, time
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        x = b"\\x01" * (48 << 20)
        time.sleep(1.0)
        os._exit(0)
    pids.append(pid)
statuses = [os.waitpid(p, 0)[1] for p in pids]
print(json.dumps({"survived": sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses)}))
"""
    out = run_json(box, code)
    assert out["survived"] * 48 <= 128, out


@needs_cgroups
@needs_ns
def test_tree_process_limit_holds_without_the_uid_limit(box):
    """The pids cgroup alone caps the tree: here the run has no uid of its own, so no
    RLIMIT_NPROC (it runs as a namespaced root without capabilities)."""
    plan = dataclasses.replace(box._runner._plan, own_uid=False)
    runner = sb._Runner(plan, LIMITS, sb.DEFAULT_HIDDEN)
    code = """
import os, time, json
n, err = 0, None
for _ in range(100):
    try:
        pid = os.fork()
    except OSError as exc:
        err = exc.errno
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
print(json.dumps({"forked": n, "errno": err, "uid": os.getuid()}))
"""
    res = runner.run(code, "", {})
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "RLIMIT_NPROC" not in LIMITS.rlimits(nproc=False)
    assert out["errno"] == errno.EAGAIN and out["forked"] < LIMITS.max_processes, out


_SYSCALLS = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
def call(*args):
    r = libc.syscall(*[L(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
out = {}
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17
out["ptrace_traceme"] = call(101, 0, 0, 0, 0)                       # ptrace(PTRACE_TRACEME)
out["add_key"] = "ok" if libc.syscall(L(248), b"user", b"k", b"v", L(1), L(-3)) >= 0 \
    else errno.errorcode[ctypes.get_errno()]                         # add_key to the session keyring
out["keyctl"] = call(250, 0, -3, 1)                                  # KEYCTL_GET_KEYRING_ID, create
out["bpf"] = call(321, 0, 0, 0)                                      # BPF_MAP_CREATE
out["perf_event_open"] = call(298, 0, 0, -1, -1, 0)
out["userfaultfd"] = call(323, 0)
out["io_uring_setup"] = call(425, 1, 0)
out["setns"] = call(308, os.open("/proc/self/ns/net", os.O_RDONLY), 0)
out["mount"] = "ok" if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0 else errno.errorcode[ctypes.get_errno()]
pid = libc.syscall(L(56), L(CLONE_NEWUSER | SIGCHLD), L(0), L(0), L(0), L(0))  # clone into a new user ns
if pid == 0:
    os._exit(0)
out["clone_newuser"] = "ok" if pid > 0 else errno.errorcode[ctypes.get_errno()]
if pid > 0:
    os.waitpid(pid, 0)
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) == 0:  # a user namespace: every capability inside it
    with open("/proc/self/status") as fh:
        caps = int(next(l for l in fh if l.startswith("CapEff:")).split()[1], 16)
    out["unshare_user"] = "ok, CapEff=%x" % caps
    out["mount"] = "ok" if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0 else out["mount"]
else:
    out["unshare_user"] = errno.errorcode[ctypes.get_errno()]
print(json.dumps(out))
"""


@needs_seccomp
@needs_ns
def test_seccomp_denies_ptrace_mount_namespaces_keyctl_bpf(box):
    assert box.isolation.seccomp and "seccomp: ptrace" in box.isolation.describe()
    out = run_json(box, _SYSCALLS)
    assert all(v == "EPERM" for v in out.values()), out
    # without the filter the same program traces itself, adds keys and holds capabilities in a user
    # namespace (the sandbox's uid is unprivileged only in the host's namespace)
    loose = run_json(Sandbox(LIMITS, seccomp=False), _SYSCALLS)
    assert loose["ptrace_traceme"] == "ok" and loose["add_key"] == "ok", loose
    if open("/proc/sys/user/max_user_namespaces").read().strip() != "0":
        assert loose["unshare_user"].startswith("ok") and loose["mount"] == "ok", loose


def test_feedback_never_quotes_host_files(box):
    """An answer that tries to make a host file's text appear in its output (the next turn's
    feedback) gets an error without the text: nothing of the sandbox layer reads host files
    into results."""
    if not box.isolation.minimal_view:
        pytest.skip(f"without the minimal view host files are readable: {box.isolation}")
    secret = str(REPO / "pyproject.toml")
    first_line = open(secret).readline().strip()
    code = f"import runpy\nrunpy.run_path({secret!r})\n"
    res = box.run(code)
    assert res.returncode != 0 and first_line not in res.stdout + res.stderr
    assert "No such file" in res.stderr
