"""The tiny base's pretraining corpus: generic documents in the world's own chat language.

A pretrained Qwen3.5 arrives able to copy a value from its context, to write a tool call and
to react to what a tool printed. A from-scratch tiny policy cannot (experiments/README.md:
after SFT it emits one memorised id per kind). This corpus teaches those three primitives on
*generic* material, never a task's brief: every document draws its own tool name, keys, flags
and values from the pools below, so nothing in it is a training or held-out task.

Each document is a chat (system, user, prior tool turns) plus one target tool call, the same
shape as an SFT row, rendered later by the policy's chat format:

  fill   a facts line `k1: v1; k2: v2; ...` and a usage line `python tools/T.py --f K2_ID ...`
         whose placeholders name facts; the target fills them in (copying by key: induction).
  react  the same, then a first call and its observation `status: ... field: value ...`; the
         usage line says which call follows which reported field; the target copies values
         out of the observation (and the facts).

Deterministic from `(seed, index)`; `GENERATOR_VERSION` is part of the cache key of a base
built from it (`bat_jax.pretrain.base`), so a change here never reuses a stale base.
"""

from __future__ import annotations

import dataclasses
import random
import shlex
from typing import Any, Mapping, Sequence

from bat_jax import workflow

# v7: observations print `field: value` (v6: `field=value`, whose values a byte-level BPE split
# into other tokens after `=` than after the call's flag; the stage tools' validate line too).
GENERATOR_VERSION = "corpus-v7"
KINDS: tuple[str, ...] = ("repeat", "fill", "react")

SYSTEM_PROMPTS = (
    "You are an agent in a sandboxed workspace. Use the execute_code tool.",
    "Work in the current directory with the execute_code tool. Follow the usage line.",
    "You run tools in a workspace. Copy each value from the facts or from what a tool printed.",
)
# Generic nouns: keys of facts, flags of tools, fields of observations (no task's own brief).
_NOUNS = ("alpha", "batch", "block", "board", "cache", "card", "cell", "chart", "class", "code",
          "color", "count", "data", "depth", "disk", "draft", "entry", "field", "file", "frame",
          "grid", "group", "image", "index", "input", "item", "label", "layer", "level", "limit",
          "list", "model", "mode", "node", "note", "order", "output", "page", "panel", "part",
          "path", "phase", "point", "queue", "range", "rank", "rate", "record", "region",
          "report", "root", "route", "sample", "scale", "scan", "score", "seed", "shape",
          "sheet", "slot", "source", "split", "stage", "store", "table", "target", "task",
          "tile", "token", "track", "unit", "value", "view", "volume", "weights", "zone")
_VERBS = ("apply", "build", "check", "clean", "copy", "count", "draw", "fetch", "fill", "find",
          "format", "index", "label", "load", "mark", "merge", "move", "open", "pack", "parse",
          "print", "probe", "read", "rank", "record", "scan", "score", "send", "sort", "split",
          "store", "sync", "tag", "test", "trace", "train", "tune", "view", "write")
_WORDS = ("amber", "basin", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris",
          "juniper", "kelp", "lumen", "maple", "nectar", "onyx", "pebble", "quartz", "raven",
          "sable", "tundra", "umber", "vapor", "willow", "yarrow", "zephyr")
_STATUSES = ("ok", "done", "warn", "error", "stopped", "ready")


def _value(rng: random.Random, key: str, shapes: str = "iinwc") -> str:
  """A value of one of the shapes tasks use: a short id (the key's letter and any digit, as the
  stage tools' ids), a count, a word, a case-like id."""
  shape = rng.choice(shapes)
  if shape == "i":
    return f"{key[0]}{rng.randrange(10)}"
  if shape == "n":
    return str(rng.randint(1, 60))
  if shape == "w":
    a, b = rng.sample(_WORDS, 2)
    return a if rng.random() < 0.5 else f"{a}_{b}"
  return f"{rng.choice(('CASE', 'ITEM', 'ROW', 'SLOT'))}{rng.randint(1000, 99999)}"


def _keys(rng: random.Random, n: int, exclude: Sequence[str] = ()) -> list[str]:
  """`n` nouns with distinct first letters (none of `exclude`'s): a short id's letter then
  names one fact, so copying its digit is a single look-up, as in a task's facts line."""
  taken = {k[0] for k in exclude}
  keys = []
  for k in rng.sample(_NOUNS, len(_NOUNS)):
    if k[0] not in taken:
      keys.append(k)
      taken.add(k[0])
    if len(keys) == n:
      break
  return keys


def _facts(rng: random.Random, n: int, exclude: Sequence[str] = ()) -> dict[str, str]:
  facts, counted = {}, False
  for k in _keys(rng, n, exclude):
    value = _value(rng, k, "iiiww" if counted else "iiinwc")
    counted |= value.isdigit()   # at most one bare number: ` 8` is two pieces, `Ġ` then `8`
    facts[k] = value
  return facts


def _placeholder(key: str, value: str) -> str:
  return f"{key.upper()}_ID" if value[:1] == key[:1] and value[1:].isdigit() else key.upper()


def _call(tool: str, flags: Sequence[tuple[str, str]], thought: str) -> dict[str, Any]:
  argv = " ".join(f"--{f} {shlex.quote(v)}" for f, v in flags)
  return {"name": workflow.TOOL_NAME,
          "arguments": {"language": "bash", "code": f"python tools/{tool}.py {argv}".rstrip()},
          "thought": thought}


def _usage(tool: str, flags: Sequence[tuple[str, str]]) -> str:
  return f"python tools/{tool}.py " + " ".join(f"--{f} {p}" for f, p in flags)


@dataclasses.dataclass(frozen=True)
class Document:
  """One pretraining document: chat messages before the target, and the target tool call."""
  kind: str
  messages: tuple[Mapping[str, Any], ...]
  target: Mapping[str, Any]
  answer: tuple[str, ...]   # the values the target copies, in order (the probe's key)


def _fill(rng: random.Random) -> Document:
  facts = _facts(rng, rng.randint(3, 7))
  used = rng.sample(list(facts), rng.randint(1, min(3, len(facts))))
  tool = rng.choice(_VERBS)
  # A flag is usually its fact's key (as in `--data DATA_ID`), sometimes another word.
  flags = [(k if rng.random() < 0.7 else rng.choice(_NOUNS), k) for k in used]
  usage = _usage(tool, [(f, _placeholder(k, facts[k])) for f, k in flags])
  user = (f"Facts: {'; '.join(f'{k}: {v}' for k, v in facts.items())}. "
          f"Run the {tool} tool: {usage}")
  target = _call(tool, [(f, facts[k]) for f, k in flags], f"Run {tool} with the facts.")
  return Document("fill", ({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                           {"role": "user", "content": user}), target,
                  tuple(facts[k] for _, k in flags))


def _react(rng: random.Random) -> Document:
  facts = _facts(rng, rng.randint(2, 6))
  first_key = rng.choice(list(facts))
  tool1, tool2 = rng.sample(_VERBS, 2)
  reported = _facts(rng, rng.randint(2, 4), exclude=list(facts))
  facts_line = "; ".join(f"{k}: {v}" for k, v in facts.items())
  for field in reported:  # one source per copied value: never a string the facts line holds
    while reported[field] in facts_line:
      reported[field] = _value(rng, field, "iww")
  fields = list(reported)
  wanted = rng.sample(fields, rng.randint(1, min(2, len(fields))))
  status = rng.choice(_STATUSES)
  usage1 = _usage(tool1, [(first_key, _placeholder(first_key, facts[first_key]))])
  usage2 = _usage(tool2, [(f, f.upper()) for f in wanted])
  user = f"Facts: {facts_line}. Run {usage1}; when it reports {status}: {usage2}"
  first = _call(tool1, [(first_key, facts[first_key])], f"Run {tool1} first.")
  observation = "exit code 0\n" + " ".join(
      [f"status: {status}"] + [f"{f}: {v}" for f, v in reported.items()]) + "\n"
  target = _call(tool2, [(f, reported[f]) for f in wanted], f"React to what {tool1} reported.")
  messages = ({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
              {"role": "user", "content": user},
              {"role": "assistant", "action": first},
              {"role": "tool", "name": workflow.TOOL_NAME, "content": observation})
  return Document("react", messages, target, tuple(reported[f] for f in wanted))


def _repeat(rng: random.Random) -> Document:
  """A list of values, then the same list again: the densest copying signal (every second
  half's token is predictable only by looking back), which grows induction heads first."""
  key = rng.choice(_NOUNS)
  items = list(_facts(rng, rng.randint(4, 10), exclude=[key]).values())
  tool = rng.choice(_VERBS)
  user = f"Facts: {key}: {' '.join(items)}. Run the {tool} tool: python tools/{tool}.py --{key} {key.upper()}"
  target = _call(tool, [(key, " ".join(items))], f"Run {tool} with the list.")
  return Document("repeat", ({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                             {"role": "user", "content": user}), target, tuple(items))


_MAKERS = {"repeat": _repeat, "fill": _fill, "react": _react}
# Half the documents are lists repeated: dense copying, meant to grow induction heads first (it
# had not by 800 steps mixed with the rest; pure random echoes do by ~300: experiments/README.md).
_SCHEDULE = ("repeat", "fill", "repeat", "react")


def document(seed: int, index: int, kind: str | None = None, attempt: int = 0) -> Document:
  """Document `index` of the corpus of `seed` (its kind alternates unless `kind` is given);
  `attempt` > 0 draws it again (one the leak check refused: `bat_jax.pretrain.base`)."""
  kind = kind or _SCHEDULE[index % len(_SCHEDULE)]
  if kind not in _MAKERS:
    raise ValueError(f"unknown pretraining document kind {kind!r}; expected one of {KINDS}")
  salt = f"|{attempt}" if attempt else ""
  return _MAKERS[kind](random.Random(f"{GENERATOR_VERSION}|{seed}|{index}{salt}"))


def documents(seed: int, start: int, count: int) -> list[Document]:
  return [document(seed, i) for i in range(start, start + count)]


# --- plain text ---------------------------------------------------------------------------------

PROMPT = "$"   # a plain document's calls follow this and a space, one per line


def plain_segments(doc: Document) -> list[tuple[str, bool]]:
  """The document as a shell transcript in `(text, is_call)` pieces: each call follows `$` on
  its own line, and only the calls (what a base must learn to produce: copies) carry loss.

  A call piece starts with its space, so a byte-level tokenizer splits it the same way as
  inside a longer text (` python` is one piece); the random facts are context, not targets.
  """
  pieces: list[tuple[str, bool]] = []
  for m in doc.messages:
    if m["role"] == "user":
      facts, _, usage = m["content"].partition(". ")
      pieces.append((f"{facts}.\nUsage: {usage.removeprefix('Run ')}\n{PROMPT}", False))
    elif m["role"] == "assistant":
      pieces += [(f" {m['action']['arguments']['code']}\n", True)]
    elif m["role"] == "tool":
      pieces.append((m["content"].strip() + f"\n{PROMPT}", False))
  return pieces + [(f" {doc.target['arguments']['code']}\n", True)]


def plain_text(doc: Document) -> tuple[str, str]:
  """`(context, target)`: the transcript up to the target call's `$`, and that call."""
  pieces = plain_segments(doc)
  return "".join(t for t, _ in pieces[:-1]), pieces[-1][0]


def encoded_documents(tokenizer: Any, docs: Sequence[Document], eot_id: int
                      ) -> list[tuple[list[int], list[int]]]:
  """`(ids, loss mask)` of `docs`, each ending in `eot_id`."""
  pieces = [plain_segments(d) for d in docs]
  encoded = iter(tokenizer([t for doc in pieces for t, _ in doc],
                           add_special_tokens=False)["input_ids"])
  out = []
  for doc in pieces:
    ids: list[int] = []
    mask: list[int] = []
    for _, is_call in doc:
      piece = next(encoded)
      ids += piece
      mask += [int(is_call)] * len(piece)
    out.append((ids + [eot_id], mask + [0]))
  return out
