"""The leak check's next forms (issue 24 item 5): each hides a real held-out string, and each
applied to training strings stays clean.

Held-out strings come from the evaluator's generators; the checker only sees their salted-hash
export. Every form is checked both ways: a held-out string in that form is rejected, and the
same form of training strings (task ids, file names) passes.
"""

import base64
import json
import random

import pytest
from test_leak_adversarial import _heldout, _row, _training_strings

from bat_jax import marker_fuzzy, marker_tables, markers, workflow
from bat_jax.evaluator import markers_export
from bat_jax.stagebank import build, leakcheck

# Cells keyed by a fixed run secret: without one make_cells draws a fresh secret, and the held-out
# strings (so the test) would change from run to run.
FIXED_SECRET = "01" * 32

# Look-alikes that the old hand table did not have (Lisu and Cherokee capitals).
_LISU = str.maketrans("ABCDEFGHIJKLMNOPRSTUVWXYZ", "ꓮꓐꓚꓓꓰꓝꓖꓧꓲꓙꓗꓡꓟꓠꓳꓑꓣꓢꓔꓴꓦꓪꓫꓬꓜ")
_CHEROKEE = str.maketrans("ABCDEGHJKLMPRSTVWZ", "ᎪᏴᏟᎠᎬᏀᎻᎫᏦᏞᎷᏢᏒᏚᎢᏙᏔᏃ")
_LEET = str.maketrans("aeostlgb", "43057198")
_HANGUL_FILLERS = ("\u3164", "\u115f", "\u1160", "\uffa0")
_OTHER_IGNORABLES = ("\u034f", "\u180b", "\ufe0f", "\U000e0020", "\u2065")


def _thirds(s):
  a, b = len(s) // 3, 2 * len(s) // 3
  return s[:a], s[a:b], s[b:]


def _three_turns(s):
  p1, p2, p3 = _thirds(s)
  return _row(f"Notes: {p1}", p2, f"{p3} (continued)")


def _five_turns(s):
  k = -(-len(s) // 5)  # five pieces (of two or more characters: a one-character piece is noise)
  return _row(*(s[i:i + k] for i in range(0, len(s), k)))


def _messages_between(s):
  p1, p2 = s[:len(s) // 2], s[len(s) // 2:]
  return _row(f"Notes: {p1}", "Ran the validation step; all good.", "ok", f"{p2} end")


def _text_between(s):
  p1, p2 = s[:len(s) // 2], s[len(s) // 2:]
  return _row(f"Notes: {p1} (see the earlier message for context) {p2} end")


def _pieces_between_fields(s):
  p1, p2, p3 = _thirds(s)
  return {"a": f"x {p1}", "role": "assistant", "b": {"flag": False, "t": p2},
          "pad": "nothing to see", "c": [f"{p3}."]}


FORMS = {
    "three_turns": _three_turns,
    "five_turns": _five_turns,
    "messages_between": _messages_between,
    "text_between": _text_between,
    "pieces_between_fields": _pieces_between_fields,
    "unicode_escapes": lambda s: _row("".join(f"\\u{ord(c):04x}" for c in s)),
    "x_escapes": lambda s: _row("".join(f"\\x{b:02x}" for b in s.encode())),
    "quoted_printable": lambda s: _row("".join(f"={b:02X}" for b in s.encode())),
    "base32": lambda s: _row(f"blob {base64.b32encode(s.encode()).decode()}"),
    "base32_lower": lambda s: _row(f"blob {base64.b32encode(s.encode()).decode().lower()}"),
    "base85": lambda s: _row(f"blob {base64.b85encode(s.encode()).decode()}"),
    "ascii85_adobe": lambda s: _row(base64.a85encode(s.encode(), adobe=True).decode()),
    "ascii85_bare": lambda s: _row(f"blob {base64.a85encode(s.encode()).decode()}"),
    "hangul_filler": lambda s: _row("".join(c + _HANGUL_FILLERS[i % 4] for i, c in enumerate(s))),
    "other_ignorables": lambda s: _row("".join(c + _OTHER_IGNORABLES[i % 5]
                                               for i, c in enumerate(s))),
    "lisu_lookalikes": lambda s: _row(s.upper().translate(_LISU)),
    "cherokee_lookalikes": lambda s: _row(s.upper().translate(_CHEROKEE)),
    "leetspeak": lambda s: _row(s.lower().translate(_LEET)),
}
CAESAR = "caesar"  # every shift 1..25, each its own planted row


def _caesar(s, k):
  return "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s.lower())


def _drop_every_3rd(s):
  return " ".join(w for i, w in enumerate(s.split()) if i % 3 != 2)


def _swap_pairs(s):
  words = s.split()
  for i in range(0, len(words) - 1, 2):
    words[i], words[i + 1] = words[i + 1], words[i]
  return " ".join(words)


def _drop_and_swap(s):
  return _swap_pairs(" ".join(w for i, w in enumerate(s.split()) if i % 4 != 3))


NEAR_DUPLICATES = {"drop_every_3rd": _drop_every_3rd, "swap_pairs": _swap_pairs,
                   "drop_and_swap": _drop_and_swap}


@pytest.fixture(scope="module")
def heldout():
  export, short, long = _heldout(20260816, 1)
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(export))
  # The forms need a marker that spans a few characters: ids, file names, answers.
  short = [s for s in short if len(markers.normalize_tokens(s)) >= 2 or len(s) >= 8]
  return checker, short, long


def _hit(checker, row):
  return any(f.reason == "heldout_marker" for f in checker.check_row(row))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_heldout_string_in_form_is_rejected(heldout, form):
  checker, short, _ = heldout
  picked = random.Random(form).sample(short, 8)
  missed = [s for s in picked if not _hit(checker, FORMS[form](s))]
  assert missed == [], (form, missed)


def test_every_caesar_shift_is_rejected(heldout):
  checker, short, _ = heldout
  lettered = [s for s in short if sum(c.isalpha() for c in s) >= marker_tables.CAESAR_MIN_LETTERS]
  picked = random.Random(5).sample(lettered, 5)
  missed = [(k, s) for k in range(1, 26) for s in picked
            if not _hit(checker, _row(f"Note: {_caesar(s, k)}"))]
  assert missed == []


def test_few_letter_markers_are_not_matched_in_every_shift():
  # "qr-895" shifted by 15 is "fg 895": a synthesis task's foreground level ({"fg": 895}).
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(
      marker_tables.export_markers(["qr-895"], salt=b"few")))
  assert not _hit(checker, _row(json.dumps({"fg": 895, "bg": 293})))
  assert _hit(checker, _row("see qr-895")) and _hit(checker, _row("see de-895"))  # rot13 stays


@pytest.mark.parametrize("form", sorted(NEAR_DUPLICATES))
def test_near_duplicate_report_text_is_rejected(heldout, form):
  checker, _, long = heldout
  # The long texts exported as shingles: those not made of public phrasing (brief openings).
  public = marker_fuzzy.public_pairs(g for g in markers_export.public_ngrams() if len(g) == 4)
  texts = [t for t in long
           if marker_fuzzy.shingle_group(markers.normalize_tokens(t), public)]
  picked = random.Random(form).sample(texts, min(6, len(texts)))
  assert picked
  missed = [t for t in picked if not _hit(checker, _row(f"Summary: {NEAR_DUPLICATES[form](t)}"))]
  assert missed == []


def test_training_strings_in_every_new_form_pass(heldout):
  """No false rejections: the same forms of training strings (task ids, file names)."""
  checker, _, _ = heldout
  _, strings = _training_strings(1)
  picked = random.Random(3).sample(strings, 30)
  flagged = [(name, s) for s in picked for name, form in FORMS.items() if _hit(checker, form(s))]
  flagged += [(f"caesar{k}", s) for s in picked[:10] for k in range(1, 26)
              if _hit(checker, _row(f"Note: {_caesar(s, k)}"))]
  assert flagged == []


def test_training_texts_near_duplicated_pass(heldout):
  checker, _, _ = heldout
  rows, _ = _training_strings(1)
  briefs = [b for row in rows for b in row["briefs"]]
  flagged = [(name, b[:60]) for b in briefs for name, form in NEAR_DUPLICATES.items()
             if _hit(checker, _row(form(b)))]
  assert flagged == []


def test_old_scheme_export_fails_closed_naming_file_and_versions(tmp_path, heldout):
  export = markers.export_markers(["heldout-case-0042"], salt="s")
  old = {k: v for k, v in export.items() if k not in ("shingles", "pieces")}
  old["scheme"] = "bat_jax.markers/v2"
  path = tmp_path / "markers.json"
  path.write_text(json.dumps(old))
  with pytest.raises(ValueError) as err:
    build.load_matcher(path)
  message = str(err.value)
  assert str(path) in message and "bat_jax.markers/v2" in message
  assert markers.SCHEME in message and "fails closed" in message


def _real_rows_pass(n_batches, cells_per_track, first_action_tasks):
  """Real generated training rows (an RL round built from the training task families, its
  workspaces, and SFT first-action rows) against the real held-out export: 0 rejections."""
  from bat_jax.evaluator.cells import make_cells
  from bat_jax.stagebank import grid, rounds, sft_rows, task_source

  export = markers_export.export_cells(make_cells(20260901, cells_per_track, "lite", secret=FIXED_SECRET), salt=b"fp")
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(export))
  spec = rounds.RoundSpec(1, rounds.RoundWeights.for_target("S3"), seed=11, n_batches=n_batches)
  built = build.build_round(spec, task_source.TasksPackageSource(), checker)  # raises if any
  assert built.receipt.passed and built.receipt.rows_checked == 8 * n_batches
  assert build.scan_workspaces(checker, built.pools) == []
  states = [grid.GridState(stage, track, outcome) for stage in ("S1", "S3", "S5")
            for track in ("classification", "report") for outcome in ("success", "failure")]
  sft = list(sft_rows.synthesize(sft_rows.SftSpec(seed=2, states=tuple(states), tasks_per_state=0,
                                             first_action_tasks=first_action_tasks)))
  receipt = checker.check_rows(("sft", row) for row in sft)
  assert receipt.rows_checked == len(sft) > 0 and receipt.passed, receipt.samples[:3]
  return built.receipt.rows_checked + receipt.rows_checked


def test_real_training_and_sft_rows_pass_with_no_false_rejections():
  assert _real_rows_pass(n_batches=2, cells_per_track=1, first_action_tasks=1) > 16


@pytest.mark.slow
def test_large_sample_of_real_rows_passes_with_no_false_rejections():
  assert _real_rows_pass(n_batches=40, cells_per_track=6, first_action_tasks=4) > 320


def test_hex_ids_do_not_match_leet_folds():
  """A training hex id folded as leetspeak is letters: an all-hex marker's fold must not be
  matched glued inside it (found as a false rejection of a real `stage_tools` round)."""
  m = markers.MarkerMatcher(markers.export_markers(["acc-251", "case-0042"], salt="s"))
  assert m.find({"task_id": "task-ff60acc251b10c"}) == []
  assert m.find({"note": "see c4s3-0042"}) and m.find({"note": "xc4s30042y"})


def test_training_briefs_do_not_spell_heldout_submission_names_in_pieces():
  """The pieces scan finds a held-out name with text between its words. A training brief once
  put "class labels." before the aside "Only executed calls earn credit.": the held-out
  submission name `class_calls` in pieces, so a run whose held-out cells used it refused that
  SFT task and ended (task seed 440044255 of the study's seed 2; ~1 classification brief in 130)."""
  from bat_jax import train_tasks
  from bat_jax.evaluator import generators
  names = sorted({n for names in generators.SUBMISSION_NAMES.values() for n in names})
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers(names, salt=b"s")))
  for track in workflow.TRACKS:
    for seed in [*range(40), 85, 270, 440044255]:
      instance = train_tasks.generate(track, seed, "success", "stage_tools")
      for focus in workflow.FOCI:
        brief = train_tasks.brief_for(instance, focus)
        assert checker.check_row({"text": brief}) == [], (track, seed, focus, brief)
