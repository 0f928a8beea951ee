"""Rollouts: token-in/token-out agent loop, in-process JAX engine, SGLang client and launcher.

The SGLang-protocol HTTP server over the JAX engine is `bat_jax.rollout.server`
(`python -m bat_jax.serve`).
"""

from bat_jax.rollout.agent_loop import (AgentLoop, AgentTurn, Environment, PolicyAgent,
                                        RolloutItem, Score, TaskEnvironment, task_environments)
from bat_jax.rollout.engine import (Completion, Engine, GenerateRequest, PromptTooLongError,
                                    SamplingParams)
from bat_jax.rollout.jax_engine import JaxEngine, JaxEngineConfig
from bat_jax.rollout.replay_engine import ScriptedEngine
from bat_jax.rollout.sglang_client import (ContextLengthExceededError, ProtocolError,
                                           RequestRejectedError, RetryPolicy,
                                           SGLangClient, SGLangEngine, SGLangError,
                                           ServerUnavailableError, WeightSyncTimes, sync_weights)
from bat_jax.rollout.sglang_launcher import (SGLangLaunchConfig, ServerProcess, ServerStartError,
                                             free_port, sglang_command)
from bat_jax.rollout.trajectory import Trajectory, collate
from bat_jax.rollout_protocol import FINISH_REASONS, UNTRAINABLE_FINISH_REASONS, RolloutLimits

__all__ = [
    "AgentLoop", "AgentTurn", "Completion", "ContextLengthExceededError", "Engine", "Environment",
    "FINISH_REASONS",
    "GenerateRequest", "JaxEngine", "JaxEngineConfig", "PolicyAgent", "PromptTooLongError",
    "ProtocolError", "RequestRejectedError", "RetryPolicy", "RolloutItem", "RolloutLimits",
    "SGLangClient", "SGLangEngine", "SGLangError", "SGLangLaunchConfig", "SamplingParams",
    "Score", "ScriptedEngine", "ServerProcess", "ServerStartError", "ServerUnavailableError",
    "TaskEnvironment", "Trajectory", "WeightSyncTimes", "collate", "free_port",
    "UNTRAINABLE_FINISH_REASONS", "sglang_command", "sync_weights", "task_environments",
]
