"""File helpers without TensorFlow: atomic writes, checksums, and the conversion manifests.

Atomic writes: the bytes go to a dot-file next to the target, `.{name}.tmp-{pid}`, which is renamed
over the target (os.replace) only once it is complete. Readers see the old file or the whole new
one; a killed writer leaves only its dot-file, which no shard glob (`train*`, `train-*`) matches.

TFRecord framing: `tfrecord_spans` walks a file's record headers (the converter's resume check, the
DALI index files, naming a truncated shard).

Manifests: `manifest-{split}.json`, written by tfscale.data.convert.convert next to the shards it describes
(`{split}-manifest.json` in older versions: still read, never written). Reading them happens here
and only here, with one error type (`ManifestError`) that names the file.

Importing this module imports no TensorFlow; only a manifest on a remote file system (`gs://...`)
is read through tf.io.gfile, imported at that point.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
from typing import Iterator

from tfscale.errors import ManifestError, WriteError, one_line

_TEMP_INFIX = ".tmp-"
_CHUNK_BYTES = 8 << 20  # large sequential reads suit parallel file systems
# Not "{split}-manifest.json": Model Garden's `train*` and NVIDIA's `train-*` globs would read it as a
# shard (DataLossError: corrupted record at 0). That name is still read, from older conversions.
MANIFEST_FORMAT = "manifest-{split}.json"
LEGACY_MANIFEST_FORMAT = "{split}-manifest.json"
# A TFRecord: uint64 little-endian data length, uint32 CRC of it, the data, uint32 CRC of the data.
_TFRECORD_LENGTH_BYTES = 8
_TFRECORD_FRAMING_BYTES = 8 + 4 + 4
MANIFEST_GLOBS = (MANIFEST_FORMAT.format(split="*"), LEGACY_MANIFEST_FORMAT.format(split="*"))  # every split


def tfrecord_spans(path: str, *, open_file=open, size_bytes: int | None = None) -> tuple[list[tuple[int, int]], bool]:
    """(offset, length) in bytes of every whole record of a TFRecord file, and whether the file ends where
    its last record does (False: truncated, the spans are the records before the cut).

    Reads only the 8-byte length headers and seeks past the rest (length, its CRC, data, data CRC), so it
    costs a small read per record. `open_file` and `size_bytes`: tf.io.gfile.GFile and its stat for
    remote paths.
    """
    size_bytes = os.path.getsize(path) if size_bytes is None else size_bytes
    spans, position = [], 0
    with open_file(path, "rb") as f:
        while position < size_bytes:
            f.seek(position)
            header = f.read(_TFRECORD_LENGTH_BYTES)
            if len(header) < _TFRECORD_LENGTH_BYTES:
                return spans, False
            length = _TFRECORD_FRAMING_BYTES + int.from_bytes(header, "little")
            if position + length > size_bytes:
                return spans, False
            spans.append((position, length))
            position += length
    return spans, True


def write_error(path: str, err: BaseException) -> WriteError:
    """A WriteError for `path` that says why (the first line of `err`) and how much space is left there."""
    reason = getattr(err, "strerror", None) or one_line(err)[:300] or type(err).__name__
    directory = os.path.dirname(os.path.abspath(path))
    while directory and not os.path.exists(directory):
        directory = os.path.dirname(directory)
    try:
        usage = shutil.disk_usage(directory)
        space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on that file system"
    except OSError:
        space = "free space unknown"
    error = WriteError(f"could not write {path}: {reason} ({space})")
    error.errno = getattr(err, "errno", None)
    return error


# ------------------------------------------------------------------------------------ atomic writes


def temp_path(path: str) -> str:
    """Where an atomic write of `path` puts its bytes first: `.{name}.tmp-{pid}` in the same directory.

    Same directory: os.replace is atomic only within one file system. A leading dot of `name` is not
    doubled (`.state.json` -> `.state.json.tmp-42`).
    """
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f".{name.lstrip('.')}{_TEMP_INFIX}{os.getpid()}")


def temp_files(directory: str, name_glob: str) -> list[str]:
    """Sorted paths of temporaries that killed writers of files matching `name_glob` left in `directory`."""
    pattern = f".{name_glob.lstrip('.')}{_TEMP_INFIX}[0-9]*"
    return sorted(glob.glob(os.path.join(glob.escape(directory), pattern)))


@contextlib.contextmanager
def replaced_on_success(path: str) -> Iterator[str]:
    """Yields `temp_path(path)` to write to; renames it to `path` when the block completes.

    When the block raises (or the process is interrupted), the temporary is deleted and `path` is
    left as it was.
    """
    temp = temp_path(path)
    try:
        yield temp
        os.replace(temp, path)
    except OSError as err:
        remove_quietly(temp)
        raise err if isinstance(err, WriteError) else write_error(path, err) from err
    except BaseException:
        remove_quietly(temp)
        raise


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` atomically (see the module docstring), fsynced before the rename."""
    with replaced_on_success(path) as temp:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # an OS crash right after the rename must not leave an empty file


def write_json(path: str, obj, *, indent: int = 2, sort_keys: bool = False) -> None:
    """Writes `obj` as JSON (plus a final newline) to `path` atomically: never a half-written file."""
    write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n").encode("utf-8"))


def append_line(path: str, line: str) -> None:
    """Appends `line` and a newline to `path`, whole or not at all: a failed write (disk full) is cut
    off again, so the file never ends in half a line; raises WriteError naming the path."""
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):  # a short write: the file system ran out of space part-way
                raise OSError(28, os.strerror(28))  # ENOSPC
        except OSError as err:
            try:
                os.ftruncate(fd, end)
            except OSError:
                pass
            raise write_error(path, err) from err
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    """Deletes `path`; a file that is already gone is not an error."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------- checksums


def file_sha256(path: str) -> str:
    """Hex sha256 of the file at `path`, read in chunks (shards are far larger than memory allows)."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------- manifests


def manifest_path(data_dir: str, split: str) -> str:
    """Where tfscale.data.convert.convert writes the manifest of `split`."""
    return os.path.join(data_dir, MANIFEST_FORMAT.format(split=split))


def legacy_manifest_path(data_dir: str, split: str) -> str:
    """The manifest's other accepted name, `<split>-manifest.json` (a split glob matches it: read, never written)."""
    return os.path.join(data_dir, LEGACY_MANIFEST_FORMAT.format(split=split))


def _is_remote(path: str) -> bool:
    return "://" in os.fspath(path)


def _exists(path: str) -> bool:
    if _is_remote(path):
        import tensorflow as tf  # only for gs:// and other remote data dirs

        return tf.io.gfile.exists(path)
    return os.path.exists(path)


def _read_text(path: str) -> str:
    if _is_remote(path):
        import tensorflow as tf

        with tf.io.gfile.GFile(path, "r") as f:
            return f.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def find_manifest(data_dir: str, split: str) -> str | None:
    """Path of the manifest of `split` in `data_dir` (local or gs://...): current name first; None if none."""
    for path in (manifest_path(data_dir, split), legacy_manifest_path(data_dir, split)):
        if _exists(path):
            return path
    return None


def read_manifest_file(path: str) -> dict | None:
    """The manifest at `path`, None when there is no such file; ManifestError when it is unusable."""
    try:
        text = _read_text(path)
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"manifest {path} is not valid JSON: {e}") from e
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "name" in s for s in shards):
        raise ManifestError(f"manifest {path} has no valid 'shards' list")
    # Shards are files next to their manifest: a name with a directory part (../x, /etc/x) reaches elsewhere.
    outside = [s["name"] for s in shards if not is_plain_file_name(s["name"])]
    if outside:
        raise ManifestError(f"manifest {path} lists shard {outside[0]!r}: shard names must be plain file names "
                            "in the manifest's directory")
    classes = manifest.get("classes", [])
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ManifestError(f"manifest {path} has no valid 'classes' list (class names, in label order)")
    return manifest


def is_plain_file_name(name) -> bool:
    """True for a file name without any directory part (not '', '.', '..', 'a/b', '/abs', 'a\\b')."""
    return (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
            and "\\" not in name and "\0" not in name)


def read_manifest(data_dir: str, split: str) -> dict | None:
    """The manifest of `split` in `data_dir` (local or gs://...), None if there is none."""
    path = find_manifest(data_dir, split)
    return None if path is None else read_manifest_file(path)
