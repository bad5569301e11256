"""Two simulated hosts on this machine, for multi-host horovodrun tests (../shared/reference/multihost.md).

    from multihost import two_hosts       # the fixture: pytest finds it in the test module

    @requires_horovod
    @pytest.mark.timeout(120)
    def test_something(two_hosts):
        h = two_hosts
        proc = h.run_on("a", [LAUNCHER, "--gloo", "-np", "2", "-H", h.hosts(), *h.horovodrun_args(),
                              sys.executable, str(script)], timeout=90)

What the fixture sets up, per test, and always takes down again (also after a failure or a time-out):
- two network namespaces (``hvdA-<pid>-<n>``, ``hvdB-<pid>-<n>``), loopback up in each, joined by
  one veth pair whose ends are both called ``hvd0`` (horovodrun sends the NIC name it resolves
  locally to every rank, so it must be the same on every host), with 10.77.13.1/24 on host a and
  10.77.13.2/24 on host b, assigned inside the namespaces only;
- ``/etc/netns/<ns>/hosts`` in each, mapping ``hvdtest-a`` and ``hvdtest-b`` to those addresses
  (``ip netns exec`` bind-mounts it over /etc/hosts);
- a temp directory with a fresh host key and client key; one sshd per namespace in the
  foreground (``sshd -D -e``, a child of the test), on port 22022 of its namespace, under
  ``unshare --uts`` with the host's own name (Horovod resolves ``gethostname()`` in one Gloo
  set-up path: hosts sharing the machine's name would resolve to 127.0.0.1);
- an ssh client drop-in ``/etc/ssh/ssh_config.d/hvdtest-<pid>-<n>.conf`` for the two host names
  (no known_hosts, no host key check, batch mode): ssh writes known_hosts under the passwd home
  whatever ``$HOME`` says, and a fresh host key every run would otherwise break the next MPI launch.

Teardown: SIGKILL everything ``ip netns pids`` lists in both namespaces (ranks launched over ssh
outlive a failed job), ``ip netns del``, remove the hosts files (and /etc/netns when this made it),
the drop-in and the temp directory. ``/run/sshd`` (sshd's privilege-separation directory, empty) is
created when missing and left, as the openssh-server package's own tmpfiles rule would.

The fixture skips (with the reason) where it cannot run: not root, or ``ip`` / ``unshare`` missing,
or OpenSSH's server or client missing. With ``HVD_SCALE_REQUIRE_HOROVOD`` set (``make test``, CI) a
missing OpenSSH fails the test instead. Debian packages: ``openssh-server`` (sshd; pulls in
``openssh-client``: ssh, ssh-keygen), ``iproute2`` (ip), ``util-linux`` (unshare) and, for ``--mpi``,
``openmpi-bin`` (orted, started over ssh on host b).
"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pytest

from hvdrun import REPO_ROOT, REQUIRE_ENV_VAR, _describe, _kill_tree, worker_env

HOST_NAMES = {"a": "hvdtest-a", "b": "hvdtest-b"}
ADDRESSES = {"a": "10.77.13.1", "b": "10.77.13.2"}  # a private /24, only inside the namespaces
PREFIX_LEN = 24
NIC = "hvd0"
SSH_PORT = 22022
SSHD_DIR = Path("/run/sshd")
SSH_CONFIG_DIR = Path("/etc/ssh/ssh_config.d")
NETNS_ETC = Path("/etc/netns")
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "hostname": "hostname"}
OPENSSH = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client"}
SBIN = "/usr/sbin:/sbin"

_COUNTER = itertools.count()


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN)


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


def multihost_missing_reason() -> tuple[str | None, bool]:
    """(why two hosts cannot be simulated here or None, whether that must fail rather than skip)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)", False
    missing = [f"{t} ({pkg})" for t, pkg in TOOLS.items() if _which(t) is None]
    if missing:
        return f"missing: {', '.join(missing)}", False
    missing = [f"{t} ({pkg})" for t, pkg in OPENSSH.items() if _which(t) is None]
    if missing:
        return f"OpenSSH missing: {', '.join(missing)}; apt-get install -y openssh-server", _required()
    return None, False


def _sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def netns_pids(ns: str) -> list[int]:
    """What runs in network namespace `ns` (empty when it is gone)."""
    proc = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def kill_namespaces(namespaces, keep=frozenset(), rounds: int = 50) -> list[int]:
    """SIGKILL everything in the namespaces but ``keep``, until none is left (ranks can start
    while others die); returns what was still there after ``rounds`` tries."""
    pids: list[int] = []
    for _ in range(rounds):
        pids = [p for name in namespaces for p in netns_pids(name) if p not in keep]
        if not pids:
            return []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes_matching(text: str) -> list[tuple[int, str]]:
    """Every process on the machine whose command line contains `text` (ours excluded)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            cmd = _cmdline(int(entry.name))
            if text in cmd:
                out.append((int(entry.name), cmd))
    return out


@dataclass
class StreamResult:
    """A command's exit code, its stdout and stderr merged, each line with its arrival time."""

    args: list[str]
    returncode: int
    stdout: str
    lines: list[tuple[float, str]]  # (time.monotonic() at arrival, line)
    elapsed: float
    stderr: str = ""


@dataclass
class TwoHosts:
    """Two simulated hosts, "a" and "b". Run commands on one with `run_on` / `stream_on`."""

    ns: dict[str, str]
    tmp: Path
    key: Path                     # the client's private key (authorized on both hosts)
    port: int = SSH_PORT
    nic: str = NIC
    names: dict[str, str] = field(default_factory=lambda: dict(HOST_NAMES))
    addresses: dict[str, str] = field(default_factory=lambda: dict(ADDRESSES))
    sshd: dict[str, subprocess.Popen] = field(default_factory=dict)
    sshd_logs: dict[str, Path] = field(default_factory=dict)

    # -- what horovodrun needs -------------------------------------------------------------------
    def hosts(self, slots: int = 1) -> str:
        """The -H value naming both hosts, e.g. ``hvdtest-a:1,hvdtest-b:1``."""
        return f"{self.names['a']}:{slots},{self.names['b']}:{slots}"

    def horovodrun_args(self) -> list[str]:
        """``--network-interfaces hvd0 -p PORT -i KEY --disable-cache`` (horovodrun would otherwise
        cache its ssh check in ~/.horovod, keyed by this run's key path)."""
        return ["--network-interfaces", self.nic, "-p", str(self.port), "-i", str(self.key),
                "--disable-cache"]

    # -- running commands "on a host" ------------------------------------------------------------
    def command_on(self, host: str, cmd: Sequence[str]) -> list[str]:
        """`cmd` in host's namespace with host's own hostname (a UTS namespace of its own)."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c",
                f'hostname {self.names[host]} && exec "$0" "$@"', *map(str, cmd)]

    def pids(self, host: str) -> list[int]:
        return netns_pids(self.ns[host])

    def leftovers(self) -> dict[str, list[tuple[int, str]]]:
        """Processes in either namespace other than its sshd listener: {host: [(pid, cmdline)]}."""
        out = {}
        for host in self.ns:
            keep = self.sshd[host].pid if host in self.sshd else None
            out[host] = [(p, _cmdline(p)) for p in self.pids(host) if p != keep]
        return out

    def wait_clean(self, timeout: float = 10) -> dict[str, list[tuple[int, str]]]:
        """leftovers(), once they are gone or after `timeout` s (an ssh session takes a moment to
        close after its command ended)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.leftovers()
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill_jobs(self) -> None:
        """SIGKILL everything in both namespaces except the two sshd listeners."""
        kill_namespaces(self.ns.values(), keep={p.pid for p in self.sshd.values()})

    def _start(self, host: str, cmd: Sequence[str], env: Mapping[str, str] | None,
               cwd: str | os.PathLike | None, merge: bool) -> subprocess.Popen:
        return subprocess.Popen(
            self.command_on(host, cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE, env=worker_env(env),
            cwd=str(cwd if cwd is not None else REPO_ROOT), start_new_session=True, text=True,
            errors="replace")

    def _abort(self, proc: subprocess.Popen) -> None:
        _kill_tree(proc)
        self.kill_jobs()

    def run_on(self, host: str, cmd: Sequence[str], timeout: float,
               env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
               check: bool = False) -> subprocess.CompletedProcess:
        """Run `cmd` on `host` with the workers' environment (hvdrun.worker_env), cwd the repo.

        On time-out (or when the test is interrupted) kills the process tree and everything in both
        namespaces but the sshds, then raises AssertionError with the output tails."""
        proc = self._start(host, cmd, env, cwd, merge=False)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._abort(proc)
            stdout, stderr = proc.communicate()
            raise AssertionError(_describe(proc.args, f"timed out after {timeout} s on host {host} "
                                           "(process tree and namespaces killed)", stdout, stderr)) from None
        except BaseException:
            self._abort(proc)
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if check and proc.returncode != 0:
            raise AssertionError(_describe(proc.args, f"exited {proc.returncode} on host {host}",
                                           stdout, stderr))
        return result

    def stream_on(self, host: str, cmd: Sequence[str], timeout: float,
                  on_line: Callable[[str, float], None] | None = None,
                  env: Mapping[str, str] | None = None,
                  cwd: str | os.PathLike | None = None) -> StreamResult:
        """Like run_on (stdout and stderr merged, no check), calling on_line(line, time) in this
        thread as each line arrives, so a test can act at a known point of a running job."""
        proc = self._start(host, cmd, env, cwd, merge=True)
        lines: queue.Queue = queue.Queue()

        def reader():
            for line in proc.stdout:
                lines.put((time.monotonic(), line))
            lines.put(None)

        thread = threading.Thread(target=reader, daemon=True)
        start = time.monotonic()
        deadline = start + timeout
        got: list[tuple[float, str]] = []
        try:
            thread.start()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(proc.args, timeout)
                try:
                    item = lines.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                if item is None:
                    break
                got.append(item)
                if on_line is not None:
                    on_line(item[1], item[0])
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._abort(proc)
            thread.join(5)
            text = "".join(line for _, line in got)
            raise AssertionError(_describe(proc.args, f"timed out after {timeout} s on host {host} "
                                           "(process tree and namespaces killed)", text, "")) from None
        except BaseException:
            self._abort(proc)
            thread.join(5)
            raise
        thread.join(5)
        return StreamResult(list(proc.args), proc.returncode, "".join(l for _, l in got), got,
                            time.monotonic() - start)

    def sshd_log(self, host: str) -> str:
        return self.sshd_logs[host].read_text(errors="replace")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


def _sshd_config(tmp: Path, host: str) -> Path:
    config = tmp / f"sshd_{host}.conf"
    _write(config, "\n".join([
        f"Port {SSH_PORT}",
        f"ListenAddress {ADDRESSES[host]}",
        f"HostKey {tmp / 'host_key'}",
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PidFile none",
        "UseDNS no",
        "PrintMotd no",
        "MaxStartups 100",
        "MaxSessions 100",
        "LogLevel INFO",
        "",
    ]))
    return config


def _wait_for_ssh(h: TwoHosts, src: str, dst: str, timeout: float = 15) -> None:
    """Until `ssh dst true` from `src` works: the sshd, the key, the names and the drop-in."""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(
            h.command_on(src, ["ssh", "-p", str(h.port), "-i", str(h.key), "-o", "ConnectTimeout=2",
                               h.names[dst], "hostname"]),
            capture_output=True, text=True, timeout=10)
        if proc.returncode == 0 and proc.stdout.strip() == h.names[dst]:
            return
        for host, p in h.sshd.items():
            if p.poll() is not None:
                raise RuntimeError(f"sshd on host {host} exited {p.returncode}: {h.sshd_log(host)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"ssh {h.names[src]} -> {h.names[dst]} failed ({proc.returncode}): "
                               f"{proc.stdout}{proc.stderr}\nsshd log: {h.sshd_log(dst)}")
        time.sleep(0.2)


def _teardown(ns: dict[str, str], sshd: dict[str, subprocess.Popen], dropin: Path | None,
              tmp: Path | None, made_netns_etc: bool) -> list[str]:
    """Take everything down; each step runs whatever failed before. Returns what went wrong."""
    errors = []
    left = kill_namespaces(ns.values())  # everything: ranks, ssh sessions, the sshds
    if left:
        errors.append(f"processes left in {list(ns.values())}: {left}")
    for p in sshd.values():
        try:
            p.kill()
            p.wait(timeout=5)
        except Exception as e:  # noqa: BLE001 - keep tearing down
            errors.append(f"sshd {p.pid}: {e}")
    for name in ns.values():
        if _sh("ip", "netns", "pids", name, check=False).returncode == 0:
            proc = _sh("ip", "netns", "del", name, check=False)
            if proc.returncode != 0:
                errors.append(f"ip netns del {name}: {proc.stderr.strip()}")
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    if made_netns_etc:
        try:
            NETNS_ETC.rmdir()
        except OSError:
            pass  # another test's hosts file is in it
    if dropin is not None:
        try:
            dropin.unlink()
        except FileNotFoundError:
            pass
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return errors


@pytest.fixture
def two_hosts():
    """Two simulated hosts (see the module's docstring); yields a TwoHosts."""
    reason, must_fail = multihost_missing_reason()
    if reason is not None:
        if must_fail:
            pytest.fail(f"cannot simulate two hosts ({REQUIRE_ENV_VAR} is set): {reason}")
        pytest.skip(f"cannot simulate two hosts: {reason}")
    tag = f"{os.getpid()}-{next(_COUNTER)}"
    ns = {"a": f"hvdA-{tag}", "b": f"hvdB-{tag}"}
    sshd: dict[str, subprocess.Popen] = {}
    dropin: Path | None = None
    tmp: Path | None = None
    made_netns_etc = not NETNS_ETC.exists()
    try:
        for host, name in ns.items():
            _sh("ip", "netns", "add", name)
            _sh("ip", "-n", name, "link", "set", "lo", "up")
        _sh("ip", "link", "add", "name", NIC, "netns", ns["a"], "type", "veth",
            "peer", "name", NIC, "netns", ns["b"])
        hosts_text = "127.0.0.1 localhost\n" + "".join(
            f"{ADDRESSES[h]} {HOST_NAMES[h]}\n" for h in ("a", "b"))
        for host, name in ns.items():
            _sh("ip", "-n", name, "addr", "add", f"{ADDRESSES[host]}/{PREFIX_LEN}", "dev", NIC)
            _sh("ip", "-n", name, "link", "set", NIC, "up")
            (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
            _write(NETNS_ETC / name / "hosts", hosts_text)

        tmp = Path(tempfile.mkdtemp(prefix=f"hvdtest-{tag}-"))
        key = tmp / "client_key"
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hvdtest-{tag}", "-f", str(tmp / "host_key"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hvdtest-{tag}", "-f", str(key))
        _write(tmp / "authorized_keys", (tmp / "client_key.pub").read_text(), 0o600)

        dropin = SSH_CONFIG_DIR / f"hvdtest-{tag}.conf"
        SSH_CONFIG_DIR.mkdir(parents=True, exist_ok=True)
        # Only settings that are the same in every such drop-in (two test sessions at once may
        # each have one for these names); port and key go on the command line (horovodrun -p -i).
        _write(dropin, (f"# hvd_scale tests ({tmp}); removed on teardown\n"
                        f"Host {HOST_NAMES['a']} {HOST_NAMES['b']}\n"
                        "    UserKnownHostsFile /dev/null\n"
                        "    GlobalKnownHostsFile /dev/null\n"
                        "    StrictHostKeyChecking no\n"
                        "    BatchMode yes\n"
                        "    LogLevel ERROR\n"))

        SSHD_DIR.mkdir(mode=0o755, exist_ok=True)
        h = TwoHosts(ns=ns, tmp=tmp, key=key)
        sshd_bin = _which("sshd")
        for host in ("a", "b"):
            log = tmp / f"sshd_{host}.log"
            h.sshd_logs[host] = log
            with open(log, "w") as f:
                sshd[host] = subprocess.Popen(
                    h.command_on(host, [sshd_bin, "-D", "-e", "-f", str(_sshd_config(tmp, host))]),
                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                    start_new_session=True)
        h.sshd = sshd
        _wait_for_ssh(h, "a", "b")
        _wait_for_ssh(h, "b", "a")
        yield h
    finally:
        errors = _teardown(ns, sshd, dropin, tmp, made_netns_etc)
        if errors:
            raise RuntimeError("two_hosts teardown: " + "; ".join(errors))
