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


def test_uds_is_checked_like_the_engine_socket_and_excludes_host_port(monkeypatch):
    """`--uds` / VOLTSERVE_UDS: a Unix socket's address (<= 107 bytes on Linux) in an existing folder, API-only
    (API processes on one engine may differ), and not together with a host / port other than the defaults."""
    with pytest.raises(ConfigError) as info:
        EngineConfig(uds="/tmp/" + "x" * 103).validate()
    assert str(info.value) == (f"uds '/tmp/{'x' * 103}' is 108 bytes long: a Unix socket's path holds at most 107 "
                               "bytes (choose a shorter one)")
    assert EngineConfig(uds="/tmp/" + "x" * 102).validate().uds == "/tmp/" + "x" * 102  # 107 bytes: Linux binds it
    with pytest.raises(ConfigError) as info:
        EngineConfig(uds="/no/such/dir/api.sock").validate()
    assert str(info.value) == ("uds '/no/such/dir/api.sock': the folder '/no/such/dir' does not exist (create it, "
                               "writable by the serving user, e.g. systemd's RuntimeDirectory=)")
    with pytest.raises(ConfigError, match=r"^uds '/tmp/a.sock' and host / port 0.0.0.0:8000 both say where"):
        EngineConfig(uds="/tmp/a.sock", host="0.0.0.0").validate()
    monkeypatch.setenv("VOLTSERVE_UDS", "/tmp/a.sock")
    config = EngineConfig.from_env()
    assert config.uds == "/tmp/a.sock" and config.engine_settings() == EngineConfig().validate().engine_settings()


def test_uds_and_engine_socket_on_one_path_is_one_line(tmp_path):
    """`--uds P --engine-socket P` (or the same file through a symlinked folder): the API process attached to its own
    HTTP socket, bound before the load, and waited ATTACH_TIMEOUT_S (an hour) for an engine; now a ConfigError."""
    (tmp_path / "run").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "run")
    sock = str(tmp_path / "run" / "s.sock")
    for engine_socket in (sock, str(tmp_path / "link" / "s.sock")):
        with pytest.raises(ConfigError) as info:
            EngineConfig(uds=sock, engine_socket=engine_socket).validate()
        assert str(info.value) == (f"uds and engine_socket are both {sock!r}: the HTTP server's socket and the "
                                   "engine's need two paths")
    config = EngineConfig(uds=sock, engine_socket=str(tmp_path / "run" / "engine.sock")).validate()
    assert config.uds == sock
