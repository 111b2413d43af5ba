"""The router's /metrics (every tenant's traffic, the whole cluster's state) and /version are
served on a scrape port of their own (``--metrics-port``), not to the public HTTP port's
clients (issue 54): there /metrics answers only a scrape token's holder, or anyone when the
router checks no API keys, and /version asks for an API key like the API.

The real router in this process with its HTTP API and scrape port on loopback; no workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_in_process import RouterInProcess

import kvrelay

KEYS = ("key-a", "key-b")


def _get(port: int, path: str, token: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"http://127.0.0.1:{port}{path}", headers=headers, timeout=30)


def _is_metrics(r: httpx.Response) -> bool:
    return r.status_code == 200 and "kvrelay:" in r.text and \
        r.headers["content-type"].startswith("text/plain")


@pytest.fixture(scope="module")
def keyed(demo_model_dir: str) -> Iterator[RouterInProcess]:
    with RouterInProcess(demo_model_dir, api_keys=KEYS, http_port=0, metrics_port=0) as r:
        yield r
        assert not r.errors, [rec.getMessage() for rec in r.errors[:5]]


def test_with_api_keys_metrics_and_version_leave_the_public_port(keyed) -> None:
    public, scrape = keyed.router.http_port, keyed.router.metrics_port
    assert scrape and scrape != public
    for token in (None, "key-a"):  # an API key is no scrape token: tenants read no metrics
        r = _get(public, "/metrics", token)
        assert r.status_code == 404, r.text
        assert "metrics port" in r.json()["error"]["message"]
    assert _get(public, "/version").status_code == 401  # as the API: a key is needed
    assert _get(public, "/version", "key-b").json() == {"version": kvrelay.__version__}
    assert _get(public, "/health").status_code in (200, 503)  # probes need no key
    assert _is_metrics(_get(scrape, "/metrics"))
    assert _get(scrape, "/version").json() == {"version": kvrelay.__version__}
    assert _get(scrape, "/v1/models").status_code == 404  # nothing else there


def test_a_scrape_token_guards_metrics_wherever_they_are_served(demo_model_dir: str) -> None:
    with RouterInProcess(demo_model_dir, api_keys=KEYS, http_port=0, metrics_port=0,
                         metrics_token="scrape-secret") as r:
        public, scrape = r.router.http_port, r.router.metrics_port
        for port in (public, scrape):
            assert _get(port, "/metrics").status_code == 401
            assert _get(port, "/metrics", "key-a").status_code == 401
            assert _is_metrics(_get(port, "/metrics", "scrape-secret"))


def test_without_api_keys_the_public_port_is_as_before(demo_model_dir: str) -> None:
    """A router that checks no keys (a development setup: its API is open too) still serves
    /metrics and /version on its HTTP port; no scrape port unless asked for."""
    with RouterInProcess(demo_model_dir, http_port=0) as r:
        assert r.router.metrics_port is None
        assert _is_metrics(_get(r.router.http_port, "/metrics"))
        assert _get(r.router.http_port, "/version").status_code == 200


def test_the_cli_reads_the_scrape_options(tmp_path: Path) -> None:
    from kvrelay.cli import build_parser, router_settings_from_args

    f = tmp_path / "token"
    f.write_text("from-file\n")

    def settings(*argv: str):
        return router_settings_from_args(build_parser().parse_args(["router", "--model", "m",
                                                                    *argv]))
    st = settings("--metrics-host", "0.0.0.0", "--metrics-port", "9100",
                  "--metrics-token-file", str(f))
    assert (st.metrics_host, st.metrics_port, st.metrics_token) == ("0.0.0.0", 9100,
                                                                    "from-file")
    assert settings().metrics_port is None and settings().metrics_token is None
    with pytest.raises(SystemExit):
        settings("--metrics-token", "other", "--metrics-token-file", str(f))
