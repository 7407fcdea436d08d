"""`kvdepot bench server`: data-plane store / retrieve / lookup against memcpy, one JSON object.

A sidecar is started (L1 only; or `--url` used) and `--clients` client processes
(bench/server_worker.py) each store `--requests` requests of their own, LOOKUP each right after
its STORE (all chunks must hit), retrieve them into preallocated, touched memory, and verify every
byte. The baseline is memcpy: each client memmoves the same request's bytes right before each
step, every client at once, so both sides of a ratio see the same load: before a retrieve into the
memory it fills, before a store into memory as cold as the arena extents a store writes (three
request-sized buffers in turn). The stores run twice: the first fill (each store claims segments
for its writer, mapped read-write as they come: `first_fill_store_vs_memcpy`), then, the chunks
cleared, into the writer's segments, as an engine's stores run for the rest of its life (every
other store figure); with `--url` once (first_fill null). With N clients the figure is the
aggregate: all clients' bytes over the span from the first client's start to the last one's end.

Chunk sizes: `--chunk-mib M ...` makes a chunk M MiB by the number of layers, the rest of the
layout fixed (`--kv-heads` 8, `--head-dim` 128, `--dtype` float16, `--chunk-tokens` 256: 1 MiB
per layer), and sizes each request to `--request-mib` (64 MiB: 64 chunks of 1 MiB, 1 of 64 MiB);
without it the layout is `--layers` etc. and requests have `--chunks-per-request` chunks. Each
chunk size gets its own sidecar; each client count in `--clients 1 2 4` its own client processes.

Lookups: `lookup_p50_ms`/`lookup_p99_ms` time LOOKUPs of one request (its token list encoded by
the client each time, server-side hashing included), in the first client of the first run.
`--prompt-tokens T` times LOOKUPs of a T-token prompt whose chunks are all in L1, sent as the
connector sends it (its wire bytes, encoded once per request: `encode_ms`), and the server's
chained blake3 of the same tokens alone (`hash_p50_ms`, `hash_ns_per_token`).

JSON: the first run's figures under the keys this benchmark always had, every run under `runs` (with
`store_vs_memcpy_p50` and `retrieve_vs_memcpy_p50`, the median over requests of each request's own
ratio, which a burst of outside load during one request does not move, and the PING round trip of
client 0 right before the run: the overhead every call pays, back to back (`ping_p50_ms`) and each
right after a memmove of one request's bytes (`ping_after_copy_p50_ms`); `phases_ms`, the median
per client and request of each step and of its parts: `memcpy`, `store` = `reserve` (the STORE
round trip) + `copy_in` (a memmove per chunk into its slot) + `commit` (`--commit post`, the
default: sending the COMMIT, its answer read by the LOOKUP that follows; `wait`: its round trip),
`retrieve` = `extents` (`--retrieve locate`, the default: views made from the extents the
untimed LOOKUP before it named, as a vLLM worker copies from its scheduler's lookup; `ask`: the
RETRIEVE round trip) + `copy_out` + `release`:
where the time beyond the copy goes; and, with a sidecar this benchmark started, `sidecar_ms`: the
mean time the sidecar itself spent handling one STORE, COMMIT, LOOKUP, RETRIEVE and RELEASE during
the run, from its /metrics: the rest of a round trip is the transport and the client), the prompt
under `prompt`,
`/proc/loadavg` before and after, and `sidecar_cpu_s`: the CPU seconds each started sidecar used
from ready to exit (less moved by other load on the machine than any time). `--tracing`: the sidecar
exports its spans over OTLP/HTTP to a receiver in this process (bench/otlp.py), which reports
the exports and spans it received under `tracing`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench.server_args import (  # noqa: F401 (add_arguments: the CLI finds it here)
    DTYPE_BYTES,
    LEAD_S,
    PINGS,
    PINGS_AFTER_COPY,
    SIDECAR_OPS,
    WORKER_ARGS,
    add_arguments,
)
from bench.sidecar import SidecarProcess, ops_delta, start_sidecar


@dataclass(frozen=True)
class Shape:
    """The layout and request sizes of one chunk size."""

    chunk_mib: float
    layers: int
    chunks_per_request: int

    def chunk_bytes(self, args: argparse.Namespace) -> int:
        per_layer: int = 2 * args.kv_heads * args.head_dim * args.chunk_tokens * DTYPE_BYTES[args.dtype]
        return self.layers * per_layer


def shapes(args: argparse.Namespace) -> list[Shape]:
    """The chunk sizes to run; ValueError for a size the fixed layout cannot make."""
    per_layer = 2 * args.kv_heads * args.head_dim * args.chunk_tokens * DTYPE_BYTES[args.dtype]
    if not args.chunk_mib:
        return [Shape(args.layers * per_layer / (1 << 20), args.layers, args.chunks_per_request)]
    out = []
    for mib in args.chunk_mib:
        if mib <= 0 or (mib << 20) % per_layer:
            raise ValueError(f"--chunk-mib {mib}: not a whole number of {per_layer}-byte layers")
        out.append(Shape(mib, (mib << 20) // per_layer, max(1, args.request_mib // mib)))
    return out


class Clients:
    """N worker processes, driven step by step over their stdin/stdout."""

    def __init__(self, args: argparse.Namespace, shape: Shape, url: str, n: int, tmp: Path) -> None:
        self._procs: list[subprocess.Popen[str]] = []
        self._errs: list[IO[str]] = []
        values = {**vars(args), "layers": shape.layers, "chunks_per_request": shape.chunks_per_request}
        for i in range(n):
            cmd = [sys.executable, "-m", "app.cli", "bench", "server", "--worker", "--client", str(i),
                   "--url", url]  # fmt: skip
            for name in WORKER_ARGS:
                cmd += [f"--{name.replace('_', '-')}", str(values[name])]
            err = (tmp / f"client-{i}.err").open("w+")
            self._errs.append(err)
            self._procs.append(subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1
            ))  # fmt: skip
        for i in range(n):
            self._read(i)  # {"ready": true}

    def _read(self, i: int) -> dict[str, Any]:
        proc = self._procs[i]
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            self._errs[i].seek(0)
            raise RuntimeError(f"bench client {i} failed:\n{self._errs[i].read()[-3000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, cmd: dict[str, Any], only: int | None = None) -> list[dict[str, Any]]:
        """Send `cmd` to every client (or to client `only`); their answers."""
        chosen = range(len(self._procs)) if only is None else [only]
        line = json.dumps(cmd) + "\n"
        for i in chosen:
            stdin = self._procs[i].stdin
            assert stdin is not None
            stdin.write(line)
            stdin.flush()
        return [self._read(i) for i in chosen]

    def timed(self, op: str, r: int, phases: dict[str, list[float]] | None = None) -> tuple[float, bool]:
        """Step `op` of request `r` in every client at once: (the span of all, every client ok).
        Each client's own time of the step and of its parts goes into `phases`."""
        answers = self.ask({"op": op, "r": r, "start": time.monotonic() + LEAD_S})
        span = max(a["end"] for a in answers) - min(a["begin"] for a in answers)
        if phases is not None:
            for a in answers:
                phases.setdefault(op, []).append(a["end"] - a["begin"])
                for name, seconds in a.get("phases", {}).items():
                    phases.setdefault(name, []).append(seconds)
        return span, all(a["ok"] for a in answers)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write('{"op": "exit"}\n')
                proc.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for err in self._errs:
            err.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _paired_median(baseline: list[float], measured: list[float]) -> float:
    """The median over requests of each request's memcpy time over its own store (or retrieve)
    time: what a burst of outside load during one request does not move."""
    return round(statistics.median(b / m for b, m in zip(baseline, measured, strict=True)), 3)


def _store_pass(
    clients: Clients, requests: int, spans: dict[str, list[float]], phases: dict[str, list[float]]
) -> bool:
    """Every request stored, each right after its memcpy, in all clients: whether all went well."""
    ok = True
    for r in range(requests):
        for op, key in (("memcpy_cold", "memcpy_store"), ("store", "store")):
            span, good = clients.timed(op, r, phases)
            spans[key].append(span)
            ok = ok and good
    return ok


def measure(
    clients: Clients, args: argparse.Namespace, shape: Shape, n: int, sidecar: SidecarProcess | None
) -> dict[str, Any]:
    """One run: every request stored, then retrieved, each step after its memcpy, in all clients."""
    ping = clients.ask({"op": "ping", "samples": PINGS, "after_copy": PINGS_AFTER_COPY}, only=0)[0]
    handled = sidecar.dataplane_ops() if sidecar is not None else {}
    spans: dict[str, list[float]] = {"memcpy_store": [], "store": [], "memcpy_retrieve": [], "retrieve": []}
    first: dict[str, list[float]] = {"memcpy_store": [], "store": []}
    phases: dict[str, list[float]] = {}
    # First fill; then, cleared (segments kept), the same stores. A sidecar not started here may
    # write behind to L2, holding cleared chunks a while: there the stores run once.
    ok = True
    if sidecar is not None:
        ok = _store_pass(clients, args.requests, first, {})
        ok = all(a["ok"] for a in clients.ask({"op": "clear"})) and ok
    ok = _store_pass(clients, args.requests, spans, phases) and ok
    for r in range(args.requests):
        ok = ok and all(a["ok"] for a in clients.ask({"op": "lock", "r": r}))
        for op, key in (("memcpy", "memcpy_retrieve"), ("retrieve", "retrieve")):
            span, good = clients.timed(op, r, phases)
            spans[key].append(span)
            ok = ok and good
    t = {key: sum(values) for key, values in spans.items()}
    sidecar_ms = {} if sidecar is None else ops_delta(handled, sidecar.dataplane_ops())
    verified = clients.ask({"op": "verify"})
    chunk_bytes = shape.chunk_bytes(args)
    total = n * args.requests * shape.chunks_per_request * chunk_bytes
    return {
        "chunk_mib": shape.chunk_mib, "chunk_bytes": chunk_bytes, "clients": n, "requests": args.requests,
        "chunks_per_request": shape.chunks_per_request,
        "store_gbps": _gbps(total, t["store"]), "retrieve_gbps": _gbps(total, t["retrieve"]),
        "memcpy_store_gbps": _gbps(total, t["memcpy_store"]),
        "memcpy_retrieve_gbps": _gbps(total, t["memcpy_retrieve"]),
        "memcpy_gbps": _gbps(2 * total, t["memcpy_store"] + t["memcpy_retrieve"]),
        "store_vs_memcpy": round(t["memcpy_store"] / t["store"], 3),
        "retrieve_vs_memcpy": round(t["memcpy_retrieve"] / t["retrieve"], 3),
        "store_vs_memcpy_p50": _paired_median(spans["memcpy_store"], spans["store"]),
        "first_fill_store_vs_memcpy": round(sum(first["memcpy_store"]) / sum(first["store"]), 3)
        if first["store"] else None,
        "retrieve_vs_memcpy_p50": _paired_median(spans["memcpy_retrieve"], spans["retrieve"]),
        "ping_p50_ms": ping["p50_ms"], "ping_p99_ms": ping["p99_ms"],
        "ping_after_copy_p50_ms": ping["after_copy_p50_ms"],
        "sidecar_ms": {op: v["mean_ms"] for op, v in sidecar_ms.items() if op in SIDECAR_OPS},
        "phases_ms": {name: round(statistics.median(v) * 1000, 3) for name, v in phases.items()},
        "bytes_verified": sum(a["bytes_verified"] for a in verified),
        "ok": ok and all(a["ok"] for a in verified),
    }  # fmt: skip


def _start_sidecar(
    args: argparse.Namespace, shape: Shape, tmp: Path, otlp_endpoint: str | None = None
) -> SidecarProcess:
    """A sidecar with an L1 big enough for every client's requests (and the prompt), and no L2."""
    request = shape.chunk_bytes(args) * shape.chunks_per_request
    need = request * args.requests * max(args.clients)
    prompt = (args.prompt_tokens or 0) * 2 * 64 * 2  # the prompt's layout: 256 bytes per token
    # One store may take at most l1.max_request_share (0.5) of the arena: room for twice the
    # largest single store (a request, or the prompt) whatever the request count.
    size_gb = max((need + prompt) * 1.25, 2.5 * max(request, prompt)) / (1 << 30) + 0.0625
    # L1 and the data plane only: write-behind to L2 would compete for the same cores.
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(args.chunk_tokens), "KVDEPOT_L2__ADAPTERS": "[]"}
    if args.kv_events_endpoint:
        env["KVDEPOT_KV_EVENTS__ENDPOINT"] = args.kv_events_endpoint
        env["KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP"] = "true"  # the bench's own reader, on loopback
    if otlp_endpoint:
        env["KVDEPOT_TRACING__OTLP_ENDPOINT"] = otlp_endpoint
    return start_sidecar(tmp, env=env, l1_size_gb=round(size_gb, 3))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (0 where /proc has none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where /proc has none)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def _run_shape(
    args: argparse.Namespace, shape: Shape, sidecar: SidecarProcess | None, tmp: Path, out: dict[str, Any]
) -> None:
    url = args.url if sidecar is None else sidecar.url
    for n in args.clients:
        clients = Clients(args, shape, url, n, tmp)
        try:
            out["runs"].append(measure(clients, args, shape, n, sidecar))
            if "lookups" not in out:
                out["lookups"] = clients.ask({"op": "lookups", "samples": args.lookups}, only=0)[0]
            if args.prompt_tokens and "prompt" not in out:
                cmd = {"op": "prompt", "tokens": args.prompt_tokens, "samples": args.prompt_samples}
                out["prompt"] = clients.ask(cmd, only=0)[0]
        finally:
            clients.close()


def _result(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    first, lookups = out["runs"][0], out["lookups"]
    result = {
        key: first[key]
        for key in ("store_gbps", "retrieve_gbps", "memcpy_gbps", "store_vs_memcpy", "retrieve_vs_memcpy")
    }
    result.update(
        lookup_p50_ms=lookups["p50_ms"], lookup_p99_ms=lookups["p99_ms"],
        lookup_chunks=first["chunks_per_request"], chunk_bytes=first["chunk_bytes"],
        chunks=args.requests * first["chunks_per_request"], requests=args.requests,
        ok=lookups["ok"] and all(r["ok"] for r in out["runs"]) and out.get("prompt", {}).get("ok", True),
        url="started" if args.url is None else args.url, commit=args.commit, retrieve=args.retrieve,
        runs=out["runs"],
    )  # fmt: skip
    if "prompt" in out:
        result["prompt"] = out["prompt"]
    return result


def run(args: argparse.Namespace) -> int:
    if args.worker:
        from bench import server_worker

        return server_worker.main(args)
    try:
        chosen = shapes(args)
    except ValueError as exc:
        print(f"kvdepot bench server: {exc}", file=sys.stderr)
        return 2
    if any(n < 1 for n in args.clients) or args.requests < 1:
        print("kvdepot bench server: --clients and --requests must be positive", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"runs": []}
    load_before = _loadavg()
    subscriber = None
    if args.kv_events_endpoint:
        from bench.event_reader import EventReader  # zmq in this process only when asked for

        subscriber = EventReader(args.kv_events_endpoint)
    receiver = None
    if args.tracing:
        from bench.otlp import OtlpReceiver

        receiver = OtlpReceiver()
    otlp = None if receiver is None else receiver.endpoint
    with tempfile.TemporaryDirectory(prefix="kvdepot-bench-") as tmp:
        for i, shape in enumerate(chosen):
            sidecar = None if args.url is not None else _start_sidecar(args, shape, Path(tmp) / f"s{i}", otlp)
            started_cpu = 0.0 if sidecar is None else _cpu_s(sidecar.proc.pid)
            try:
                _run_shape(args, shape, sidecar, Path(tmp), out)
            except RuntimeError as exc:
                print(str(exc), file=sys.stderr)
                return 1
            finally:
                if sidecar is not None:
                    before = _children_cpu_s()  # the clients were waited for already
                    sidecar.stop()
                    # the sidecar's CPU from ready to exit (its shutdown and last exports included)
                    used = _children_cpu_s() - before - started_cpu
                    out.setdefault("sidecar_cpu_s", []).append(round(used, 3))
    result = _result(args, out)
    result["loadavg"] = [load_before, _loadavg()]
    if "sidecar_cpu_s" in out:
        result["sidecar_cpu_s"] = out["sidecar_cpu_s"]
    if subscriber is not None:
        result["kv_events"] = {"endpoint": args.kv_events_endpoint, **subscriber.stop()}
    if receiver is not None:
        result["tracing"] = {"endpoint": otlp, **receiver.stop()}  # the sidecar flushed at its stop
    print(json.dumps(result))
    return 0 if result["ok"] else 1
