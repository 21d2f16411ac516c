"""The cgroup path logic of the sandbox's tree limits (hetrl.envs._cgroup): which hierarchy hosts
the runs' groups, for cgroup v1, v2 and hybrid machines, from the texts of /proc/self/cgroup and
/proc/self/mountinfo; and the files a v2 group is configured through (on a directory standing in
for the cgroup file system, since this machine's v2 hierarchy has no controllers)."""

import os

from hetrl.envs import _cgroup
from hetrl.envs._cgroup import Layout

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
34 31 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
38 31 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_SELF = "8:pids:/\n4:memory:/process_api/abc\n0::/\n"
V2_MOUNTS = "30 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def files(mapping):
    return lambda path: mapping.get(path)


def test_v1_memory_and_pids_hierarchies_at_the_callers_cgroups():
    # the unified hierarchy is mounted but has no controllers (this machine kind): v1 is used
    read = files({"/sys/fs/cgroup/unified/cgroup.controllers": ""})
    assert _cgroup.candidates(V1_SELF, V1_MOUNTS, read) == [
        Layout(1, ("/sys/fs/cgroup/memory/process_api/abc", "/sys/fs/cgroup/pids"))]


def test_v1_needs_both_controllers():
    mounts = "\n".join(line for line in V1_MOUNTS.splitlines() if "pids" not in line)
    assert _cgroup.candidates(V1_SELF, mounts, files({})) == []


def test_v2_delegated_cgroup_is_used_as_is():
    self_cg = "0::/user.slice/user-1000.slice/app.slice/run.scope\n"
    d = "/sys/fs/cgroup/user.slice/user-1000.slice/app.slice/run.scope"
    read = files({f"{d}/cgroup.controllers": "cpu memory pids io\n", f"{d}/cgroup.subtree_control": "memory pids\n"})
    assert _cgroup.candidates(self_cg, V2_MOUNTS, read) == [Layout(2, (d,), ())]


def test_v2_root_enables_the_controllers_it_lacks():
    read = files({"/sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids",
                  "/sys/fs/cgroup/cgroup.subtree_control": "cpu"})
    assert _cgroup.candidates("0::/\n", V2_MOUNTS, read) == [Layout(2, ("/sys/fs/cgroup",), ("memory", "pids"))]


def test_v2_undelegated_leaf_is_not_usable():
    # enabling controllers for children of a cgroup that holds processes (ours) is refused by v2
    d = "/sys/fs/cgroup/system.slice/x.service"
    read = files({f"{d}/cgroup.controllers": "memory pids", f"{d}/cgroup.subtree_control": ""})
    assert _cgroup.candidates("0::/system.slice/x.service\n", V2_MOUNTS, read) == []


def test_v2_in_a_container_with_its_cgroup_namespace_root_mounted():
    # a container whose cgroup namespace root is /docker/abc sees itself at "/" and mounts that root
    mounts = "500 490 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    read = files({"/sys/fs/cgroup/cgroup.controllers": "memory pids", "/sys/fs/cgroup/cgroup.subtree_control": ""})
    assert _cgroup.candidates("0::/\n", mounts, read) == [Layout(2, ("/sys/fs/cgroup",), ("memory", "pids"))]
    # without a cgroup namespace the mount's root is a sub-tree; our path is joined relative to it
    mounts = "500 490 0:27 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    read = files({"/sys/fs/cgroup/sub/cgroup.controllers": "memory pids",
                  "/sys/fs/cgroup/sub/cgroup.subtree_control": "memory pids"})
    assert _cgroup.candidates("0::/docker/abc/sub\n", mounts, read) == [Layout(2, ("/sys/fs/cgroup/sub",), ())]
    assert _cgroup.candidates("0::/elsewhere\n", mounts, read) == []  # not under the mounted part


def test_hybrid_prefers_v2_when_it_has_the_controllers():
    read = files({"/sys/fs/cgroup/unified/cgroup.controllers": "memory pids",
                  "/sys/fs/cgroup/unified/cgroup.subtree_control": "memory pids"})
    layouts = _cgroup.candidates(V1_SELF, V1_MOUNTS, read)
    assert [lay.version for lay in layouts] == [2, 1]


def test_v2_group_is_configured_through_its_files(tmp_path, monkeypatch):
    base = tmp_path / "cg"
    base.mkdir()
    for name in ("cgroup.subtree_control",):
        (base / name).write_text("")
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    manager = _cgroup.Manager(Layout(2, (str(base),), ("memory", "pids")))
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"
    parent = base / "hetrl-sandbox-4242"
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert manager.parents == (str(parent),)


def test_v2_limits_and_oom_count(tmp_path, monkeypatch):
    base = tmp_path / "cg"
    parent = base / "hetrl-sandbox-7"
    parent.mkdir(parents=True)
    monkeypatch.setattr(os, "getpid", lambda: 7)
    real_mkdir = os.mkdir

    def mkdir_with_control_files(path, mode=0o777):  # what cgroupfs does on mkdir
        real_mkdir(path, mode)
        for name in ("cgroup.procs", "memory.swap.max"):
            open(os.path.join(path, name), "w").close()

    monkeypatch.setattr(os, "mkdir", mkdir_with_control_files)
    group = _cgroup.Manager(Layout(2, (str(base),))).group(96 << 20, 12)
    run = parent / "run-7-0"
    assert (run / "memory.max").read_text() == str(96 << 20)
    assert (run / "memory.swap.max").read_text() == "0" and (run / "pids.max").read_text() == "12"
    assert group.oom_kills() == 0
    (run / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert group.oom_kills() == 2
    group.close_fds()
