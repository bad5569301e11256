"""The torchrun engine across two simulated hosts (tests/multihost.py's network namespaces; no
ssh: torchrun starts nothing remotely). `hvd-scale run --engine torchrun -np 1 --nnodes 2
--rdzv-endpoint <host a's address>:PORT` runs once in each namespace (`ip netns exec`, each with its
own hostname); the c10d rendezvous lives on host a, Gloo goes over the veth (GLOO_SOCKET_IFNAME),
and the two ranks train a few DDP steps with adascale: the same gains, tau and weights on both, S
= 2, each rank on its own host."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from hvdrun import WORKERS_DIR, worker_results
from multihost import two_hosts  # noqa: F401  (the fixture)

HVD_SCALE = Path(sys.executable).parent / "hvd-scale"
WORKER = WORKERS_DIR / "ddp_train_worker.py"
RDZV_PORT = 29433  # inside host a's namespace: nothing else listens there
STEPS = 4


@pytest.mark.timeout(300)
def test_two_hosts_train_ddp_with_adascale_over_the_veth(two_hosts):
    h = two_hosts
    cmd = [HVD_SCALE, "run", "--engine", "torchrun", "-np", "1", "--nnodes", "2",
           "--rdzv-endpoint", f"{h.addresses['a']}:{RDZV_PORT}", "--rdzv-id", "mh",
           "--policy", "adascale", "--", "python", WORKER, "--steps", str(STEPS)]
    env = {"GLOO_SOCKET_IFNAME": h.nic}
    done: dict[str, object] = {}

    def node(host):
        try:
            done[host] = h.run_on(host, cmd, timeout=240, env=env)
        except BaseException as e:  # noqa: BLE001 - reported below
            done[host] = e

    threads = [threading.Thread(target=node, args=(host,)) for host in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for host in ("a", "b"):
        if isinstance(done[host], BaseException):
            raise done[host]
        assert done[host].returncode == 0, (host, done[host].stdout, done[host].stderr[-4000:])
    results = worker_results(done["a"].stdout + done["b"].stdout)
    starts = {r["rank"]: r for r in results if r["event"] == "start"}
    assert sorted(starts) == [0, 1]
    assert {s["host"] for s in starts.values()} == set(h.names.values())  # one rank per host
    for s in starts.values():
        assert (s["world"], s["scale"], s["policy"]) == (2, 2, "adascale")
        assert s["master_addr"] in (h.names["a"], h.names["b"], *h.addresses.values())
    steps = {r: [s for s in results if s["event"] == "step" and s["rank"] == r] for r in (0, 1)}
    assert [s["steps"] for s in steps[0]] == list(range(1, STEPS + 1))
    for a, b in zip(steps[0], steps[1], strict=True):
        for key in ("gain", "progress", "lr_factor", "sigma2", "mu2", "weights", "scale"):
            assert a[key] == b[key], (key, a, b)
        assert a["scale"] == 2 and 1 < a["gain"] < 2 and a["lr_factor"] == a["gain"]
    assert not any(h.wait_clean().values())
