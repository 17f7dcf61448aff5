"""A multi-host test bed on one machine: each host a Linux network namespace with its own
address, joined to the others by a veth pair on a bridge, its link's rate (tbf) and delay
(netem, where the kernel has it) set with tc, and cut or restored at will.

    with Bed(["router", "p0", "redis"]) as bed:
        bed.shape("p0", Link(rate_bit=1e9, delay_ms=0.1))
        WorkerProcess(...).command = bed.exec("p0") + [...]
        bed.cut("p0"); bed.restore("p0")

Host i has address 10.213.0.(10 + i); this (the root) namespace is 10.213.0.1, on a link of
its own to the bridge, so a test reaches every host, and every host reaches the others, through
the bridge only. The bridge lives in a namespace of its own (the switch), out of reach of this
machine's firewall: once dockerd has run, the root namespace drops forwarded packets
(`iptables -P FORWARD DROP`, and br_netfilter sends bridged frames through it).
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
# time); namespaces pdbed<tag>-<host> and pdbed<tag>-switch (the bridge, br0, and its ends
# pdb<tag>v<i>), the root namespace's link pdb<tag>
PREFIX = "pdbed"
SWITCH = "switch"
LEFTOVER = re.compile(rf"^{PREFIX}(\d+)[a-z]-")
LEFTOVER_LINK = re.compile(r"^pdb(\d+)[a-z]$")  # the root's link (a bridge, in older beds)
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
    """Remove the namespaces and links of beds whose process has died; their names."""
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = LEFTOVER.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            kill_in(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = LEFTOVER_LINK.match(name)
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
        if SWITCH in hosts:
            raise ValueError(f"a bed host cannot be called {SWITCH!r}")
        self.root = f"pdb{tag}"  # the root namespace's link to the bridge
        self.switch = f"{PREFIX}{tag}-{SWITCH}"  # the namespace the bridge is in
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
        switch = self.switch
        ip("netns", "add", switch)
        self.made.append(switch)
        ip("link", "add", "br0", "type", "bridge", netns=switch)
        ip("link", "set", "br0", "up", netns=switch)
        self._plug(self.root, f"{self.root}r")
        ip("addr", "add", f"{SUBNET}.1/24", "dev", self.root)
        ip("link", "set", self.root, "up")
        for host, i in self.hosts.items():
            ns, inner = self.netns[host], f"pdb{self.tag}h{i}"
            ip("netns", "add", ns)
            self.made.append(ns)
            self._plug(inner, self.outer[host])
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", inner, "name", "eth0", netns=ns)
            ip("addr", "add", f"{self.address(host)}/24", "dev", "eth0", netns=ns)
            ip("link", "set", "eth0", "up", netns=ns)
            ip("link", "set", "lo", "up", netns=ns)
        return self

    def _plug(self, end: str, port: str) -> None:
        """A veth pair made here, `port` moved into the switch and onto the bridge."""
        ip("link", "add", end, "type", "veth", "peer", "name", port)
        ip("link", "set", port, "netns", self.switch)
        ip("link", "set", port, "master", "br0", netns=self.switch)
        ip("link", "set", port, "up", netns=self.switch)

    def close(self) -> None:
        """Remove every namespace (its processes killed first), link and qdisc made."""
        for ns in self.made:
            kill_in(ns)
            ip("netns", "del", ns, check=False)  # its veth ends go, and the pairs with them
        self.made = []
        ip("link", "del", self.root, check=False)
        for inner in (f"pdb{self.tag}h{i}" for i in self.hosts.values()):
            ip("link", "del", inner, check=False)  # made, not yet moved (a failed open)

    # -- hosts ----------------------------------------------------------------------------

    def address(self, host: str) -> str:
        return f"{SUBNET}.{10 + self.hosts[host]}"

    def exec(self, host: str) -> list[str]:
        """The command prefix that runs a program on `host`."""
        return ["ip", "netns", "exec", self.netns[host]]

    def shape(self, host: str, link: Link) -> None:
        """Set the host's link, both ways (replacing what was set)."""
        for dev, ns in (("eth0", self.netns[host]), (self.outer[host], self.switch)):
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
        ip("link", "set", self.outer[host], "down", netns=self.switch)

    def restore(self, host: str) -> None:
        ip("link", "set", self.outer[host], "up", netns=self.switch)
