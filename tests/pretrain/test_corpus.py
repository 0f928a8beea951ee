"""The tiny base's generated corpus: deterministic, generic, and its targets copy their context."""

import re

import pytest

from bat_jax.pretrain import corpus


def test_documents_are_deterministic_and_differ_by_seed():
  a = [corpus.plain_text(d) for d in corpus.documents(3, 0, 30)]
  assert a == [corpus.plain_text(d) for d in corpus.documents(3, 0, 30)]
  assert a != [corpus.plain_text(d) for d in corpus.documents(4, 0, 30)]
  assert corpus.document(3, 17) == corpus.documents(3, 10, 10)[7]


@pytest.mark.parametrize("kind", corpus.KINDS)
def test_every_target_value_is_in_the_context_and_the_call(kind):
  for i in range(40):
    doc = corpus.document(0, i, kind)
    context, target = corpus.plain_text(doc)
    assert doc.answer
    for value in doc.answer:
      assert value in context, (kind, value, context)
      assert value in target
    assert target.startswith(" python tools/") and target.endswith("\n")
    assert context.endswith(corpus.PROMPT)


def test_react_targets_copy_from_the_observation_not_the_facts():
  for i in range(40):
    doc = corpus.document(0, i, "react")
    facts = doc.messages[1]["content"].split(". Run")[0]
    observation = doc.messages[3]["content"]
    for value in doc.answer:
      flag_value = re.escape(value)
      assert re.search(rf": {flag_value}(\s|$)", observation), (value, observation)
    assert any(v not in facts for v in doc.answer) or len(doc.answer) == 0


def test_segments_mark_only_calls_and_join_to_the_text():
  doc = corpus.document(1, 2, "react")
  pieces = corpus.plain_segments(doc)
  assert [is_call for _, is_call in pieces] == [False, True, False, True]
  context, target = corpus.plain_text(doc)
  assert "".join(t for t, _ in pieces) == context + target


def test_corpus_is_generic_not_a_task_brief():
  from bat_jax import workflow
  texts = "".join("".join(corpus.plain_text(d)) for d in corpus.documents(0, 0, 300))
  for command in workflow.TOOL_COMMANDS:  # the stage tools are the world's, not the corpus's
    assert f"tools/{command}.py" not in texts
  with pytest.raises(ValueError, match="unknown pretraining document kind"):
    corpus.document(0, 0, "brief")
