"""A multi-host test bed on one machine: each host a Linux network namespace with its own
address, joined to the others by a veth pair on a bridge, its link's rate (tbf) and delay
(netem, where the kernel has it) set with tc, and cut or restored at will.

    with Bed(["router", "p0", "redis"]) as bed:
        bed.shape("p0", Link(rate_bit=1e9, delay_ms=0.1))
        WorkerProcess(...).command = bed.exec("p0") + [...]
        bed.cut("p0"); bed.restore("p0")

Host i has address 10.213.0.(10 + i); this (the root) namespace is 10.213.0.1 on the bridge,
so a test reaches every host, and every host reaches the others, through the bridge only.
A host's link is shaped both ways: its own end (what it sends) and the bridge's end (what it
receives). Between two hosts a packet crosses two links: their delays add up.

Needs root, `ip` and `tc` (iproute2); `unavailable()` says why a bed cannot be made here.
Everything made is named after this process (pdbed<pid><letter>-...): `close()` removes it, and a
new bed first removes what a dead process's bed left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType

SUBNET = "10.213.0"
# a bed's tag: this process's id and a letter (a process may make several beds, one at a
# time); namespaces pdbed<tag>-<host>, the bridge pdb<tag>, its links pdb<tag>v<i>
PREFIX = "pdbed"
LEFTOVER = re.compile(rf"^{PREFIX}(\d+)[a-z]-")
LEFTOVER_BRIDGE = re.compile(r"^pdb(\d+)[a-z]$")
_made = 0  # beds this process made


@dataclass(frozen=True)
class Link:
    """A host's link: `rate_bit` bits/s each way (None: the veth's own speed), and
    `delay_ms` added each way (0: none)."""

    rate_bit: float | None = None
    delay_ms: float = 0.0


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def tc(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["tc", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why no bed can be made here (None: it can)."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the multi-host bed needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the multi-host bed needs `{tool}` (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def has_netem() -> bool:
    """Whether this kernel has the netem qdisc (delay); tbf (rate) is assumed."""
    name = f"pdb{os.getpid()}q"
    ip("link", "add", name, "type", "veth", "peer", "name", f"{name}p")
    try:
        return tc("qdisc", "add", "dev", name, "root", "netem", "delay", "1ms",
                  check=False).returncode == 0  # fmt: skip
    finally:
        ip("link", "del", name, check=False)


def remove_leftovers() -> list[str]:
    """Remove the namespaces and bridges of beds whose process has died; their names."""
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = LEFTOVER.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            kill_in(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", "type", "bridge").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = LEFTOVER_BRIDGE.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def kill_in(netns: str) -> None:
    """Kill every process left in a namespace."""
    for pid in ip("netns", "pids", netns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


class Bed:
    def __init__(self, hosts: list[str]) -> None:
        global _made
        self.tag = tag = f"{os.getpid()}{chr(ord('a') + _made % 26)}"
        _made += 1
        self.bridge = f"pdb{tag}"
        self.hosts = {h: i for i, h in enumerate(hosts)}
        self.netns = {h: f"{PREFIX}{tag}-{h}" for h in hosts}
        self.outer = {h: f"pdb{tag}v{i}" for h, i in self.hosts.items()}  # the bridge's ends
        self.netem = False
        self.made: list[str] = []  # namespaces made, for close()

    def __enter__(self) -> Bed:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> Bed:
        remove_leftovers()
        self.netem = has_netem()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for host, i in self.hosts.items():
            ns, outer, inner = self.netns[host], self.outer[host], f"pdb{self.tag}h{i}"
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", inner, "name", "eth0", netns=ns)
            ip("addr", "add", f"{self.address(host)}/24", "dev", "eth0", netns=ns)
            ip("link", "set", "eth0", "up", netns=ns)
            ip("link", "set", "lo", "up", netns=ns)
            ip("link", "set", outer, "master", self.bridge)
            ip("link", "set", outer, "up")
        return self

    def close(self) -> None:
        """Remove every namespace (its processes killed first), link and qdisc made."""
        for ns in self.made:
            kill_in(ns)
            ip("netns", "del", ns, check=False)  # its veth end goes, and the pair with it
        self.made = []
        for outer in self.outer.values():
            ip("link", "del", outer, check=False)
        ip("link", "del", self.bridge, check=False)

    # -- hosts ----------------------------------------------------------------------------

    def address(self, host: str) -> str:
        return f"{SUBNET}.{10 + self.hosts[host]}"

    def exec(self, host: str) -> list[str]:
        """The command prefix that runs a program on `host`."""
        return ["ip", "netns", "exec", self.netns[host]]

    def shape(self, host: str, link: Link) -> None:
        """Set the host's link, both ways (replacing what was set)."""
        for dev, ns in (("eth0", self.netns[host]), (self.outer[host], None)):
            tc("qdisc", "del", "dev", dev, "root", netns=ns, check=False)
            if link.rate_bit is None and not link.delay_ms:
                continue
            if link.delay_ms and not self.netem:
                raise RuntimeError("this kernel has no netem qdisc: a bed link cannot add delay")
            if self.netem:
                rate = ["rate", f"{int(link.rate_bit)}bit"] if link.rate_bit else []
                tc("qdisc", "add", "dev", dev, "root", "netem", "delay",
                   f"{link.delay_ms * 1000:.0f}us", *rate, "limit", "100000", netns=ns)  # fmt: skip
                continue
            assert link.rate_bit is not None
            # a burst of 1 ms at the rate, and at least one full frame (tbf splits a larger
            # GSO packet into frames): a trickle is a trickle from its first bytes
            burst = max(1600, int(link.rate_bit / 8 / 1000))
            tc("qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(link.rate_bit)}bit",
               "burst", str(burst), "latency", "200ms", netns=ns)  # fmt: skip

    def cut(self, host: str) -> None:
        """The host's cable pulled: nothing in or out, and no reset to anyone."""
        ip("link", "set", self.outer[host], "down")

    def restore(self, host: str) -> None:
        ip("link", "set", self.outer[host], "up")
