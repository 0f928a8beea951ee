"""SFT cold-start rows: one model-neutral target action after its real prior context."""

import json

import pytest

from bat_jax import workflow
from bat_jax.stagebank import grid
from bat_jax.stagebank import sft_rows

ACTIONS = [
    {"name": "execute_code", "thought": "Look at the inputs first.",
     "arguments": {"language": "bash", "code": "ls data"}},
    {"name": "execute_code", "thought": "Run the small case.",
     "arguments": {"language": "python", "code": "print(open('data/index.csv').read())"}},
    {"name": "execute_code", "thought": "",
     "arguments": {"language": "python", "code": "import json; print(json.dumps({'ok': 1}))"}},
]
OBSERVATIONS = [workflow.format_observation(0, f"out{i}\n", "") for i in range(3)]
STATE = grid.GridState("S3", "vqa", "recovery")


USER = "Track: vqa. Answer the questions about the images in data/. Do stage S3 only."


def _rows():
  actions = [sft_rows.neutral_action(a) for a in ACTIONS]
  return sft_rows.rows_for_task(USER, STATE, actions, OBSERVATIONS, state_id="sid",
                                task_seed=5, generator="bat_jax.train_tasks/vqa")


def test_one_row_per_action_with_growing_real_context():
  rows = _rows()
  assert len(rows) == 3
  for k, row in enumerate(rows):
    msgs = row["messages"]
    assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "tool"] * k
    assert sft_rows.target_action(row) == sft_rows.neutral_action(ACTIONS[k])
    assert row["target"]["action"]["type"] == "tool"
    for j in range(k):
      assert msgs[2 + 2 * j]["action"]["arguments"] == ACTIONS[j]["arguments"]
      assert msgs[3 + 2 * j]["content"] == OBSERVATIONS[j]
    meta = row["metadata"]
    assert meta["action_index"] == k and meta["stage"] == "S3" and meta["track"] == "vqa"
    assert meta["workspace_recipe"]["boundary_stage"] == "S3"
    assert row["loss_mask"]["target_action"] == 1 and row["loss_mask"]["messages"] == 0
  assert rows[0]["messages"][1] == {"role": "user", "content": USER}


def test_rows_are_model_neutral():
  blob = json.dumps(_rows())
  for syntax in ("<tool_call>", "<function=", "<|im_start|>", "<|im_end|>", "<think>",
                 "<parameter="):
    assert syntax not in blob


def test_bad_expert_actions_are_named():
  with pytest.raises(ValueError, match="'name'"):
    sft_rows.neutral_action({"name": "shell", "arguments": {"language": "bash", "code": ""}})
  with pytest.raises(ValueError, match="language 'ruby'"):
    sft_rows.neutral_action({"name": "execute_code",
                              "arguments": {"language": "ruby", "code": ""}})
  with pytest.raises(ValueError, match="3 actions but 2 observations"):
    sft_rows.rows_for_task("b", STATE,
                           [sft_rows.neutral_action(a) for a in ACTIONS], OBSERVATIONS[:2],
                           state_id="s", task_seed=1, generator="g")


def test_rows_render_with_a_chat_format(tmp_path):
  tokenizer_mod = pytest.importorskip("bat_jax.model.tokenizer")
  from bat_jax.model import chat_format, tokenizer_corpus
  tok_dir = tokenizer_mod.train_tokenizer(tokenizer_corpus.tiny_corpus(60), 400, tmp_path / "tok")
  fmt = chat_format.ChatFormat.for_model("qwen3_5", tokenizer_mod.load_tokenizer(tok_dir))
  row = _rows()[2]
  ids, mask = fmt.encode_sft_example(row["messages"], sft_rows.target_action(row))
  assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
  assert mask[-1] == 1 and mask[0] == 0
  target_text = fmt.tokenizer.decode([i for i, m in zip(ids, mask) if m])
  assert "print(json.dumps" in target_text


def test_stop_row_follows_the_last_call_and_ends_the_episode(chat):
  """`stop=True`: one more row whose context holds every call and observation and whose
  target is the final turn, which a rollout parses as a turn without a call (agent_stop)."""
  actions = [sft_rows.neutral_action(a) for a in ACTIONS]
  rows = sft_rows.rows_for_task(USER, STATE, actions, OBSERVATIONS, state_id="sid",
                                task_seed=5, generator="g", stop=True)
  assert len(rows) == len(ACTIONS) + 1
  assert [sft_rows.target_action(r) for r in rows[:-1]] == actions
  stop = rows[-1]
  assert [m["role"] for m in stop["messages"]] == ["system", "user"] + ["assistant", "tool"] * 3
  assert stop["messages"][-1]["content"] == OBSERVATIONS[-1]
  assert "action" not in stop["target"] and stop["target"]["content"] == sft_rows.STOP_TEXT
  meta = stop["metadata"]
  assert meta["action_index"] == meta["actions_in_focus"] == len(ACTIONS)
  ids, mask = chat.encode_sft_example(stop["messages"], sft_rows.target_action(stop))
  target = chat.decode([i for i, m in zip(ids, mask) if m])
  parsed = chat.parse_actions(target.removesuffix("<|im_end|>"))
  assert parsed.ok and parsed.actions == () and sft_rows.STOP_TEXT in target
  assert "<tool_call>" not in target


def test_decision_kind_names_the_choice_each_row_asks_for():
  """Stage-tools rows are keyed by command and first flag (a recovery's fix, a failure's
  blocked infer and failed submit are their own kinds); other code by its action index."""
  from bat_jax import train_tasks
  from bat_jax.taskkit import expert_actions
  kinds = []
  for outcome in ("recovery", "failure"):
    inst = train_tasks.generate("vqa", 3, outcome, "stage_tools")
    actions = [sft_rows.neutral_action(a) for s in workflow.STAGES
               for a in expert_actions(inst, s)]
    state = grid.GridState("E2E", "vqa", outcome)
    observations = [workflow.format_observation(0, "ok\n", "")] * len(actions)
    rows = sft_rows.rows_for_task(USER, state, actions, observations, state_id="s",
                                  task_seed=3, generator="g", stop=True)
    kinds.append([sft_rows.decision_kind(r) for r in rows])
  assert kinds[0] == ["E2E:plan --weights", "E2E:setup --card", "E2E:validate --cases",
                      "E2E:fix --fault", "E2E:validate --cases", "E2E:infer --data",
                      "E2E:submit --to", "E2E:stop"]
  assert kinds[1][3:] == ["E2E:infer --blocked", "E2E:submit --failed", "E2E:stop"]
  assert [sft_rows.decision_kind(r) for r in _rows()] == [
      "S3:action 0", "S3:action 1", "S3:action 2"]
