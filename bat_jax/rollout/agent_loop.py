"""Multi-turn, token-in / token-out agent loop over sandboxed task workspaces.

For every row (a `RolloutItem`) the loop runs G continuations in parallel, each in its own
freshly materialised workspace and on its own thread: a turn (batched with the other
trajectories' turns by an `EngineWorker`), its tool calls, the observation appended as the chat
template's token delta, the next turn. Nothing waits for a batch-mate's turn or tool call, and
each turn samples with its own seed, so the tokens do not depend on the batching. Token-in /
token-out:

* generated tokens are kept exactly as the engine returned them (ids and logprobs), loss mask 1;
* observations are appended as `ChatFormat.encode_observation_delta` tokens, loss mask 0;
* generated text is decoded only to *parse* the tool call, never re-encoded.

Malformed output (unparseable call, unknown tool, wrong arguments, over-long code, a turn cut
at the per-turn token limit) becomes an observation saying what was wrong and the trajectory
goes on. Failures of the infrastructure (sandbox, engine) end only the trajectory they hit
(finish reason "error", reward 0); a rollout never crashes the batch. A rubric failure is
scored 0 but stays trainable: the rubric reads what the policy wrote. A request the server
aborted ends its trajectory as "aborted" without keeping the cut turn. Neither is
`Trajectory.trainable`. An over-context prompt (the JAX engine's check, or SGLang's HTTP 400)
ends the trajectory as "context_full", the policy's own outcome.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from bat_jax import rubric, train_tasks, workflow
from bat_jax.model.chat_format import ChatFormat
from bat_jax.rollout.engine import (Completion, Engine, GenerateRequest, PromptTooLongError,
                                    SamplingParams)
from bat_jax.rollout.trajectory import Trajectory
from bat_jax.rollout.worker import EngineWorker
from bat_jax.rollout_protocol import (RolloutLimits, calls_over_limit, cut_turn,
                                      error_observation, malformed_call, tool_call_problem)
from bat_jax.sandbox import SandboxLimits
from bat_jax.stagebank.rounds import derive_seed

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RolloutItem:
  """One row to roll out: a reset point and its reward contract.

  Attributes:
    state_id: GRPO group key.
    focus: `E2E` or the stage the row asks for (its rubric is the reward).
    pool: Stage Bank pool.
    messages: the model-neutral prompt (system + user).
    instance: the task instance (`bat_jax.train_tasks.TaskInstance`) the workspace is built from.
  """
  state_id: str
  focus: str
  pool: str
  messages: tuple[Mapping[str, Any], ...]
  instance: Any

  @classmethod
  def from_row(cls, row: Mapping[str, Any], instance: Any = None) -> "RolloutItem":
    """From a Stage Bank RL row; the instance is regenerated from its workspace recipe."""
    try:
      extra = row["extra_info"]
      recipe = extra["workspace_recipe"]
      if instance is None:
        instance = train_tasks.generate(recipe["track"], int(recipe["seed"]), recipe["outcome"],
                                        recipe.get("action_space", "code"))
      return cls(state_id=str(extra["state_id"]), focus=str(extra["focus_stage"]),
                 pool=str(extra["source_pool"]), messages=tuple(row["prompt"]),
                 instance=instance)
    except KeyError as e:
      raise ValueError(f"RL row is missing field {e.args[0]!r}") from e


@dataclasses.dataclass(frozen=True)
class Score:
  """The rubric's verdict on one finished workspace."""
  reward: float
  stage_items: Mapping[str, Mapping[str, Optional[bool]]]
  stage_scores: Mapping[str, Optional[float]]
  task_score: Optional[float]
  failed_calls: int = 0  # executed calls that exited non-zero (the evidence log's count)


class Environment(Protocol):
  """A resettable tool environment: one per trajectory."""

  def execute(self, language: str, code: str) -> str:
    """Runs a tool call; returns the observation text."""
    ...

  def score(self) -> Score:
    ...


class TaskEnvironment:
  """A task workspace at the row's stage boundary, in the bubblewrap sandbox, with its rubric."""

  def __init__(self, item: RolloutItem, root: Path,
               sandbox_limits: Optional[SandboxLimits] = None, *,
               cache_dir: Optional[Path] = None):
    self.item = item
    boundary = workflow.STAGES[0] if item.focus == workflow.E2E else item.focus
    self.sandbox = train_tasks.materialize_at(item.instance, boundary, Path(root),
                                        sandbox_limits or SandboxLimits(), cache_dir=cache_dir)

  def execute(self, language: str, code: str) -> str:
    return self.sandbox.execute(language, code).observation

  def score(self) -> Score:
    r = rubric.score(self.item.instance, self.item.focus, self.sandbox.workspace,
                     self.sandbox.evidence)
    return Score(reward=float(r.reward), stage_items=r.stage_items,
                 stage_scores=r.stage_scores, task_score=r.task_score,
                 failed_calls=sum(1 for rec in self.sandbox.evidence if rec.exit_code != 0))


def task_environments(root: Path, sandbox_limits: Optional[SandboxLimits] = None, *,
                      cache_dir: Optional[Path] = None
                      ) -> Callable[[RolloutItem, int], Environment]:
  """An environment factory: workspace `root/<state_id>-<g>-<nonce>` per continuation.

  With `cache_dir`, stage-boundary snapshots are reused, so the G continuations of a row (and
  later rows of the same task) do not re-run the expert's earlier stages.
  """
  def make(item: RolloutItem, g: int) -> Environment:
    return TaskEnvironment(item, Path(root) / f"{item.state_id[:16]}-{g}-{uuid.uuid4().hex[:8]}",
                           sandbox_limits, cache_dir=cache_dir)
  return make


@dataclasses.dataclass
class _Live:
  """A trajectory in progress."""
  item: RolloutItem
  g: int
  session: str
  env: Optional[Environment]
  traj: Trajectory
  done: bool = False
  calls: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)  # this turn's
  notes: list[str] = dataclasses.field(default_factory=list)  # error observations this turn

  def finish(self, reason: str, error: Optional[str] = None) -> None:
    self.done = True
    self.traj.finish_reason = reason
    if error:
      self.traj.error = error


class AgentLoop:
  """Rolls out G continuations per item with an engine, a chat format and tool environments.

  Args:
    engine: any `Engine` (JAX in process, or SGLang).
    chat_format: `bat_jax.model.chat_format.ChatFormat` of the policy's family.
    make_env: builds the environment of continuation g of an item (see `task_environments`).
    sampling: temperature / top-p / top-k; `max_new_tokens`, stop ids and the seed are set per
      turn.
    limits: per-trajectory limits.
    concurrency: trajectories in flight at once (threads; at most the engine's slots).
    step_tokens: `EngineWorker` step of a prefix-caching engine (None: whole turns).
    stage_end: a stage-local row ends where its stage does: a turn that calls a later stage's
      command (`workflow.call_stage`) finishes the trajectory (`stage_end`) unrun, and its
      tokens are dropped (`rollout.stage_end`; the stage-tools action space).
  """

  def __init__(self, engine: Engine, chat_format: ChatFormat,
               make_env: Callable[[RolloutItem, int], Environment], *,
               sampling: SamplingParams = SamplingParams(temperature=1.0),
               limits: RolloutLimits = RolloutLimits(), concurrency: int = 8,
               step_tokens: Optional[int] = None, stage_end: bool = False):
    if concurrency < 1:
      raise ValueError(f"concurrency = {concurrency} must be >= 1")
    self.engine = engine
    self.chat_format = chat_format
    self.make_env = make_env
    self.sampling = sampling
    self.limits = limits
    self.concurrency = concurrency
    self.step_tokens = step_tokens
    self.stage_end = stage_end
    self._stop_ids = tuple(chat_format.stop_token_ids)

  def run(self, items: Sequence[RolloutItem], group_size: int,
          seed: int = 0) -> list[Trajectory]:
    """G = group_size trajectories per item, ordered item-major.

    Each trajectory runs on its own thread (turn, tool calls, next turn), and an
    `EngineWorker` batches the turns of all of them continuously, so no trajectory waits for
    another's turn or tool call. Turn k of continuation g samples with its own seed
    (`turn_seed`): a trajectory's tokens depend on `seed`, the params and its own observations,
    never on what ran beside it (the JAX engine's rows are batch-invariant), so a replayed step
    reproduces its rollouts.
    """
    if group_size < 1:
      raise ValueError(f"group_size = {group_size} must be >= 1")
    threads = max(1, min(self.concurrency, len(items) * group_size))
    worker = EngineWorker(self.engine, max_batch=threads, step_tokens=self.step_tokens)
    try:
      with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        live = self._start_all(items, group_size, pool)
        try:
          list(pool.map(lambda s: self._episode(s, worker, seed), live))
        finally:
          worker.release([s.session for s in live])
        list(pool.map(self._score, live))
    finally:
      worker.close()
    return [s.traj for s in live]

  # -- phases ---------------------------------------------------------------------------------

  def _start_all(self, items: Sequence[RolloutItem], group_size: int,
                 pool: concurrent.futures.Executor) -> list[_Live]:
    """Every continuation's start, item-major. Each item's first continuation starts before its
    others: it runs the expert's earlier stages and caches the boundary (`task_environments`'
    `cache_dir`), which the other G-1 copy instead of running the same stages concurrently."""
    firsts = list(pool.map(lambda item: self._start(item, 0), items))
    others = list(pool.map(lambda ig: self._start(*ig),
                           [(item, g) for item in items for g in range(1, group_size)]))
    per_item = group_size - 1
    return [s for i, first in enumerate(firsts)
            for s in [first] + others[i * per_item:(i + 1) * per_item]]

  def _start(self, item: RolloutItem, g: int) -> _Live:
    session = f"{item.state_id}/{g}/{uuid.uuid4().hex[:8]}"
    error, prompt = None, []
    try:
      prompt = self.chat_format.encode_prompt(list(item.messages))
    except Exception as e:  # pylint: disable=broad-except
      error = f"prompt could not be rendered: {type(e).__name__}: {e}"
    traj = Trajectory(state_id=item.state_id, focus=item.focus, pool=item.pool,
                      task_id=str(getattr(item.instance, "task_id", "")), sample_index=g,
                      token_ids=list(prompt), loss_mask=[0] * len(prompt),
                      sampler_logp=[0.0] * len(prompt), prompt_len=len(prompt))
    state = _Live(item, g, session, None, traj)
    if error is not None:
      state.finish("error", error)
      return state
    try:
      state.env = self.make_env(item, g)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("environment setup failed for %s/%d", item.state_id, g)
      state.finish("error", f"environment setup failed: {type(e).__name__}: {e}")
    return state

  def _episode(self, s: _Live, worker: EngineWorker, seed: int) -> None:
    """Turns and tool calls of one trajectory until it finishes."""
    while not s.done:
      request = self._turn_request(s, seed)
      if request is None:
        return
      try:
        result: Completion | Exception = worker.submit_generate(request).result()
      except Exception as e:  # pylint: disable=broad-except
        result = e
      self._absorb(s, result)
      if not s.done:
        self._run_tools(s)

  def _turn_request(self, s: _Live, seed: int) -> Optional[GenerateRequest]:
    """The next turn's request, or None (finished "context_full") when no token fits."""
    lim = self.limits
    budget = min(lim.max_turn_tokens, lim.max_response_tokens - s.traj.num_response_tokens)
    if lim.max_context_tokens is not None:
      budget = min(budget, lim.max_context_tokens - len(s.traj.token_ids))
      if budget < 1:
        s.finish("context_full")
        return None
    sampling = dataclasses.replace(
        self.sampling, max_new_tokens=budget, stop_token_ids=self._stop_ids,
        seed=turn_seed(seed, s.item.state_id, s.g, s.traj.num_turns))
    return GenerateRequest(tuple(s.traj.token_ids), sampling, session_id=s.session)

  def _absorb(self, s: _Live, result: Completion | Exception) -> None:
    """Takes the engine's answer to the turn, or ends the trajectory with the engine's error."""
    if isinstance(result, Completion) and result.finish_reason == "abort":
      # The server cut the request (SGLang /abort_request, a weight update that aborts): not
      # the policy ending its turn, so the partial turn is not kept and nothing is trained.
      s.finish("aborted", f"the engine aborted the turn after {len(result.output_ids)} tokens")
    elif isinstance(result, Completion):
      self._take_turn(s, result)
    elif isinstance(result, PromptTooLongError):
      s.finish("context_full")
    else:
      s.finish("error", f"engine failed: {type(result).__name__}: {result}")

  def _take_turn(self, s: _Live, c: Completion) -> None:
    """Appends the generated tokens and decides what the turn asks for."""
    t, lim = s.traj, self.limits
    t.turn_spans.append((len(t.token_ids), len(t.token_ids) + len(c.output_ids), None))
    t.token_ids += c.output_ids
    t.loss_mask += [1] * len(c.output_ids)
    t.sampler_logp += c.logprobs
    t.num_turns += 1
    t.num_response_tokens += len(c.output_ids)
    t.weight_version = c.weight_version
    s.calls, s.notes = [], []
    stopped = bool(c.output_ids) and c.output_ids[-1] in self._stop_ids
    if not stopped:
      if t.num_response_tokens >= lim.max_response_tokens:
        s.finish("max_response_tokens")
        return
      t.num_malformed += 1
      s.notes.append(error_observation(cut_turn(len(c.output_ids), lim.max_turn_tokens)))
      return
    parsed = self.chat_format.parse_actions(self.chat_format.decode(c.output_ids))
    if parsed.error is not None:
      t.num_malformed += 1
      s.notes.append(error_observation(malformed_call(parsed.error.message)))
      return
    if not parsed.actions:
      s.finish("agent_stop")
      return
    stages = [workflow.call_stage(str(a.get("arguments", {}).get("code", "")))
              for a in parsed.actions]
    if self.stage_end and _past_stage(s.item.focus, stages):
      # The row was cut at its stage's end, so the next stage's call is where the practice
      # stops, not an action of it: unrun, and its text is not trained on.
      n = len(c.output_ids)
      del t.token_ids[-n:], t.loss_mask[-n:], t.sampler_logp[-n:]
      t.num_response_tokens -= n
      t.turn_spans.pop()
      s.finish("stage_end")
      return
    start, end, _ = t.turn_spans[-1]
    t.turn_spans[-1] = (start, end, next((st for st in stages if st is not None), None))
    room = lim.max_tool_calls - t.num_tool_calls
    if room <= 0:
      s.finish("max_tool_calls")
      return
    s.calls = list(parsed.actions[:room])
    if len(parsed.actions) > room:
      s.notes.append(error_observation(
          calls_over_limit(lim.max_tool_calls, len(parsed.actions) - room)))

  def _run_tools(self, s: _Live) -> None:
    """Runs this turn's tool calls, then appends the trajectory's observation delta."""
    lim, t = self.limits, s.traj
    observations = [self._call_tool(s, call) for call in s.calls] + s.notes
    t.num_tool_calls += len(s.calls)
    if s.done:  # the sandbox failed during a call
      return
    if t.num_turns >= lim.max_assistant_turns:
      s.finish("max_turns")
      return
    if t.num_response_tokens >= lim.max_response_tokens:
      s.finish("max_response_tokens")
      return
    observations = [_clip(o, lim.max_observation_chars) for o in observations]
    after_stop = bool(t.token_ids) and t.token_ids[-1] == self.chat_format.im_end_id
    delta = self.chat_format.encode_observation_delta(observations, after_stop=after_stop)
    if (lim.max_context_tokens is not None
        and len(t.token_ids) + len(delta) >= lim.max_context_tokens):
      s.finish("context_full")  # no room for the observation and a next turn
      return
    t.token_ids += delta
    t.loss_mask += [0] * len(delta)
    t.sampler_logp += [0.0] * len(delta)

  def _call_tool(self, s: _Live, call: Mapping[str, Any]) -> str:
    problem = tool_call_problem(call, self.limits)
    if problem is not None:
      return error_observation(problem)
    args = call["arguments"]
    try:
      return s.env.execute(args["language"], args["code"])
    except ValueError as e:  # a bad argument the sandbox refused
      return f"error: {e}"
    except Exception as e:  # pylint: disable=broad-except
      log.exception("tool call failed in %s", s.session)
      s.finish("error", f"sandbox failed: {type(e).__name__}: {e}")
      return f"error: the sandbox failed ({type(e).__name__})"

  def _score(self, s: _Live) -> None:
    t = s.traj
    if s.env is None:
      return
    try:
      score = s.env.score()
    except Exception as e:  # pylint: disable=broad-except
      # The rubric reads what the policy left: its failure is scored 0 and kept in the batch
      # (finish reason unchanged), so writing files the rubric chokes on is no way out.
      log.exception("rubric failed for %s", s.session)
      t.reward = 0.0
      t.error = f"rubric failed: {type(e).__name__}: {e}"
      return
    t.reward = float(score.reward) if t.trainable else 0.0
    t.stage_items = {k: dict(v) for k, v in score.stage_items.items()}
    t.stage_scores = dict(score.stage_scores)
    t.task_score = score.task_score
    t.num_failed_calls = int(score.failed_calls)


def _past_stage(focus: str, stages: Sequence[Optional[str]]) -> bool:
  """Whether a stage-local row's turn calls (`stages`: of its calls) a later stage's command."""
  if focus not in workflow.STAGES:
    return False
  return any(st is not None and workflow.STAGES.index(st) > workflow.STAGES.index(focus)
             for st in stages)


def turn_seed(seed: int, state_id: str, g: int, turn: int) -> int:
  """The sampling seed of turn `turn` of continuation `g` of `state_id` (63 bits, stable)."""
  return derive_seed("turn", seed, state_id, g, turn)


def _clip(text: str, max_chars: int) -> str:
  """Cuts text to max_chars with a visible marker saying how much was removed."""
  if len(text) <= max_chars:
    return text
  marker = "\n...[truncated {} chars]"
  keep = max(0, max_chars - len(marker.format(len(text))))
  return text[:keep] + marker.format(len(text) - keep)


# -- the evaluator's agent protocol -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AgentTurn:
  """The policy's answer to a conversation.

  Attributes:
    actions: model-neutral actions `{"name", "arguments", "thought"}`; empty means stop.
    thought: free text of the turn (reasoning / message).
    error: set when the turn was malformed (the harness shows it as the observation).
    finish_reason: the engine's finish reason.
  """
  actions: tuple[Mapping[str, Any], ...]
  thought: str = ""
  error: Optional[str] = None
  finish_reason: str = "stop"

  @property
  def stop(self) -> bool:
    return not self.actions and self.error is None


class PolicyAgent:
  """Adapter for the held-out evaluator: given messages, returns the next action or a stop.

  Messages are model-neutral (system / user / `{"role": "assistant", "action": a}` / tool);
  the chat format renders them for the policy's family.
  """

  def __init__(self, engine: Engine, chat_format: ChatFormat, *,
               sampling: SamplingParams = SamplingParams(temperature=0.0),
               max_turn_tokens: int = 4096, session_id: Optional[str] = None):
    self.engine = engine
    self.chat_format = chat_format
    self.sampling = dataclasses.replace(sampling, max_new_tokens=max_turn_tokens,
                                        stop_token_ids=tuple(chat_format.stop_token_ids))
    self.max_turn_tokens = max_turn_tokens
    self.session_id = session_id or uuid.uuid4().hex

  def __call__(self, messages: Sequence[Mapping[str, Any]]) -> AgentTurn:
    ids = self.chat_format.encode_prompt(list(messages))
    c = self.engine.generate([GenerateRequest(ids, self.sampling, self.session_id)])[0]
    if c.finish_reason == "length":
      return AgentTurn((), error=cut_turn(len(c.output_ids), self.max_turn_tokens),
                       finish_reason="length")
    parsed = self.chat_format.parse_actions(self.chat_format.decode(c.output_ids))
    error = malformed_call(parsed.error.message) if parsed.error is not None else None
    return AgentTurn(tuple(parsed.actions), parsed.thought, error, c.finish_reason)

  def close(self) -> None:
    self.engine.release([self.session_id])
