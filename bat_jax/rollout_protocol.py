"""The rollout vocabulary shared by training rollouts and the held-out evaluator.

Training (`bat_jax.rollout.agent_loop`) and evaluation (`bat_jax.evaluator.episode`) drive the
same policy through the same tool, so they share one limits type, one tool-call check, one set
of error texts the model sees and one set of finish reasons. This module stays free of JAX so
the evaluator can import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from bat_jax import workflow

# Why a rollout (a training trajectory or an evaluation cell) ended.
FINISH_REASONS: tuple[str, ...] = (
    "agent_stop",        # the policy ended a turn without a tool call (it is done)
    "stage_end",         # a stage-local row's turn called a later stage (`rollout.stage_end`)
    "max_turns",         # assistant-turn limit reached
    "max_tool_calls",    # the policy asked for a tool call past the limit
    "max_response_tokens",  # cumulative generated-token budget used up
    "context_full",      # the next turn would not fit the engine's context
    "error",             # infrastructure failure (sandbox, engine); reward 0, see `error`
    "aborted",           # the server aborted a request (SGLang finish_reason "abort"); the cut
                         # turn is not kept, and the trajectory is not trained on
)
# Finish reasons that are not the policy's doing: such trajectories are not trainable.
UNTRAINABLE_FINISH_REASONS: frozenset[str] = frozenset({"error", "aborted"})
# The finish reasons a valid evaluation cell can have (its infrastructure failures are invalid
# cells instead, see `bat_jax.evaluator.episode`).
EPISODE_FINISH_REASONS: tuple[str, ...] = ("agent_stop", "max_turns", "max_tool_calls")


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
  """Per-rollout limits (BaT reference values by default), for training and evaluation."""
  max_assistant_turns: int = 24
  max_tool_calls: int = 23
  max_response_tokens: int = 16_384
  max_observation_chars: int = workflow.MAX_OBSERVATION_CHARS
  max_turn_tokens: int = 4_096
  max_code_chars: int = 32_768
  # None: the engine decides (the JAX engine raises PromptTooLongError -> "context_full"). Set
  # it for SGLang, whose answer to an over-long prompt is an HTTP 400 like any bad request.
  max_context_tokens: Optional[int] = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if v is None and f.name == "max_context_tokens":
        continue
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"RolloutLimits.{f.name} must be a positive int, got {v!r}")


def error_observation(problem: str) -> str:
  """The observation the policy sees for a problem with its turn."""
  return f"error: {problem}"


def malformed_call(parser_message: str) -> str:
  return f"malformed tool call: {parser_message}"


def cut_turn(num_tokens: int, max_turn_tokens: int) -> str:
  return (f"the turn was cut at {num_tokens} tokens before it ended; "
          f"keep each turn under {max_turn_tokens} tokens")


def calls_over_limit(max_tool_calls: int, dropped: int) -> str:
  return (f"tool-call limit ({max_tool_calls}) reached; "
          f"{dropped} call(s) of this turn were not run")


def tool_call_problem(call: Mapping[str, Any], limits: RolloutLimits) -> Optional[str]:
  """Why a model-neutral call `{"name", "arguments"}` cannot run, in the words the policy sees
  (see `error_observation`); None if it can."""
  args = call.get("arguments", {})
  name = call.get("name")
  if name != workflow.TOOL_NAME:
    return f"unknown tool {name!r}; the only tool is {workflow.TOOL_NAME!r}"
  language, code = args.get("language"), args.get("code")
  if language not in workflow.TOOL_LANGUAGES:
    return (f"{workflow.TOOL_NAME}.language = {language!r} is not one of "
            f"{list(workflow.TOOL_LANGUAGES)}")
  if not isinstance(code, str):
    return f"{workflow.TOOL_NAME}.code must be a string"
  if len(code) > limits.max_code_chars:
    return (f"{workflow.TOOL_NAME}.code is {len(code)} characters, over the "
            f"{limits.max_code_chars}-character limit; nothing was run")
  return None
