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


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"compression_methods": ["bm25", "zip"]},
            "invalid settings: compression_methods: Value error, unknown compressor(s) zip; known: "
            "bm25, coarse-to-fine, fast, first-docs, identity, llmlingua2, top-docs",
        ),
        (
            {"compression_methods": ["bm25"]},
            "invalid settings: compression_default_method: 'coarse-to-fine' is not among "
            "compression_methods (bm25)",
        ),
        (
            {
                "compression_methods": ["bm25"],
                "compression_default_method": "bm25",
                "compression_method": "fast",
            },
            "invalid settings: compression_method: 'fast' is not among compression_methods (bm25)",
        ),
        (
            {"compression_methods": ["llmlingua2", "coarse-to-fine"]},
            "invalid settings: compression_methods: llmlingua2 needs compression_llmlingua2_model "
            "(a local LLMLingua-2 model folder)",
        ),
    ],
)
def test_compression_settings_that_disagree_are_named(options, message):
    with pytest.raises(ConfigError) as error:
        load_settings(**options)
    assert str(error.value) == message


def test_compression_settings_agree_across_layers(monkeypatch):
    # The environment offers only bm25 and the flag makes it the default: neither layer alone
    # agrees with the shipped default, the merged settings do.
    monkeypatch.setenv("RAGSPEED_COMPRESSION_METHODS", '["bm25"]')
    settings = load_settings(compression_default_method="bm25", compression_method="none")
    assert (settings.compression_methods, settings.compression_default_method) == (["bm25"], "bm25")
