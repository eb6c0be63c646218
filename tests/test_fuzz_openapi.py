"""Fuzzing every dialect from the OpenAPI document with schemathesis (on the echo backend, so
it runs in seconds): no 5xx, and every response matches what the document declares (status
codes, content types, JSON bodies and SSE events, the dialects' error formats)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from conftest import ECHO_PLUGIN

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 25  # per operation; raise locally to dig deeper (80 ran clean when this was written)


@pytest.fixture(scope="module")
def app():
    from fastapi.testclient import TestClient

    from llmserve.config import load_config
    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN]}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app):  # runs the lifespan: the engine is up while fuzzing
        yield app


def test_every_route_is_in_the_openapi_document(app):
    paths = app.openapi()["paths"]
    missing = []
    for route in app.routes:
        if not isinstance(route, Route) or route.path in ("/openapi.json",):
            continue
        for method in route.methods or ():
            if method != "HEAD" and method.lower() not in paths.get(route.path, {}):
                missing.append(f"{method} {route.path}")
    assert not missing
    dialects = {"/v1/chat/completions", "/generate_stream", "/v2/models/{model_name}/infer", "/infer",
                "/generate", "/metrics", "/health"}
    assert dialects <= set(paths)


def test_error_responses_declare_each_dialects_format(app):
    paths = app.openapi()["paths"]

    def error_schema(path: str, method: str = "post") -> dict:
        return paths[path][method]["responses"]["4XX"]["content"]["application/json"]["schema"]

    assert "param" in error_schema("/v1/chat/completions")["properties"]["error"]["properties"]
    assert error_schema("/generate_stream")["required"] == ["error", "error_type"]
    assert error_schema("/v2/models/{model_name}/infer")["properties"]["error"] == {"type": "string"}
    assert len(error_schema("/generate")["anyOf"]) == 2  # shared by TGI and vLLM-native
    assert "422" not in paths["/v1/chat/completions"]["post"]["responses"]  # no FastAPI detail shape
    assert "text/event-stream" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]


def test_schemathesis_finds_nothing(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(checks=CHECKS)

        try:
            run()
        except BaseException as exc:  # collect every operation's failures, then report
            if isinstance(exc, KeyboardInterrupt):
                raise
            failures.append(f"{operation.method.upper()} {operation.path}:\n{str(exc)[:2000]}")
    assert not failures, "\n\n".join(failures)
