"""Settings precedence, config-file errors and the flags of `ragspeed serve`."""

from __future__ import annotations

import gc
from typing import Any

import click
import pytest
from click.testing import CliRunner
from pydantic import TypeAdapter

from ragspeed.cli import NumberOrNone, cli, keep_startup_heap, serve, serve_settings
from ragspeed.gateway.settings import OPTIONS, ConfigError, load_settings

SETTINGS_OPTIONS = [p for p in serve.params if p.name in OPTIONS]
# Values the rules of _valid_value cannot make: each names something the settings know.
VALID = {
    "log_level": "debug",
    "compression_method": "bm25",
    "compression_default_method": "bm25",
    "compression_methods": ["coarse-to-fine", "bm25"],
    "api_keys": [f"sha256:{'a' * 64},tenant=t"],
    "admin_key_hashes": [f"sha256:{'b' * 64}"],
}


def test_precedence_flags_over_env_over_file(tmp_path, monkeypatch):
    config = tmp_path / "ragspeed.yaml"
    config.write_text("port: 9000\nmax_num_seqs: 8\nengine: transformers\n")
    monkeypatch.setenv("RAGSPEED_MAX_NUM_SEQS", "16")
    settings = load_settings(config, engine="openai", upstreams=["http://a:1"])
    assert (settings.server.port, settings.engine.max_num_seqs, settings.engine.backend) == (
        9000,
        16,
        "openai",
    )
    assert settings.upstreams.config().urls == ("http://a:1",)


def test_toml_config(tmp_path):
    config = tmp_path / "ragspeed.toml"
    config.write_text('model = "bench-135m"\nblock-size = 32\n')
    settings = load_settings(config)
    assert settings.engine.config().model == "bench-135m" and settings.engine.block_size == 32


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
    assert (settings.compression.methods, settings.compression.default_method) == (["bm25"], "bm25")


def _valid_value(option: click.Option, default: Any) -> Any:
    """A value of the option that the settings accept, other than its default."""
    if option.name in VALID:
        return VALID[option.name]
    if isinstance(option.type, click.Choice):
        return next(choice for choice in option.type.choices if choice != default)
    if option.is_flag:
        return not default
    number = option.type.base if isinstance(option.type, NumberOrNone) else option.type
    if number is click.INT:
        return 64 if default is None else default + 1
    if number is click.FLOAT:
        return default / 2 if default else 0.5
    if option.multiple:
        return [f"{option.name}-value"]
    return f"{option.name}-value"


@pytest.mark.parametrize("option", SETTINGS_OPTIONS, ids=lambda option: option.name)
def test_every_serve_flag_parses_and_reaches_the_settings(option):
    info = OPTIONS[option.name].info
    default = info.get_default(call_default_factory=True)
    value = _valid_value(option, default)
    if option.is_flag:
        args = [option.opts[0] if value else option.secondary_opts[0]]
    else:
        items = value if option.multiple else [value]
        args = [arg for item in items for arg in (option.opts[0], str(item))]
    params = serve.make_context("serve", args).params
    settings = serve_settings(params.pop("config_file"), params)
    expected = TypeAdapter(info.annotation).validate_python(value)
    assert expected != default and settings.options()[option.name] == expected


def test_a_number_option_that_takes_none_takes_it_from_a_flag_and_the_environment(monkeypatch):
    takes_none = [o for o in SETTINGS_OPTIONS if isinstance(o.type, NumberOrNone)]
    assert {"tpot_target_ms", "ttft_deadline_ms", "num_threads"} <= {o.name for o in takes_none}
    params = serve.make_context("serve", ["--tpot-target-ms", "none", "--ttft-deadline-ms", "None"]).params
    settings = serve_settings(params.pop("config_file"), params)
    assert (settings.engine.tpot_target_ms, settings.limits.ttft_deadline_ms) == (None, None)
    monkeypatch.setenv("RAGSPEED_TPOT_TARGET_MS", "none")
    assert load_settings(None).engine.tpot_target_ms is None
    assert load_settings(None, tpot_target_ms="25").engine.tpot_target_ms == 25.0  # a flag over it
    assert load_settings(None, compression_method="none").compression.method == "none"  # text stays
    assert "--tpot-target-ms FLOAT|NONE" in CliRunner().invoke(serve, ["--help"]).output
    result = CliRunner().invoke(serve, ["--tpot-target-ms", "fast"])
    assert result.exit_code == 2 and "'fast' is not a valid float" in result.output


def test_a_choice_flag_lists_its_values_and_names_them_when_refused():
    assert "--dtype [auto|float32|bfloat16|float16]" in CliRunner().invoke(serve, ["--help"]).output
    result = CliRunner().invoke(serve, ["--dtype", "float8"])
    assert result.exit_code == 2
    assert (
        "Invalid value for '--dtype': 'float8' is not one of 'auto', 'float32', 'bfloat16', 'float16'."
        in result.output
    )


def test_serve_is_a_command_and_freezes_the_start_up_heap_once_ready():
    assert cli.get_command(click.Context(cli), "serve") is serve
    frozen = gc.get_freeze_count()
    try:
        keep_startup_heap()
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()


def test_the_engine_options_are_engine_configs_fields_with_the_served_engines_defaults():
    """Each engine setting is declared once (engine.config): the engine section's options take
    EngineConfig's names and `SERVED_ENGINE`'s defaults, and each of them reaches the config."""
    from dataclasses import fields

    from ragspeed.engine.config import SERVED_ENGINE, EngineConfig
    from ragspeed.gateway.settings import EngineSettings, Settings

    config_fields = [f.name for f in fields(EngineConfig)]
    not_options = ["seed"]  # an engine built in code seeds itself; a server's is 0
    policy = [  # the document cache's policy, which the gateway applies
        "document_cache",
        "document_cache_policy",
        "document_cache_tokens",
        "document_cache_ratio",
        "document_cache_glue",
    ]
    section = list(EngineSettings.model_fields)
    assert sorted(section) == sorted([n for n in config_fields if n not in not_options] + policy)
    assert [o.section for o in OPTIONS.values() if o.name.startswith("document_cache")] == ["engine"] * 9
    assert Settings().engine.config() == SERVED_ENGINE
    for name in config_fields:
        if name not in not_options:
            assert EngineSettings.model_fields[name].default == getattr(SERVED_ENGINE, name), name
    # A server differs from an engine built in code in two defaults alone, both "auto".
    built = EngineConfig()
    assert {n for n in config_fields if getattr(built, n) != getattr(SERVED_ENGINE, n)} == {
        "quantization",
        "document_cache_dir",
    }
    changed = Settings(block_size=32, document_cache_bytes=5, document_cache_dtype="float32").engine.config()
    assert (changed.block_size, changed.document_cache_bytes, changed.document_cache_dtype) == (
        32,
        5,
        "float32",
    )
