"""What a lost rank costs: recovery in place (ferrodist.elastic) against the restart path,
the same training job, in one run.

    python bench/elastic/recovery.py [--backends shm,tcp,nodes] [--ranks 4] [--steps 400] [--seed 1] [--json out.json]

A DDP training (ferrodist.ddp over a torch MLP of 2.1 M parameters, float32, batch 16 per
rank, SGD with momentum) on RANKS ranks; one rank kills itself (SIGKILL) at a step drawn
from the seed, the same in both runs:

- elastic: ``ferrodist run -n RANKS-1:RANKS``, ``ferrodist.elastic.run`` with a commit in
  memory every 10 steps: the survivors shrink the group, restore the commit, train on, and
  the launcher's replacement for the lost rank joins at a commit point (the time from its
  start to its first step in the group of RANKS is reported too);
- restart: ``ferrodist run -n RANKS --max-restarts 1``, ``save_checkpoint`` every 10 steps
  and ``resume_checkpoint`` at the start: every rank is stopped and started again.

``nodes``: two nodes of RANKS/2 ranks each, in two network namespaces joined by a veth pair
(``ferrodist.testing.two_hosts``; needs root), one launcher per node (``--nnodes 2``, the
auto backend: the two levels), elastic with ``-n RANKS/2-1:RANKS/2`` on each node.

Every rank logs the wall-clock time at which it finishes each step; the table gives, for
each path, the time from the kill to the first step the job finishes after it (detection,
shrink or restart, and the redone step included), the steps done again, the whole job's
time, and the ratios, all from this run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVERY = 10  # commit / checkpoint every this many steps


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 256),
    )


def _age() -> float:
    """Seconds since this process started (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def worker(mode: str, outdir: Path, backend: str, steps: int, kill_at: int, victim: int) -> None:
    import torch

    import ferrodist.collectives as dist
    from ferrodist.ddp import DDP, resume_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    world = dist.init_process_group(backend, timeout=20)
    rank = world.rank
    restart = int(os.environ.get("FERRODIST_RESTART_COUNT", "0"))
    log = open(outdir / f"{mode}-rank{rank}.jsonl", "a", buffering=1)
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    calls = [restart]  # the job's start (a restart) or ``train``'s call (a recovery) this step is in

    def one_step(ddp, group, step: int) -> None:
        if step == kill_at and group.global_rank == victim and restart == 0:
            (outdir / f"{mode}-killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step * 1000 + group.rank)
        x = torch.randn(16, 256, generator=g)
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        log.write(json.dumps({"step": step, "t": time.time(), "call": calls[0]}) + "\n")

    if mode == "elastic":
        from ferrodist.elastic import State, run

        state = State(model=net, optimizer=opt, step=0)

        def train(state):
            calls[0] += 1 if state.group is not world else 0
            if dist.is_replacement() and not (outdir / f"{mode}-joined").exists():
                (outdir / f"{mode}-joined").write_text(repr(_age()))  # back at RANKS ranks, with the state
            ddp = DDP(net, state.group)
            while state.step < steps:
                one_step(ddp, state.group, state.step)
                state.step += 1
                if state.step % EVERY == 0:
                    state.commit()

        run(train, state)
    else:
        ddp = DDP(net, world)
        path = outdir / "checkpoint.pt"
        start = resume_checkpoint(path, ddp, opt) or 0
        for step in range(start, steps):
            one_step(ddp, world, step)
            if (step + 1) % EVERY == 0:
                save_checkpoint(path, ddp, opt, extra=step + 1)
    dist.destroy_process_group()


def _launch(mode: str, outdir: Path, args: argparse.Namespace, backend: str, kill_at: int, victim: int) -> float:
    nodes = 2 if backend == "nodes" else 1
    ranks = args.ranks // nodes
    shape = ["-n", f"{ranks - 1}:{ranks}"] if mode == "elastic" else ["-n", str(ranks), "--max-restarts", "1"]
    script = [__file__, "worker", mode, str(outdir), "auto" if nodes > 1 else backend]
    script += [str(args.steps), str(kill_at), str(victim)]
    command = [sys.executable, "-m", "ferrodist.launch", "run", *shape]
    started = time.time()
    if nodes == 1:
        done = subprocess.run([*command, *script], capture_output=True, text=True, timeout=900)
        outputs, codes = [done.stdout + done.stderr], [done.returncode]
    else:
        from ferrodist.testing import two_hosts

        env = dict(os.environ, FERRODIST_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
        with two_hosts("fr", "10.231.13") as link:
            master = ["--nnodes", "2", "--master-addr", link.hosts[0].address, "--master-port", "29571"]
            procs = [
                subprocess.Popen(
                    host.command(*command, *master, "--node-rank", str(k), *script),
                    env=dict(env, FERRODIST_SOCKET_IFNAME=host.device),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for k, host in enumerate(link.hosts)
            ]
            outputs = [proc.communicate(timeout=900)[0] for proc in procs]
            codes = [proc.returncode for proc in procs]
    if any(codes):
        tails = "\n".join(out[-3000:] for out in outputs)
        raise SystemExit(f"{mode} job failed ({codes}):\n{tails}")
    return time.time() - started


def _measure(mode: str, outdir: Path, elapsed: float, kill_at: int) -> dict:
    killed = float((outdir / f"{mode}-killed").read_text())
    entries = [json.loads(line) for f in outdir.glob(f"{mode}-rank*.jsonl") for line in f.read_text().splitlines()]
    after = [e for e in entries if e["call"] > 0]  # steps of the recovered (or restarted) job
    first = min(e["t"] for e in after)
    redone = kill_at - min(e["step"] for e in after)
    joined = outdir / f"{mode}-joined"
    rejoin = float(joined.read_text()) if joined.exists() else None  # the replacement's start -> joined
    return {"recovery_s": first - killed, "redone_steps": redone, "job_s": elapsed, "rejoin_s": rejoin}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        mode, outdir, backend = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
        steps, kill_at, victim = map(int, sys.argv[5:8])
        worker(mode, outdir, backend, steps, kill_at, victim)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="shm,tcp,nodes", help="comma-separated: shm, tcp, nodes (2 namespaces)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from ferrodist.testing import NamespacesUnavailable

    rng = random.Random(args.seed)
    kill_at, victim = rng.randrange(EVERY + 1, args.steps // 4), rng.randrange(1, args.ranks)  # time left to rejoin
    backends: dict[str, dict] = {}
    print(f"{args.ranks} ranks, rank {victim} killed at step {kill_at} of {args.steps}")
    print("| backend | path | kill -> next step done | steps done again | whole job | replacement start -> joined |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="ferrodist-recovery-") as tmp:
        for backend in args.backends.split(","):
            results = backends[backend] = {}
            for mode in ("elastic", "restart"):
                outdir = Path(tmp) / backend / mode
                outdir.mkdir(parents=True)
                try:
                    elapsed = _launch(mode, outdir, args, backend, kill_at, victim)
                except NamespacesUnavailable as exc:
                    print(f"| {backend} | not measured: {exc} | | | | |")
                    del backends[backend]
                    break
                m = results[mode] = _measure(mode, outdir, elapsed, kill_at)
                path = "in place (-n MIN:MAX)" if mode == "elastic" else "restart (--max-restarts 1)"
                rejoin = "" if m["rejoin_s"] is None else f"{m['rejoin_s']:.2f} s"
                print(
                    f"| {backend} | {path} | {m['recovery_s']:.2f} s | {m['redone_steps']} | {m['job_s']:.1f} s | {rejoin} |"
                )
            if backend not in backends:
                continue
            e, r = results["elastic"], results["restart"]
            print(
                f"| {backend} | in place is | {r['recovery_s'] / e['recovery_s']:.1f}x faster | | {r['job_s'] / e['job_s']:.2f}x |"
            )
    if args.json:
        record = {"ranks": args.ranks, "steps": args.steps, "kill_at": kill_at, "victim": victim, "backends": backends}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
