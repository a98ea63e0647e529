"""tfscale.io: atomic writes, checksums and manifest reading, all without TensorFlow."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tfscale import errors
from tfscale import io as tfio


def test_write_json_writes_the_whole_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "summary.json")
    tfio.write_json(path, {"b": 1, "a": [1, 2]}, sort_keys=True)
    text = (tmp_path / "summary.json").read_text()
    assert json.loads(text) == {"a": [1, 2], "b": 1} and text.endswith("\n") and text.index('"a"') < text.index('"b"')
    tfio.write_json(path, {"x": 1}, indent=0)
    assert json.loads((tmp_path / "summary.json").read_text()) == {"x": 1}
    assert os.listdir(tmp_path) == ["summary.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = str(tmp_path / "state.json")
    tfio.write_json(path, {"old": True})
    with pytest.raises(TypeError):
        tfio.write_json(path, {"new": object()})  # not serialisable
    with pytest.raises(KeyboardInterrupt):
        with tfio.replaced_on_success(path) as temp:
            assert os.path.dirname(temp) == str(tmp_path) and os.path.basename(temp).startswith(".state.json.tmp-")
            with open(temp, "w") as f:
                f.write('{"half')
            raise KeyboardInterrupt
    assert json.loads((tmp_path / "state.json").read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["state.json"]


def test_temporaries_are_dot_files_next_to_the_target_that_temp_files_finds(tmp_path):
    assert tfio.temp_path(str(tmp_path / ".hidden.json")) == str(tmp_path / f".hidden.json.tmp-{os.getpid()}")
    for name in (".a.json.tmp-12", ".a.json.tmp-7", ".a.json", "a.json.tmp-3", ".b.json.tmp-1"):
        (tmp_path / name).write_text("x")
    expected = [str(tmp_path / ".a.json.tmp-12"), str(tmp_path / ".a.json.tmp-7")]
    assert tfio.temp_files(str(tmp_path), "a.json") == expected


def test_file_sha256_and_remove_quietly(tmp_path):
    data = os.urandom(3 << 20)  # spans several read chunks
    (tmp_path / "shard").write_bytes(data)
    assert tfio.file_sha256(str(tmp_path / "shard")) == hashlib.sha256(data).hexdigest()
    tfio.remove_quietly(str(tmp_path / "shard"))
    tfio.remove_quietly(str(tmp_path / "shard"))  # already gone: fine
    assert not (tmp_path / "shard").exists()


def test_manifests_current_name_first_then_legacy(tmp_path):
    assert tfio.find_manifest(str(tmp_path), "train") is None and tfio.read_manifest(str(tmp_path), "train") is None
    legacy = {"shards": [{"name": "train-00000-of-00001"}], "version": "old"}
    (tmp_path / "train-manifest.json").write_text(json.dumps(legacy))
    assert tfio.find_manifest(str(tmp_path), "train") == tfio.legacy_manifest_path(str(tmp_path), "train")
    assert tfio.read_manifest(tmp_path, "train") == legacy
    current = {"shards": [], "version": "new"}
    tfio.write_json(tfio.manifest_path(str(tmp_path), "train"), current)
    assert tfio.read_manifest(str(tmp_path), "train") == current


@pytest.mark.parametrize("text,problem", [("{not json", "is not valid JSON"), ('{"shards": 3}', "no valid 'shards'"),
                                          ('[1, 2]', "no valid 'shards'"), ('{"shards": [{"bytes": 1}]}', "no valid")])
def test_an_unusable_manifest_is_one_error_type_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "manifest-validation.json"
    path.write_text(text)
    with pytest.raises(errors.ManifestError, match=f"{path}.*{problem}") as err:
        tfio.read_manifest(str(tmp_path), "validation")
    assert isinstance(err.value, ValueError)  # callers' "bad input" handling catches it


@pytest.mark.parametrize("name", ["../train-00000-of-00001", "/etc/passwd", "sub/train-00000-of-00001", "..", ""])
def test_a_manifest_cannot_name_a_file_outside_its_directory(tmp_path, name):
    path = tmp_path / "manifest-train.json"
    path.write_text(json.dumps({"shards": [{"name": "train-00000-of-00002"}, {"name": name}], "classes": ["a"]}))
    with pytest.raises(errors.ManifestError, match=f"manifest {path} lists shard {name!r}: shard names must be plain"):
        tfio.read_manifest(str(tmp_path), "train")


def test_importing_io_imports_no_tensorflow():
    code = "import sys, tfscale.io; print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
