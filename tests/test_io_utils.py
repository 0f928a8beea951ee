"""`bat_jax.io_utils`: atomic writes replace whole files, never write through links, clean up."""

import json
import os

import pytest

from bat_jax import io_utils


def test_atomic_write_creates_parents_and_replaces(tmp_path):
  path = tmp_path / "a" / "b" / "f.bin"
  assert io_utils.atomic_write_bytes(path, b"one") == path
  io_utils.atomic_write_bytes(path, b"two")
  assert path.read_bytes() == b"two"
  assert os.listdir(path.parent) == ["f.bin"]  # no tmp file left behind


def test_text_and_json_formats(tmp_path):
  io_utils.atomic_write_text(tmp_path / "t.txt", "héllo")
  assert (tmp_path / "t.txt").read_bytes() == "héllo".encode("utf-8")
  io_utils.atomic_write_json(str(tmp_path / "j.json"), {"b": 1, "a": [1, 2]})
  text = (tmp_path / "j.json").read_text()
  assert text.endswith("\n") and text.index('"a"') < text.index('"b"')
  assert json.loads(text) == {"a": [1, 2], "b": 1}


def test_mode_is_what_a_plain_open_gives(tmp_path):
  io_utils.atomic_write_bytes(tmp_path / "atomic", b"x")
  with open(tmp_path / "plain", "wb") as f:
    f.write(b"x")
  assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_a_link_at_the_destination_is_replaced_not_written_through(tmp_path):
  victim = tmp_path / "victim"
  victim.write_bytes(b"keep")
  link = tmp_path / "out"
  link.symlink_to(victim)
  io_utils.atomic_write_bytes(link, b"new")
  assert victim.read_bytes() == b"keep"
  assert not link.is_symlink() and link.read_bytes() == b"new"


def test_a_failed_write_leaves_the_old_file_and_no_tmp(tmp_path, monkeypatch):
  path = tmp_path / "f.json"
  io_utils.atomic_write_json(path, {"v": 1})

  def broken_replace(src, dst):
    raise OSError("disk full")
  monkeypatch.setattr(io_utils.os, "replace", broken_replace)
  with pytest.raises(OSError, match="disk full"):
    io_utils.atomic_write_json(path, {"v": 2})
  assert json.loads(path.read_text()) == {"v": 1}
  assert os.listdir(tmp_path) == ["f.json"]


def test_fsync_helpers_accept_files_and_folders(tmp_path):
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "x").write_bytes(b"1")
  io_utils.fsync_tree(tmp_path)
  io_utils.fsync_dir(tmp_path / "d")
  io_utils.fsync_file(tmp_path / "d" / "x")
  with pytest.raises(NotADirectoryError):
    io_utils.fsync_dir(tmp_path / "d" / "x")
