"""The `stage_tools` action space in the real sandbox: the expert scores 1.0 on every training
and held-out cell, a null agent 0, and wrongly grounded calls fail or earn what the rubric
rejects."""

import collections
import json
import re
from pathlib import Path

import pytest

from bat_jax import rubric, workflow
from bat_jax import train_tasks
from bat_jax.evaluator import generators
from bat_jax.evaluator.agents import NullAgent, OracleAgent
from bat_jax.evaluator.cells import Cell
from bat_jax.evaluator.episode import run_cell
from bat_jax.sandbox import SandboxLimits
from bat_jax.taskkit import expert_actions, expert_episode, materialize_at, toolspace

CELLS = [(t, o) for t in workflow.TRACKS for o in workflow.OUTCOMES]
LIMITS = SandboxLimits(wall_s=60.0)


def _run(sandbox, code: str):
  return sandbox.execute("bash", code)


def _score(inst, focus, sandbox):
  return rubric.score(inst, focus, sandbox.workspace, sandbox.evidence)


def test_actions_are_short_grounded_tool_calls():
  inst = train_tasks.generate("classification", 5, "recovery", "stage_tools")
  facts = toolspace.facts(inst)
  calls = [a["arguments"]["code"] for s in workflow.STAGES for a in expert_actions(inst, s)]
  assert all(c.startswith("python tools/") and len(c) < 160 for c in calls), calls
  assert facts["weights"] in calls[0] and facts["card"] in calls[1]
  fix = calls[3]
  assert inst.hidden["fault"] in fix
  assert str(toolspace.short_id(inst, inst.hidden["fault_subject"])) in fix
  # The copied values are short ids (a letter, a digit) that the spec maps to real values.
  ids = inst.spec["ids"]
  others = {short for m, short, _ in _listed(inst) if m != facts["modality"]}
  assert sorted([facts[k] for k in toolspace.ID_LETTERS] + sorted(others)) == sorted(ids)
  assert all(re.fullmatch(r"[cwdvs]\d", i) for i in ids), ids
  assert ids[facts["card"]] == inst.spec["model"]["card"]
  assert ids[facts["validation"]] == ",".join(inst.spec["validation_case_ids"])
  assert toolspace.task_facts(inst) in inst.brief and "tools/" in inst.brief
  assert set(workflow.STAGE_TOOL_FILES) <= set(inst.files)
  assert inst.spec["stage_tools"] == dict(workflow.STAGE_TOOLS)
  code_task = train_tasks.generate("classification", 5, "recovery")
  assert code_task.action_space == "code" and not set(workflow.STAGE_TOOL_FILES) & set(
      code_task.files)
  with pytest.raises(ValueError, match="action space"):
    train_tasks.generate("classification", 5, "recovery", "gui")


def _listed(inst) -> list[tuple[str, str, str]]:
  """(modality, short id, path) of each checkpoint, in the facts line's order."""
  return [(m, toolspace.short_id(inst, path), path) for m, path in inst.spec["checkpoints"]]


@pytest.mark.parametrize("side", ["train", "heldout"])
def test_the_plan_names_the_checkpoint_of_the_tasks_modality(side):
  """S1 is a two-step look-up: the facts line lists one checkpoint per modality, in an order
  drawn per task, and the expert's plan names the card's weights, the task modality's."""
  make = (lambda s: train_tasks.generate(workflow.TRACKS[s % 7], s, "success", "stage_tools")) \
      if side == "train" else \
      (lambda s: generators.generate(workflow.TRACKS[s % 7], s, "success", "lite", "stage_tools"))
  positions, modalities = collections.Counter(), collections.Counter()
  for seed in range(42):
    inst = make(seed)
    facts, listed = toolspace.facts(inst), _listed(inst)
    own = [i for i, (m, _, _) in enumerate(listed) if m == facts["modality"]]
    assert len(own) == 1 and len({m for m, _, _ in listed}) == toolspace.N_CHECKPOINTS
    assert len({short for _, short, _ in listed}) == toolspace.N_CHECKPOINTS
    _, short, path = listed[own[0]]
    assert path == inst.hidden["weights"] and short == facts["weights"]
    line = toolspace.task_facts(inst)
    assert f"modality: {facts['modality']};" in line
    assert "weights: " + ", ".join(f"{m} {s}" for m, s, _ in listed) + ";" in line
    plan = toolspace.tool_actions(inst, "S1")[0]["arguments"]["code"]
    assert f"--weights {facts['weights']} " in plan
    assert all(p in inst.files for _, _, p in listed)   # every listed checkpoint exists
    positions[own[0]] += 1
    modalities[facts["modality"]] += 1
  # Neither a position nor a modality answers it: the look-up is needed.
  assert len(positions) == toolspace.N_CHECKPOINTS and max(positions.values()) <= 24
  assert set(modalities) == set(toolspace.MODALITIES)


def test_a_plan_naming_another_modalitys_checkpoint_is_not_grounded(tmp_path):
  inst = train_tasks.generate("detection", 4, "success", "stage_tools")
  facts = toolspace.facts(inst)
  wrong = next(s for m, s, _ in _listed(inst) if m != facts["modality"])
  for weights, grounded in ((wrong, False), (facts["weights"], True)):
    sandbox = materialize_at(inst, "S1", tmp_path / weights)
    res = _run(sandbox, f"python tools/plan.py --weights {weights} --data {facts['data']} "
                        f"--cases {facts['cases']}")
    assert res.exit_code == 0, res.stderr
    items = _score(inst, "S1", sandbox).stage_items["S1"]
    assert items["resources_grounded"] is grounded and items["plan_written"]


# The default suite runs one cell per track (outcomes rotating); the slow run every cell.
ONE_PER_TRACK = [(t, workflow.OUTCOMES[i % 3]) for i, t in enumerate(workflow.TRACKS)]
_CELL_PARAMS = [pytest.param(t, o, marks=() if (t, o) in ONE_PER_TRACK else pytest.mark.slow)
                for t, o in CELLS]


@pytest.mark.parametrize("track,outcome", _CELL_PARAMS)
def test_expert_and_null_on_every_training_and_heldout_cell(require_bwrap, tmp_path, track,
                                                            outcome):
  train = train_tasks.generate(track, 11, outcome, "stage_tools")
  ep = expert_episode(train, workflow.E2E, tmp_path / "train", LIMITS)
  assert ep.result.reward == 1.0, ep.result
  cell = Cell(track, outcome, seed=4242, tier="lite", action_space="stage_tools")
  oracle = run_cell(cell, OracleAgent, tmp_path / "oracle", sandbox_limits=LIMITS)
  assert oracle["valid"] and oracle["overall"] == 1.0, oracle
  null = run_cell(cell, NullAgent, tmp_path / "null", sandbox_limits=LIMITS)
  assert null["valid"] and null["overall"] == 0.0 and null["agentic"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("track,outcome", CELLS)
def test_expert_on_every_stage_boundary(require_bwrap, tmp_path, track, outcome):
  for seed in range(3):
    inst = train_tasks.generate(track, 300 + seed, outcome, "stage_tools")
    for focus in workflow.FOCI:
      ep = expert_episode(inst, focus, tmp_path / f"{seed}{focus}", LIMITS,
                          cache_dir=tmp_path / f"c{seed}")
      assert ep.result.reward == 1.0, (seed, focus, ep.result)


def test_train_and_heldout_differ_but_share_the_tools():
  train = train_tasks.generate("vqa", 3, "recovery", "stage_tools")
  held = generators.generate("vqa", 3, "recovery", "lite", "stage_tools")
  for rel in workflow.STAGE_TOOL_FILES:
    assert train.files[rel] == held.files[rel]
  # Both sides draw each short id's digit from all ten, per task: no digit is one side's, so
  # the policy has written every held-out id in training, and a memorised one is right 1 in 10.
  def digits(side, kind):
    return collections.Counter(int(toolspace.facts(side(seed))[kind][1:]) for seed in range(60))
  sides = {"train": lambda seed: train_tasks.generate("detection", seed, "success", "stage_tools"),
           "held": lambda seed: generators.generate("detection", seed, "success", "lite",
                                                    "stage_tools")}
  for name, side in sides.items():
    for kind in toolspace.ID_LETTERS:
      counts = digits(side, kind)
      assert set(counts) == set(range(10)), (name, kind, counts)
      assert max(counts.values()) <= 15, (name, kind, counts)   # ~6 each of 60: not one digit
      assert {toolspace.facts(side(s))[kind][0] for s in range(3)} == {
          toolspace.ID_LETTERS[kind]}
  assert train.brief.split("Facts:")[0] != held.brief.split("facts:")[0]
  assert train.task_id != held.task_id and held.task_id.startswith("task-")


def test_wrong_grounding_fails_or_is_rejected(require_bwrap, tmp_path):
  inst = train_tasks.generate("segmentation", 8, "success", "stage_tools")
  f = toolspace.facts(inst)
  # S1: a wrong case count still writes a plan, but its resources are not grounded.
  sb = materialize_at(inst, "S1", tmp_path / "s1", LIMITS)
  res = _run(sb, f"python tools/plan.py --weights {f['weights']} --data {f['data']} "
                 f"--cases {f['cases'] + 3}")
  assert res.exit_code == 0
  items = _score(inst, "S1", sb).stage_items["S1"]
  assert items["plan_written"] and not items["resources_grounded"]
  # S2: a card path that is not the card fails and leaves no evidence.
  sb = materialize_at(inst, "S2", tmp_path / "s2", LIMITS)
  assert _run(sb, "python tools/setup.py --card models/nope/card.json").exit_code == 1
  assert _score(inst, "S2", sb).stage_scores["S2"] is None
  # S3: an id outside the index fails.
  sb = materialize_at(inst, "S3", tmp_path / "s3", LIMITS)
  assert _run(sb, "python tools/validate.py --cases nope-1").exit_code == 1
  assert _score(inst, "S3", sb).stage_scores["S3"] is None
  # S4: another data folder fails.
  sb = materialize_at(inst, "S4", tmp_path / "s4", LIMITS)
  assert _run(sb, "python tools/infer.py --data data/elsewhere").exit_code == 1
  # S5: a submission written elsewhere under submission/ is not the native one.
  sb = materialize_at(inst, "S5", tmp_path / "s5", LIMITS)
  assert _run(sb, "python tools/submit.py --to submission/other.csv").exit_code == 0
  items = _score(inst, "S5", sb).stage_items["S5"]
  assert not items["submission_native_schema"] and not items["submission_complete"]


def test_reactive_fix_must_name_the_observed_fault(require_bwrap, tmp_path):
  inst = next(i for i in (train_tasks.generate("classification", s, "recovery", "stage_tools")
                          for s in range(60)) if i.hidden["fault"] == "corrupted_case")
  ids = toolspace.facts(inst)["validation"]
  sb = materialize_at(inst, "S3", tmp_path / "ok", LIMITS)
  first = _run(sb, f"python tools/validate.py --cases {ids}")
  assert f"fault: corrupted_case subject: {inst.hidden['fault_subject']}" in first.observation
  # Excluding another (valid) case is applied as told, and the rubric rejects it.
  other = next(c for c in inst.hidden["case_ids"] if c != inst.hidden["fault_subject"])
  sb = materialize_at(inst, "S3", tmp_path / "wrong", LIMITS)
  _run(sb, f"python tools/validate.py --cases {ids}")
  assert _run(sb, f"python tools/fix.py --fault corrupted_case --subject {other}").exit_code == 0
  _run(sb, f"python tools/validate.py --cases {ids}")
  items = _score(inst, "S3", sb).stage_items["S3"]
  assert items["failure_diagnosed"] and not items["correction_executed"]
  assert not items["corrected_result_verified"]
  # A fault that cannot be fixed here is refused.
  assert _run(sb, "python tools/fix.py --fault missing_dependency --subject x").exit_code == 1


def test_receipts_still_need_executed_writes(require_bwrap, tmp_path):
  """A stage tool's receipt is void once a file it names is edited afterwards."""
  inst = train_tasks.generate("detection", 2, "success", "stage_tools")
  sb = materialize_at(inst, "S5", tmp_path / "s5", LIMITS)
  for a in expert_actions(inst, "S5"):
    assert _run(sb, a["arguments"]["code"]).exit_code == 0
  assert _score(inst, "S5", sb).reward == 1.0
  target = Path(sb.workspace) / inst.spec["submission"]["path"]
  target.write_text(target.read_text() + "\n")  # outside any executed call
  assert _score(inst, "S5", sb).reward < 1.0
  assert json.loads((Path(sb.workspace) / workflow.ARTIFACTS["spec"]).read_text())[
      "stage_tools"]["S5"] == workflow.STAGE_TOOLS["S5"]


@pytest.mark.parametrize("outcome", workflow.OUTCOMES)
def test_handoff_states_what_validation_printed_and_decides_the_next_call(
    require_bwrap, tmp_path, outcome):
  """A stage-local S4 / S5 row's first call follows from its context: the brief's handoff is
  the line validation really printed by that boundary, and the expert's call copies from it
  (an unfixable fault: `--blocked FAULT`, `--failed FAULT --subject SUBJECT`); the outcome the
  task hides is never needed."""
  inst = train_tasks.generate("segmentation", 11, outcome, "stage_tools")
  sb = materialize_at(inst, "S3", tmp_path / "s3", LIMITS)
  printed = [_run(sb, a["arguments"]["code"]).observation for a in expert_actions(inst, "S3")]
  last_line = printed[-1].split("stdout:", 1)[1].splitlines()[0]
  report = toolspace.validation_report(inst)
  assert last_line.startswith(report)
  assert (report == last_line) == (outcome == "failure")
  for stage in ("S4", "S5"):
    brief = train_tasks.brief_for(inst, stage)
    assert f", which printed: {report}" in brief
    (call,) = [a["arguments"]["code"] for a in expert_actions(inst, stage)]
    if outcome == "failure":
      fault = re.search(r"fault: (\S+) subject: (\S+)", brief)
      assert f"--{'blocked' if stage == 'S4' else 'failed'} {fault.group(1)}" in call
      assert stage == "S4" or call.endswith(f"--subject {fault.group(2)}")
    else:
      assert "--blocked" not in call and "--failed" not in call
  for stage in ("S1", "S2", "S3"):
    assert "printed" not in train_tasks.brief_for(inst, stage)


@pytest.mark.parametrize("outcome", workflow.OUTCOMES)
def test_handoff_lists_the_earlier_stages_calls_never_the_stages_own(outcome):
  """A stage-local row's handoff lists the calls of the stages before it, in order, so its own
  call must pick its id past theirs and its tool after theirs, as in an episode; the row's own
  call, stage and tool never appear."""
  inst = train_tasks.generate("detection", 5, outcome, "stage_tools")
  assert "Calls run" not in train_tasks.brief_for(inst, "S1")
  for k, stage in enumerate(workflow.STAGES[1:], start=1):
    brief = train_tasks.brief_for(inst, stage)
    earlier = [a["arguments"]["code"] for s in workflow.STAGES[:k]
               for a in expert_actions(inst, s)]
    listed = brief.split("Calls run: ", 1)[1].split(". Continue", 1)[0]
    assert [c.split(", which printed")[0] for c in listed.split("; ")] == earlier
    if "S3" in workflow.STAGES[:k]:  # validation's printout follows its last call, as in an episode
      last_validate = max(i for i, c in enumerate(earlier) if "validate.py" in c)
      assert listed.split("; ")[last_validate].endswith(toolspace.validation_report(inst))
    own = {a["arguments"]["code"] for a in expert_actions(inst, stage)} - set(earlier)
    assert own and not any(call in brief for call in own), (stage, own)
    # The row poses the episode's choice: neither its stage nor its stage's tool is named.
    command = next(c for c, s in workflow.COMMAND_STAGES.items() if s == stage)
    assert f"tools/{command}.py" not in brief and stage not in brief, (stage, brief)


def test_e2e_briefs_vary_in_every_part_but_keep_the_facts():
  briefs = [train_tasks.generate("detection", s, "success", "stage_tools") for s in range(60)]
  openings = {b.brief.split(". ")[0] for b in briefs}
  labels = {re.search(r"(\S+:) card: ", b.brief).group(1) for b in briefs}
  assert len(openings) >= 8 and len(labels) >= 6
  assert all(toolspace.task_facts(b) in b.brief for b in briefs)
  assert len({b.brief.replace(toolspace.task_facts(b), "") for b in briefs}) >= 50


@pytest.mark.parametrize("fault", workflow.FAULTS["recovery"] + workflow.FAULTS["failure"])
def test_reactive_calls_copy_values_that_follow_a_space_in_the_observation(
    require_bwrap, tmp_path, fault):
  """Each value a reactive call copies (`--fault F`, `--subject S`, `--blocked F`, ...) stands in
  validate's line after a space, as after its flag in the call: a byte-level BPE splits it into
  the same tokens in both places (`fault=degenerate_output` began with `=`, `de`, `generate`,
  the call with ` degenerate`), so copying is copying tokens, on both sides."""
  outcome = "recovery" if fault in workflow.FAULTS["recovery"] else "failure"
  sides = {"train": lambda s: train_tasks.generate("detection", s, outcome, "stage_tools"),
           "heldout": lambda s: generators.generate("detection", s, outcome, "lite",
                                                    "stage_tools")}
  for side, make in sides.items():
    inst = next(i for i in map(make, range(80)) if i.hidden["fault"] == fault)
    sb = materialize_at(inst, "S3", tmp_path / side, LIMITS)
    f = toolspace.facts(inst)
    printed = _run(sb, f"python tools/validate.py --cases {f['validation']}").observation
    stage = "S3" if outcome == "recovery" else "S5"
    reaction = expert_actions(inst, stage)[1 if outcome == "recovery" else 0]
    copied = re.findall(r"--(?:fault|subject|blocked|failed) (\S+)",
                        reaction["arguments"]["code"])
    assert copied and fault in copied, (side, reaction)
    for value in copied:
      assert f" {value} " in printed or printed.split("stdout:")[1].startswith(f"{value} "), \
          (side, value, printed)
      assert f"={value}" not in printed, (side, value, printed)
