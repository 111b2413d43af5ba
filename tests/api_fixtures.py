"""The fixtures of the API feature modules (n > 1, sampling, structured output), which share the
session's ``api_cluster`` (conftest): bind them in a module with
``cluster, oai = api_fixtures.cluster, api_fixtures.oai``."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster(api_cluster):
    """The shared 1P2D cluster, a worker an earlier module killed replaced first."""
    api_cluster.ensure_workers(prefill=1, decode=2)
    return api_cluster


@pytest.fixture(scope="module")
def oai(cluster):
    return cluster.openai(timeout=180)
