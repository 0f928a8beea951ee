"""SFT rows end to end: real expert actions executed in the bubblewrap sandbox, then published."""

import pytest

from bat_jax import markers
from bat_jax import workflow
from bat_jax.stagebank import grid
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import sft_rows

from bat_jax import train_tasks
from bat_jax.taskkit import toolspace

# Two foci of one task (the S3 row's boundary reuses the S2 row's cached snapshot) + one more.
STATES = (grid.GridState("S2", "segmentation", "recovery"),
          grid.GridState("S3", "segmentation", "recovery"),
          grid.GridState("S1", "report", "failure"))


def test_sft_set_from_executed_expert_actions(tmp_path, require_bwrap):
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.empty_export()),
                                   allow_no_markers=True)
  spec = sft_rows.SftSpec(seed=4, states=STATES)
  out = sft_rows.build_sft_set(tmp_path / "sft", spec, checker, workers=2)  # sandboxes at once
  rows = sft_rows.load_sft_rows(out)
  assert rows
  for state in STATES:
    mine = [r for r in rows if r["metadata"]["grid_state"] == state.key]
    recipe = mine[0]["metadata"]["workspace_recipe"]
    instance = train_tasks.FAMILIES[state.track].generate(recipe["seed"], state.outcome)
    expert = sft_rows.focus_actions(train_tasks, instance, state.focus)
    assert len(mine) == len(expert) > 0
    for k, row in enumerate(mine):
      assert sft_rows.target_action(row) == expert[k]
      observations = [m["content"] for m in row["messages"] if m["role"] == "tool"]
      assert len(observations) == k
      assert all(o.startswith("exit_code=") for o in observations)
      assert all(len(o) <= workflow.MAX_OBSERVATION_CHARS for o in observations)


def test_first_action_tasks_add_one_unexecuted_row_per_focus(tmp_path):
  """`first_action_tasks` rows: each focus's first expert action over further distinct tasks,
  with no observation in the context, so nothing runs (no sandbox needed)."""
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.empty_export()),
                                   allow_no_markers=True)
  spec = sft_rows.SftSpec(seed=4, states=STATES, tasks_per_state=0, first_action_tasks=3,
                          action_space="stage_tools")
  rows = sft_rows.load_sft_rows(sft_rows.build_sft_set(tmp_path / "sft", spec, checker))
  assert len(rows) == 3 * len(STATES)
  seeds = {r["metadata"]["workspace_recipe"]["seed"] for r in rows}
  assert len(seeds) == 3 * 2  # three tasks per (track, outcome) cell, two cells
  for row in rows:
    meta = row["metadata"]
    instance = train_tasks.generate(meta["track"], meta["workspace_recipe"]["seed"],
                                    meta["outcome"], "stage_tools")
    assert meta["action_index"] == 0
    assert [m["role"] for m in row["messages"]] == ["system", "user"]
    assert row["messages"][1]["content"] == train_tasks.brief_for(instance, meta["stage"])
    assert sft_rows.target_action(row) == sft_rows.focus_actions(train_tasks, instance,
                                                                 meta["stage"])[0]


def test_rows_come_out_in_the_same_order_for_any_number_of_workers():
  spec = sft_rows.SftSpec(seed=5, states=STATES, tasks_per_state=0, first_action_tasks=4,
                          action_space="stage_tools")
  one = list(sft_rows.synthesize(spec))
  assert len(one) == 4 * len(STATES)
  assert list(sft_rows.synthesize(spec, workers=3)) == one


def test_e2e_tasks_add_whole_episodes_only(tmp_path, require_bwrap):
  """`e2e_tasks` rows: the E2E focus alone of further tasks, every action after the real
  observations of the ones before; the other foci of the same cell give nothing more."""
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.empty_export()),
                                   allow_no_markers=True)
  states = (grid.GridState("E2E", "detection", "recovery"),
            grid.GridState("S4", "detection", "recovery"))
  spec = sft_rows.SftSpec(seed=3, states=states, tasks_per_state=0, first_action_tasks=1,
                          e2e_tasks=2, action_space="stage_tools")
  rows = sft_rows.load_sft_rows(sft_rows.build_sft_set(tmp_path / "sft", spec, checker,
                                                       workers=2))
  parts = [r["metadata"]["sft_part"] for r in rows]
  assert parts.count("first_action") == 2
  e2e = [r for r in rows if r["metadata"]["sft_part"] == "e2e"]
  assert {r["metadata"]["stage"] for r in e2e} == {"E2E"}
  seeds = sorted({r["metadata"]["workspace_recipe"]["seed"] for r in e2e})
  assert len(seeds) == 2
  for seed in seeds:
    mine = [r for r in e2e if r["metadata"]["workspace_recipe"]["seed"] == seed]
    instance = train_tasks.generate("detection", seed, "recovery", "stage_tools")
    expert = sft_rows.focus_actions(train_tasks, instance, "E2E")
    assert [sft_rows.target_action(r) for r in mine] == expert and len(expert) == 7
    last = [m for m in mine[-1]["messages"] if m["role"] == "tool"]
    assert len(last) == 6 and all(m["content"].startswith("exit_code=0") for m in last)
  assert spec.to_json()["e2e_tasks"] == 2


def test_reaction_tasks_add_the_e2e_rows_after_validation(tmp_path, require_bwrap):
  """`reaction_tasks` rows: the E2E episode of further tasks from the call after validation on
  (the reaction to what it printed, then every call after), each after the real history."""
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.empty_export()),
                                   allow_no_markers=True)
  states = tuple(grid.GridState(f, "segmentation", o) for o in ("recovery", "failure")
                 for f in ("E2E", "S4"))
  spec = sft_rows.SftSpec(seed=6, states=states, tasks_per_state=0, reaction_tasks=1,
                          action_space="stage_tools", stop_rows=True)
  assert sft_rows.sft_part(spec, 0) == "reaction"
  rows = sft_rows.load_sft_rows(sft_rows.build_sft_set(tmp_path / "sft", spec, checker))
  assert {(r["metadata"]["sft_part"], r["metadata"]["stage"]) for r in rows} == {
      ("reaction", "E2E")}
  for outcome, first in (("recovery", "tools/fix.py --fault"), ("failure", "--blocked")):
    mine = [r for r in rows if r["metadata"]["outcome"] == outcome]
    instance = train_tasks.generate("segmentation", mine[0]["metadata"]["workspace_recipe"]
                                    ["seed"], outcome, "stage_tools")
    expert = sft_rows.focus_actions(train_tasks, instance, "E2E")
    # Every expert call from the reaction on, then the stop turn.
    assert [sft_rows.target_action(r) for r in mine[:-1]] == expert[3:]
    assert "final" in sft_rows.target_action(mine[-1])
    assert first in sft_rows.target_action(mine[0])["arguments"]["code"]
    history = [m for m in mine[0]["messages"] if m["role"] == "tool"]
    fault_line = toolspace.stage_tools.fault_line(
        instance.hidden["fault"], toolspace.short_id(instance, instance.hidden["fault_subject"]),
        outcome == "recovery")
    assert len(history) == 3 and fault_line in history[-1]["content"]
  assert spec.to_json()["reaction_tasks"] == 1


def _first_action_spec(seed: int = 4) -> sft_rows.SftSpec:
  return sft_rows.SftSpec(seed=seed, states=STATES, tasks_per_state=0, first_action_tasks=3,
                          action_space="stage_tools")


def test_a_task_the_leak_check_refuses_is_drawn_again(tmp_path):
  """A task whose rows hold a held-out marker by chance is replaced by another draw (recorded in
  the manifest), instead of the whole set, and with it the run, failing."""
  spec = _first_action_spec()
  plain = list(sft_rows.synthesize(spec))
  seed_of = lambda row: row["metadata"]["workspace_recipe"]["seed"]

  def refused_by(facts_line):   # the tasks whose rows hold this facts line as a "marker"
    checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers([facts_line],
                                                                                 salt=b"s")))
    return checker, {seed_of(r) for r in plain if checker.check_row(r)}

  for refused in (r["metadata"] for r in plain):   # a task whose facts line no other task has
    task = train_tasks.generate(refused["track"], refused["workspace_recipe"]["seed"],
                                refused["outcome"], "stage_tools")
    checker, hit = refused_by(toolspace.task_facts(task))
    if hit == {refused["workspace_recipe"]["seed"]}:
      break
  else:
    raise AssertionError("no task with a facts line of its own")
  cell_seeds = [seed_of(r) for r in plain
                if (r["metadata"]["track"], r["metadata"]["outcome"]) == (refused["track"],
                                                                          refused["outcome"])]
  task_index = list(dict.fromkeys(cell_seeds)).index(refused["workspace_recipe"]["seed"])
  out = sft_rows.build_sft_set(tmp_path / "sft", spec, checker)
  rows = sft_rows.load_sft_rows(out)
  manifest = sft_rows.shards.load_manifest(out)
  assert manifest["redraws"] == {f"{refused['track']}/{refused['outcome']}/{task_index}": 1}
  assert manifest["leak_receipt"]["rows_rejected"] == 0
  assert len(rows) == len(plain)
  seeds = lambda rs: [seed_of(r) for r in rs]
  assert refused["workspace_recipe"]["seed"] not in seeds(rows)
  # The redraw's group ids are new too: a refusal can come from the id's own hex text.
  refused_ids = {r["metadata"]["state_id"] for r in plain if seed_of(r) == seed_of({"metadata":
                                                                                    refused})}
  assert refused_ids and not refused_ids & {r["metadata"]["state_id"] for r in rows}
  # Every other task is the one drawn without the check (attempt 0 keeps its seed).
  changed = [i for i, (a, b) in enumerate(zip(seeds(plain), seeds(rows))) if a != b]
  assert changed and all(plain[i]["metadata"]["workspace_recipe"]["seed"]
                         == refused["workspace_recipe"]["seed"] for i in changed)


def test_a_generator_that_keeps_leaking_fails_closed(tmp_path):
  """Refusals beyond chance are a leaking generator: nothing is published."""
  spec = _first_action_spec()
  # A "marker" every row holds (the system prompt's wording).
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers(
      ["working in a sandboxed workspace"], salt=b"s")))
  with pytest.raises(sft_rows.SftLeakError, match="refused"):
    sft_rows.build_sft_set(tmp_path / "sft", spec, checker)
  assert not (tmp_path / "sft").exists()


def test_stop_rows_only_where_the_workflow_ends(require_bwrap):
  """`stage_stop_rows` False: E2E and S5 foci end with the stop turn, a stage-local S1-S4 focus
  at its last call (an E2E episode goes on from there, so a stop row would contradict it)."""
  states = tuple(grid.GridState(f, "vqa", "recovery") for f in workflow.FOCI)
  rows = list(sft_rows.synthesize(sft_rows.SftSpec(
      seed=2, states=states, action_space="stage_tools", stop_rows=True,
      stage_stop_rows=False)))
  instance = train_tasks.generate("vqa", rows[0]["metadata"]["workspace_recipe"]["seed"],
                                  "recovery", "stage_tools")
  for focus in workflow.FOCI:
    mine = [r for r in rows if r["metadata"]["stage"] == focus]
    expert = sft_rows.focus_actions(train_tasks, instance, focus)
    stops = focus in (workflow.E2E, "S5")
    assert len(mine) == len(expert) + stops, focus
    assert [sft_rows.target_action(r) for r in mine[:len(expert)]] == expert
    assert ("final" in sft_rows.target_action(mine[-1])) == stops, focus
  every = sft_rows.SftSpec(stop_rows=True)
  assert all(every.stops_after(f) for f in workflow.FOCI)
  assert not any(sft_rows.SftSpec(stage_stop_rows=False).stops_after(f) for f in workflow.FOCI)
