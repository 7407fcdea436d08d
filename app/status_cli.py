"""`kvdepot status`: a terminal summary of a running sidecar, read from its control plane.

    kvdepot status [--url URL] [--token T | --token-file F] [--top N] [--json]

What it shows: version, uptime and readiness (with the components that are not running); lookups
(chunks hit in L1, missed there, then loaded from L2, and the hit ratio of both); each tier (L1 and every L2
adapter: health, use, capacity, objects, loads found / missed, errors, the last error); the
write-behind queue (written, dropped, failed); and, with the admin token, the tenants holding the
most bytes (per tier bytes, hit ratio, quota refusals). `--json` prints the same summary as one
JSON object for scripts. The token comes from --token, --token-file, or the environment variable
KVDEPOT_HTTP__ADMIN_TOKEN (the sidecar's own setting name); it is sent only to --url.

State: none; one run reads GET /status and, with a token, GET /quotas (urllib, no event loop).
Exit status: 0, or 1 with one line on stderr when the sidecar cannot be read.

Primitives in call order: add_arguments(parser); run(args) -> exit status
  (fetch -> summarize -> render or JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TOKEN_ENV = "KVDEPOT_HTTP__ADMIN_TOKEN"


class Unreadable(Exception):
    """The sidecar did not answer, or answered something that is not its status."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="control plane (default %(default)s)")
    parser.add_argument("--token", help=f"admin token (default: ${TOKEN_ENV}); shows the tenants")
    parser.add_argument("--token-file", type=Path, help="file whose first line is the admin token")
    parser.add_argument("--top", type=count, default=5, help="tenants shown, most bytes first (default 5)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")


def count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def fetch(url: str, token: str | None, timeout: float) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError) as exc:
        raise Unreadable(f"cannot read {url}: {exc}") from exc


def ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def summarize(status: dict[str, Any], quotas: dict[str, Any] | None, top: int) -> dict[str, Any]:
    """The figures shown, from /status and (token holders) /quotas."""
    l1 = status["l1"]
    c = l1["counters"]
    hits, l2_hits = c.get("hit_chunks", 0), c.get("l2_hit_chunks", 0)
    tiers = [{
        "tier": "l1", "type": "memory", "health": "ok" if l1["allocator_ok"] else "down",
        "bytes": l1["used_bytes"], "capacity_bytes": l1["capacity_bytes"], "objects": l1["objects"],
        "hits": hits, "misses": None, "errors": 0, "last_error": l1["allocator_error"],
    }]  # fmt: skip
    l2 = status.get("l2") or {}
    for a in l2.get("adapters", []):
        s = a["stats"]
        tiers.append({
            "tier": a["name"], "type": a["type"], "health": a["health"]["state"],
            "bytes": a["usage"]["bytes_used"], "capacity_bytes": a["usage"]["capacity_bytes"] or None,
            "objects": a["usage"]["objects"], "hits": s["loads"], "misses": s["misses"],
            "errors": s["errors"], "last_error": a["health"]["last_error"],
        })  # fmt: skip
    summary: dict[str, Any] = {
        "version": status["version"],
        "uptime_s": status["uptime_s"],
        "ready": status["ready"],
        "not_running": {k: v for k, v in status["components"].items() if v != "running"},
        "lookups": c.get("lookups", 0),
        "hit_chunks": hits,
        "miss_chunks": c.get("miss_chunks", 0),
        # Misses are L1's at lookup time; the chunks an L2 prefetch then brought count as hits.
        "hit_ratio": ratio(hits + l2_hits, hits + c.get("miss_chunks", 0)),
        "hits_from_l2": l2_hits,
        "tiers": tiers,
        "write_behind": None,
        "tenants": None,
    }
    if "store" in l2:
        st = l2["store"]
        summary["write_behind"] = {
            "queued": l2["policy"]["store_queue_depth"], "submitted": st["submitted"],
            "written": st["written"], "dropped": st["dropped"], "failed": st["failed"],
            "quota_refused": st["quota_refused"],
        }  # fmt: skip
    if quotas is not None:
        summary["tenants"] = sorted(
            (tenant_summary(t) for t in quotas["tenants"]), key=lambda t: (-t["bytes"], t["tenant"])
        )[:top]
    return summary


def tenant_summary(t: dict[str, Any]) -> dict[str, Any]:
    tiers = t["tiers"]
    hits = sum(f["hits"] for f in tiers.values())
    misses = sum(f["misses"] for f in tiers.values())
    return {
        "tenant": t["tenant"],
        "bytes": sum(f["bytes"] for f in tiers.values()),
        "bytes_by_tier": {name: f["bytes"] for name, f in tiers.items()},
        "hit_ratio": ratio(hits, hits + misses),
        "quota_refusals": sum(f["quota_refusals"] for f in tiers.values()),
    }


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def percent(r: float | None) -> str:
    return "-" if r is None else f"{100 * r:.1f} %"


def render(summary: dict[str, Any], url: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    state = "[green]ready[/]" if summary["ready"] else "[red]NOT READY[/]"
    console.print(f"[bold]kvdepot {summary['version']}[/] at {url}: {state}, up {summary['uptime_s']:.0f} s")
    for component, why in summary["not_running"].items():
        console.print(f"  [red]{component}: {why}[/]")
    console.print(
        f"lookups {summary['lookups']}: {summary['hit_chunks']} chunks hit in L1, "
        f"{summary['miss_chunks']} missed there, of which {summary['hits_from_l2']} were loaded from L2 "
        f"(hit ratio {percent(summary['hit_ratio'])})"
    )
    tiers = Table(title="Tiers", title_justify="left")
    for column in ("tier", "type", "health", "used", "capacity", "objects", "hits", "L2 found", "errors",
                   "last error"):  # fmt: skip
        numeric = column in ("used", "capacity", "objects", "hits")
        tiers.add_column(column, justify="right" if numeric else "left")
    colors = {"ok": "green", "degraded": "yellow", "down": "red"}
    for t in summary["tiers"]:
        found = "-" if t["misses"] is None else percent(ratio(t["hits"], t["hits"] + t["misses"]))
        tiers.add_row(
            t["tier"], t["type"], f"[{colors.get(t['health'], 'white')}]{t['health']}[/]", size(t["bytes"]),
            size(t["capacity_bytes"]), str(t["objects"]), str(t["hits"]), found, str(t["errors"]),
            (t["last_error"] or "")[:60],
        )  # fmt: skip
    console.print(tiers)
    wb = summary["write_behind"]
    if wb is not None:
        console.print(
            f"write-behind: {wb['queued']} queued, {wb['written']} written, {wb['dropped']} dropped, "
            f"{wb['failed']} failed, {wb['quota_refused']} refused by quotas (of {wb['submitted']})"
        )
    if summary["tenants"] is None:
        console.print("tenants: shown with the admin token (--token, --token-file or $" + TOKEN_ENV + ")")
        return
    tenants = Table(title="Top tenants (most bytes)", title_justify="left")
    for column in ("tenant", "bytes", "by tier", "hit ratio", "quota refusals"):
        tenants.add_column(column)
    for t in summary["tenants"]:
        by_tier = ", ".join(f"{tier} {size(n)}" for tier, n in t["bytes_by_tier"].items() if n)
        tenants.add_row(
            t["tenant"], size(t["bytes"]), by_tier, percent(t["hit_ratio"]), str(t["quota_refusals"])
        )
    console.print(tenants)


def run(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    try:
        token = args.token
        if token is None and args.token_file is not None:
            try:
                token = (args.token_file.read_text().splitlines() or [""])[0].strip() or None
            except (OSError, UnicodeDecodeError) as exc:
                raise Unreadable(f"cannot read the token file {args.token_file}: {exc}") from None
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        code, status = fetch(base + "/status", token, args.timeout)
        if code != 200 or not isinstance(status, dict) or "l1" not in status:
            raise Unreadable(f"{base}/status answered {code}, not a kvdepot status")
        quotas = None
        if token:
            code, quotas = fetch(base + "/quotas", token, args.timeout)
            if code != 200:
                raise Unreadable(f"{base}/quotas answered {code}: is the admin token right?")
    except Unreadable as exc:
        print(f"kvdepot status: {exc}", file=sys.stderr)
        return 1
    summary = summarize(status, quotas, args.top)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        render(summary, base)
    return 0
