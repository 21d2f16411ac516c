"""The in-sandbox launcher of :mod:`hetrl.envs.sandbox` (trusted code, standard library only).

Run by the parent as ``python -I -S -B _launcher.py CONFIG_JSON``, possibly inside fresh
namespaces made by ``unshare``. It never runs untrusted code itself: it prepares the sandbox,
forks the program and waits for it. Modes:

* ``run``: (inside a mount namespace) copy the staged run directory onto a size-capped tmpfs owned
  by the sandbox uid, mount a private ``/proc``, cover hidden paths with empty read-only tmpfs,
  make every mount read-only except the run directory; then fork. The child sets the rlimits,
  drops to the sandbox uid/gid (no groups, no capabilities, ``no_new_privs``) and execs the first
  interpreter it can execute as that uid with isolation flags. The launcher reaps every process
  that reparents to it (it is PID 1 of the PID namespace when there is one) and, once the program
  exits, writes one JSON status line to ``status_fd`` and exits; leaving PID 1 kills whatever the
  program left behind.
  Under bubblewrap (``mount.staged`` set) the mounts are bubblewrap's: the launcher only copies
  the staged files (bound read-only at ``mount.staged``) into the run directory's tmpfs, gives it
  to the sandbox uid and unmounts the staging and launcher binds.
  The child, before anything else, joins the run's cgroup (``cgroup_fds``: ``cgroup.procs``
  opened by the parent) and, as its last step before the exec, installs the seccomp filter
  (``seccomp``: raw BPF, hex) after ``no_new_privs``.
* ``sweep``: become the sandbox uid and ``kill(-1, SIGKILL)``: every process of that uid dies
  (the clean-up used when there is no PID namespace; the kernel makes it atomic against fork).

Any preparation step that fails (in the launcher or in the child before its exec) is reported on
``status_fd`` as ``{"setup_error": ...}`` before any untrusted code runs: the launcher fails
closed, it never runs a program with less isolation than it was asked for.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
SYS_MOUNT_SETATTR = 442  # same number on every architecture that has it (Linux >= 5.12)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_SECCOMP = 38, 24, 28, 22
SECCOMP_MODE_FILTER, MNT_DETACH, PTRACE_DETACH = 2, 2, 17
# SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED
SECUREBITS_LOCKED_NOROOT = 0x1 | 0x2 | 0x8 | 0x20

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data):
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                       data.encode()), f"mount {fstype} on {target}")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install_seccomp(program):
    """Install a classic BPF seccomp program (``struct sock_filter[]``, 8 bytes per instruction)."""
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    ulong = ctypes.c_ulong
    _check(_libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), ulong(0),
                       ulong(0)), "prctl(SET_SECCOMP)")


def _mount_setattr(path, attr_set, attr_clr):
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    long = ctypes.c_long
    _check(_libc.syscall(long(SYS_MOUNT_SETATTR), long(AT_FDCWD), ctypes.c_char_p(path.encode()),
                         long(AT_RECURSIVE), ctypes.byref(attr), long(ctypes.sizeof(attr))),
           f"mount_setattr {path}")


def _read_tree(root):
    """Every regular file under ``root`` as (relative path, bytes, mode); the tree is small."""
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as fh:
                out.append((os.path.relpath(full, root), fh.read(), os.stat(full).st_mode & 0o777))
    return out


def _write_tree(root, entries, uid):
    for rel, data, mode in entries:
        full = os.path.join(root, rel)
        parent = os.path.dirname(full)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        with open(full, "wb") as fh:
            fh.write(data)
        os.chmod(full, mode)
    if uid is not None:
        for dirpath, dirs, names in os.walk(root):
            for name in dirs + names:
                os.lchown(os.path.join(dirpath, name), uid, uid)


def _prepare_bwrap(cfg):
    """Under bubblewrap: fill the run directory's tmpfs from the staged copy, then unmount the
    staging and launcher binds so that the program sees neither."""
    mount, workdir, uid = cfg["mount"], cfg["workdir"], cfg["uid"]
    _write_tree(workdir, _read_tree(mount["staged"]), uid)
    if uid is not None:
        os.chown(workdir, uid, uid)
    os.chmod(workdir, 0o700)
    for path in mount["unmount"]:
        _check(_libc.umount2(path.encode(), ctypes.c_int(MNT_DETACH)), f"umount {path}")


def _prepare_mounts(cfg):
    mount = cfg["mount"]
    if os.stat("/proc/self/ns/mnt").st_ino == mount["parent_mnt_ns"]:
        raise RuntimeError("not in a new mount namespace; refusing to touch the parent's mounts")
    if "staged" in mount:
        return _prepare_bwrap(cfg)
    workdir, uid = cfg["workdir"], cfg["uid"]
    entries = _read_tree(workdir)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={mount['tmpfs_mb']}m,nr_inodes={mount['tmpfs_inodes']},mode=0700{owner}")
    _write_tree(workdir, entries, uid)
    if mount["proc"]:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "")
    for path in mount["hide"]:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    _mount_setattr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
    _mount_setattr(workdir, 0, MOUNT_ATTR_RDONLY)


def _drop_capabilities():
    """Empty the capability bounding set and lock the securebits so that no later execve (even as
    uid 0) grants capabilities again."""
    ulong = ctypes.c_ulong
    cap = 0
    while _libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ulong(cap), ulong(0), ulong(0), ulong(0)) == 0:
        cap += 1
    _check(_libc.prctl(ctypes.c_int(PR_SET_SECUREBITS), ulong(SECUREBITS_LOCKED_NOROOT), ulong(0), ulong(0),
                       ulong(0)), "prctl(SET_SECUREBITS)")


def _drop_privileges(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _child(cfg, status_fd):
    """Runs in the forked child; never returns. ``status_fd`` is close-on-exec: the program never
    holds it; a failure before the exec is reported on it."""
    try:
        for fd in cfg["cgroup_fds"]:
            os.write(fd, b"0")  # join the run's cgroup; everything started from here inherits it
            os.close(fd)
        os.chdir(cfg["workdir"])
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if os.geteuid() == 0:  # real root, or root of a user namespace
            _drop_capabilities()
        if cfg["uid"] is not None:
            _drop_privileges(cfg["uid"])
        ulong = ctypes.c_ulong
        _check(_libc.prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ulong(1), ulong(0), ulong(0), ulong(0)),
               "prctl(NO_NEW_PRIVS)")
        os.umask(0o077)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        python = next((p for p in cfg["pythons"] if os.access(p, os.X_OK)), None)
        if python is None:
            raise RuntimeError(f"no interpreter executable by the sandbox user among {cfg['pythons']}")
        if cfg["seccomp"]:
            _install_seccomp(bytes.fromhex(cfg["seccomp"]))
        os.execve(python, [python, *cfg["argv"]], cfg["env"])
    except BaseException as exc:  # report and leave; nothing untrusted has run yet
        os.write(status_fd, (json.dumps({"setup_error": f"child: {exc!r}"}) + "\n").encode())
        os._exit(125)


def _run(cfg, status_fd):
    try:
        if cfg["mount"] is not None:
            _prepare_mounts(cfg)
    except BaseException as exc:
        os.write(status_fd, (json.dumps({"setup_error": repr(exc)}) + "\n").encode())
        sys.exit(125)
    pid = os.fork()
    if pid == 0:
        _child(cfg, status_fd)
    # Our own wall-clock limit, in case the parent that enforces the real one has died.
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.setitimer(signal.ITIMER_REAL, cfg["wall_s"] + 1.0)
    status = None
    while True:  # reap everything that reparents to us; stop when the program itself exits
        try:
            wpid, wstatus, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if os.WIFSTOPPED(wstatus):  # the program made us its tracer (PTRACE_TRACEME): let it go
            _libc.ptrace(ctypes.c_long(PTRACE_DETACH), ctypes.c_long(wpid), None,
                         ctypes.c_long(os.WSTOPSIG(wstatus)))
            continue
        if wpid == pid:
            status = {"cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kb": usage.ru_maxrss}
            if os.WIFSIGNALED(wstatus):
                status["signal"] = os.WTERMSIG(wstatus)
            else:
                status["exit"] = os.WEXITSTATUS(wstatus)
            break
    os.write(status_fd, (json.dumps(status) + "\n").encode())
    sys.exit(0)


def _sweep(cfg):
    _drop_privileges(cfg["uid"])
    try:
        os.kill(-1, signal.SIGKILL)  # every process of this uid but ourselves; atomic against fork
    except ProcessLookupError:
        pass


def main():
    cfg = json.loads(sys.argv[1])
    if cfg["mode"] == "sweep":
        _sweep(cfg)
    else:
        for fd in (cfg["status_fd"], *cfg["cgroup_fds"]):
            os.set_inheritable(fd, False)
        _run(cfg, cfg["status_fd"])


if __name__ == "__main__":
    main()
