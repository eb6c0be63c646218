"""Configuration: precedence CLI > env > YAML > defaults, unknown keys, wrong types, plugin sections."""

import json
import textwrap
from pathlib import Path

import pytest

from conftest import run_cli
from llmserve.config import load_config
from llmserve.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_cli_over_env_over_yaml_over_default(tmp_path):
    cfg_file = write(tmp_path, "port: 7001\nhost: 0.0.0.0\nmax-model-len: 1024\ndtype: float32\n")
    env = {"LLMSERVE_PORT": "7002", "LLMSERVE_HOST": "10.0.0.1"}
    config, sources = load_config({"port": 7003}, cfg_file, environ=env)
    assert config.port == 7003 and sources["port"] == "cli"
    assert config.host == "10.0.0.1" and sources["host"] == "env:LLMSERVE_HOST"
    assert config.max_model_len == 1024 and sources["max_model_len"].startswith("yaml:")
    assert config.dtype == "float32"
    assert config.block_size == 16 and sources["block_size"] == "default"


def test_yaml_accepts_both_spellings_and_lists(tmp_path):
    cfg_file = write(tmp_path, "max_num_seqs: 8\nserved-model-name: [a, b]\nprotocols: ops\n")
    config, _ = load_config({}, cfg_file, environ={"LLMSERVE_API_KEY": "k1,k2"})
    assert config.max_num_seqs == 8
    assert config.served_model_name == ["a", "b"]
    assert config.protocols == ["ops"]
    assert config.api_key == ["k1", "k2"]


def test_unknown_key_names_key_and_valid_keys(tmp_path):
    cfg_file = write(tmp_path, "prot: 8000\n")
    with pytest.raises(ConfigError) as err:
        load_config({}, cfg_file, environ={})
    msg = str(err.value)
    assert "'prot'" in msg and "did you mean 'port'" in msg and "max-model-len" in msg


def test_wrong_type_names_key_and_source(tmp_path):
    cfg_file = write(tmp_path, "port: eighty\n")
    with pytest.raises(ConfigError) as err:
        load_config({}, cfg_file, environ={})
    assert "port:" in str(err.value) and "integer" in str(err.value) and "yaml:" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config({}, None, environ={"LLMSERVE_DTYPE": "float64"})
    assert "dtype: must be one of" in str(err.value) and "LLMSERVE_DTYPE" in str(err.value)


def test_plugins_accumulate_yaml_then_cli(tmp_path):
    cfg_file = write(tmp_path, "plugins: [a.b]\n")
    config, sources = load_config({"plugins": ["c.d"]}, cfg_file, environ={})
    assert config.plugins == ["a.b", "c.d"]
    assert sources["plugins"].endswith("+cli")


def test_yaml_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_config({}, write(tmp_path, "- a\n- b\n"), environ={})


def test_config_show_cli(tmp_path):
    cfg_file = write(tmp_path, "port: 7001\n")
    result = run_cli("config", "show", "--json", "--config", cfg_file, "--max-num-seqs", "4",
                     env={"LLMSERVE_HOST": "0.0.0.0"})
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["port"] == {"value": 7001, "source": f"yaml:{cfg_file}"}
    assert shown["max_num_seqs"] == {"value": 4, "source": "cli"}
    assert shown["host"] == {"value": "0.0.0.0", "source": "env:LLMSERVE_HOST"}


def test_config_show_bad_value_is_one_clear_line():
    result = run_cli("config", "show", "--dtype", "float8")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "dtype: must be one of" in result.stderr


def test_backend_options_cli_over_env_over_yaml_over_default(tmp_path, monkeypatch):
    """The torch backend's options merge like the settings; its variables keep their names."""
    from llmserve.hooks.manager import PluginManager
    from llmserve.hooks.registry import Registry
    from llmserve.server.serve import plugin_options

    cfg_file = write(tmp_path, "torch:\n  compact-weights: false\n  threads: 3\n  native_step: false\n")
    for name in ("CPU_KERNELS", "CPU_MATMUL_DECODE", "THREADS", "COMPACT_WEIGHTS", "GGUF_NATIVE"):
        monkeypatch.delenv(f"LLMSERVE_{name}", raising=False)
    monkeypatch.setenv("LLMSERVE_FUSED_FORWARD", "0")
    monkeypatch.setenv("LLMSERVE_NATIVE_STEP", "1")
    config, _ = load_config({"torch": {"threads": 2, "cpu_kernels": None}}, cfg_file, environ={})
    options = plugin_options(config, Registry.collect(PluginManager().load(autoload=False)))["torch"]
    assert options.model_dump() == {"fused_forward": False, "cpu_kernels": True, "native_step": True,
                                    "compact_weights": False, "cpu_matmul_decode": True, "gguf_native": True,
                                    "gguf_bf16_matmul": False, "gguf_decode_activations": "auto",
                                    "triton_attention": True, "threads": 2}


def test_config_show_lists_backend_options_with_sources(tmp_path):
    cfg_file = write(tmp_path, "torch:\n  compact-weights: false\n")
    result = run_cli("config", "show", "--json", "--config", cfg_file, "--no-torch-native-step", "--torch-threads", "2",
                     env={"LLMSERVE_FUSED_FORWARD": "0", "LLMSERVE_CPU_KERNELS": "", "LLMSERVE_THREADS": "5"})
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["torch.native_step"] == {"value": False, "source": "cli"}
    assert shown["torch.threads"] == {"value": 2, "source": "cli"}
    assert shown["torch.fused_forward"] == {"value": False, "source": "env:LLMSERVE_FUSED_FORWARD"}
    assert shown["torch.compact_weights"] == {"value": False, "source": f"yaml:{cfg_file}"}
    assert shown["torch.cpu_kernels"] == {"value": True, "source": "default"}  # an empty variable is unset
    text = run_cli("config", "show", "--backend", "torch", env={"LLMSERVE_COMPACT_WEIGHTS": "often"})
    assert text.returncode == 2 and text.stderr.strip().count("\n") == 0
    assert "invalid options for 'torch': compact-weights" in text.stderr
    assert "env:LLMSERVE_COMPACT_WEIGHTS" in text.stderr


def test_backend_options_reach_the_backend(tmp_path, monkeypatch):
    """A backend record that declares options gets the validated model as its second argument;
    YAML, the backend's variables (LLMSERVE_<BACKEND>_<FIELD> by default) and flags set it."""
    from fastapi.testclient import TestClient

    from conftest import ECHO_PLUGIN
    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    plugin = tmp_path / "tuned_echo.py"
    plugin.write_text(textwrap.dedent("""
        from pydantic import BaseModel, ConfigDict
        from echo_backend import EchoBackend
        from llmserve import hookimpl
        from llmserve.hooks.records import BackendSpec

        GOT = []

        class TunedOptions(BaseModel):
            model_config = ConfigDict(extra="forbid")
            speed: int = 1
            label: str = "plain"

        class TunedEcho(EchoBackend):
            def __init__(self, config, options):
                super().__init__(config)
                GOT.append(options)

        @hookimpl
        def register_backends():
            return [BackendSpec(name="tuned", target="tuned_echo:TunedEcho", options="tuned_echo:TunedOptions")]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(ECHO_PLUGIN).parent))
    monkeypatch.setenv("LLMSERVE_TUNED_LABEL", "from-env")
    cfg_file = write(tmp_path, "tuned:\n  speed: 3\n  label: from-yaml\n")
    config, _ = load_config({"backend": "tuned", "plugins": ["tuned_echo"], "protocols": ["ops"]}, cfg_file, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app):
        pass
    import tuned_echo

    assert [o.model_dump() for o in tuned_echo.GOT] == [{"speed": 3, "label": "from-env"}]
    config, _ = load_config({"backend": "tuned", "plugins": ["tuned_echo"], "tuned": {"speed": "fast"}}, None,
                            environ={})
    with pytest.raises(ConfigError, match="invalid options for 'tuned': speed: .*from cli"):
        build_server(config, PluginManager().load(autoload=False))


def test_settings_live_in_typed_sections():
    """A setting given by its own name goes to its section; a section may be given whole; the
    flat name wins over the same setting in a section; errors name the setting, not the section."""
    from llmserve.config import SECTION_OF, SECTIONS, FIELDS, SchedulerConfig, ServerConfig

    config = ServerConfig(max_num_seqs=4, port=9000, block_size=32, log_level="debug")
    assert (config.scheduler.max_num_seqs, config.http.port, config.cache.block_size) == (4, 9000, 32)
    assert config.scheduler.model_fields_set == {"max_num_seqs"}  # what was given, as the CUDA default needs
    given = ServerConfig(scheduler=SchedulerConfig(max_num_seqs=7), enable_chunked_prefill=False)
    assert given.scheduler == SchedulerConfig(max_num_seqs=7, enable_chunked_prefill=False)
    assert ServerConfig(scheduler={"max_num_seqs": 3}, max_num_seqs=5).scheduler.max_num_seqs == 5
    assert config.max_num_seqs == 4 and config.port == 9000  # plugins written against flat reads still work
    # every setting sits in exactly one section, or is one of ServerConfig's own two
    assert sorted(FIELDS) == sorted([*SECTION_OF, "log_level", "plugins"])
    assert sum(len(model.model_fields) for model in SECTIONS.values()) == len(SECTION_OF)
    with pytest.raises(ConfigError, match=r"block-size: Input should be greater than or equal to 1.*LLMSERVE_BLOCK"):
        load_config({}, None, environ={"LLMSERVE_BLOCK_SIZE": "0"})
    with pytest.raises(AttributeError):
        _ = config.no_such_setting
    with pytest.raises(ValueError, match="prot"):
        ServerConfig(prot=8000)
