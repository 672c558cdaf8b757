"""deploy/grafana/atp-router.json (issue 11 item 3): a Grafana dashboard over the
router's Prometheus metrics.

* its shape: valid JSON Grafana imports (ids, grid, datasource and instance
  variables, one refId per query);
* every metric it queries is in a real router's ``/v1/metrics`` output, with
  the sample suffix its type has (``_total``, ``_bucket``), and every label it
  groups or filters by is one of that metric's;
* every query runs on a real Prometheus (Debian's, ``scripts/peers/prometheus.sh``)
  scraping a real ``atp-router`` process through deploy/grafana/prometheus.yml,
  and the main panels have data after a few tasks. Without Prometheus that test
  skips (fails under ``ATP_REQUIRE_PEERS=1``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from atp_router.observability.metrics import RouterMetrics
from tests.conftest import MECHANICS_RIB, ROOT
from tests.helpers import golden, router_process
from tests.peers import free_port, serve_http_peer

DASHBOARD = ROOT / "deploy" / "grafana" / "atp-router.json"
SCRAPE_CONFIG = ROOT / "deploy" / "grafana" / "prometheus.yml"
#: The sample names each metric type exposes (prometheus_client, text format 0.0.4).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
#: Labels Prometheus adds (the scrape target) or a histogram has.
IMPLICIT_LABELS = {"instance", "job", "le"}
#: Panels that must show data once a few code reviews ran.
MUST_HAVE_DATA = ("Open streams", "Tasks / s", "RIB generation", "Streams opened / s by QoS",
                  "Streams closed / s by outcome", "Frames / s", "Stream latency (SYN → FINAL)",
                  "Next-hop latency p95 by agent", "Calls / s by agent and outcome", "Tokens / s by next-hop",
                  "Consensus agreement", "P95 stream latency")


def _queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def _as_prometheus_runs_it(expr: str) -> str:
    """The query Grafana sends: its variables filled in."""
    return (expr.replace("$__rate_interval", "30s").replace("$__range", "5m")
            .replace('"$instance"', '".*"'))


def test_dashboard_is_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "atp-router" and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
    assert len(_queries()) >= 25


async def test_every_metric_and_label_it_queries_is_the_routers(router_env) -> None:
    async with httpx.AsyncClient(base_url=router_env.url) as h:
        text = (await h.get("/v1/metrics")).text
    exposed = {f.name + s for f in text_string_to_metric_families(text) if f.type in SUFFIXES
               for s in SUFFIXES[f.type]}
    labels: dict[str, set[str]] = {}
    for m in vars(RouterMetrics()).values():
        if hasattr(m, "_labelnames"):
            for s in SUFFIXES[m._type]:
                labels[m._name + s] = set(m._labelnames)
    used_metrics: set[str] = set()
    for title, expr in _queries():
        names = set(re.findall(r"\batp_[a-z_]+\b", expr))
        assert names, title
        assert names <= exposed, f"{title!r} queries {sorted(names - exposed)}: not in the router's /v1/metrics"
        used_metrics |= names
        used = set(re.findall(r"\bby \(([^)]*)\)", expr))
        grouped = {x.strip() for group in used for x in group.split(",")}
        matched = set(re.findall(r"[{,]\s*([a-z_]+)\s*[=!]~?", expr))
        known = set().union(*(labels[n] for n in names)) | IMPLICIT_LABELS
        assert grouped | matched <= known, f"{title!r} uses labels {sorted((grouped | matched) - known)}"
    # Every metric family of the router is on the dashboard.
    families = {m._name for m in vars(RouterMetrics()).values() if hasattr(m, "_labelnames")}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used_metrics}
    assert families - shown <= {"atp_retained_streams", "atp_retained_bytes"} | {
        f for f in families if f.startswith("atp_cache_")}, sorted(families - shown)


@pytest.fixture
def prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("ATP_REQUIRE_PEERS") == "1":
            pytest.fail("ATP_REQUIRE_PEERS=1 but prometheus is not installed (scripts/peers/prometheus.sh)",
                        pytrace=False)
        pytest.skip("prometheus unavailable (run scripts/peers/prometheus.sh)")
    return found


@pytest.mark.peers
@pytest.mark.slow
def test_every_query_runs_on_prometheus_scraping_a_router(prometheus: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    token = "tok-prometheus-scrape"
    monkeypatch.setenv("ATP_ROUTER_TOKENS", f"prometheus:{token}:operator,acme:tok-acme")
    policies = tmp_path / "policies"
    shutil.copytree(MECHANICS_RIB, policies)
    with router_process(policies, tmp_path / "state") as url:
        config = yaml.safe_load(SCRAPE_CONFIG.read_text())
        job = config["scrape_configs"][0]
        (tmp_path / "token").write_text(token)
        job["authorization"]["credentials_file"] = str(tmp_path / "token")
        job["static_configs"] = [{"targets": [url.removeprefix("http://")]}]
        config["global"]["scrape_interval"] = "1s"
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        argv = [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
        with serve_http_peer(argv, name="prometheus", base=f"http://127.0.0.1:{port}", ready_path="/-/ready",
                             timeout_s=60) as prom, \
                httpx.Client(base_url=url, timeout=60, headers={"Authorization": "Bearer tok-acme"}) as client, \
                httpx.Client(base_url=prom, timeout=30) as q:

            def query(expr: str) -> list:
                r = q.get("/api/v1/query", params={"query": expr})
                body = r.json()
                assert r.status_code == 200 and body["status"] == "success", (expr, body)
                return body["data"]["result"]

            # Tasks spread over a few scrapes, so rates have two samples apart.
            for _ in range(6):
                r = client.post("/v1/streams", json={"task": {"task_type": "code_review"}, "content": golden()})
                assert r.status_code == 201, r.text
                time.sleep(0.7)
            deadline = time.monotonic() + 30
            while not query('count_over_time(atp_rib_version[1m]) >= 8'):
                assert time.monotonic() < deadline, query('up')
                time.sleep(0.5)
            [up] = query("up")
            assert up["value"][1] == "1", up  # the scrape authenticated with the operator token

            empty = []
            for title, expr in _queries():
                if not query(_as_prometheus_runs_it(expr)):
                    empty.append(title)
            assert not set(MUST_HAVE_DATA) & set(empty), sorted(set(MUST_HAVE_DATA) & set(empty))
