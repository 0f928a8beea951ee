"""Adversarial planting: real held-out strings hidden in every form, and the catch rate per form.

The held-out strings come from the evaluator's own generators at test time (task ids, case ids,
file paths, answers, report texts); the matcher only ever sees their salted-hash export. Each
form turns one string into a training-looking row; the suite reports caught/total per form and
requires 100% of the plain forms and >= 95% overall. Clean controls: training rows and training
strings put through the same forms are never flagged.
"""

import base64
import codecs
import html
import json
import random
import urllib.parse

import pytest

from bat_jax import markers, workflow
from bat_jax.evaluator import markers_export
from bat_jax.evaluator.cells import make_cells
from bat_jax.stagebank import leakcheck
from bat_jax.train_tasks import FAMILIES, brief_for

# Cells keyed by a fixed run secret: without one make_cells draws a fresh secret, and the held-out
# strings (so the test) would change from run to run.
FIXED_SECRET = "01" * 32

_CYRILLIC = str.maketrans("aceopxyiAСEOPXY", "асеорхуіАСЕОРХУ")
_GREEK = str.maketrans("aoiktvxABEHIKMNOPTXYZ", "αοικτνχΑΒΕΗΙΚΜΝΟΡΤΧΥΖ")


def _row(*texts):
  """A training-looking row holding `texts` as consecutive string fields."""
  return {"prompt": [{"role": "system", "content": "Work in the sandbox."},
                     *({"role": "user", "content": t} for t in texts)],
          "extra_info": {"state_id": "abc123", "split": "train"}}


def _split(s, at):
  return _row(f"Notes: {s[:at]}", f"{s[at:]} (continued)")


def _word_boundary_split(s):
  cut = max((i for i, c in enumerate(s) if c in " _-./"), default=len(s) // 2)
  return _split(s, cut)


def _each_char(s, sep):
  return sep.join(s)


PLAIN_FORMS = {
    "as_is": lambda s: _row(s),
    "upper": lambda s: _row(s.upper()),
    "embedded": lambda s: _row(f"Before you start, compare against {s} and report back."),
    "nested_key": lambda s: {"a": [{"b": {s: 1}}]},
    "json_encoded": lambda s: _row(json.dumps({"note": s})),
    "fullwidth": lambda s: _row("".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c
                                        for c in s)),
    "sep_dash": lambda s: _row(s.replace("_", "-").replace(" ", "-")),
    "sep_slash": lambda s: _row(s.replace("_", "/").replace(" ", "/")),
    "sep_backslash": lambda s: _row(s.replace("_", "\\").replace("/", "\\")),
    "file_url": lambda s: _row(f"file://{s}"),
}
HIDDEN_FORMS = {
    "zero_width_space": lambda s: _row(_each_char(s, "\u200b")),
    "zero_width_joiner": lambda s: _row(_each_char(s, "\u200d")),
    "soft_hyphen": lambda s: _row(_each_char(s, "\u00ad")),
    "cyrillic": lambda s: _row(s.translate(_CYRILLIC)),
    "greek": lambda s: _row(s.upper().translate(_GREEK)),
    "split_mid_word": lambda s: _split(s, len(s) // 2),
    "split_word_boundary": _word_boundary_split,
    "glued_in_word": lambda s: _row(f"xyz{s.replace(' ', '')}qwv"),
    "separators_removed": lambda s: _row("".join(c for c in s if c.isalnum())),
    "spaced_letters": lambda s: _row(" ".join(c for c in s if c.isalnum())),
    "url_encoded": lambda s: _row("".join(f"%{b:02X}" for b in s.encode())),
    "html_entities": lambda s: _row("".join(f"&#x{ord(c):x};" for c in s)),
    "base64": lambda s: _row(f"blob: {base64.b64encode(s.encode()).decode()}"),
    "hex": lambda s: _row(f"bytes {s.encode().hex()}"),
    "rot13": lambda s: _row(codecs.encode(s, "rot13")),
    "reversed": lambda s: _row(s[::-1]),
}
LONG_FORMS = {
    "excerpt_7_words": lambda s: _row("Summary: " + " ".join(s.split()[3:10]) + "."),
    "every_5th_word_dropped": lambda s: _row(" ".join(w for i, w in enumerate(s.split())
                                                      if i % 5 != 4)),
    "html_escaped_text": lambda s: _row(html.escape(s).replace(" ", "&nbsp;")),
    "url_quoted_text": lambda s: _row(urllib.parse.quote(s)),
}


def _heldout(seed, cells_per_track):
  """(export, short markers, long texts) from the evaluator's generators."""
  cells = make_cells(seed, cells_per_track, "lite", secret=FIXED_SECRET)
  strings = markers_export.collect_markers(c.instance() for c in cells)
  short = [s for s in strings if len(markers.normalize_tokens(s)) <= 6 and not s.isspace()]
  long = [s for s in strings if len(s.split()) >= 12]
  return markers_export.export_cells(cells, salt=b"adversarial"), short, long


def _marker_hits(checker, row):
  return [f for f in checker.check_row(row) if f.reason == "heldout_marker"]


def _catch_rates(checker, short, long, per_form, rng):
  """{form: (caught, total)} over `per_form` sampled strings per form."""
  rates = {}
  for forms, pool in ((PLAIN_FORMS, short), (HIDDEN_FORMS, short), (LONG_FORMS, long)):
    for name, form in forms.items():
      picked = rng.sample(pool, min(per_form, len(pool)))
      caught = sum(bool(_marker_hits(checker, form(s))) for s in picked)
      rates[name] = (caught, len(picked))
  return rates


def _report_and_check(rates, capsys):
  total = sum(t for _, t in rates.values())
  caught = sum(c for c, _ in rates.values())
  with capsys.disabled():
    print(f"\n{total} planted held-out strings, {caught} caught "
          f"({100 * caught / total:.1f}%):")
    for name, (c, t) in rates.items():
      print(f"  {name:24s} {c}/{t}")
  missed_plain = {n: rates[n] for n in PLAIN_FORMS if rates[n][0] != rates[n][1]}
  assert not missed_plain, missed_plain
  assert caught >= 0.95 * total, rates
  for name, (c, t) in rates.items():
    assert c >= 0.8 * t, (name, c, t)  # no single form may be a blind spot


@pytest.fixture(scope="module")
def heldout():
  return _heldout(20260816, 1)


def test_planted_heldout_strings_are_caught_in_every_form(heldout, capsys):
  export, short, long = heldout
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(export))
  rates = _catch_rates(checker, short, long, per_form=6, rng=random.Random(0))
  _report_and_check(rates, capsys)


@pytest.mark.slow
def test_planted_heldout_strings_are_caught_at_scale(capsys):
  export, short, long = _heldout(7, 6)
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(export))
  rates = _catch_rates(checker, short, long, per_form=60, rng=random.Random(1))
  _report_and_check(rates, capsys)


def _training_strings(n_seeds):
  """Training-side content: briefs, file names, task ids and spec values of training tasks."""
  rows, strings = [], []
  for track in workflow.TRACKS:
    for outcome in workflow.OUTCOMES:
      for seed in range(n_seeds):
        inst = FAMILIES[track].generate(seed, outcome)
        rows.append({"briefs": [brief_for(inst, f) for f in workflow.FOCI],
                     "files": sorted(inst.files), "spec": inst.spec, "task_id": inst.task_id})
        strings.extend([inst.task_id, *sorted(inst.files)])
  return rows, strings


def test_training_content_in_every_form_is_not_flagged(heldout):
  """No false rejections: training rows, and training strings put through every form."""
  export, _, _ = heldout
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(export))
  rows, strings = _training_strings(1)
  assert [i for i, row in enumerate(rows) if checker.check_row(row)] == []
  forms = {**PLAIN_FORMS, **HIDDEN_FORMS}
  flagged = [(name, s) for s in random.Random(2).sample(strings, 40)
             for name, form in forms.items() if _marker_hits(checker, form(s))]
  assert flagged == []
