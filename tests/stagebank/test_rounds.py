"""Grid, round views, batch composition and balance, RL row content."""

import collections
import json

import pytest

from bat_jax import workflow
from bat_jax.stagebank import grid
from bat_jax.stagebank import rl_rows
from bat_jax.stagebank import rounds

REFERENCE = rounds.RoundSpec(2, rounds.RoundWeights.for_target("S3"), seed=7)


@pytest.fixture(scope="module")
def reference_view():
  return rounds.plan_round(REFERENCE)


def test_grid_has_126_distinct_abstract_states():
  assert len(grid.SOURCE_GRID) == 126
  assert len({s.key for s in grid.SOURCE_GRID}) == 126
  assert len({s.condition for s in grid.SOURCE_GRID}) == 126
  for state in grid.SOURCE_GRID:
    assert state.track in state.condition
    assert not any(ch.isdigit() for ch in state.condition)  # no ids, values or case numbers
  with pytest.raises(ValueError, match="track"):
    grid.GridState("S1", "radiology", "success")


def test_reference_round_is_378_batches_of_4_2_2(reference_view):
  assert {p: len(v) for p, v in reference_view.items()} == {
      "s_target": 1512, "s_mix": 756, "e2e": 756}
  assert sum(map(len, reference_view.values())) == 3024
  comp = rounds.batch_composition(REFERENCE.weights.pool_mix, 8)
  assert comp == {"s_target": 4, "s_mix": 2, "e2e": 2}
  assert all(s.stage == "S3" for s in reference_view["s_target"])
  assert all(s.stage == "E2E" for s in reference_view["e2e"])
  # S-mix: the other four stages round-robin, so every batch's two S-mix rows differ.
  mix = [s.stage for s in reference_view["s_mix"]]
  assert mix[:8] == ["S1", "S2", "S4", "S5"] * 2
  assert collections.Counter(mix) == {"S1": 189, "S2": 189, "S4": 189, "S5": 189}


def test_reference_round_is_exactly_balanced(reference_view):
  for pool, slots in reference_view.items():
    for stage in {s.stage for s in slots}:
      cells = collections.Counter((s.track, s.outcome) for s in slots if s.stage == stage)
      assert len(cells) == 21 and len(set(cells.values())) == 1, (pool, stage, cells)
    tracks = collections.Counter(s.track for s in slots)
    outcomes = collections.Counter(s.outcome for s in slots)
    assert set(tracks) == set(workflow.TRACKS) and len(set(tracks.values())) == 1
    assert set(outcomes) == set(workflow.OUTCOMES) and len(set(outcomes.values())) == 1


def _spread(values, kinds) -> int:
  counts = collections.Counter(values)
  return max(counts.get(k, 0) for k in kinds) - min(counts.get(k, 0) for k in kinds)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_prefix_of_a_stage_sequence_is_balanced_within_one(seed):
  # The tiny run takes 12 E2E rows a round: a random order of the 21 pairs gave 2 success
  # tasks of 12 (round 0); every prefix must hold each outcome and each track within one.
  weights = rounds.RoundWeights({"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25},
                                {"S1": 0.0, "S2": 0.0, "S3": 0.0, "S4": 0.0, "S5": 1.0})
  view = rounds.plan_round(rounds.RoundSpec(0, weights, seed=seed, n_batches=24, rows_per_batch=4))
  for pool, slots in view.items():
    for stage in {s.stage for s in slots}:
      seq = [s for s in slots if s.stage == stage]
      for n in range(1, len(seq) + 1):
        assert _spread([s.outcome for s in seq[:n]], workflow.OUTCOMES) <= 1, (pool, stage, n)
        assert _spread([s.track for s in seq[:n]], workflow.TRACKS) <= 1, (pool, stage, n)
      full = collections.Counter((s.track, s.outcome) for s in seq[:21])
      assert len(seq) < 21 or len(full) == 21   # a whole cycle meets every pair once
  e2e = collections.Counter(s.outcome for s in view["e2e"][:12])
  assert e2e == {o: 4 for o in workflow.OUTCOMES}


def test_view_is_deterministic_and_state_ids_unique(reference_view):
  again = rounds.plan_round(REFERENCE)
  assert again == reference_view
  ids = [s.state_id for v in reference_view.values() for s in v]
  assert len(set(ids)) == len(ids) == 3024
  other_round = rounds.plan_round(rounds.RoundSpec(3, REFERENCE.weights, seed=7, n_batches=2))
  other_seed = rounds.plan_round(rounds.RoundSpec(2, REFERENCE.weights, seed=8, n_batches=2))
  assert other_round["s_target"][0].state_id != reference_view["s_target"][0].state_id
  assert other_seed["s_target"][0].state_id != reference_view["s_target"][0].state_id
  assert rounds.state_id(2, rounds.DATA_SOURCE, "s_target", "S3", 0, 7) == \
      reference_view["s_target"][0].state_id


def test_soft_stage_weights_are_apportioned_and_spread():
  weights = rounds.RoundWeights(
      {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25},
      {"S1": 0.1, "S2": 0.2, "S3": 0.4, "S4": 0.2, "S5": 0.1})
  view = rounds.plan_round(rounds.RoundSpec(0, weights, n_batches=10))
  stages = [s.stage for s in view["s_target"]]
  assert collections.Counter(stages) == {"S1": 4, "S2": 8, "S3": 16, "S4": 8, "S5": 4}
  # Spread: every 4-row batch holds at least one S3 row.
  assert all("S3" in stages[i:i + 4] for i in range(0, 40, 4))
  assert {s.stage for s in view["s_mix"]} == {"S1", "S2", "S4", "S5"}


def test_pool_mix_sets_composition():
  e2e_only = rounds.RoundWeights({"s_target": 0, "s_mix": 0, "e2e": 1},
                                 {s: 0.2 for s in workflow.STAGES})
  view = rounds.plan_round(rounds.RoundSpec(0, e2e_only, n_batches=3))
  assert {p: len(v) for p, v in view.items()} == {"s_target": 0, "s_mix": 0, "e2e": 24}
  assert rounds.batch_composition({"s_target": 0.6, "s_mix": 0.2, "e2e": 0.2}, 8) == {
      "s_target": 5, "s_mix": 2, "e2e": 1}
  assert rounds.apportion([1, 1, 1], 8) == [3, 3, 2]


def test_weights_validation_and_json_form():
  stage_w = {s: 0.2 for s in workflow.STAGES}
  pool = dict(rounds.REFERENCE_POOL_MIX)
  w = rounds.RoundWeights.from_json({"pool_mix": pool, "stage_weights": stage_w})
  assert w == rounds.RoundWeights(pool, stage_w) and w.primary_stage == "S1"
  assert rounds.RoundWeights.from_json(w.to_json()) == w
  with pytest.raises(ValueError, match="missing"):
    rounds.RoundWeights.from_json({"pool_mix": pool})
  with pytest.raises(TypeError, match="mapping"):
    rounds.RoundWeights.from_json((pool, stage_w))
  with pytest.raises(ValueError, match="stage_weights"):
    rounds.RoundWeights(pool, {**stage_w, "S1": 0.5})
  with pytest.raises(ValueError, match="pool_mix"):
    rounds.RoundWeights({"s_target": 1.0}, stage_w)
  with pytest.raises(ValueError, match=r"pool_mix\['e2e'\]"):
    rounds.RoundWeights({"s_target": 1.0, "s_mix": 0.5, "e2e": -0.5}, stage_w)
  with pytest.raises(ValueError, match="target stage 'S9'"):
    rounds.RoundWeights.for_target("S9")


def test_rl_row_is_a_reset_point_not_a_demonstration(reference_view, source):
  for pool in workflow.POOLS:
    slot = reference_view[pool][5]
    task = source.describe(slot.track, slot.outcome, slot.task_seed, slot.stage)
    row = rl_rows.rl_row(slot, task, round_index=2, round_target="S3")
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    info = row["extra_info"]
    assert info["state_id"] == slot.state_id and info["source_pool"] == pool
    assert info["target_stage"] == slot.stage and info["outcome_bucket"] == slot.outcome
    recipe = info["workspace_recipe"]
    assert recipe["seed"] == slot.task_seed and "files" not in recipe
    assert recipe["boundary_stage"] == slot.stage and row["prompt"][1]["content"] == task.brief
    contract = info["reward_contract"]
    if slot.stage == "E2E":
      assert contract["items"]["S3"] == list(workflow.stage_items("S3", slot.outcome))
    else:
      assert contract["items"] == list(workflow.stage_items(slot.stage, slot.outcome))
    blob = json.dumps(row)
    for syntax in ("<tool_call>", "<function=", "tool_calls", '"assistant"', "<think>",
                   "<|im_start|>", "completion", "trajectory\":"):
      assert syntax not in blob, syntax
    assert info["assistant_target_included"] is False
    assert info["rollout_transcript_reuse_allowed"] is False
