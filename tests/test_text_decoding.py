"""Decoded forms: real encodings decode, words read as base64/85 do not (issue 24 item 5)."""

import base64

from bat_jax import text_decoding


def test_encoded_text_decodes_even_with_a_few_planted_invalid_bytes():
  clean = base64.b64encode(b"heldout-case-0042 in the summary").decode()
  planted = base64.b64encode(b"heldout-case\xff-0042 in the summary").decode()
  assert "heldout-case-0042 in the summary" in text_decoding.decoded_variants(f"blob {clean}")
  assert "heldout-case-0042 in the summary" in text_decoding.decoded_variants(f"blob {planted}")


def test_identifiers_read_as_encodings_give_no_variants():
  # Each is a valid base64/85 run that decodes to near-random bytes, mostly invalid UTF-8:
  # before the filter every one of them came back as a variant (measured on a round's rows).
  words = ["extra_info", "outcome_bucket", "reward_contract", "rubric_contract",
           "model_specific_serialization", "teacher_trajectory_included", "action_space"]
  assert [v for w in words for v in text_decoding.decoded_variants(w)] == []


def test_mostly_invalid_bytes_are_not_text():
  assert text_decoding._text_of(bytes(range(0x80, 0xC0))) == ""
  assert text_decoding._text_of(b"plain text" + b"\xff") == "plain text"
