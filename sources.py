"""Where a checkpoint comes from: a local folder, a URI (``file://``, ``s3://``, ``gs://``, any
filesystem pyarrow opens, as Ray does), or a Hugging Face repository id.

A URI is copied once per machine into a local cache (``$DSV4RAY_MODEL_CACHE``, default
``~/.cache/dsv4ray/models``), one folder per URI. Processes of one machine that ask at once take
a file lock; the first copies into a private folder, hashing every file as it streams, checks
each copy against its hash and renames the folder into place with a manifest (file sizes and
sha256). Later asks reuse the folder when every file still has its manifest size, and copy
again otherwise. Errors name the source.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time

from dsv4ray.pids import process_alive

log = logging.getLogger("dsv4ray.model")

CACHE_ENV = "DSV4RAY_MODEL_CACHE"
CACHE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
MANIFEST = ".dsv4ray-manifest.json"
CHUNK = 8 << 20
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ValueError):
    """A model source that cannot be read; the message names it."""


def is_remote(source: str) -> bool:
    """A URI, or a Hugging Face repository id (``org/name`` where no local ``org`` exists)."""
    if _SCHEME.match(source):
        return True
    return bool(_REPO_ID.match(source)) and not os.path.exists(source.split("/", 1)[0])


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "dsv4ray", "models"
    )


def fetch_model(source: str, cache: str | None = None) -> str:
    """The local folder that holds ``source``: itself for a local path, else the cached copy
    (made now when missing or incomplete)."""
    if not is_remote(source):
        return source
    if not _SCHEME.match(source):
        return _from_hub(source, cache or cache_dir())
    dest = os.path.join(cache or cache_dir(), _folder_name(source))
    if _complete(dest):  # a finished copy needs no lock (the cache may be a read-only volume)
        log.info("model %s: cached copy %s", source, dest)
        return dest
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with _locked(dest + ".lock"):
            if _complete(dest):
                log.info("model %s: cached copy %s", source, dest)
                return dest
            _remove_orphans(dest)
            _copy(source, dest)
    except OSError as exc:
        if exc.errno in CACHE_ERRNOS:  # a full or read-only cache folder
            raise ModelSourceError(
                f"model source {source!r}: cannot copy it into the cache "
                f"{os.path.dirname(dest)!r} ({exc.strerror}); set ${CACHE_ENV} to a writable "
                "folder with room for it"
            ) from None
        raise ModelSourceError(f"model source {source!r}: the copy failed: {exc}") from None
    return dest


def _remove_orphans(dest: str) -> None:
    """Partial copies of processes that are gone (killed mid-copy: SIGKILL runs no cleanup)."""
    folder, name = os.path.split(dest)
    for entry in os.listdir(folder):
        owner = entry.removeprefix(f"{name}.partial-")
        if owner != entry and owner.isdigit() and not process_alive(int(owner)):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def _folder_name(source: str) -> str:
    """One folder per model: ``s3://b/m`` and ``s3://b/m/`` name the same copy."""
    source = source.rstrip("/")
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", source.rsplit("/", 1)[-1]) or "model"
    return f"{base}-{hashlib.sha256(source.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # one copy per machine; the others wait, then reuse it
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _complete(dest: str) -> bool:
    """Every file of the manifest present with its size (a copy interrupted or damaged since is
    copied again)."""
    try:
        with open(os.path.join(dest, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return False
    for name, entry in files.items():
        path = os.path.join(dest, name)
        if not os.path.isfile(path) or os.path.getsize(path) != entry["size"]:
            log.warning("cached model %s: %s is missing or damaged: copying again", dest, name)
            return False
    return True


def _listing(source: str):
    """(filesystem, [(relative name, path, size)]) of the files under a URI."""
    from pyarrow import fs as pafs

    try:
        filesystem, root = pafs.FileSystem.from_uri(source)
        info = filesystem.get_file_info(root)
    except Exception as exc:  # pyarrow raises several types for a bad URI
        raise ModelSourceError(f"model source {source!r} cannot be opened: {exc}") from exc
    if info.type != pafs.FileType.Directory:
        raise ModelSourceError(f"model source {source!r} is not a folder (found {info.type.name})")
    selector = pafs.FileSelector(root, recursive=True)
    files = [
        (os.path.relpath(f.path, root), f.path, f.size)
        for f in filesystem.get_file_info(selector)
        if f.type == pafs.FileType.File
    ]
    if "config.json" not in {name for name, _, _ in files}:
        raise ModelSourceError(f"model source {source!r} has no config.json")
    return filesystem, sorted(files)


def _copy(source: str, dest: str) -> None:
    filesystem, files = _listing(source)
    total = sum(size for _, _, size in files)
    log.info("model %s: copying %d files (%.2f GiB) to %s", source, len(files), total / 2**30, dest)
    partial = f"{dest}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    start, manifest = time.perf_counter(), {}
    try:
        with _progress(total, source) as bar:
            for name, path, size in files:
                out = os.path.join(partial, name)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                digest = _stream(filesystem, path, out, bar)
                if _sha256(out) != digest or os.path.getsize(out) != size:
                    raise ModelSourceError(f"model source {source!r}: {name} changed while copied")
                manifest[name] = {"size": size, "sha256": digest}
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump({"source": source, "files": manifest}, f, indent=1)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    log.info("model %s: copied %.2f GiB in %.1f s (%.0f MB/s)", source, total / 2**30, seconds,
             total / max(seconds, 1e-9) / 1e6)  # fmt: skip


def _stream(filesystem, path: str, out: str, bar) -> str:
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as src, open(out, "wb") as dst:
        while chunk := src.read(CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _progress(total: int, source: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"fetching {source}", leave=False,
                disable=total < (64 << 20))  # fmt: skip


def _from_hub(repo_id: str, cache: str) -> str:
    """A Hugging Face repository's snapshot (the hub's own cache, under ``cache``)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelSourceError(
            f"model source {repo_id!r} looks like a Hugging Face repository id, but "
            "huggingface_hub is not installed"
        ) from exc
    start = time.perf_counter()
    try:
        path = snapshot_download(repo_id, cache_dir=os.path.join(cache, "hub"))
    except Exception as exc:  # offline, unknown repository, no access: many types
        raise ModelSourceError(
            f"model source {repo_id!r} (a Hugging Face repository id) cannot be downloaded: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    log.info("model %s: snapshot %s in %.1f s", repo_id, path, time.perf_counter() - start)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelSourceError(f"model source {repo_id!r} has no config.json")
    return path
