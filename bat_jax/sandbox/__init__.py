"""The agent's one tool, `execute_code`, under bubblewrap, plus workspace and evidence helpers."""

from bat_jax.sandbox.bwrap import (ExecResult, Sandbox, SandboxLimits, SandboxUnavailableError,
                                   check_available)
from bat_jax.sandbox.evidence import EvidenceRecord, load_evidence
from bat_jax.sandbox.workspace import diff, fingerprint, fingerprint_digest, materialize

__all__ = ["ExecResult", "Sandbox", "SandboxLimits", "SandboxUnavailableError",
           "check_available", "EvidenceRecord", "load_evidence", "diff", "fingerprint",
           "fingerprint_digest", "materialize"]
