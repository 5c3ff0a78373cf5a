"""What attacks cost authorised traffic (issue 53): authorised HTTPS /predict alone, then beside every attack of the
attack suite at full rate, then alone again, on the real service with API keys and TLS on; the throughput kept, the
front end's memory and CPU, nothing lost.

    python -m bench.soak.attacks --priority --out bench/results/cpu   # ~2.5 min on a 2-core host: attacks_cpu.md, .json

The service: one front end and one engine (the unit an attacker reaches: a connection lands on one front end),
`--mode` on `--device`, API keys, TLS on HTTP and gRPC, the per-client limit `--per-client`, header and body
timeouts of 2 s (stalled clients are cut and come back within a phase, the harshest setting the suite uses).
Authorised load: `--connections` keep-alive HTTPS connections, closed loop, single-row POST /predict with the key, in
one client process on uvloop. Attackers, each a process of its own on its own loopback address (127.0.0.2...),
each flat out for the attack phase:

- headers: TLS connections sending 64 KiB header values until the 431, 16 at once;
- uploads: TLS POST /predict without a key announcing 10 GB and pushing 64 KiB pieces until the 401's close, 16 at
  once;
- handshakes: `--per-client` connections that send 3 bytes of a ClientHello and stall, each reopened when the server
  drops it (at the header timeout);
- idle: `--per-client` TLS connections that finish their handshake and send nothing, reopened when dropped (408);
- grpc: unauthenticated 2 MB ModelInfer calls over TLS, 64 in flight.

`--connect-rate` (and `--connect-burst`) bound new connections per client address a second
(FUSEDSERVE_PER_CLIENT_CONNECT_RATE): the attackers then go on flat out, most of their connections refused at the
accept; their rates count every attempt, refused or not.

On a machine of 2+ cores the server is pinned to core 0 (`--server-cores N`: cores 0 to N-1, one a process on a host
that has them, as a deployment would give its front ends and engine) and every client to the other cores
(`--no-pin` shares them):
the attackers and the authorised client share cores, not the server's, as clients elsewhere would; the attackers run
at nice 10 so that the authorised client gets its CPU first and they take the rest. On a host shared with other work
`--priority` (root) gives the server's session and the authorised client's a scheduling-group nice of -10, and each
attacker a session of its own at nice 0 (Linux's autogroups share the CPU between sessions, whatever a process's
nice), so that other work sways the numbers less. Each phase is `--seconds` long; the phases alternate quiet and
attacked `--rounds` times, and the throughput kept is the median over the attacked phases of each one's throughput
over the mean of the quiet phases either side (issue 53's target: at least 80%; the median over median is reported
too). Every authorised request must be answered 200 (anything else, or a connection lost, is counted
and fails the run); the front end must not restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..local_server import children, free_port

REPO = Path(__file__).resolve().parents[2]
MB = 1_000_000
KEY = "bench-attacks-key-" + os.urandom(6).hex()
ATTACKS = ("headers", "uploads", "handshakes", "idle", "grpc")
HEADER_TIMEOUT_S = 2.0
PREDICT = b'{"inputs":[[' + b",".join(b"0.5" for _ in range(64)) + b"]]}"
INFER = "/inference.GRPCInferenceService/ModelInfer"


# ------------------------------------------------------------------ certificates, server, /proc


def make_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files): the server's and the clients' trust root."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_path, key_path


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cores_busy() -> list[tuple[float, float]]:
    """(busy, total) jiffies of each core, from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + v[4]
            out.append((sum(v) - idle, sum(v)))
    return out


def prioritise(pid: int) -> None:
    """Nice -10 for the session of `pid` (its own): with autogroup scheduling (Linux's default on a desktop or a
    shared host) a process's nice counts only within its session's group, and every group shares the CPU equally."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():
        autogroup.write_text("-10")
    os.setpriority(os.PRIO_PROCESS, pid, -10)


def tls_context(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


def start_server(args, workdir: Path, cert: Path, key: Path, pin: bool) -> tuple[subprocess.Popen, int, int]:
    port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDSERVE_")}
    env |= {"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
    env |= {f"FUSEDSERVE_{k.upper()}": str(v) for k, v in {
        "host": "127.0.0.1", "port": port, "grpc_port": grpc_port, "workers": 1, "mode": args.mode,
        "device": args.device, "dtype": "float32", "api_key": KEY, "tls_cert": cert, "tls_key": key,
        "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": HEADER_TIMEOUT_S,
        "max_connections_per_client": args.per_client, "drain_delay_s": 0, "max_batch_size": 64,
        "grpc_workers": args.grpc_workers,
    }.items()}  # fmt: skip
    if args.connect_rate is not None:
        env["FUSEDSERVE_PER_CLIENT_CONNECT_RATE"] = str(args.connect_rate)
        env["FUSEDSERVE_PER_CLIENT_CONNECT_BURST"] = str(args.connect_burst)
    argv = [sys.executable, "-m", "service.cli", "serve"]
    if pin:
        argv = ["taskset", "-c", f"0-{args.server_cores - 1}", *argv]
    log = (workdir / "server.log").open("wb")
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if args.priority:
        prioritise(proc.pid)
    ctx = tls_context(cert)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = (workdir / "server.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{tail}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), 2) as s,
            ctx.wrap_socket(s, server_hostname="127.0.0.1") as t,
        ):
            t.sendall(b"GET /health/ready HTTP/1.1\r\nhost: b\r\nconnection: close\r\n\r\n")
            if t.recv(64).startswith(b"HTTP/1.1 200"):
                return proc, port, grpc_port
        time.sleep(0.3)
    raise TimeoutError("the server was not ready in 300 s")


# ------------------------------------------------------------------ the authorised client


async def _read_answer(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    i = lower.find(b"content-length:")
    length = int(head[i + 15 : head.index(b"\r\n", i)]) if i >= 0 else 0
    await reader.readexactly(length)
    return status


async def _authorised(port: int, cafile: Path, connections: int, seconds: float) -> dict:
    ctx = tls_context(cafile)
    request = (b"POST /predict HTTP/1.1\r\nhost: b\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (KEY.encode(), len(PREDICT), PREDICT))  # fmt: skip
    out: dict[str, int] = {}
    latencies: list[float] = []
    conns = [await asyncio.open_connection("127.0.0.1", port, ssl=ctx) for _ in range(connections)]
    start = time.monotonic()
    end = start + seconds

    async def loop(reader, writer) -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                writer.write(request)
                status = str(await _read_answer(reader))
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                status = type(e).__name__  # a lost request: the connection broke before its answer
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            out[status] = out.get(status, 0) + 1
            latencies.append(time.perf_counter() - t0)

    cpu0 = time.process_time()
    await asyncio.gather(*(loop(r, w) for r, w in conns))
    took = time.monotonic() - start
    cpu = time.process_time() - cpu0
    for _, w in conns:
        w.close()
    latencies.sort()
    n = len(latencies)
    return {
        "answers": out, "requests": n, "seconds": took, "rps": n / took, "client_cpu": cpu / took,
        "p50_ms": 1e3 * latencies[n // 2] if n else None, "p99_ms": 1e3 * latencies[int(n * 0.99)] if n else None,
    }  # fmt: skip


def authorised_main(port, cafile, connections, seconds, cpus, priority, queue) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    if priority:
        os.setsid()
        prioritise(os.getpid())
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    queue.put(asyncio.run(_authorised(port, cafile, connections, seconds)))


# ------------------------------------------------------------------ attackers


def _connect(port: int, source: str, ctx: ssl.SSLContext | None):
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    return ctx.wrap_socket(sock, server_hostname="127.0.0.1") if ctx is not None else sock


async def _headers(port, source, ctx, stop, counts) -> None:
    value = b"x-pad: " + b"a" * (64 * 1024 - 9) + b"\r\n"

    async def one() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, local_addr=(source, 0))
                w.write(b"GET /model HTTP/1.1\r\nhost: t\r\n")
                for _ in range(32):  # 2 MB offered; the 431 comes at 32 KiB
                    w.write(value)
                    await w.drain()
                    if r.at_eof():
                        break
                await asyncio.wait_for(r.read(), 5)
                w.close()
            counts["headers"] += 1

    await asyncio.gather(*(one() for _ in range(16)))


async def _uploads(port, source, ctx, stop, counts) -> None:
    piece = b"1" * 65536

    async def one() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, local_addr=(source, 0))
                w.write(b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000000\r\n\r\n")
                for _ in range(160):  # up to 10 MB, until the server's close stops the pushing
                    w.write(piece)
                    await asyncio.wait_for(w.drain(), 2)
                w.close()
            counts["uploads"] += 1

    await asyncio.gather(*(one() for _ in range(16)))


async def _hold(port, source, ctx, stop, counts, name, n) -> None:
    """`n` connections that stall (3 bytes of a ClientHello; or, with `ctx`, a finished handshake and nothing), each
    reopened once the server drops it."""

    async def one() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, local_addr=(source, 0))
                if ctx is None:
                    w.write(b"\x16\x03\x01")
                counts[name] += 1
                await asyncio.wait_for(r.read(), HEADER_TIMEOUT_S + 5)  # the server's close
                w.close()
            await asyncio.sleep(0.05)  # refused past the per-client limit: do not spin

    await asyncio.gather(*(one() for _ in range(n)))


async def _grpc(port, cafile: Path, stop, counts) -> None:
    import grpc

    creds = grpc.ssl_channel_credentials(root_certificates=cafile.read_bytes())
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    payload = b"\x01" * (2 * MB)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=options) as channel:
        call = channel.unary_unary(INFER)

        async def one() -> None:
            while not stop.is_set():
                try:
                    await call(payload, timeout=30)
                    counts["grpc OK (must not happen)"] = counts.get("grpc OK (must not happen)", 0) + 1
                except grpc.aio.AioRpcError as e:
                    counts["grpc"] += e.code() == grpc.StatusCode.UNAUTHENTICATED

        await asyncio.gather(*(one() for _ in range(64)))


def attacker_main(name, port, grpc_port, cafile, source, per_client, cpus, priority, stop, queue) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    if priority:
        os.setsid()  # a scheduling group of its own (prioritise): as much CPU as any other work on the host
    else:
        os.nice(10)
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "socket.send() raised exception": the point
    ctx = tls_context(cafile)
    ctx.check_hostname = False
    counts = {name: 0}

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda *_: None)  # resets are the point
        waiter = asyncio.ensure_future(asyncio.to_thread(stop.wait))
        attack = {
            "headers": lambda: _headers(port, source, ctx, stop, counts),
            "uploads": lambda: _uploads(port, source, ctx, stop, counts),
            "handshakes": lambda: _hold(port, source, None, stop, counts, name, per_client),
            "idle": lambda: _hold(port, source, ctx, stop, counts, name, per_client),
            "grpc": lambda: _grpc(grpc_port, cafile, stop, counts),
        }[name]()
        task = asyncio.ensure_future(attack)
        await waiter
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 3)

    asyncio.run(run())
    queue.put(counts)


# ------------------------------------------------------------------ the run


def phase(args, port, grpc_port, cafile, server, frontends, attacks: tuple[str, ...], pin: bool) -> dict:
    """One phase of `args.seconds`: authorised load, with `attacks` started a second before it and stopped after."""
    ctx = mp.get_context("fork")
    queue, stop = ctx.Queue(), ctx.Event()
    clients = set(range(args.server_cores, os.cpu_count() or 1)) if pin else None
    attackers = [
        ctx.Process(target=attacker_main, args=(a, port, grpc_port, cafile, f"127.0.0.{2 + i}", args.per_client,
                                                clients, args.priority, stop, queue), daemon=True)
        for i, a in enumerate(attacks)
    ]  # fmt: skip

    def fe_rss() -> int:  # the front ends together (a gRPC front end of its own included)
        return sum(rss(p) for p in frontends)

    def fe_cpu_s() -> float:
        return sum(cpu_s(p) for p in frontends)

    peak, rss0, cpu0, busy0 = fe_rss(), fe_rss(), fe_cpu_s(), cores_busy()
    server_pids = list(children(server).values())
    server_cpu0 = sum(cpu_s(p) for p in server_pids)
    for p in attackers:
        p.start()
    if attackers:
        time.sleep(1.0)  # the attacks at full rate before the window opens
    client = ctx.Process(
        target=authorised_main, args=(port, cafile, args.connections, args.seconds, clients, args.priority, queue)
    )
    client.start()
    t0 = time.monotonic()
    while client.is_alive():
        peak = max(peak, fe_rss())
        time.sleep(0.05)
    took = time.monotonic() - t0
    fe_cpu = (fe_cpu_s() - cpu0) / took
    server_cpu = (sum(cpu_s(p) for p in server_pids) - server_cpu0) / took
    busy = [(b1 - b0) / max(1, t1 - t0) for (b0, t0), (b1, t1) in zip(busy0, cores_busy(), strict=True)]
    out = queue.get(timeout=30)
    stop.set()
    counts: dict[str, int] = {}
    for p in attackers:
        p.join(15)
        if p.is_alive():
            p.kill()
    while not queue.empty():
        counts |= queue.get_nowait()
    time.sleep(0.5)
    return {**out, "attacks": {k: v / (args.seconds + 1.0) for k, v in counts.items()}, "rss_before": rss0,
            "rss_peak": peak, "rss_after": fe_rss(), "frontend_cpu": fe_cpu,
            "server_cpu": server_cpu, "cores_busy": busy}  # fmt: skip


def report(result: dict) -> str:
    r = result
    lines = [
        "# Authorised traffic under attack (issue 53)", "",
        f"`{r['command']}` at {r['commit']}, {r['date']}, on {r['machine']}.", "",
        ("One front end" if not r.get("grpc_workers") else
         f"One HTTP front end, {r['grpc_workers']} gRPC front end(s) of its own (GRPC_WORKERS)")
        + f" and one engine ({r['mode']} on {r['device']}), API keys and TLS on (HTTPS and gRPC), "
        f"{r['per_client']} connections per client address, "
        + (f"new connections per client address {r['connect_rate']:g} a second after a burst of {r['connect_burst']} "
           "(PER_CLIENT_CONNECT_RATE, _BURST), " if r.get("connect_rate") else "no bound on new connections a second, ")
        + f"header and body timeouts {HEADER_TIMEOUT_S:g} s. "
        f"{r['placement']} Authorised: {r['connections']} keep-alive HTTPS connections, closed loop, single-row "
        f"`POST /predict` with the key, {r['seconds']:g} s a phase. Attackers (bench/soak/attacks.py says what each "
        "sends), one process each on its own loopback address, flat out.", "",
        "| phase | authorised req/s | p50 ms | p99 ms | answers | CPU: front ends, server | front ends' RSS MB "
        "(before, peak, after) | attacks a second |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for p in r["phases"]:
        attacks = ", ".join(f"{k} {v:.0f}" for k, v in p["attacks"].items()) or "none"
        lines.append(
            f"| {p['name']} | {p['rps']:.0f} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} | "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(p['answers'].items()))} | "
            f"{100 * p['frontend_cpu']:.0f}%, {100 * p['server_cpu']:.0f}% | "
            f"{p['rss_before'] / MB:.0f}, {p['rss_peak'] / MB:.0f}, {p['rss_after'] / MB:.0f} | {attacks} |"
        )
    s = r["summary"]
    lines += [
        "",
        f"Throughput kept under attack: **{100 * s['kept_paired']:.1f}%**, the median of each attacked phase over the "
        f"quiet phases either side ({', '.join(f'{100 * x:.0f}%' for x in s['paired'])}; target 80%: "
        f"{'met' if s['kept_paired'] >= 0.8 else 'missed'}); {100 * s['kept']:.0f}% median over median (attacked "
        f"{s['attacked_rps']:.0f} req/s, quiet {s['quiet_rps']:.0f}). "
        f"The server's CPU (front end and engine) an authorised request takes when quiet: "
        f"{s['server_cpu_per_request_ms']:.2f} ms; the attacks took {100 * s['attacks_server_cpu']:.0f}% of a core "
        f"beside the attacked phases' requests (median), so that a server whose core is the limit keeps "
        f"{100 * (1 - s['attacks_server_cpu']):.0f}% of its capacity. "
        f"Authorised requests not answered 200: {s['lost']}. Front-end restarts: {s['restarts']}. The front ends' "
        f"peak growth over its first quiet phase: {s['rss_growth_mb']:.0f} MB; after the last phase "
        f"{s['rss_end_mb']:+.0f} MB.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak.attacks", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="directory for attacks_<host>.md and .json (none: print only)")
    p.add_argument("--name", default="cpu", help="the host's short name in the file names [cpu]")
    p.add_argument("--device", default="cpu", help="the server's device [cpu]")
    p.add_argument("--mode", default="unfused", help="the server's mode [unfused]")
    p.add_argument("--seconds", type=float, default=10.0, help="each phase [10]")
    p.add_argument("--rounds", type=int, default=3, help="quiet and attacked phase pairs [3], then one quiet")
    p.add_argument("--connections", type=int, default=8, help="authorised keep-alive connections [8]")
    p.add_argument("--per-client", type=int, default=64, help="MAX_CONNECTIONS_PER_CLIENT [64]")
    p.add_argument("--connect-rate", type=float, help="PER_CLIENT_CONNECT_RATE, new connections/s per address [unset]")
    p.add_argument("--connect-burst", type=int, default=10, help="PER_CLIENT_CONNECT_BURST, with --connect-rate [10]")
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"which, comma-separated [{','.join(ATTACKS)}]")
    p.add_argument(
        "--priority",
        action="store_true",
        help="server and authorised client at nice -10 (root): less sway from other work on a shared host",
    )
    p.add_argument(
        "--grpc-workers",
        type=int,
        default=0,
        help="GRPC_WORKERS: gRPC served by front ends of its own (0: by the HTTP front end) [0]",
    )
    p.add_argument("--shared", action="store_true", help="say in the report that the host is shared with other work")
    p.add_argument("--server-cores", type=int, default=1, help="cores the server is pinned to, 0 to N-1 [1]")
    p.add_argument("--no-pin", action="store_true", help="server and clients share every core")
    args = p.parse_args(argv)
    attacks = tuple(a for a in args.attacks.split(",") if a)
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        p.error(f"unknown attacks: {sorted(unknown)}")
    pin = not args.no_pin and (os.cpu_count() or 1) > args.server_cores and shutil.which("taskset") is not None
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-attacks-") as tmp:
        workdir = Path(tmp)
        cert, key = make_cert(workdir)
        proc, port, grpc_port = start_server(args, workdir, cert, key, pin)
        try:
            frontends = {n: p for n, p in children(proc.pid).items() if n.startswith("fs-frontend")}
            print(f"serving on port {port} (gRPC {grpc_port}); front ends {frontends}", flush=True)
            pids = tuple(frontends.values())
            phase(args, port, grpc_port, cert, proc.pid, pids, (), pin)  # warm-up: caches, the first TLS sessions
            phases = []
            for i in range(args.rounds):
                for name, which in (("quiet", ()), ("attacked", attacks)):
                    ph = phase(args, port, grpc_port, cert, proc.pid, pids, which, pin)
                    phases.append({"name": f"{name} {i + 1}", **ph})
                    print(f"{name} {i + 1}: {ph['rps']:.0f} req/s, answers {ph['answers']}, CPU: front end "
                          f"{100 * ph['frontend_cpu']:.0f}%, server {100 * ph['server_cpu']:.0f}%, client "
                          f"{100 * ph['client_cpu']:.0f}%, cores {[round(100 * b) for b in ph['cores_busy']]}%; "
                          f"RSS peak {ph['rss_peak'] / MB:.0f} MB; attacks/s {ph['attacks']}", flush=True)  # fmt: skip
            last = phase(args, port, grpc_port, cert, proc.pid, pids, (), pin)
            phases.append({"name": "quiet after", **last})
            restarts = (workdir / "server.log").read_text(errors="replace").count("starting it again")
            alive = proc.poll() is None and all(children(proc.pid).get(n) == p for n, p in frontends.items())
        finally:
            os.killpg(proc.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    quiet = [ph["rps"] for ph in phases if ph["name"].startswith("quiet")]
    attacked = [ph["rps"] for ph in phases if ph["name"].startswith("attacked")]
    lost = sum(n for ph in phases for k, n in ph["answers"].items() if k != "200")
    base = phases[0]["rss_before"]
    # The server's CPU an authorised request takes when quiet, and so what the attacks took of the server's CPU beside
    # the attacked phases' own requests: with the server's core the limit, 1 - that is the capacity they leave.
    per_request = statistics.median(ph["server_cpu"] / ph["rps"] for ph in phases if ph["name"].startswith("quiet"))
    taken = [ph["server_cpu"] - ph["rps"] * per_request for ph in phases if ph["name"].startswith("attacked")]
    # Each attacked phase against the quiet phases either side of it: the CPU's speed drifts between phases on a
    # shared host (quiet phases of one run 1,649-2,815 req/s on the 2-core CI machine), which the ratio of medians
    # over the whole run takes in, and a neighbour's drift mostly cancels.
    rps = [ph["rps"] for ph in phases]
    paired = [rps[i] / ((rps[i - 1] + rps[i + 1]) / 2) for i in range(1, len(rps) - 1, 2)]
    summary = {
        "quiet_rps": statistics.median(quiet), "attacked_rps": statistics.median(attacked),
        "kept_paired": statistics.median(paired), "paired": paired,
        "server_cpu_per_request_ms": 1e3 * per_request, "attacks_server_cpu": statistics.median(taken),
        "kept": statistics.median(attacked) / statistics.median(quiet), "lost": lost,
        "restarts": restarts + (0 if alive else 1), "rss_growth_mb": (max(ph["rss_peak"] for ph in phases) - base) / MB,
        "rss_end_mb": (phases[-1]["rss_after"] - base) / MB,
    }  # fmt: skip
    server_cores = "core 0" if args.server_cores == 1 else f"cores 0-{args.server_cores - 1}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    result = {
        "command": "python -m bench.soak.attacks " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit.stdout.strip() or "?", "date": datetime.date.today().isoformat(),
        "machine": (f"{platform.machine()}, {os.cpu_count()} cores, no GPU" if args.device == "cpu" else args.name)
        + (", shared with other work" if args.shared else ""),
        "placement": (f"The server pinned to {server_cores}, every client to the other cores (taskset)" if pin
                      else "Server and clients sharing every core")
        + ("; the server's and the authorised client's scheduling groups at nice -10, each attacker in its own."
           if args.priority else "; attackers at nice 10."),
        "mode": args.mode, "device": args.device, "per_client": args.per_client, "connections": args.connections,
        "grpc_workers": args.grpc_workers,
        "connect_rate": args.connect_rate, "connect_burst": args.connect_burst if args.connect_rate else None,
        "seconds": args.seconds, "attacks": attacks, "phases": phases, "summary": summary,
    }  # fmt: skip
    text = report(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"attacks_{args.name}.md").write_text(text)
        (args.out / f"attacks_{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if lost == 0 and summary["restarts"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
