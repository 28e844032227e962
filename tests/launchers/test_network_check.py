"""The network check before the first collective, on namespaced machines (one network namespace each).

Each misconfiguration must stop every machine with one line naming the machine, the address/port and the
fix, printed within 10 s of the last machine starting the check; never a hang (each launcher is bounded). Needs root and iproute2; the
firewall cases also need nftables (`make system-deps`). Skipped with the reason otherwise.
"""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hasten.testing
from hasten.testing.netns import netns_unavailable, simulated_machines

# serial: wall-clock bounds and cluster daemons; `make test` runs these alone, after the parallel part
pytestmark = [pytest.mark.launch, pytest.mark.serial]
_WHY_NOT = netns_unavailable()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=f"simulated machines unavailable: {_WHY_NOT}")
needs_nft = pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (`nft`) is not installed: make system-deps")

TRAIN = str(Path(hasten.testing.__file__).parent / "scripts" / "regression_train.py")
PORT = "29521"  # fixed ports are safe: each test's namespaces are new and hold nothing else
START = "hasten launch: checking the network"
FAILED = "hasten launch: network check failed: "


def _env(tmp_path, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
               PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # each launcher must find its machine's interface itself
    env.update(extra)
    return env


def _argv(count, rank, main_ip, tmp_path, extra=(), machines=None):
    """A real training launch: the check must stop it before any worker starts (else it trains)."""
    return [sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", machines or str(count),
            "--machine_rank", str(rank), "--num_processes", str(2 * count), "--main_process_ip", main_ip,
            "--main_process_port", PORT, *extra, TRAIN, str(tmp_path / "out"), "8", "-1"]


class _Watched:
    """A launcher in a namespace whose output lines are time-stamped as they arrive."""

    def __init__(self, machine, argv, env):
        self.proc = machine.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[tuple[float, str]] = []
        self.ended = 0.0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        self.ended = time.monotonic()  # end of output: the launcher exited

    def finish(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=30)
        return self.proc.returncode

    @property
    def output(self):
        return "\n".join(line for _, line in self.lines)

    def started_check(self):
        return next(t for t, line in self.lines if line.startswith(START))

    def failed_at(self):
        return next(t for t, line in self.lines if line.startswith(FAILED))

    def failures(self):
        return [line[len(FAILED):] for _, line in self.lines if line.startswith(FAILED)]


def _run(machines, argvs, envs, timeout=90):
    watched = [_Watched(m, argv, env) for m, argv, env in zip(machines, argvs, envs)]
    codes = [w.finish(timeout) for w in watched]
    return codes, watched


def _nft(machine, rule):
    for command in ("add table inet hx", "add chain inet hx input { type filter hook input priority 0; }", rule):
        subprocess.run(machine.command(["nft", command]), check=True, capture_output=True, timeout=30)


def _assert_all_stop_with(codes, watched, *expected):
    outputs = "\n---\n".join(w.output for w in watched)
    assert codes == [1] * len(watched), outputs
    for w in watched:
        assert len(w.failures()) == 1, w.output  # one line, on every machine
        line = w.failures()[0]
        for part in expected:
            assert part in line, line
    last_start = max(w.started_check() for w in watched)
    told = max(w.failed_at() for w in watched) - last_start
    stopped = max(w.ended for w in watched) - last_start
    print(f"network check: every machine gave its line {told:.1f} s (and exited {stopped:.1f} s) after the last one "
          "started the check")
    assert told < 10, outputs
    out = Path(watched[0].proc.args[-3])  # the training script's output folder: no worker ever wrote there
    assert not out.exists() or not list(out.iterdir()), outputs


@needs_netns
def test_check_network_alone_passes_on_a_good_setup_and_starts_no_worker(tmp_path):
    with simulated_machines(3) as machines:
        argvs = [[sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_machines", "3",
                  "--machine_rank", str(rank), "--main_process_ip", machines[0].ip, "--main_process_port", PORT,
                  "--check_network"] for rank in range(3)]
        codes, watched = _run(machines, argvs, [_env(tmp_path)] * 3)
    outputs = "\n---\n".join(w.output for w in watched)
    assert codes == [0, 0, 0], outputs
    for w in watched:
        passed = [line for _, line in w.lines if "network check passed" in line]
        assert len(passed) == 1, w.output
        for rank, machine in enumerate(machines):
            assert f"{rank}: {machine.ip} on {machine.interface}" in passed[0]


@needs_netns
def test_a_loopback_main_address_stops_every_machine(tmp_path):
    with simulated_machines(2) as machines:
        codes, watched = _run(machines, [_argv(2, r, "127.0.0.1", tmp_path) for r in range(2)], [_env(tmp_path)] * 2)
    # Each machine meets only itself on its loopback: machine 0 waits for the others, machine 1 for a listener.
    _assert_all_stop_with(codes, watched, "--main_process_ip 127.0.0.1 is a loopback address, so every machine "
                          "must run on this one", "(port 29521)", "HINT: pass --main_process_ip with machine 0's "
                          "address on the network the machines share")
    assert "machine 0 (" in watched[0].failures()[0] and "machine(s) 1 did not arrive" in watched[0].failures()[0]
    assert "machine 1 (" in watched[1].failures()[0] and "nothing listens there" in watched[1].failures()[0]


@needs_netns
@pytest.mark.parametrize("interface", ["lo", "eth7"], ids=["loopback-interface", "missing-interface"])
def test_a_wrong_gloo_interface_on_one_machine_stops_every_machine(tmp_path, interface):
    with simulated_machines(2) as machines:
        envs = [_env(tmp_path), _env(tmp_path, GLOO_SOCKET_IFNAME=interface)]
        codes, watched = _run(machines, [_argv(2, r, machines[0].ip, tmp_path) for r in range(2)], envs)
    reason = "carries only the loopback address 127.0.0.1" if interface == "lo" else "has no interface 'eth7'"
    _assert_all_stop_with(codes, watched, f"GLOO_SOCKET_IFNAME={interface}: ", "machine 1", reason,
                          f"HINT: set GLOO_SOCKET_IFNAME={machines[1].interface}")


@needs_netns
def test_an_interface_the_peers_cannot_reach_stops_every_machine(tmp_path):
    with simulated_machines(2) as machines:
        second = machines[1]
        # A second network on machine 1 only (a veth pair with both ends inside it): machine 0 has no route there.
        for step in (["link", "add", "side0", "type", "veth", "peer", "name", "side1"],
                     ["addr", "add", "10.99.0.2/24", "dev", "side0"], ["link", "set", "side0", "up"],
                     ["link", "set", "side1", "up"]):
            subprocess.run(["ip", "-n", second.name, *step], check=True, capture_output=True, timeout=30)
        envs = [_env(tmp_path), _env(tmp_path, GLOO_SOCKET_IFNAME="side0")]
        codes, watched = _run(machines, [_argv(2, r, machines[0].ip, tmp_path) for r in range(2)], envs)
    _assert_all_stop_with(codes, watched, "machine 0 (", "cannot reach machine 1", "at 10.99.0.2:",
                          "(interface side0)", "HINT: on machine 1", "set GLOO_SOCKET_IFNAME")


@needs_netns
@needs_nft
def test_a_firewall_dropping_connections_to_a_machine_stops_every_machine(tmp_path):
    with simulated_machines(2) as machines:
        # Machine 1 drops every incoming connection attempt (its own connections out still work).
        _nft(machines[1], "add rule inet hx input tcp flags & (syn | ack) == syn drop")
        codes, watched = _run(machines, [_argv(2, r, machines[0].ip, tmp_path) for r in range(2)],
                              [_env(tmp_path)] * 2)
    _assert_all_stop_with(codes, watched, "machine 0 (", "cannot reach machine 1", f"at {machines[1].ip}:",
                          "no answer", "a firewall", "HINT: allow TCP between the machines")


@needs_netns
@needs_nft
@pytest.mark.parametrize("rule", ["drop", "reject with tcp reset"], ids=["dropped", "rejected"])
def test_a_firewalled_rendezvous_port_stops_every_machine_machine_0_too(tmp_path, rule):
    with simulated_machines(2) as machines:
        _nft(machines[0], f"add rule inet hx input iifname {machines[0].interface} tcp dport {PORT} {rule}")
        # A long rendezvous timeout: machine 0 must not stop because of it, but because machine 1 told it.
        argvs = [_argv(2, r, machines[0].ip, tmp_path, ["--rdzv_conf", "timeout=60"]) for r in range(2)]
        codes, watched = _run(machines, argvs, [_env(tmp_path)] * 2)
    where = f"{machines[0].ip}:{PORT}"
    _assert_all_stop_with(codes, watched, where, "a firewall", "HINT: allow TCP")
    blocked, main = watched[1].failures()[0], watched[0].failures()[0]
    assert blocked.startswith("machine 1 ("), blocked
    if rule == "drop":
        assert f"gets no answer from the rendezvous endpoint {where}" in blocked and f"drops TCP port {PORT}" in blocked
    else:  # refused while machine 0's check runs: a rule, not a machine 0 that has not started yet
        assert f"is refused by the rendezvous endpoint {where} although machine 0's launcher runs there" in blocked
        assert f"rejects TCP port {PORT}" in blocked, blocked
    # Nothing reaches machine 0 over TCP: machine 1 told it over UDP, and its line names machine 1.
    assert main.startswith("machine 0 (") and f"hosts the rendezvous endpoint {where}, but machine 1 (" in main, main
    assert f", {machines[1].ip}) " in main and ("drops" if rule == "drop" else "rejects") + f" TCP port {PORT}" in main


@needs_netns
@needs_nft
def test_under_min_max_machines_that_cannot_join_stop_every_machine_once_too_few_can(tmp_path):
    """--num_machines 3:4 (c10d): machines 2 and 3 are dropped at the rendezvous port. Machine 0 hears the first
    over UDP and names it (3 may still join); the second leaves 2 < 3, while machine 1 already waits in torch's
    rendezvous: every machine stops at once with its line, none at the 60 s join timeout."""
    with simulated_machines(4) as machines:
        _nft(machines[0], f"add rule inet hx input ip saddr {{ {machines[2].ip}, {machines[3].ip} }} tcp dport {PORT} "
                          "drop")
        argvs = [_argv(4, r, machines[0].ip, tmp_path, ["--rdzv_conf", "join_timeout=60"], machines="3:4")
                 for r in range(4)]
        codes, watched = _run(machines, argvs, [_env(tmp_path)] * 4)
    where = f"{machines[0].ip}:{PORT}"
    _assert_all_stop_with(codes, watched, where, "a firewall", f"drops TCP port {PORT}", "HINT: allow TCP")
    for rank in (2, 3):
        assert watched[rank].failures()[0].startswith(f"machine {rank} ("), watched[rank].output
    main = watched[0].failures()[0]
    assert watched[1].failures() == [main], watched[1].output  # machine 1 read machine 0's line from its store
    assert main.startswith("machine 0 (") and f"hosts the rendezvous endpoint {where}, but machine " in main, main
    assert "With --num_machines 3:4 at most 2 machine(s) can join now, fewer than 3: every machine stops" in main
    named = [line for _, line in watched[0].lines if line.startswith("hasten launch: network check: machine 0 (")]
    assert len(named) == 1 and "The run goes on without it (--num_machines 3:4: at most 3 of 4" in named[0], named
    # One blocked machine is named while the launch goes on, the other in the line that stops it.
    assert {f"but machine {r} (" in named[0] for r in (2, 3)} == {True, False}, named
    assert {f"but machine {r} (" in main for r in (2, 3)} == {True, False}, main
    assert not any(f"but machine {r} (" in named[0] and f"but machine {r} (" in main for r in (2, 3))


def test_under_min_max_machine_0_names_a_blocked_machine_and_stops_only_when_too_few_can_join(monkeypatch, capsys):
    """The decision of machine 0's watch (in-process): under 2:3 a first blocked machine is named and the launch
    goes on; a second leaves 1 < 2, so the watch records its line in the store and closes the rendezvous."""
    from hasten.environments import find_free_port
    from hasten.launchers.machines import membership
    from hasten.launchers.machines.reports import Report
    from hasten.launchers.machines.store import store_server
    from hasten.launchers.machines.watch import ElasticWatch, recorded_problem

    closed = []
    monkeypatch.setattr(membership, "close_rendezvous", lambda: closed.append(True))
    monkeypatch.setattr(membership, "rounds_met", lambda: 0)
    port = find_free_port()
    with store_server("127.0.0.1", port), ElasticWatch("127.0.0.1", "127.0.0.1", port, 2, 3) as watch:
        assert recorded_problem("127.0.0.1", port) is None
        first = Report(1, "m1", "10.0.0.2", "failed", "no answer within 3 s")
        watch.heard(first)
        watch.heard(first)  # each report comes twice
        named = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hasten launch: ")]
        assert len(named) == 1 and "but machine 1 (m1, 10.0.0.2) gets no answer" in named[0], named
        assert "The run goes on without it (--num_machines 2:3: at most 2 of 3 machines can join" in named[0]
        assert watch.fatal is None and not closed
        watch.heard(Report(2, "m2", "10.0.0.3", "failed", "refused"))
        assert closed == [True] and watch.fatal is not None and "but machine 2 (m2, 10.0.0.3) is refused" in watch.fatal
        assert "at most 1 machine(s) can join now, fewer than 2: every machine stops" in watch.fatal
        assert recorded_problem("127.0.0.1", port) == watch.fatal  # what the other machines print
    monkeypatch.setattr(membership, "rounds_met", lambda: 1)  # once the run started, a blocked machine is only named
    with store_server("127.0.0.1", port), ElasticWatch("127.0.0.1", "127.0.0.1", port, 3, 3) as watch:
        watch.heard(first)
        assert watch.fatal is None and closed == [True]
        assert "the machines that joined train on" in capsys.readouterr().err


def test_a_rendezvous_timeout_names_the_likely_cause_where_no_report_arrived():
    from hasten.launchers.machines.watch import timeout_problem

    line = timeout_problem("10.0.0.1:29500", 29500, 2, 3, TimeoutError("join"))
    assert "fewer than 2 of up to 3 machines joined the rendezvous before its timeout" in line
    assert "its report over UDP port 29500 could not arrive either (UDP blocked too)" in line
    assert "HINT: allow TCP (and UDP) port 29500" in line
    heard = timeout_problem("10.0.0.1:29500", 29500, 2, 3, TimeoutError("join"), ["machine 0 (h) hosts ... m2"])
    assert heard.endswith("machine 0 (h) hosts ... m2") and "UDP blocked" not in heard


def test_nccl_interface_selection_follows_nccl_rules():
    from hasten.environments.network import nccl_interfaces

    names = ["lo", "docker0", "eth0", "eth10", "ib0"]
    assert nccl_interfaces("eth", names) == ["eth0", "eth10"]
    assert nccl_interfaces("=eth0", names) == ["eth0"]
    assert nccl_interfaces("^docker,lo", names) == ["eth0", "eth10", "ib0"]
    assert nccl_interfaces("^=eth0", names) == ["lo", "docker0", "eth10", "ib0"]


def test_an_nccl_interface_that_selects_nothing_is_a_problem():
    import psutil

    from hasten.launchers.machines.check import collective_address

    found = next(((n, a.address) for n, addrs in psutil.net_if_addrs().items() for a in addrs
                  if a.family == 2 and not a.address.startswith("127.")), None)
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = found
    _, _, problem = collective_address(address, address, 0, {"NCCL_SOCKET_IFNAME": "=nosuch9"})
    assert "NCCL_SOCKET_IFNAME==nosuch9: on machine 0" in problem and "selected: none" in problem
    assert "HINT: set NCCL_SOCKET_IFNAME" in problem
    assert collective_address(address, address, 0, {"NCCL_SOCKET_IFNAME": name})[2] is None


def test_the_check_waits_as_long_as_the_rendezvous():
    from hasten.launchers.machines.check import rendezvous_timeout

    assert rendezvous_timeout("") == 600
    assert rendezvous_timeout("timeout=12") == 12
    assert rendezvous_timeout("is_host=1,join_timeout=30") == 30


def test_check_network_on_one_machine_has_nothing_to_check_and_a_launch_needs_a_script(tmp_path):
    main = [sys.executable, "-m", "hasten.commands.main", "launch"]
    alone = subprocess.run([*main, "--cpu", "--check_network"], env=_env(tmp_path), capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode == 0 and "no network check to run: a single-machine launch" in alone.stderr
    missing = subprocess.run([*main, "--cpu"], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "the training script is missing" in missing.stderr


# A loopback address on one computer, in-process: each thread plays one machine's launcher (its
# presence mark, its check); machine 0's thread hosts the rendezvous store as its launcher does.
# LOOPBACK_WAIT is 0, so every wait below is past the window that used to end such a launch.

def _loopback_check(port, rank, results, timeout=60):
    from hasten.launchers.machines.check import NetworkCheckFailed, check_network

    try:
        results[rank] = check_network("127.0.0.1", "127.0.0.1", port, rank, 2, {}, timeout)
    except NetworkCheckFailed as exc:
        results[rank] = str(exc)


def _host_machine_0(port, results):
    from hasten.launchers.machines.store import store_server

    with store_server("127.0.0.1", port):
        _loopback_check(port, 0, results)


@pytest.fixture
def loopback_launch(monkeypatch):
    """(port, refused): a free port, and an event set once machine 1 was refused there (machine 0 is late)."""
    from hasten.environments import find_free_port
    from hasten.launchers.machines import check as netcheck

    monkeypatch.setattr(netcheck, "LOOPBACK_WAIT", 0.0)
    refused, connect = threading.Event(), netcheck._connect

    def watched(address, port, timeout=netcheck.PROBE_TIMEOUT):
        reason = connect(address, port, timeout)
        if reason == "refused":
            refused.set()
        return reason

    monkeypatch.setattr(netcheck, "_connect", watched)
    return find_free_port(), refused


def test_loopback_machines_on_one_computer_meet_however_late_machine_0_starts(loopback_launch):
    from hasten.launchers.machines.reports import host_identity, present

    port, refused = loopback_launch
    results = {}
    with present(port, 0), present(port, 1):  # both launchers started; machine 0's is slow to reach its check
        one = threading.Thread(target=_loopback_check, args=(port, 1, results))
        one.start()
        assert refused.wait(30), "machine 1 never tried the endpoint"
        _host_machine_0(port, results)
        one.join(60)
    for rank in (0, 1):
        assert not isinstance(results[rank], str), results[rank]
        assert [(p.rank, p.address, p.host_id) for p in results[rank]] == [(0, "127.0.0.1", host_identity()),
                                                                             (1, "127.0.0.1", host_identity())]


def test_a_loopback_machine_whose_peer_runs_elsewhere_stops_at_once(loopback_launch):
    from hasten.launchers.machines.reports import present

    port, _ = loopback_launch
    results = {}
    with present(port, 1):  # machine 0's launcher does not run on this computer
        start = time.monotonic()
        _loopback_check(port, 1, results)
        assert time.monotonic() - start < 5
    with present(port, 0):  # nor does machine 1's
        _host_machine_0(port, results)
    assert "machine 1 (" in results[1] and "nothing listens there on this machine" in results[1]
    assert "machine 0 (" in results[0] and "machine(s) 1 did not arrive" in results[0]
    for line in results.values():
        assert "--main_process_ip 127.0.0.1 is a loopback address" in line and "no launcher of it runs on this" in line
        assert f"(port {port})" in line and "HINT: pass --main_process_ip with machine 0's address" in line


def test_a_machine_reaching_the_loopback_port_from_another_computer_is_refused(loopback_launch, monkeypatch):
    from hasten.launchers.machines import check as netcheck
    from hasten.launchers.machines.reports import present

    port, refused = loopback_launch
    # Machine 1 reaches machine 0's loopback port as through a tunnel: another boot id / network namespace.
    monkeypatch.setattr(netcheck, "host_identity", lambda: threading.current_thread().name)
    results = {}
    with present(port, 0), present(port, 1):
        one = threading.Thread(target=_loopback_check, args=(port, 1, results), name="elsewhere")
        one.start()
        _host_machine_0(port, results)
        one.join(60)
    assert results[0] == results[1], results  # the same line on both
    assert results[0].startswith("machine 1 (") and f"reaches the rendezvous 127.0.0.1:{port}, a loopback" in results[0]
    assert "does not run on the computer of machine 0" in results[0] and "HINT: pass --main_process_ip" in results[0]


def test_a_multi_machine_launcher_marks_itself_present_for_the_whole_launch(monkeypatch):
    """The mark the loopback waits rely on: made before torchrun's agent (and torch) start, gone after."""
    import argparse

    from hasten.commands.launch import build_launch_parser, options_from_args, resolve_config
    from hasten.environments import find_free_port
    from hasten.launchers import torchrun
    from hasten.launchers.machines.reports import is_present
    from hasten.launchers.plan import build_plan

    port = find_free_port()
    args = build_launch_parser(argparse.ArgumentParser()).parse_args(
        ["--cpu", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "127.0.0.1",
         "--main_process_port", str(port), "--check_network"])
    plan = build_plan(resolve_config(args, {}), options_from_args(args), {}, device_count=0)
    seen = []
    monkeypatch.setattr(torchrun, "_run", lambda plan, options: seen.append(is_present(port, 1)) or 0)
    assert not is_present(port, 1)
    assert torchrun.run_torchrun(plan, options_from_args(args)) == 0
    assert seen == [True] and not is_present(port, 1)


def test_machine_0_answers_hellos_and_reads_only_reports_of_its_own_launch():
    import socket as sockets

    from hasten.environments import find_free_port
    from hasten.launchers.machines.reports import Inbox, Report, ask_host, send_report

    port = find_free_port()
    inbox = Inbox("127.0.0.1", port, 3)
    try:
        with sockets.socket(sockets.AF_INET, sockets.SOCK_DGRAM) as stray:
            stray.sendto(b"not json", ("127.0.0.1", port))
        send_report("127.0.0.1", port + 1, Report(1, "h", "a", "failed", "x"))  # another launch's port
        for rank in (0, 3):  # machine 0 itself, and a rank this launch does not have
            send_report("127.0.0.1", port, Report(rank, "h", "a", "failed", "no answer"))
        assert inbox.poll() is None
        answered, polled, stop = [], [], threading.Event()

        def serve():  # machine 0's check polls its inbox while it waits
            while not stop.is_set():
                polled.append(inbox.poll())
                time.sleep(0.01)

        server = threading.Thread(target=serve)
        server.start()
        answered.append(ask_host("127.0.0.1", port, Report(2, "h", "a", "hello"), 10))
        stop.set()
        server.join(10)
        assert answered == [True] and polled and not any(polled)  # a hello is answered, never reported
        send_report("127.0.0.1", port, Report(2, "m2", "10.0.0.2", "failed", "refused"))
        assert inbox.poll() == Report(2, "m2", "10.0.0.2", "failed", "refused")
    finally:
        inbox.close()
    assert not ask_host("127.0.0.1", port, Report(2, "h", "a", "hello"), 0.2)  # nobody answers any more
