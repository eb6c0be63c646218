"""Server skeleton: protocol mounting, route conflicts, per-dialect error mapping, hooks."""

import textwrap

import pytest

from conftest import ECHO_PLUGIN, EXAMPLE_PLUGIN
from llmserve.config import load_config
from llmserve.errors import ConfigError
from llmserve.hooks.manager import PluginManager
from llmserve.server.serve import build_server


def acme_config(tmp_path, monkeypatch, **flags):
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGIN))
    flags.setdefault("backend", "echo")
    flags.setdefault("plugins", [ECHO_PLUGIN, "llmserve_acme"])
    config, _ = load_config(flags, environ={})
    return config


def test_health_and_unknown_route_uses_error_envelope(echo_app):
    client, context = echo_app()
    assert client.get("/health").status_code == 200
    assert client.post("/ping").status_code == 200
    missing = client.get("/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no route GET /nope"
    assert "detail" not in missing.json()
    assert context.model_name == "echo"


def test_plugin_protocol_route_and_its_own_error_format(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    config = acme_config(tmp_path, monkeypatch)
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        ok = client.post("/acme/shout", json={"text": "hi there", "max_tokens": 20})
        assert ok.status_code == 200
        assert ok.json() == {"shout": "HI THERE!", "model": "echo"}
        bad = client.post("/acme/shout", json={"text": 5})
        assert bad.status_code == 400
        assert bad.json() == {"acme_error": "text: Input should be a valid string"}
        not_json = client.post("/acme/shout", content=b"{oops", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and not_json.json() == {"acme_error": "request body is not valid JSON"}


def test_plugin_options_section_validated(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    cfg = tmp_path / "c.yaml"
    cfg.write_text("acme:\n  exclamations: 3\n")
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGIN))
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, "llmserve_acme"]}, str(cfg), environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app) as client:
        assert client.post("/acme/shout", json={"text": "yo"}).json()["shout"] == "YO!!!"
    cfg.write_text("acme:\n  exclamations: many\n")
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, "llmserve_acme"]}, str(cfg), environ={})
    with pytest.raises(ConfigError, match="invalid options for 'acme': exclamations"):
        build_server(config, PluginManager().load(autoload=False))
    cfg.write_text("nosuchplugin:\n  a: 1\n")
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN]}, str(cfg), environ={})
    with pytest.raises(ConfigError, match="unknown config key 'nosuchplugin'"):
        build_server(config, PluginManager().load(autoload=False))


def test_two_protocols_claiming_one_route_refuse_to_start(tmp_path, monkeypatch):
    clash = tmp_path / "clash.py"
    clash.write_text(textwrap.dedent("""
        from fastapi import APIRouter
        from llmserve import hookimpl
        from llmserve.hooks.records import ProtocolSpec
        from llmserve.server.protocol import Protocol

        class Clash(Protocol):
            def router(self):
                r = APIRouter()
                @r.get("/health")
                async def health():
                    return {}
                return r

        @hookimpl
        def register_protocols():
            return [ProtocolSpec(name="clash", target=__name__ + ":Clash")]
    """))
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, str(clash)]}, environ={})
    with pytest.raises(ConfigError) as err:
        build_server(config, PluginManager().load(autoload=False))
    assert "GET /health is claimed by both protocol 'clash' and protocol 'ops'" in str(err.value) or \
           "GET /health is claimed by both protocol 'ops' and protocol 'clash'" in str(err.value)
    assert "--protocol-prefix" in str(err.value)
    # A prefix resolves it.
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, str(clash)],
                             "protocol_prefix": ["clash=/clash"]}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        assert client.get("/clash/health").json() == {}
        assert client.get("/health").content == b""
        assert "/clash/health" in client.get("/openapi.json").json()["paths"]


def test_protocol_selection(echo_app):
    client, _ = echo_app(protocols=["ops"])
    assert client.get("/health").status_code == 200
    with pytest.raises(ConfigError, match="unknown protocol 'nope'"):
        echo_app(protocols=["nope"])


def test_startup_and_shutdown_hooks_run(tmp_path):
    from fastapi.testclient import TestClient

    hooks = tmp_path / "hooks_plugin.py"
    hooks.write_text(textwrap.dedent("""
        from llmserve import hookimpl
        EVENTS = []

        @hookimpl
        def startup(context):
            EVENTS.append(("startup", context.model_name))

        @hookimpl
        def shutdown(context):
            EVENTS.append(("shutdown", context.ready))
    """))
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, str(hooks)]}, environ={})
    app, context = build_server(config, PluginManager().load(autoload=False))
    module = context.plugins.pm.get_plugin("hooks_plugin")
    with TestClient(app):
        assert module.EVENTS == [("startup", "echo")]
        assert context.ready
    assert module.EVENTS == [("startup", "echo"), ("shutdown", False)]


def test_failing_startup_hook_is_one_clear_error(tmp_path):
    bad = tmp_path / "badstart.py"
    bad.write_text("from llmserve import hookimpl\n\n@hookimpl\n"
                   "def startup(context):\n    raise RuntimeError('no db')\n")
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, str(bad)]}, environ={})
    with pytest.raises(ConfigError, match="startup hook of plugin 'badstart' failed: RuntimeError: no db"):
        build_server(config, PluginManager().load(autoload=False))


def test_shared_route_dispatches_by_body(tmp_path):
    from fastapi.testclient import TestClient

    plugin = tmp_path / "sharers.py"
    plugin.write_text(textwrap.dedent("""
        from fastapi import APIRouter
        from pydantic import BaseModel
        from starlette.responses import JSONResponse
        from llmserve import hookimpl
        from llmserve.hooks.records import ProtocolSpec
        from llmserve.errors import InvalidRequestError
        from llmserve.server.protocol import Protocol
        from llmserve.server.shared import SharedRoute

        class ABody(BaseModel):
            inputs: str

        class A(Protocol):
            def router(self):
                return APIRouter()
            def shared_routes(self):
                async def handle(request, body):
                    if not body["inputs"]:
                        raise InvalidRequestError("inputs must not be empty", param="inputs")
                    return JSONResponse({"a": body["inputs"]})
                return [SharedRoute("POST", "/gen", lambda b: isinstance(b, dict) and "inputs" in b, handle,
                                    "a body with `inputs`", ABody)]
            def error_response(self, error, request):
                return JSONResponse({"error": error.message, "error_type": "validation"}, status_code=422)

        class B(Protocol):
            def router(self):
                return APIRouter()
            def shared_routes(self):
                async def handle(request, body):
                    return JSONResponse({"b": body["prompt"]})
                return [SharedRoute("POST", "/gen", lambda b: isinstance(b, dict) and "prompt" in b, handle,
                                    "a body with `prompt`")]

        @hookimpl
        def register_protocols():
            return [ProtocolSpec(name="pa", target=__name__ + ":A"), ProtocolSpec(name="pb", target=__name__ + ":B")]
    """))
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, str(plugin)]}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/gen", json={"inputs": "x"}).json() == {"a": "x"}
        assert client.post("/gen", json={"prompt": "y"}).json() == {"b": "y"}
        bad = client.post("/gen", json={"inputs": ""})
        assert bad.status_code == 422 and bad.json()["error"] == "inputs must not be empty"
        neither = client.post("/gen", json={"other": 1})
        assert neither.status_code == 422
        assert "a body with `inputs`; or a body with `prompt`" in neither.json()["error"]
        assert client.post("/gen", content=b"{x").json()["error"] == "request body is not valid JSON"
        spec = client.get("/openapi.json").json()
        assert "ABody" in spec["components"]["schemas"]
        assert "/gen" in spec["paths"]


def test_model_loads_on_a_passing_thread(tmp_path, monkeypatch):
    """The backend is loaded (and the KV pool allocated) on a thread that then exits, never on
    the main thread: a compute library's per-thread worker pool must not outlive the load."""
    import threading

    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN]}, environ={})
    plugins = PluginManager().load(autoload=False)
    seen = {}
    app, context = build_server(config, plugins)  # registers the echo backend class
    backend_cls = type(context.engine.loop.engine.backend)
    load, init = backend_cls.load, backend_cls.init_kv_cache

    def spy_load(self):
        seen["load"] = threading.current_thread()
        return load(self)

    def spy_init(self, spec):
        seen["init_kv_cache"] = threading.current_thread()
        return init(self, spec)

    context.engine.shutdown()
    monkeypatch.setattr(backend_cls, "load", spy_load)
    monkeypatch.setattr(backend_cls, "init_kv_cache", spy_init)
    app, context = build_server(config, plugins)
    try:
        assert seen["load"].name == seen["init_kv_cache"].name == "llmserve-load"
        assert seen["load"] is not threading.main_thread() and not seen["load"].is_alive()
        assert context.model.name == "echo"
    finally:
        context.engine.shutdown()


def test_on_passing_thread_returns_and_raises():
    import threading

    from llmserve.server.serve import on_passing_thread

    assert on_passing_thread(lambda: threading.current_thread().name) == "llmserve-load"
    with pytest.raises(KeyError, match="boom"):
        on_passing_thread(lambda: {}["boom"])
