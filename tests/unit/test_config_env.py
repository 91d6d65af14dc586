"""`VOLTSERVE_<NAME>` variables: booleans take a fixed set of words; anything else is a ConfigError (the CLI's
one-line exit 2), not a silent "off"."""

import pytest

from voltserve import cli
from voltserve.config import ConfigError, EngineConfig


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), (" Yes ", True), ("ON", True),
                                        ("0", False), ("false", False), ("no", False), ("Off", False)])
def test_boolean_words(monkeypatch, raw, value):
    monkeypatch.setenv("VOLTSERVE_ENABLE_PREFIX_CACHING", raw)
    assert EngineConfig.from_env().enable_prefix_caching is value


@pytest.mark.parametrize("raw", ["maybe", "enabled", "y", "treu", "2"])
def test_an_unknown_boolean_word_is_an_error(monkeypatch, raw):
    monkeypatch.setenv("VOLTSERVE_ENABLE_PREFIX_CACHING", raw)
    with pytest.raises(ConfigError, match=f"VOLTSERVE_ENABLE_PREFIX_CACHING='{raw}' is not a valid bool"):
        EngineConfig.from_env()


def test_the_cli_refuses_an_unknown_boolean_word(monkeypatch, caplog):
    monkeypatch.setenv("VOLTSERVE_EXIT_ON_ENGINE_DEATH", "treu")
    assert cli.main(["serve"]) == 2
    assert "bad configuration: VOLTSERVE_EXIT_ON_ENGINE_DEATH='treu' is not a valid bool" in caplog.text
