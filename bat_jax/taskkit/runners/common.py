"""Stdlib helpers shared by the provided model runners.

A workspace's `models/<name>/runner.py` is this file followed by one track runner (whose
import of this module is dropped), so everything here must run on a bare system python:
standard library only, no package-relative imports.
"""
from __future__ import annotations

import json
import os

SUPPORTED_FORMATS = (2,)  # rewritten per task: the weights format versions this runner reads


def parse_pgm(text, name="image"):
  """Parses ASCII PGM (P2) text into (width, height, maxval, rows [H][W] of ints)."""
  tokens = []
  for line in text.splitlines():
    tokens.extend(line.split("#", 1)[0].split())
  if len(tokens) < 4 or tokens[0] != "P2":
    raise ValueError("%s: not an ASCII PGM (P2) file" % name)
  width, height, maxval = int(tokens[1]), int(tokens[2]), int(tokens[3])
  values = tokens[4:]
  if len(values) != width * height:
    raise ValueError("%s: truncated PGM data: expected %d pixel values, found %d"
                     % (name, width * height, len(values)))
  flat = [int(v) for v in values]
  return width, height, maxval, [flat[r * width:(r + 1) * width] for r in range(height)]


def format_pgm(rows, maxval):
  """ASCII PGM (P2) text of rows [H][W] of ints."""
  lines = ["P2", "%d %d" % (len(rows[0]), len(rows)), str(maxval)]
  lines.extend(" ".join(str(int(v)) for v in row) for row in rows)
  return "\n".join(lines) + "\n"


def read_pgm(path):
  with open(path, encoding="ascii") as f:
    return parse_pgm(f.read(), os.path.basename(path))


def load_weights(path):
  """Loads JSON weights; refuses a format version this runner does not support."""
  with open(path, encoding="utf-8") as f:
    blob = json.load(f)
  version = blob.get("format_version")
  if version not in SUPPORTED_FORMATS:
    raise ValueError("weights format_version %r is not supported by this runner (supports %s);"
                     " convert the weights with convert.py" % (version, list(SUPPORTED_FORMATS)))
  return blob["params"]


def normalise(rows, scale):
  """Pixel values / scale, clipped to [0, 1]."""
  return [[min(1.0, max(0.0, v / float(scale))) for v in row] for row in rows]


def binary_mask(img, threshold):
  return [[1 if v >= threshold else 0 for v in row] for row in img]


def components(mask, min_area=1):
  """4-connected foreground components of a binary mask, each a list of (y, x)."""
  height, width = len(mask), len(mask[0])
  seen = [[False] * width for _ in range(height)]
  found = []
  for y0 in range(height):
    for x0 in range(width):
      if not mask[y0][x0] or seen[y0][x0]:
        continue
      stack, pixels = [(y0, x0)], []
      seen[y0][x0] = True
      while stack:
        y, x = stack.pop()
        pixels.append((y, x))
        for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
          if 0 <= ny < height and 0 <= nx < width and mask[ny][nx] and not seen[ny][nx]:
            seen[ny][nx] = True
            stack.append((ny, nx))
      if len(pixels) >= min_area:
        found.append(sorted(pixels))
  return found


def box_of(pixels):
  """[x0, y0, x1, y1] (x1, y1 exclusive) of a component."""
  ys = [p[0] for p in pixels]
  xs = [p[1] for p in pixels]
  return [min(xs), min(ys), max(xs) + 1, max(ys) + 1]


def predict(params, case, data_dir, intensity_scale):
  """Runs the track's `predict_case` on one index row; reads its `image` column if any.

  intensity_scale: the divisor that maps pixels to [0, 1]; None means the image's own maxval.
  """
  image = read_pgm(os.path.join(data_dir, case["image"])) if case.get("image") else None
  return predict_case(params, case, image, intensity_scale)  # noqa: F821 (defined per track)
