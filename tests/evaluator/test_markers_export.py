"""Marker export: hashed only, found embedded anywhere, silent on training content."""

import json
import re

from bat_jax import markers, workflow
from bat_jax.evaluator import markers_export
from bat_jax.evaluator.cells import make_cells
from bat_jax.train_tasks import FAMILIES, brief_for

# Cells keyed by a fixed run secret: without one make_cells draws a fresh secret, and the held-out
# strings (so the test) would change from run to run.
FIXED_SECRET = "01" * 32


def _cells():
  return make_cells(11, 3, "lite", secret=FIXED_SECRET)


def test_export_holds_no_plaintext():
  cells = _cells()
  strings = markers_export.collect_markers(c.instance() for c in cells)
  assert len(strings) > 300
  instances = [c.instance() for c in cells]
  # Every kind of marker is in the list: task ids, case ids, file names, answers, report text.
  assert {i.task_id for i in instances} <= set(strings)
  assert any(s.endswith(".pgm") for s in strings) and any(s.endswith(".csv") for s in strings)
  assert any(len(s) > 80 for s in strings)  # report texts / wording
  export = markers_export.export_cells(cells)
  assert set(export) == {"scheme", "salt_hex", "min_chars", "window", "marker_count", "hashes",
                         "squash", "anchors", "firsts", "grams", "shingles", "pieces"}
  all_hashes = ([h for table in ("hashes", "squash") for hs in export[table].values() for h in hs]
                + list(export["anchors"]) + [h for g in export["grams"]["groups"] for h in g]
                + export["shingles"]["vocab"] + [h for g in export["shingles"]["groups"] for h in g]
                + export["pieces"]["prefixes"]
                + [h for hs in export["firsts"].values() for h in hs])
  assert export["shingles"]["groups"] and export["pieces"]["prefixes"]
  assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in all_hashes)
  assert export["scheme"] == markers.SCHEME and export["marker_count"] == len(strings)
  dumped = json.dumps(export).lower()
  values = " ".join([export["salt_hex"]] + all_hashes)
  for s in strings:
    assert s.lower() not in dumped, s
    for token in markers.normalize_tokens(s):
      if re.search(r"[g-z]", token):  # a hex-looking token could occur in a hash by chance
        assert token not in values, (s, token)


def test_markers_are_found_embedded_in_rows():
  cells = _cells()
  matcher = markers.MarkerMatcher(markers_export.export_cells(cells, salt=b"s"))
  inst = cells[4].instance()
  case_id = inst.hidden["case_ids"][0]
  image = next(rel.rsplit("/", 1)[1] for rel in inst.files if rel.endswith(".pgm")) \
      if any(rel.endswith(".pgm") for rel in inst.files) else inst.spec["data"]["index"]
  row = {"prompt": [{"role": "user", "content": f"Look at {case_id.upper()} first."}],
         "extra": {"notes": [f"see {image} and task {inst.task_id}"]}}
  assert len(matcher.find(row)) >= 3
  report = next(c.instance() for c in cells if c.track == "report")
  text = next(iter(report.hidden["expected"].values()))
  assert matcher.find({"completion": f"Final answer follows. {text.lower()} End."})


def test_no_false_hits_on_training_content():
  matcher = markers.MarkerMatcher(markers_export.export_cells(_cells(), salt=b"s"))
  for track in workflow.TRACKS:
    for outcome in workflow.OUTCOMES:
      for seed in range(3):
        inst = FAMILIES[track].generate(seed, outcome)
        row = {"briefs": [brief_for(inst, f) for f in workflow.FOCI],
               "files": sorted(inst.files), "spec": inst.spec,
               "answers": json.dumps(inst.hidden["truth"])[:5000]}
        assert matcher.find(row) == [], (track, outcome, seed)
