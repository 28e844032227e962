"""Kill/restart drill for torchft on CPU/gloo: Lighthouse + N replica groups (torchrun each), loopback only.

usage: python drill.py OUTDIR [--nproc K] [--kill-at 10] [--restart-at 20] [--steps 40] [--no-kill]
Prints the timings and the bit-equality check; every process started here is killed at the end.
"""
import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = ".tft-venv/bin/python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(out: str) -> list:
    rows = []
    for path in glob.glob(os.path.join(out, "g*_r*_i*.jsonl")):
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by kill -9
    return sorted(rows, key=lambda r: r["t"])


def max_step(out: str, group: int, inc: str | None = None) -> int:
    steps = [r["after"] for r in records(out) if r.get("event") == "step" and r["group"] == group
             and r["committed"] and (inc is None or r["inc"] == inc)]
    return max(steps, default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--restart-at", type=int, default=20)
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--step-s", default="0.2")
    ap.add_argument("--timeout-s", default="5")
    ap.add_argument("--heartbeat-ms", default="1000")
    ap.add_argument("--join-ms", default="1000")
    ap.add_argument("--compute-first", action="store_true", help="sleep before the all-reduce, not after")
    ap.add_argument("--kill-signal", default="KILL", help="KILL, or STOP to freeze the group (a hung host)")
    ap.add_argument("--reduce", default="ddp", choices=["ddp", "manual"])
    ap.add_argument("--deadline-s", type=float, default=240)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for f in glob.glob(os.path.join(a.out, "*")):
        os.remove(f)
    procs: list[subprocess.Popen] = []
    lh_port = free_port()
    lh = subprocess.Popen([os.path.join(os.path.dirname(PY), "torchft_lighthouse"), "--bind", f"127.0.0.1:{lh_port}",
                           "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", a.join_ms,
                           "--heartbeat_timeout_ms", a.heartbeat_ms],
                          stdout=open(os.path.join(a.out, "lighthouse.log"), "w"), stderr=subprocess.STDOUT,
                          start_new_session=True)
    procs.append(lh)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lh_port}", NUM_REPLICA_GROUPS=str(a.groups),
               SPIKE_OUT=a.out, SPIKE_STEPS=str(a.steps), SPIKE_STEP_S=a.step_s, SPIKE_TIMEOUT_S=a.timeout_s,
               GLOO_SOCKET_IFNAME="lo", SPIKE_COMPUTE_FIRST="1" if a.compute_first else "0", SPIKE_REDUCE=a.reduce, OMP_NUM_THREADS="1", RUST_BACKTRACE="1")

    def start_group(g: int, inc: int) -> subprocess.Popen:
        cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--node_rank", "0",
               "--nproc_per_node", str(a.nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "--max_restarts", "0", os.path.join(HERE, "train.py")]
        p = subprocess.Popen(cmd, env=dict(env, REPLICA_GROUP_ID=str(g), SPIKE_INCARNATION=str(inc)),
                             stdout=open(os.path.join(a.out, f"group{g}_i{inc}.log"), "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    t0 = time.time()
    groups = {g: start_group(g, 0) for g in range(a.groups)}
    victim = a.groups - 1
    t_kill = t_restart = None
    try:
        while True:
            if time.time() - t0 > a.deadline_s:
                raise SystemExit("DEADLINE: drill did not finish")
            time.sleep(0.05)
            if not a.no_kill and t_kill is None and max_step(a.out, victim) >= a.kill_at:
                # torchrun puts each worker in its own session: kill the workers by pid, then the agent
                pids = [r["pid"] for r in records(a.out) if r.get("event") == "ready" and r["group"] == victim]
                sig = getattr(signal, "SIG" + a.kill_signal)
                for pid in pids:
                    os.kill(pid, sig)
                os.killpg(groups[victim].pid, sig)
                t_kill = time.time()
                if sig == signal.SIGSTOP:  # a frozen host: kill it for good only when replacing it
                    groups["frozen"] = groups[victim]
                else:
                    groups[victim].wait(10)
                print(f"+{t_kill - t0:.2f}s killed group {victim} (pids {pids}) at its step "
                      f"{max_step(a.out, victim)}", flush=True)
            if t_kill and t_restart is None and max_step(a.out, 0) >= a.restart_at:
                if "frozen" in groups:
                    frozen = groups.pop("frozen")
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    os.killpg(frozen.pid, signal.SIGKILL)
                    frozen.wait(10)
                t_restart = time.time()
                groups[victim] = start_group(victim, 1)
                print(f"+{t_restart - t0:.2f}s restarted group {victim} when survivors at step {max_step(a.out, 0)}", flush=True)
            live = [p for g, p in groups.items() if g != "frozen"]
            if all(p.poll() is not None for p in live):
                break
            if t_restart is None and any(p.poll() not in (None, 0) for g, p in groups.items() if g == 0):
                print(f"+{time.time() - t0:.2f}s SURVIVOR group 0 exited with {groups[0].returncode}", flush=True)
                break
        print("exit codes:", {g: p.returncode for g, p in groups.items()}, f"wall {time.time() - t0:.1f}s")
    finally:
        for r in records(a.out):  # workers live in their own sessions (torchrun), kill them by pid
            if r.get("event") == "ready":
                try:
                    os.kill(r["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    report(a, t0, t_kill, t_restart)


def report(a, t0, t_kill, t_restart) -> None:
    import torch
    rows = records(a.out)
    steps = [r for r in rows if r.get("event") == "step"]
    for r in rows:
        if r.get("event") == "ready":
            print(f"ready g{r['group']} r{r['rank']} inc{r['inc']} at +{r['t'] - t0:.2f}s "
                  f"(import {r['import_s']:.2f}s, setup {r['setup_s']:.2f}s of which Manager+DDP {r['manager_s']:.2f}s)")
    first = min((r["t"] for r in steps if r["committed"]), default=None)
    if first:
        print(f"first committed step at +{first - t0:.2f}s")
    if t_kill:
        surv = [r for r in steps if r["group"] != a.groups - 1 and r["t"] > t_kill]
        # the first commit of a step whose quorum no longer holds the victim (a commit right after the kill
        # may be a step that had already finished its all-reduce)
        nxt = next((r for r in surv if r["committed"] and r["participants"] < a.groups), None)
        failed = [r["step"] for r in surv if not r["committed"] and (nxt is None or r["t"] <= nxt["t"])]
        print(f"kill -> survivors' next commit: {nxt['t'] - t_kill:.2f}s (step {nxt['step']}, "
              f"uncommitted attempts before it: {failed})" if nxt else "survivors never committed after kill")
        print("survivor step dts around kill:",
              [(r["step"], r["committed"], round(r["dt"], 2)) for r in surv[:6]])
    if t_restart:
        healed = [r for r in steps if r["inc"] == "1"]
        heal_c = next((r for r in healed if r["committed"]), None)
        loads = [r for r in rows if r.get("event") == "healed_load" and r["inc"] == "1"]
        rdy = [r for r in rows if r.get("event") == "ready" and r["inc"] == "1"]
        if heal_c:
            print(f"restart -> healed group's first commit: {heal_c['t'] - t_restart:.2f}s (step {heal_c['step']}); "
                  f"ready at +{rdy[0]['t'] - t_restart:.2f}s, state loaded at +{loads[0]['t'] - t_restart:.2f}s"
                  if rdy and loads else f"restart -> healed first commit {heal_c['t'] - t_restart:.2f}s")
        else:
            print("healed group never committed")
    # bit-equality: same committed step -> same digest in every process
    by_step: dict = {}
    for r in steps:
        if r["committed"]:
            by_step.setdefault(r["after"], set()).add(r["digest"])
    diverged = sorted(s for s, d in by_step.items() if len(d) > 1)
    print(f"steps with differing weights across processes: {diverged or 'none'} (of {len(by_step)} steps)")
    finals = {os.path.basename(p): torch.load(p) for p in glob.glob(os.path.join(a.out, "final_*.pt"))}
    names = sorted(finals)
    ref = finals[names[0]] if names else {}
    eq = all(all(torch.equal(ref[k], f[k]) for k in ref) for f in finals.values())
    print(f"final weights bit-equal across {names}: {eq}")
    # sample accounting (global ids over committed steps, per group incarnation, first rank only)
    seen = [i for r in steps if r["committed"] and r.get("participating", True) and r["rank"] == 0 for i in r["ids"]]
    final = max((r["after"] for r in steps if r["committed"]), default=0)
    # the sampler's view: every sample that steps 0..final-1 of all groups would have covered
    expected = {i for s in range(final) for g in range(a.groups) for i in range(g + a.groups * 8 * s, g + a.groups * 8 * (s + 1), a.groups)}
    print(f"samples in participating committed steps: {len(seen)}, distinct {len(set(seen))}, "
          f"duplicates {len(seen) - len(set(seen))}, never used of the {len(expected)} the sampler dealt for "
          f"steps 0..{final - 1}: {len(expected - set(seen))}")


if __name__ == "__main__":
    main()
