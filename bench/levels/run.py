"""Collectives across two nodes on a shaped link: ferrodist's two levels against flat tcp,
Gloo and Open MPI, and the link's floor, one table.

    sudo python bench/levels/run.py [--rate 10gbit] [--delay 50us] [--ranks-per-node 2]
                                    [--sizes 4K,64K,1M,16M,64M] [--ops all_reduce] [--rounds 5]

Two network namespaces joined by a veth pair are the two nodes (``ferrodist.testing.
two_hosts``); each end of the link is shaped with tc (netem rate and delay where the kernel
has netem, else tbf's rate alone, and the table says which). Each library runs the sweep of
``ferrodist bench``'s worker with the same sizes, on the same ranks: ``ferrodist run`` with
one launcher per namespace for ferrodist (``levels``: shared memory inside each node, tcp
between; ``tcp``: every rank over tcp) and for torch.distributed's Gloo, and ``mpiexec``
with an rsh agent that starts each node's daemon in its namespace (and its own host name,
so that Open MPI sees two nodes) for mpi4py, over Open MPI's tcp transport with its default
collectives; its ranks yield the core while they wait (``mpi_yield_when_idle``), as
ferrodist's and Gloo's do. The libraries run one after another, in turn over ``--passes`` (fastest
median kept). The link's floor of an all_reduce across N nodes is 2 (N - 1) / N x bytes
over the link rate (each direction carries that much), plus the delay once per step of a
ring across nodes; the table also gives one tcp stream's measured rate over the link.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrodist.testing import Link, two_hosts

LIBRARIES = ("ferrodist:levels", "ferrodist:tcp", "gloo", "mpi4py")
NAMES = {"ferrodist:levels": "ferrodist two levels", "ferrodist:tcp": "ferrodist flat tcp"}
RSH = """#!/bin/sh
host="$1"; shift
while [ "${host#-}" != "$host" ]; do host="$1"; shift; done
case "$host" in
%s
  *) echo "no namespace for host $host" >&2; exit 1 ;;
esac
"""


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg")) * scale


def stream_rate(link: Link, nbytes: int = 64 << 20) -> float:
    """One tcp stream's rate from the first host to the second, in bytes per second."""
    a, b = link.hosts
    code = (
        "import socket,sys,time\n"
        "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind((sys.argv[1],5201));s.listen(1)\n"
        "c,_=s.accept();buf=bytearray(1<<20);n=0;t=None\n"
        f"while n<{nbytes}:\n  k=c.recv_into(buf);t=t or time.perf_counter();n+=k\n"
        "print(n/(time.perf_counter()-t));c.sendall(b'x')\n"
    )
    server = subprocess.Popen(b.command(sys.executable, "-c", code, b.address), stdout=subprocess.PIPE, text=True)
    send = (
        "import socket,sys,time\n"
        "for _ in range(100):\n"
        "  try: c=socket.create_connection((sys.argv[1],5201)); break\n"
        "  except OSError: time.sleep(0.05)\n"
        f"d=bytes(1<<20)\nfor _ in range({nbytes >> 20}): c.sendall(d)\nc.recv(1)\n"
    )
    subprocess.run(a.command(sys.executable, "-c", send, b.address), check=True, timeout=120)
    out, _ = server.communicate(timeout=60)
    return float(out.strip())


def spec(args: argparse.Namespace) -> str:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    return json.dumps(
        {"ops": args.ops.split(","), "sizes": sizes, "dtype": "float32", "rounds": args.rounds, "target": 0.05}
    )


def run_ferrodist(link: Link, library: str, payload: str, ranks: int, out: str) -> None:
    """ferrodist's worker (or Gloo's) under one ``ferrodist run`` per namespace."""
    port = 29400 + secrets.randbelow(500)
    env = dict(os.environ, FERRODIST_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    procs = []
    for k, host in enumerate(link.hosts):
        node_env = dict(env, FERRODIST_SOCKET_IFNAME=host.device, GLOO_SOCKET_IFNAME=host.device)
        argv = [sys.executable, "-m", "ferrodist.launch", "run", "--nnodes", "2", "--node-rank", str(k)]
        argv += ["--master-addr", link.hosts[0].address, "--master-port", str(port), "-n", str(ranks)]
        argv += ["-m", "ferrodist.launch._bench.worker", library, out, payload]
        procs.append(subprocess.Popen(host.command(*argv), env=node_env, stdout=subprocess.PIPE, text=True))
    finish(procs, library)


def run_mpi(link: Link, payload: str, ranks: int, out: str, workdir: str) -> None:
    """mpi4py's worker under mpiexec started in the first namespace; the agent starts the
    second node's daemon in the second namespace, each with a host name of its own."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    agent = Path(workdir, "rsh.sh")
    cases = "\n".join(
        f'  {h.address}) exec ip netns exec {h.namespace} unshare --uts /bin/sh -c "hostname {h.namespace}; $*" ;;'
        for h in link.hosts
    )
    agent.write_text(RSH % cases)
    agent.chmod(0o755)
    a = link.hosts[0]
    subnet = a.address.rsplit(".", 1)[0] + ".0/24"
    # Ranks that wait by yielding the core, as ferrodist's do (this machine may have fewer
    # cores than ranks); --oversubscribe would put every rank on the first node.
    argv = [str(mpiexec), "--allow-run-as-root", "-n", str(2 * ranks), "--mca", "mpi_yield_when_idle", "1"]
    if ranks > (os.cpu_count() or 1):
        argv += ["--bind-to", "none"]  # more ranks on a node than cores: Open MPI refuses to bind them
    argv += ["--host", ",".join(f"{h.address}:{ranks}" for h in link.hosts), "--mca", "plm_rsh_agent", str(agent)]
    argv += ["--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet, "-x", "PATH"]
    argv += [sys.executable, "-m", "ferrodist.launch._bench.worker", "mpi4py", out, payload]
    inner = " ".join(f"'{w}'" for w in argv)
    command = a.command("unshare", "--uts", "/bin/sh", "-c", f"hostname {a.namespace}; exec {inner}")
    finish([subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)], "mpi4py")


def finish(procs: list[subprocess.Popen[str]], library: str, limit: float = 1800) -> None:
    deadline = time.monotonic() + limit
    failed = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(text[-3000:])
    if failed:
        raise SystemExit(f"{library} failed:\n" + "\n".join(failed))


def floor(nbytes: int, link: Link, nodes: int = 2) -> float:
    """The link's floor of an all_reduce across ``nodes`` nodes (seconds)."""
    assert link.rate is not None
    return 2 * (nodes - 1) / nodes * nbytes * 8 / link.rate + 2 * (nodes - 1) * link.delay


def table(records: list[dict[str, Any]], link: Link, measured: float, args: argparse.Namespace) -> str:
    libs = [lib for lib in LIBRARIES if any(r["library"] == lib for r in records)]
    lines = [
        f"2 nodes x {args.ranks_per_node} ranks, float32, link: {link.shaping}; one tcp stream over it: "
        f"{measured / 1e9:.3f} GB/s; host: {socket.gethostname()}, {os.cpu_count()} cores",
        "",
    ]
    for op in args.ops.split(","):
        mine = {r["bytes"]: r["seconds"] for r in records if r["op"] == op and r["library"] == LIBRARIES[0]}
        head = ["op", "bytes"] + [NAMES.get(lib, lib) + " ms" for lib in libs]
        head += [f"{NAMES.get(lib, lib)} / two levels" for lib in libs[1:]]
        if op == "all_reduce":
            head += ["link floor ms", "two levels / floor"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for nbytes in sorted(mine):
            row = [op, f"{nbytes:,}"]
            times = {
                lib: next(
                    (r["seconds"] for r in records if (r["library"], r["op"], r["bytes"]) == (lib, op, nbytes)), None
                )
                for lib in libs
            }
            row += [f"{t * 1e3:.3f}" if t else "-" for t in times.values()]
            row += [f"{times[lib] / mine[nbytes]:.2f}x" if times[lib] else "-" for lib in libs[1:]]
            if op == "all_reduce":
                bound = floor(nbytes, link)
                row += [f"{bound * 1e3:.3f}", f"{mine[nbytes] / bound:.2f}x"]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="10gbit")
    parser.add_argument("--delay", default="50us")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--ops", default="all_reduce")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    payload = spec(args)
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    with two_hosts("fdb", "10.232.5", rate=args.rate, delay=args.delay) as link, tempfile.TemporaryDirectory() as tmp:
        measured = stream_rate(link)
        libraries = args.libraries.split(",")
        for number in range(args.passes):
            for library in libraries if number % 2 == 0 else reversed(libraries):
                out = os.path.join(tmp, f"{library.replace(':', '-')}.jsonl")
                print(f"running {library} ...", file=sys.stderr, flush=True)
                if library == "mpi4py":
                    run_mpi(link, payload, args.ranks_per_node, out, tmp)
                else:
                    run_ferrodist(link, library, payload, args.ranks_per_node, out)
                with open(out) as f:
                    for record in map(json.loads, filter(str.strip, f)):
                        key = (record["library"], record["op"], record["bytes"])
                        if key not in best or record["seconds"] < best[key]["seconds"]:
                            best[key] = record
        records = list(best.values())
        print(table(records, link, measured, args))
    if args.json:
        floors = {r["bytes"]: floor(r["bytes"], link) for r in records if r["op"] == "all_reduce"}
        Path(args.json).write_text(
            json.dumps(
                {
                    "shaping": link.shaping,
                    "stream_rate": measured,
                    "ranks_per_node": args.ranks_per_node,
                    "all_reduce_floor": {str(n): seconds for n, seconds in sorted(floors.items())},
                    "records": records,
                }
            )
        )


if __name__ == "__main__":
    main()
