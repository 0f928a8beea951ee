"""Held-out marker export and matching (bat_jax.markers)."""

import json
import re

import pytest

from bat_jax import markers

SECRETS = ["case_0042_answer", "Gleason pattern 4+3", "lesion-volume 17.25", "hx-task-9931"]


@pytest.fixture(scope="module")
def matcher():
  return markers.MarkerMatcher(markers.export_markers(SECRETS, salt="unit-salt"))


def test_export_holds_no_plaintext():
  export = markers.export_markers(SECRETS, salt="unit-salt")
  blob = json.dumps(export).casefold()
  for secret in SECRETS:
    for token in markers.normalize_tokens(secret):
      if re.search(r"[g-z]", token):  # a hex-looking token occurs inside some hash by chance
        assert token not in blob, token
  assert export["marker_count"] == len(SECRETS)
  assert export["scheme"] == markers.SCHEME


def test_export_is_deterministic_and_salted():
  a = markers.export_markers(SECRETS, salt="s1")
  assert a == markers.export_markers(list(reversed(SECRETS)), salt="s1")  # order hidden
  b = markers.export_markers(SECRETS, salt="s2")
  assert set(a["hashes"]["3"]).isdisjoint(b["hashes"]["3"])
  assert markers.export_digest(a) != markers.export_digest(b)


@pytest.mark.parametrize("text", [
    "case_0042_answer",
    "CASE-0042-ANSWER",
    "the file Case.0042.Answer.txt was read",
    "ｃａｓｅ＿００４２＿ａｎｓｗｅｒ",  # fullwidth, NFKC folds it
    "prefix/gleason PATTERN 4 + 3/suffix",
    "volume: Lesion Volume 17.25 ml",
])
def test_finds_marker_case_insensitive_and_embedded(matcher, text):
  assert matcher.find(text)


def test_finds_markers_in_nested_keys_and_values(matcher):
  row = {"a": [{"b": {"note": "see HX_TASK_9931 for details"}}],
         "meta": {"Lesion-Volume 17.25": 1}}
  hits = matcher.find(row)
  paths = {(h.path, h.in_key) for h in hits}
  assert ("$.a[0].b.note", False) in paths
  assert ("$.meta.Lesion-Volume 17.25", True) in paths
  assert all(len(h.digest) == 64 for h in hits)


def test_numbers_are_scanned(matcher):
  assert matcher.find({"x": 17.25, "y": "lesion volume"}) == []  # split across fields: no hit
  m = markers.MarkerMatcher(markers.export_markers(["31337"], salt="n"))
  assert m.find({"value": 31337})


def test_no_false_positive_on_partial_or_differing_tokens(matcher):
  assert not matcher.find("case 0042 question")      # last token differs
  assert not matcher.find("case_0043_answer")        # one character differs
  assert matcher.find("mycase_0042_answers")         # glued into a longer word: found
  assert not matcher.find("an unrelated sentence about lesions and cases")


def test_short_markers_are_ignored():
  export = markers.export_markers(["ab", "x y", "abcd"], salt="s")
  assert export["marker_count"] == 1
  m = markers.MarkerMatcher(export)
  assert not m.find("ab x y") and m.find("ABCD")


def test_long_markers_match_any_window():
  report = ("the left kidney shows a hypodense lesion measuring four centimetres with irregular "
            "margins suggesting malignancy")
  m = markers.MarkerMatcher(markers.export_markers([report], salt="s", window=6))
  assert m.find("Summary: Hypodense lesion measuring four centimetres, with margins")
  assert not m.find("a hypodense lesion measuring five centimetres")


def test_bad_export_names_the_field():
  export = markers.export_markers(SECRETS, salt="s")
  with pytest.raises(ValueError, match="salt_hex"):
    markers.MarkerMatcher({k: v for k, v in export.items() if k != "salt_hex"})
  with pytest.raises(ValueError, match="scheme"):
    markers.MarkerMatcher({**export, "scheme": "other/v9"})
  with pytest.raises(TypeError, match="marker #1"):
    markers.export_markers(["abcd", 5], salt="s")
