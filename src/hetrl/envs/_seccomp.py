"""The sandbox's seccomp filter: which system calls a sandboxed program may not make, compiled to a
classic BPF program by libseccomp (through the ``pyseccomp`` ctypes binding).

The filter allows everything except the calls below, which fail with ``EPERM`` (``clone3`` with
``ENOSYS``, so that the C library falls back to ``clone``, whose flags the filter can inspect):

* other processes' memory and state: ``ptrace``, ``process_vm_readv/writev``, ``kcmp``,
  ``pidfd_getfd``;
* mounts and roots: ``mount``, ``umount2``, the new mount API (``open_tree``, ``move_mount``,
  ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``, ``mount_setattr``), ``pivot_root``,
  ``chroot``;
* new namespaces: ``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag;
* kernel keyrings: ``keyctl``, ``add_key``, ``request_key``;
* kernel attack surface a program never needs: ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``io_uring_*`` (whose operations bypass seccomp), ``open_by_handle_at``/``name_to_handle_at``,
  ``fanotify_init``, ``lookup_dcookie``;
* machine administration: modules, ``kexec_*``, ``reboot``, ``swapon/off``, ``acct``,
  ``quotactl*``, ``syslog``, ``iopl``/``ioperm``, clock setting, ``vhangup``, ``uselib``,
  ``nfsservctl``.

Calls made through another ABI (32-bit ``int 0x80``, x32) are refused by libseccomp's
architecture check (the process is killed). The launcher installs the program with
``prctl(PR_SET_SECCOMP)`` after ``no_new_privs``, immediately before it execs the program.
"""

from __future__ import annotations

import errno
import functools
import logging
import tempfile

log = logging.getLogger(__name__)

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount", "umount2", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "pivot_root", "chroot",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "lookup_dcookie",
    "init_module", "finit_module", "delete_module", "create_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "iopl", "ioperm",
    "settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex", "vhangup", "uselib",
    "nfsservctl",
)
#: ``clone`` flags that create namespaces (CLONE_NEWNS, CGROUP, UTS, IPC, USER, PID, NET).
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


@functools.lru_cache(maxsize=1)
def compiled() -> bytes | None:
    """The filter as raw BPF (``struct sock_filter`` array, native byte order), or None when
    libseccomp or its binding is unavailable (the sandbox then reports seccomp as inactive)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, AttributeError) as exc:  # the binding raises when libseccomp is absent
        log.warning("no seccomp filter: libseccomp unavailable (%s)", exc)
        return None
    arch = sc.system_arch()
    filt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        if sc.resolve_syscall(arch, name) >= 0:  # negative: not a call of this architecture
            filt.add_rule(sc.ERRNO(errno.EPERM), name)
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NEW_FLAGS:
        filt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as fh:
        filt.export_bpf(fh)
        fh.seek(0)
        return fh.read()
