"""Configuration: precedence CLI > env > YAML > defaults, unknown keys, wrong types, plugin sections."""

import json

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
