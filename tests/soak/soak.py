"""The randomized soak: writers and readers in their own processes against one real sidecar, under
chaos; the one figure that must stay 0 is `wrong_bytes` (bytes a reader was told were valid and
were not).

    python -m tests.soak.soak --minutes 10 [--writers 3] [--readers 3] [--hostile 1] [--seed 0]

The sidecar runs with short leases (`--lease-s`, reaped every 50 ms) and a small arena, so
extents are reclaimed and reused all the time. Chaos, every `--chaos-every-s`: a client is
SIGSTOPped past its lease and SIGCONTed later (a writer then goes on writing into its old slots; a
reader goes on copying out of its old extents), or SIGKILLed and replaced. Writers abort now and
then, readers drop their locks unread now and then; a hostile engine commits memory it never
wrote and tries to overwrite the chunks readers read through its mapping (tests/soak/client.py).

Prints one JSON object: ops, hits, bytes verified, wrong bytes and chunks reported valid, the
hostile engine's overwrites tried / refused / done, invalid releases, expired commits, client
errors by code, chaos counts, whether the sidecar is alive and its allocator consistent. Exit
status 1 on a wrong byte, an overwrite that got through or a dead sidecar.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.sidecar import SidecarProcess, start_sidecar

ROOT = Path(__file__).resolve().parents[2]
SUMMED = ["ops", "stored_chunks", "commits_expired", "aborted", "hit_chunks", "bytes_verified",
          "releases_invalid", "wrong_bytes", "wrong_chunks", "commits_unwritten", "overwrites_tried",
          "overwrites_refused", "overwrites_done"]  # fmt: skip


@dataclass
class Client:
    role: str
    proc: subprocess.Popen[bytes]
    stats_file: Path
    resume_at: float | None = None  # stopped until then


@dataclass
class Soak:
    sidecar: SidecarProcess
    workdir: Path
    until: float
    rng: random.Random
    env: dict[str, str]
    clients: list[Client] = field(default_factory=list)
    chaos: Counter[str] = field(default_factory=Counter)
    _spawned: int = 0

    def spawn(self, role: str) -> None:
        self._spawned += 1
        stats = self.workdir / f"{role}-{self._spawned}.json"
        cmd = [sys.executable, "-m", "tests.soak.client", role, self.sidecar.url, str(stats),
               str(self.rng.randrange(1 << 30)), str(self.until)]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL)
        self.clients.append(Client(role, proc, stats))

    def step(self, lease_s: float) -> None:
        """One round of chaos: continue those whose stop is over, then maybe stop or kill one."""
        now = time.monotonic()
        for c in self.clients:
            if c.resume_at is not None and now >= c.resume_at:
                c.proc.send_signal(signal.SIGCONT)
                c.resume_at = None
        running = [c for c in self.clients if c.proc.poll() is None and c.resume_at is None]
        if not running:
            return
        victim = self.rng.choice(running)
        roll = self.rng.random()
        if roll < 0.5:
            victim.proc.send_signal(signal.SIGSTOP)
            victim.resume_at = now + lease_s * self.rng.uniform(1.5, 4.0)
            self.chaos["sigstop_" + victim.role] += 1
        elif roll < 0.6:
            victim.proc.kill()
            victim.proc.wait()
            self.chaos["sigkill_" + victim.role] += 1
            self.spawn(victim.role)

    def finish(self) -> None:
        for c in self.clients:
            if c.resume_at is not None:
                c.proc.send_signal(signal.SIGCONT)
        for c in self.clients:
            try:
                c.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
                self.chaos["did_not_finish"] += 1

    def totals(self) -> dict[str, Any]:
        out: dict[str, Any] = dict.fromkeys(SUMMED, 0)
        errors: Counter[str] = Counter()
        examples: list[Any] = []
        for stats_file in sorted(self.workdir.glob("*.json")):
            stats = json.loads(stats_file.read_text())
            for key in SUMMED:
                out[key] += stats[key]
            errors.update(stats["errors"])
            examples += stats["wrong_examples"]
        out["client_errors"] = dict(errors)
        out["wrong_examples"] = examples[:10]
        return out


def _alive(sidecar: SidecarProcess) -> tuple[bool, bool | None]:
    if sidecar.proc.poll() is not None:
        return False, None
    try:
        status = sidecar.get_json("/status")
    except OSError:
        return False, None
    return True, bool(status["l1"]["allocator_ok"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "connector"), str(ROOT), env.get("PYTHONPATH", "")])
    sidecar_env = {
        "PYTHONPATH": env["PYTHONPATH"], "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]",
        "KVDEPOT_L1__WRITE_LEASE_S": str(args.lease_s), "KVDEPOT_L1__READ_LEASE_S": str(args.lease_s),
        "KVDEPOT_L1__REAP_INTERVAL_S": "0.05",
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvdepot-soak-") as tmp:
        workdir = Path(tmp) / "stats"
        workdir.mkdir()
        sidecar = start_sidecar(Path(tmp) / "sidecar", env=sidecar_env, l1_size_gb=args.l1_gb)
        start = time.monotonic()
        soak = Soak(sidecar, workdir, time.time() + args.minutes * 60, rng, env)
        try:
            for role, n in (("writer", args.writers), ("reader", args.readers), ("hostile", args.hostile)):
                for _ in range(n):
                    soak.spawn(role)
            while time.time() < soak.until and sidecar.proc.poll() is None:
                left = soak.until - time.time()
                if args.chaos_every_s <= 0:
                    time.sleep(max(0.0, min(left, 1.0)))
                    continue
                pause = args.chaos_every_s * rng.uniform(0.5, 1.5)  # the pace of chaos, not a wait
                time.sleep(max(0.0, min(pause, left)))
                soak.step(args.lease_s)
        finally:
            soak.finish()
            alive, allocator_ok = _alive(sidecar)
            sidecar.stop()
        result = soak.totals()
    result.update(
        seconds=round(time.monotonic() - start, 1),
        chaos=dict(soak.chaos),
        sidecar_alive=alive,
        allocator_ok=allocator_ok,
        seed=args.seed,
    )
    result["ok"] = alive and result["wrong_bytes"] == 0 and result["overwrites_done"] == 0
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.soak.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--readers", type=int, default=3)
    ap.add_argument("--hostile", type=int, default=1, help="hostile engines (tests/soak/client.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lease-s", type=float, default=0.5, help="write and read lease of the sidecar")
    ap.add_argument("--chaos-every-s", type=float, default=0.5, help="0: no chaos (a control run)")
    ap.add_argument("--l1-gb", type=float, default=1 / 32, help="arena size (small: extents are reused)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
