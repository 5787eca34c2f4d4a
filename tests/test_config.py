from pathlib import Path

import pytest

from config import ConfigError, GalleyConfig, ModelSpec, load_config, parse_model_flag, with_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_config_toml_documents_exactly_the_embedded_defaults():
    assert load_config(ROOT / "config.toml") == GalleyConfig()


def test_unknown_keys_and_sections_are_rejected(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_num_seq = 3\n")
    with pytest.raises(ConfigError, match="max_num_seq.*known"):
        load_config(path)
    path.write_text("[engin]\n")
    with pytest.raises(ConfigError, match="engin"):
        load_config(path)


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 9000\n[cache]\nblock_size = 32\n[[models]]\nname = "a"\npath = "x"\n')
    cfg = with_overrides(load_config(path), server={"port": 9100, "host": None},
                         engine={"devices": ("cpu", "cpu")}, cache={"kv_cache_gib": 0.5},
                         extra_models=["b=/models/b", "org/Some-Model"])
    assert cfg.server.port == 9100 and cfg.server.host == "127.0.0.1"
    assert cfg.engine.devices == ("cpu", "cpu")
    assert cfg.engine.cache.block_size == 32 and cfg.engine.cache.kv_cache_gib == 0.5
    assert [m.name for m in cfg.models] == ["a", "b", "Some-Model"]


def test_model_flag_forms():
    assert parse_model_flag("name=/p/q") == ModelSpec("name", "/p/q")
    assert parse_model_flag("/models/llama-3/") == ModelSpec("llama-3", "/models/llama-3/")
    with pytest.raises(ConfigError):
        parse_model_flag("=x")


def test_encoder_entries_become_registry_options_and_a_name_keeps_one_kind(tmp_path):
    path = tmp_path / "c.toml"
    entry = '[[models]]\nname = "e"\npath = "x"\nkind = "embed"\nmax_batch = 4\nkeep_alive = 2.0\n'
    path.write_text(entry)
    (model,) = load_config(path).models
    assert model.options == {"keep_alive": 2.0, "max_batch": 4}
    path.write_text(entry + '[[models]]\nname = "e"\npath = "y"\nversion = "2"\n')
    with pytest.raises(ConfigError, match="one kind"):
        load_config(path)
