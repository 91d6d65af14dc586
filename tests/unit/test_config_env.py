"""`VOLTSERVE_<NAME>` variables: booleans take a fixed set of words; anything else is a ConfigError (the CLI's
one-line exit 2), not a silent "off"."""

import os
from unittest import mock

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
    with mock.patch.dict(os.environ):  # main exports its flags to the environment: keep them from later tests
        assert cli.main(["serve"]) == 2
    assert "bad configuration: VOLTSERVE_EXIT_ON_ENGINE_DEATH='treu' is not a valid bool" in caplog.text


def test_the_cli_checks_the_draft_model_before_loading_the_target(caplog):
    """--speculative-model is checked as MODEL is: one line, exit 2, before any weights load."""
    args = ["serve", "--speculative-method", "draft_model", "--speculative-model", "/nope/draft.gguf"]
    with mock.patch.dict(os.environ):  # main exports its flags to the environment: keep them from later tests
        assert cli.main(args) == 2
    assert "VOLTSERVE_SPECULATIVE_MODEL" not in os.environ
    assert "bad configuration: " in caplog.text and "/nope/draft.gguf" in caplog.text


def test_a_chat_template_file_that_is_not_utf8_or_unreadable_is_one_line(tmp_path, monkeypatch, caplog):
    """--chat-template FILE is read at startup: a binary or unreadable file was a UnicodeDecodeError (or
    PermissionError) traceback from the engine after the model's load, and exit status 1."""
    import builtins
    import logging

    binary = tmp_path / "t.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    monkeypatch.setattr(cli.event_loop, "run", lambda *a: pytest.fail("the server started: the file was not read"))
    assert cli.main(["serve", "smollm2-135m-instruct", "--port", "0", "--chat-template", str(binary)]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        f"bad configuration: chat_template {str(binary)!r} is not UTF-8 text (byte 0: invalid start byte)"]
    real_open = builtins.open

    def no_permission(path, *args, **kwargs):
        if str(path) == str(binary):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_permission)  # root reads any file: as another user
    with pytest.raises(ConfigError, match=r"^chat_template '.*t.jinja' cannot be read: Permission denied$"):
        EngineConfig(chat_template=str(binary)).validate()
