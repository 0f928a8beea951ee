"""Cold-start SFT rows: prior context plus exactly one target assistant action, model-neutral.

For a task and a focus (a stage, or E2E), the expert solver of `bat_jax.train_tasks` gives the
focus's actions. They are executed in a sandbox materialised at the focus's stage boundary
(`train_tasks.materialize_at`, which runs the earlier stages for real), so every prior turn is
followed by its real observation. Action k of the focus becomes one row:

    messages: system, user, then for j < k: {"role": "assistant", "action": a_j},
              {"role": "tool", "name": "execute_code", "content": observation_j}
    target:   {"role": "assistant", "reasoning_summary": thought_k,
               "action": {"type": "tool", "name": "execute_code", "arguments": {...}}}

Actions are stored as a tool name plus typed arguments; the model's chat template is applied only
later (`ChatFormat.encode_sft_example(row["messages"], target_action(row))`). The row's shape
follows the reference `sft-semantic-row.json`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from bat_jax import workflow
from bat_jax.stagebank import grid
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import rl_rows
from bat_jax.stagebank import rounds
from bat_jax.stagebank import shards

SFT_POOL = "sft"
LOSS_MASK = {"messages": 0, "target_reasoning_summary": 1, "target_action": 1, "padding": 0}


def neutral_action(action: Mapping[str, Any]) -> dict[str, Any]:
  """Validates an expert action and returns its model-neutral {name, arguments, thought}."""
  name, args = action.get("name"), action.get("arguments")
  if name != workflow.TOOL_NAME:
    raise ValueError(f"expert action field 'name' is {name!r}, expected {workflow.TOOL_NAME!r}")
  if not isinstance(args, Mapping) or set(args) != {"language", "code"}:
    raise ValueError(f"expert action field 'arguments' must hold exactly language and code, "
                     f"got {args!r}")
  if args["language"] not in workflow.TOOL_LANGUAGES:
    raise ValueError(f"expert action language {args['language']!r} is not one of "
                     f"{workflow.TOOL_LANGUAGES}")
  return {"name": name, "arguments": {"language": args["language"], "code": args["code"]},
          "thought": str(action.get("thought", ""))}


# The target of a focus's last row: no tool call, the agent is done (a rollout or held-out
# episode ends on it, `agent_stop`, instead of running to its call limit).
STOP_THOUGHT = "Every call this work needs has run; nothing is left to do."
STOP_TEXT = "Done."


def target_action(row: Mapping[str, Any]) -> dict[str, Any]:
  """The row's target as the action the chat formats take: `{name, arguments, thought}`, or
  `{thought, final}` for a final turn (no tool call)."""
  target = row["target"]
  if "action" not in target:
    return {"thought": target.get("reasoning_summary", ""), "final": target["content"]}
  return {"name": target["action"]["name"], "arguments": dict(target["action"]["arguments"]),
          "thought": target.get("reasoning_summary", "")}


def decision_kind(row: Mapping[str, Any]) -> str:
  """What the row's target decides, as `FOCUS:DECISION`: `stop` for a final turn; for a
  stage-tools call its command and first flag (`E2E:submit --failed`, `S3:fix --fault`), the
  choice a context asks for; for other code, its action index in the focus (`S2:action 1`)."""
  meta, target = row["metadata"], row["target"]
  if "action" not in target:
    return f"{meta['stage']}:stop"
  words = str(target["action"]["arguments"].get("code", "")).split()
  if workflow.call_stage(" ".join(words)) is None:
    return f"{meta['stage']}:action {meta['action_index']}"
  command = words[1].rsplit("/", 1)[-1].removesuffix(".py")
  flag = next((w for w in words[2:] if w.startswith("--")), "")
  return f"{meta['stage']}:{command} {flag}".rstrip()


def focus_actions(tasks_module: Any, instance: Any, focus: str) -> list[dict[str, Any]]:
  """The expert's actions of one focus (E2E: every stage's, in order), model-neutral."""
  stages = workflow.STAGES if focus == workflow.E2E else (focus,)
  return [neutral_action(a) for s in stages for a in tasks_module.expert_actions(instance, s)]


def rows_for_task(user: str, state: grid.GridState, actions: Sequence[Mapping[str, Any]],
                  observations: Sequence[str], *, state_id: str, task_seed: int,
                  generator: str, stop: bool = False) -> list[dict[str, Any]]:
  """One SFT row per action: context = everything before it, target = the action; with `stop`,
  one more whose context holds every action and observation and whose target is the final turn
  (`STOP_THOUGHT`, `STOP_TEXT`; `action_index == actions_in_focus`).

  Args:
    user: the row's user message (`train_tasks.brief_for(instance, focus)`).
    state: the grid state (focus, track, outcome).
    actions: the focus's model-neutral expert actions, in order.
    observations: each action's observation, from executing it.
    state_id: the task's group id.
    task_seed: the generator seed (recorded in the workspace recipe).
    generator: the generator id.
  """
  if len(observations) != len(actions):
    raise ValueError(f"{len(actions)} actions but {len(observations)} observations")
  context: list[dict[str, Any]] = [{"role": "system", "content": rl_rows.SYSTEM_PROMPT},
                                   {"role": "user", "content": user}]
  rows = []
  targets = [{"role": "assistant", "reasoning_summary": a["thought"],
              "action": {"type": "tool", "name": a["name"], "arguments": dict(a["arguments"])}}
             for a in actions]
  if stop:
    targets.append({"role": "assistant", "reasoning_summary": STOP_THOUGHT, "content": STOP_TEXT})
  for k, target in enumerate(targets):
    rows.append({
        "schema_version": rl_rows.ROW_SCHEMA_VERSION,
        "messages": [dict(m) for m in context],
        "target": target,
        "loss_mask": dict(LOSS_MASK),
        "metadata": {
            "state_id": state_id, "stage": state.focus, "track": state.track,
            "outcome": state.outcome, "grid_state": state.key, "action_index": k,
            "actions_in_focus": len(actions), "source": rl_rows.PROVENANCE_SOURCE,
            "model_specific_serialization": False,
            "workspace_recipe": {"generator": generator, "track": state.track,
                                 "outcome": state.outcome, "seed": task_seed,
                                 "boundary_stage": state.focus},
        },
    })
    if k < len(actions):
      context.append({"role": "assistant", "action": dict(actions[k])})
      context.append({"role": "tool", "name": workflow.TOOL_NAME, "content": observations[k]})
  return rows


@dataclasses.dataclass(frozen=True)
class SftSpec:
  """Which SFT rows to synthesise.

  Attributes:
    seed: base seed.
    tasks_per_state: generated tasks per grid state.
    states: grid states to cover (default: all 126).
    action_space: the tasks' action space (`workflow.ACTION_SPACES`).
    first_action_tasks: further tasks per grid state that give only the row of each focus's
      first action. Its context is the system and user messages alone (no observation), so
      nothing is executed for it: many distinct tasks cheaply, so a small policy must learn to
      copy a brief's values rather than memorise a few tasks' values.
    e2e_tasks: further tasks per (track, outcome) whose whole E2E episode gives rows (every
      action, each after the real observations of the ones before): the mid-episode contexts
      (a history of earlier stages' calls) that a held-out episode's later turns see, which
      stage-local rows never show.
    stop_rows: each executed focus (the `tasks_per_state` and `e2e_tasks` parts) also gives
      the row after its last call, whose target is the final turn: the agent ends its episode
      instead of calling on to its limit.
    stage_stop_rows: with `stop_rows`, stage-local foci before S5 too (False: only E2E and S5,
      where the workflow ends). After S3's last call an E2E episode calls `infer`, so an S3
      row that stops there teaches the opposite at the same observation: the SFT policy ended
      E2E episodes after "validation ok" (experiments/README.md, "Cut at both ends").
    reaction_tasks: further tasks per (track, outcome) whose E2E episode gives the rows after
      validation: the reaction to what it printed (infer, fix, or record the blocker) and every
      call after, each after the real history. That decision is one row of an E2E episode, ~2%
      of a set dominated by first actions; the tiny SFT policy garbled or skipped the fix on
      every held-out recovery cell (experiments/README.md, "A two-step plan").
  """
  seed: int = 0
  tasks_per_state: int = 1
  states: tuple[grid.GridState, ...] = grid.SOURCE_GRID
  action_space: str = "code"
  first_action_tasks: int = 0
  e2e_tasks: int = 0
  stop_rows: bool = False
  stage_stop_rows: bool = True
  reaction_tasks: int = 0

  def to_json(self) -> dict[str, Any]:
    return {"seed": self.seed, "tasks_per_state": self.tasks_per_state,
            "states": [s.key for s in self.states], "action_space": self.action_space,
            "first_action_tasks": self.first_action_tasks, "e2e_tasks": self.e2e_tasks,
            "stop_rows": self.stop_rows, "stage_stop_rows": self.stage_stop_rows,
            "reaction_tasks": self.reaction_tasks}

  def stops_after(self, focus: str) -> bool:
    """Whether an executed `focus` gets the stop row after its last call."""
    return self.stop_rows and (self.stage_stop_rows or focus in (workflow.E2E, workflow.STAGES[-1]))

  def tasks_per_cell(self) -> int:
    return (self.tasks_per_state + self.first_action_tasks + self.e2e_tasks
            + self.reaction_tasks)


class SftLeakError(RuntimeError):
  """The leak check refused too many SFT tasks (or every draw of one): nothing is published."""


# A task whose rows the leak check refuses is drawn again (another task seed), at most this many
# times; more than `MAX_REDRAWN_SHARE` of the tasks refused is a generator that leaks, not chance.
MAX_REDRAWS = 8
MAX_REDRAWN_SHARE = 0.01


def synthesize(spec: SftSpec, *, sandbox_limits: Any = None, workers: int = 1,
               checker: Optional[leakcheck.LeakChecker] = None,
               redraws: Optional[dict[str, int]] = None) -> Iterator[dict[str, Any]]:
  """Generates every SFT row of `spec`, running the expert actions in sandboxes.

  One task is generated per (track, outcome, i) and shared by all of its foci, so the boundary
  snapshots of `materialize_at` (cached in a per-task temporary directory, removed afterwards)
  run each earlier stage once. The `first_action_tasks` after them give one row per focus
  (its first action; `actions_in_focus` 1) and run nothing; the `e2e_tasks` after those give
  their E2E focus's rows alone. `workers` tasks are synthesised at
  once on threads (a task's time is mostly sandbox start-up and waits, not Python); the rows
  come out in the same order for any `workers`.

  With a `checker`, a task any of whose rows it refuses is drawn again (`MAX_REDRAWS`), and
  `redraws` gets `"track/outcome/i" -> the attempt kept`: a generated task can spell a held-out
  marker by chance (a fuzzy match over its names and ids, ~1 task in 5,000), and one such task
  must not end the run.
  """
  from bat_jax.sandbox import SandboxLimits
  limits = sandbox_limits if sandbox_limits is not None else SandboxLimits()
  cells: dict[tuple[str, str], list[grid.GridState]] = {}
  for state in spec.states:
    cells.setdefault((state.track, state.outcome), []).append(state)
  jobs = [(track, outcome, sorted(states, key=lambda s: workflow.FOCI.index(s.focus)), i)
          for (track, outcome), states in cells.items()
          for i in range(spec.tasks_per_cell())]
  one_task = lambda job: _clean_task_rows(spec, limits, job, checker, redraws)
  if workers <= 1:
    for job in jobs:
      yield from one_task(job)
    return
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sft-rows") as pool:
    for rows in pool.map(one_task, jobs):
      yield from rows


def _clean_task_rows(spec: SftSpec, limits: Any, job: tuple, checker: Any,
                     redraws: Optional[dict[str, int]]) -> list[dict[str, Any]]:
  """`_one_task_rows` of `job`, drawn again while `checker` refuses any of its rows."""
  if checker is None:
    return _one_task_rows(spec, limits, *job)
  track, outcome, _, i = job
  for attempt in range(MAX_REDRAWS):
    rows = _one_task_rows(spec, limits, *job, attempt=attempt)
    if not any(checker.check_row(r, index=n, pool=SFT_POOL) for n, r in enumerate(rows)):
      if attempt and redraws is not None:
        redraws[f"{track}/{outcome}/{i}"] = attempt
      return rows
  raise SftLeakError(f"SFT task {track}/{outcome}/{i} (seed {spec.seed}): the leak "
                                 f"check refused all {MAX_REDRAWS} draws")


def _one_task_rows(spec: SftSpec, limits: Any, track: str, outcome: str,
                   states: Sequence[grid.GridState], i: int, attempt: int = 0
                   ) -> list[dict[str, Any]]:
  """The rows of task `i` of one (track, outcome) cell over its foci (`states`, in order);
  `attempt` > 0 draws another task (one the leak check refused: `_clean_task_rows`)."""
  from bat_jax import train_tasks  # deferred: the bank's CLI must start without the task families
  redraw = (attempt,) if attempt else ()   # attempt 0 keeps the seeds of sets built before
  task_seed = rounds.derive_seed(SFT_POOL, spec.seed, track, outcome, i, *redraw) & 0x7FFFFFFF
  instance = train_tasks.generate(track, task_seed, outcome, spec.action_space)
  row = functools.partial(_task_rows, train_tasks, instance, task_seed=task_seed, index=i,
                          seed=spec.seed, attempt=attempt)
  part = sft_part(spec, i)
  if part == "first_action":  # first actions only: their context has no observation
    return _tagged(part, [r for state in states for r in row(
        state, focus_actions(train_tasks, instance, state.focus)[:1], [""], stop=False)])
  if part in ("e2e", "reaction"):
    states = [s for s in states if s.focus == workflow.E2E]
  out = []
  with tempfile.TemporaryDirectory(prefix="bat-sft-") as tmp:
    for state in states:
      sandbox = train_tasks.materialize_at(instance, state.focus, Path(tmp) / state.focus, limits,
                                     cache_dir=Path(tmp) / "cache")
      actions = focus_actions(train_tasks, instance, state.focus)
      observations = [sandbox.execute(a["arguments"]["language"],
                                      a["arguments"]["code"]).observation for a in actions]
      rows = row(state, actions, observations, stop=spec.stops_after(state.focus))
      out += rows[REACTION_INDEX:] if part == "reaction" else rows
  return _tagged(part, out)


# An E2E episode's action after plan, setup and validate: the reaction to validation's report.
REACTION_INDEX = 3


def sft_part(spec: SftSpec, i: int) -> str:
  """Which part of `spec` task `i` of a (track, outcome) cell belongs to: `full` (every focus,
  executed), `first_action`, `e2e` or `reaction` (the row metadata's `sft_part`)."""
  ends = itertools.accumulate((spec.tasks_per_state, spec.first_action_tasks, spec.e2e_tasks))
  return next((part for part, end in zip(("full", "first_action", "e2e"), ends) if i < end),
              "reaction")


def _tagged(part: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  for r in rows:
    r["metadata"]["sft_part"] = part
  return rows


def _task_rows(tasks_module: Any, instance: Any, state: grid.GridState,
               actions: Sequence[Mapping[str, Any]], observations: Sequence[str], *,
               task_seed: int, index: int, seed: int, stop: bool,
               attempt: int = 0) -> list[dict[str, Any]]:
  # A redrawn task gets its own group id too: the refused text can be the id's (a hex state_id
  # beside the next field can spell a held-out case id to the junction scan).
  pool = f"{SFT_POOL}/redraw{attempt}" if attempt else SFT_POOL
  sid = rounds.state_id(-1, rounds.DATA_SOURCE, pool, state.key, index, seed)
  return rows_for_task(tasks_module.brief_for(instance, state.focus), state, actions,
                       observations, state_id=sid, task_seed=task_seed, stop=stop,
                       generator=f"bat_jax.train_tasks/{instance.track}")


def build_sft_set(out_dir: Path, spec: SftSpec, checker: leakcheck.LeakChecker, *,
                  sandbox_limits: Any = None, workers: int = 1) -> Path:
  """Synthesises (`workers` tasks at once), leak-checks (fail-closed) and atomically publishes
  an SFT set to `out_dir`. A task the check refuses is drawn again (`synthesize`; the manifest's
  `redraws`), at most `MAX_REDRAWN_SHARE` of them; the whole set is then checked once more and
  any refused row rejects it."""
  redraws: dict[str, int] = {}
  rows = list(synthesize(spec, sandbox_limits=sandbox_limits, workers=workers, checker=checker,
                         redraws=redraws))
  tasks = len({r["metadata"]["workspace_recipe"]["seed"] for r in rows})
  if len(redraws) > max(1, MAX_REDRAWN_SHARE * tasks):
    raise SftLeakError(
        f"the leak check refused {len(redraws)} of {tasks} SFT tasks (at most "
        f"{MAX_REDRAWN_SHARE:.0%} are redrawn): the training generator emits held-out content; "
        f"redrawn: {sorted(redraws)[:10]}")
  receipt = checker.check_rows((SFT_POOL, r) for r in rows)
  if not receipt.passed:
    raise leakcheck.RoundRejected(receipt)
  return shards.publish_dir(Path(out_dir), {SFT_POOL: rows}, {
      "kind": "sft", "config": spec.to_json(), "leak_receipt": receipt.to_json(),
      "redraws": dict(sorted(redraws.items()))})


def load_sft_rows(sft_dir: Path) -> list[dict[str, Any]]:
  """The rows of a published SFT set, after digest and receipt verification."""
  return shards.read_rows(sft_dir, SFT_POOL)
