"""Settings precedence and config-file errors."""

from __future__ import annotations

import pytest

from ragspeed.gateway.settings import ConfigError, load_settings


def test_precedence_flags_over_env_over_file(tmp_path, monkeypatch):
    config = tmp_path / "ragspeed.yaml"
    config.write_text("port: 9000\nmax_num_seqs: 8\nengine: transformers\n")
    monkeypatch.setenv("RAGSPEED_MAX_NUM_SEQS", "16")
    settings = load_settings(config, engine="openai", upstreams=["http://a:1"])
    assert (settings.port, settings.max_num_seqs, settings.engine) == (9000, 16, "openai")
    assert settings.engine_config().upstreams == ("http://a:1",)


def test_toml_config(tmp_path):
    config = tmp_path / "ragspeed.toml"
    config.write_text('model = "bench-135m"\nblock-size = 32\n')
    settings = load_settings(config)
    assert settings.engine_config().model == "bench-135m" and settings.block_size == 32


@pytest.mark.parametrize(
    "text, message",
    [
        ("prot: 9000\n", "unknown option(s) prot"),
        ("port: [1, 2\n", "not valid"),
        ("- a\n- b\n", "must hold a mapping"),
        ("port: -1\n", "port"),
    ],
)
def test_bad_config_is_named(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        load_settings(config)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.yaml")
