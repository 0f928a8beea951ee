"""safe_fs.parse_json / read_json: agent-made JSON parsed with bounded depth and size."""

import time

import pytest

from bat_jax.sandbox import safe_fs


def test_ordinary_json_parses_with_brackets_inside_strings():
  text = '{"a": [1, "[[[[\\"{{", {"b": null}], "\\u0070": "]]]}"}'
  assert safe_fs.parse_json(text) == {"a": [1, '[[[["{{', {"b": None}], "p": "]]]}"}
  nested = "[" * safe_fs.MAX_JSON_DEPTH + "]" * safe_fs.MAX_JSON_DEPTH
  assert safe_fs.parse_json(nested) is not None


@pytest.mark.parametrize("text,problem", [
    ("[" * 200_000 + "]" * 200_000, "nested over 64 levels"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nested over 64 levels"),
    ("[1, NaN]", "non-standard JSON constant NaN"),
    ('{"x": -Infinity}', "non-standard JSON constant -Infinity"),
    ("9" * 5000, "digits"),
    ("[1, 2", "do not balance"),
    ('{"a": 1', "do not balance"),
])
def test_hostile_json_is_a_value_error_naming_the_problem(text, problem):
  with pytest.raises(ValueError, match=problem):
    safe_fs.parse_json(text)


def test_size_cap_and_linear_depth_scan():
  with pytest.raises(ValueError, match="over the 100-char cap"):
    safe_fs.parse_json("[" + "1," * 60 + "1]", max_chars=100)
  wide = "[" + ",".join(["[1]"] * 200_000) + "]"  # many brackets, shallow: the scan is C-speed
  start = time.monotonic()
  assert len(safe_fs.parse_json(wide)) == 200_000
  assert time.monotonic() - start < 5.0


def test_read_json_names_the_file(tmp_path):
  (tmp_path / "deep.json").write_text("[" * 1000 + "]" * 1000)
  with pytest.raises(ValueError, match="'deep.json': JSON nested over"):
    safe_fs.read_json(tmp_path, "deep.json")
  (tmp_path / "ok.json").write_text('{"k": [1, 2]}')
  assert safe_fs.read_json(tmp_path, "ok.json") == {"k": [1, 2]}
