"""fingerprint / fingerprint_digest / diff / materialize: contents, symlinks, bad paths."""

import hashlib
import os

import pytest

from bat_jax.sandbox import diff, fingerprint, fingerprint_digest, materialize
from bat_jax.sandbox import workspace as workspace_lib


def test_fingerprint_hashes_files_by_relpath(tmp_path):
  materialize({"a.txt": "alpha", "sub/dir/b.bin": b"\x00\x01"}, tmp_path)
  fp = fingerprint(tmp_path)
  assert fp == {"a.txt": hashlib.sha256(b"alpha").hexdigest(),
                "sub/dir/b.bin": hashlib.sha256(b"\x00\x01").hexdigest()}
  assert list(fp) == sorted(fp)


def test_fingerprint_digest_is_order_independent_and_content_sensitive(tmp_path):
  fp = {"a": "0" * 64, "b": "1" * 64}
  assert fingerprint_digest(fp) == fingerprint_digest(dict(reversed(fp.items())))
  assert fingerprint_digest(fp) != fingerprint_digest({**fp, "b": "2" * 64})
  assert fingerprint_digest(fp) != fingerprint_digest({"a": "0" * 64})


def test_diff_reports_new_changed_and_deleted():
  before = {"keep": "k" * 64, "edit": "e" * 64, "gone": "g" * 64}
  after = {"keep": "k" * 64, "edit": "f" * 64, "new": "n" * 64}
  assert diff(before, after) == {"edit": "f" * 64, "gone": None, "new": "n" * 64}


def test_fingerprint_does_not_follow_symlinks_out(tmp_path):
  host = tmp_path / "host"
  host.mkdir()
  (host / "secret.txt").write_text("host secret")
  ws = tmp_path / "ws"
  ws.mkdir()
  os.symlink(host / "secret.txt", ws / "file_link")
  os.symlink(host, ws / "dir_link")
  fp = fingerprint(ws)
  # The links are recorded by their target string; the host dir's files never appear.
  assert set(fp) == {"file_link", "dir_link"}
  assert fp["file_link"] != hashlib.sha256(b"host secret").hexdigest()
  os.remove(ws / "file_link")
  os.symlink(host / "other", ws / "file_link")
  assert fingerprint(ws)["file_link"] != fp["file_link"]  # retargeting is a change


def test_materialize_refuses_bad_paths_naming_them(tmp_path):
  for bad in ("/etc/passwd", "../outside.txt", "a/../../b", ""):
    with pytest.raises(ValueError, match="materialize") as e:
      materialize({bad: "x"}, tmp_path / "ws")
    assert repr(bad) in str(e.value)
  assert not (tmp_path / "outside.txt").exists()


def test_materialize_validates_everything_before_writing(tmp_path):
  with pytest.raises(ValueError, match="'../x'"):
    materialize({"ok.txt": "fine", "../x": "bad"}, tmp_path / "ws")
  assert not (tmp_path / "ws" / "ok.txt").exists()


def test_materialize_never_writes_through_symlinks(tmp_path):
  host = tmp_path / "host"
  host.mkdir()
  canary = host / "canary.txt"
  canary.write_text("untouched")
  ws = tmp_path / "ws"
  ws.mkdir()
  os.symlink(canary, ws / "link.txt")
  os.symlink(host, ws / "linkdir")
  materialize({"link.txt": "replaced"}, ws)  # replaces the link itself
  assert canary.read_text() == "untouched"
  assert not (ws / "link.txt").is_symlink()
  assert (ws / "link.txt").read_text() == "replaced"
  with pytest.raises(ValueError, match="symlink"):
    materialize({"linkdir/canary.txt": "pwned"}, ws)
  assert canary.read_text() == "untouched"
  assert sorted(os.listdir(host)) == ["canary.txt"]


def test_materialize_rejects_non_bytes_content(tmp_path):
  with pytest.raises(TypeError, match="'n.txt'"):
    materialize({"n.txt": 3}, tmp_path)


def test_tree_bytes_and_claim(tmp_path):
  materialize({"a": b"x" * 10, "d/b": b"y" * 5}, tmp_path / "ws")
  os.symlink("/etc/passwd", tmp_path / "ws" / "link")  # not followed, not counted
  assert workspace_lib.tree_bytes(tmp_path / "ws") == 15
  if os.geteuid() != 0:
    pytest.skip("chown needs root")
  workspace_lib.claim(tmp_path / "ws", 4242, 4343)
  for rel in ("", "a", "d", "d/b", "link"):
    st = os.lstat(tmp_path / "ws" / rel)
    assert (st.st_uid, st.st_gid) == (4242, 4343), rel
  assert os.stat("/etc/passwd").st_uid == 0  # the link target was not chowned
