"""The OTLP exporter behind TLS, as an operator configures it with the OTLP variables: a collector
whose certificate comes from a private CA (OTEL_EXPORTER_OTLP_CERTIFICATE), mutual TLS
(CLIENT_CERTIFICATE, CLIENT_KEY) and compression (COMPRESSION: gzip or deflate), against a real
https receiver with certificates made by openssl here. A server the configured CA did not sign, or
one that wants a client certificate the exporter does not have, gets nothing (the batches are
counted lost); a file that cannot be read or an unknown compression stops `kvdepot serve` at
start with the variable named."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest

from api.tracing.config import TracingSettings
from api.tracing.export import OtlpExporter
from api.tracing.otlp import OtlpEncoder
from app.errors import ConfigError
from app.tracing import build_tracing
from bench.otlp import OtlpReceiver
from bench.sidecar import start_sidecar

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
VARIABLES = ("CERTIFICATE", "CLIENT_CERTIFICATE", "CLIENT_KEY", "COMPRESSION", "HEADERS")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed(name: str, ca: str, cwd: Path, san: str | None = None) -> None:
    """`name`.key and `name`.pem, signed by the CA `ca` (.key/.pem)."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)  # fmt: skip
    extra: list[str] = []
    if san is not None:
        (cwd / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        extra = ["-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *extra, cwd=cwd)  # fmt: skip


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             cwd=cwd)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private CA, a collector's certificate for 127.0.0.1 and a client certificate from it, and a
    second CA that signed nothing here."""
    d = tmp_path_factory.mktemp("pki")
    _ca("ca", d)
    _ca("other-ca", d)
    _signed("collector", "ca", d, san="IP:127.0.0.1")
    _signed("sidecar", "ca", d)
    return d


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{name}", raising=False)
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_TRACES_{name}", raising=False)


def collector_tls(pki: Path, *, client_ca: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "collector.pem", pki / "collector.key")
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pki / "ca.pem")
    return context


def export(endpoint: str, spans: int) -> OtlpExporter:
    exporter = OtlpExporter(endpoint, OtlpEncoder({}, "", "kvdepot", None), timeout_s=5, queue=10_000,
                            batch=64, delay_s=60)  # fmt: skip
    try:
        for i in range(spans):
            exporter.add(("lookup", TRACE, i + 1, 0x1111, False, i, i + 1, (("kvdepot.chunks", i),), None))
        exporter.flush()
    finally:
        exporter.close()
    return exporter


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_mutual_tls_and_compression_deliver_every_span(
    pki: Path, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    receiver = OtlpReceiver(keep=1000, tls=collector_tls(pki, client_ca=True))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(pki / "ca.pem"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", str(pki / "sidecar.pem"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", str(pki / "sidecar.key"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", compression.upper())
    try:
        exporter = export(receiver.endpoint, 300)
    finally:
        figures = receiver.stop()
    assert receiver.endpoint.startswith("https://")
    assert exporter.exported == figures["spans"] == 300 and exporter.failed == 0 and figures["errors"] == 0
    assert receiver.compressed[compression] == figures["exports"] >= 300 // 64
    assert sorted(s.attributes["kvdepot.chunks"] for s in receiver.received()) == list(range(300))


@pytest.mark.parametrize("trusted", [None, "other-ca.pem"])
def test_a_collector_the_configured_ca_did_not_sign_gets_nothing(
    pki: Path, monkeypatch: pytest.MonkeyPatch, trusted: str | None
) -> None:
    """Without CERTIFICATE the system's CAs decide (they did not sign the collector); with another
    CA named, that CA decides: either way the handshake fails and the spans are counted lost."""
    receiver = OtlpReceiver(keep=10, tls=collector_tls(pki, client_ca=False))
    if trusted is not None:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(pki / trusted))
    try:
        exporter = export(receiver.endpoint, 10)
    finally:
        figures = receiver.stop()
    assert exporter.exported == 0 and exporter.failed == 1 and exporter.failed_spans == 10
    assert figures["spans"] == 0 and receiver.received() == []


def test_a_collector_that_wants_a_client_certificate_gets_nothing_without_one(
    pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = OtlpReceiver(keep=10, tls=collector_tls(pki, client_ca=True))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(pki / "ca.pem"))
    try:
        exporter = export(receiver.endpoint, 10)
    finally:
        figures = receiver.stop()
    assert exporter.exported == 0 and exporter.failed == 1 and figures["spans"] == 0


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", "OTEL_EXPORTER_OTLP_CERTIFICATE"),
        ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "/nonexistent/c.pem", "CLIENT_CERTIFICATE"),
        ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/nonexistent/c.key", "CLIENT_KEY is set without"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "br", "gzip, deflate or none"),
    ],
)
def test_an_unusable_variable_is_a_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=named):
        build_tracing(TracingSettings(otlp_endpoint="https://127.0.0.1:4318/v1/traces"), "test/1")


def test_a_sidecar_with_an_unreadable_ca_file_does_not_start(tmp_path: Path) -> None:
    env = {
        "KVDEPOT_TRACING__OTLP_ENDPOINT": "https://127.0.0.1:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path / "missing-ca.pem"),
        "KVDEPOT_L2__ADAPTERS": "[]",
    }
    sidecar = start_sidecar(tmp_path / "data", env=env, wait=False)
    try:
        code = sidecar.proc.wait(60)
    finally:
        sidecar.stop()
    assert code != 0
    named = [line for line in sidecar.lines if "OTEL_EXPORTER_OTLP_CERTIFICATE" in line]
    assert any("missing-ca.pem" in line for line in named), sidecar.lines[-10:]
