"""The 7 track families: each samples cases, truths and its model's params.

The sampling logic is shared; names and seed stream come from the `NamePool` an instance is
bound to (`FAMILY_TYPES[track](names, write_brief)`), so training and the held-out evaluator
bind the same logic to disjoint vocabularies.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from bat_jax.taskkit import metrics
from bat_jax.taskkit.base import CaseData, SampleContext, TrackFamily, pgm_bytes
from bat_jax.taskkit.runners import (classification, detection, enhancement, report, segmentation,
                                   synthesis, vqa)

_NOISE = 0.03  # pixel noise as a fraction of maxval; thresholds keep a wider margin


def _image(ctx: SampleContext, level: Callable[[int, int], float],
           noise: float = _NOISE) -> list[list[int]]:
  """[H][W] ints: level(x, y) in [0, 1] plus uniform noise, at ctx.maxval."""
  rng = ctx.rng
  return [[max(0, min(ctx.maxval, round((level(x, y) + rng.uniform(-noise, noise)) * ctx.maxval)))
           for x in range(ctx.width)] for y in range(ctx.height)]


def _blobs(ctx: SampleContext, n: int, sizes: range, rects: bool) -> list[tuple[int, ...]]:
  """n non-touching shapes (x0, y0, x1, y1), distinct areas, kept off the image centre lines."""
  rng = ctx.rng
  placed: list[tuple[int, ...]] = []
  areas: set[int] = set()
  for _ in range(200):
    if len(placed) == n:
      break
    w, h = rng.choice(sizes), rng.choice(sizes)
    if not rects:
      h = w
    x0, y0 = rng.randint(1, ctx.width - w - 1), rng.randint(1, ctx.height - h - 1)
    box = (x0, y0, x0 + w, y0 + h)
    cx, cy = (box[0] + box[2] - 1) / 2, (box[1] + box[3] - 1) / 2
    if abs(cx - (ctx.width - 1) / 2) < 1 or abs(cy - (ctx.height - 1) / 2) < 1:
      continue
    if w * h in areas or any(box[0] <= b[2] and b[0] <= box[2] and box[1] <= b[3]
                             and b[1] <= box[3] for b in placed):
      continue
    placed.append(box)
    areas.add(w * h)
  return placed


def _inside(boxes: list[tuple[int, ...]]) -> Callable[[int, int], bool]:
  return lambda x, y: any(b[0] <= x < b[2] and b[1] <= y < b[3] for b in boxes)


def _levels(rng: random.Random) -> tuple[float, float]:
  return rng.uniform(0.15, 0.3), rng.uniform(0.6, 0.9)


def _stem(ctx: SampleContext, cid: str) -> str:
  return f"{ctx.rng.choice(('', 'img_', 'scan_', 'slice_'))}{cid}.pgm"


def _lesion_images(ctx: SampleContext, max_lesions: int, rects: bool):
  """Per case: (file name, PGM bytes, boxes)."""
  out = {}
  for cid in ctx.case_ids:
    boxes = _blobs(ctx, ctx.rng.randint(1, max_lesions), range(2, 6), rects)
    bg, fg = _levels(ctx.rng)
    inside = _inside(boxes)
    rows = _image(ctx, lambda x, y: fg if inside(x, y) else bg)
    out[cid] = (_stem(ctx, cid), pgm_bytes(rows, ctx.maxval), boxes)
  return out


def _lesion_cases(ctx: SampleContext, max_lesions: int, rects: bool,
                  truth_of: Callable[[list], Any]):
  """(rows, files, truth) of one-image-per-case lesion data; truth_of(boxes) per case."""
  rows, files, truth = [], {}, {}
  for cid, (name, data, boxes) in _lesion_images(ctx, max_lesions, rects).items():
    truth[cid] = truth_of(boxes)
    files[name] = data
    rows.append({"case_id": cid, "image": name})
  return tuple(rows), files, truth


class ClassificationFamily(TrackFamily):
  track = "classification"
  runner = classification
  objective = "Assign every case one of the labels its model card lists."

  def sample(self, ctx: SampleContext) -> CaseData:
    rng = ctx.rng
    labels = rng.sample(ctx.names.labels, rng.randint(2, 4))
    centroids: dict[str, list[float]] = {}
    while len(centroids) < len(labels):
      c = [round(rng.uniform(0.15, 0.95), 3), round(rng.uniform(0.15, 0.6), 3)]
      if all(math.dist(c, o) >= 0.25 for o in centroids.values()):
        centroids[labels[len(centroids)]] = c
    rows, files, truth = [], {}, {}
    for i, cid in enumerate(ctx.case_ids):
      label = labels[i % len(labels)] if i < len(labels) else rng.choice(labels)
      centre, border = (v + rng.uniform(-0.03, 0.03) for v in centroids[label])
      h4, w4 = ctx.height // 4, ctx.width // 4
      rows_px = _image(ctx, lambda x, y: centre if (h4 <= y < ctx.height - h4
                                                    and w4 <= x < ctx.width - w4) else border)
      name = _stem(ctx, cid)
      files[name] = pgm_bytes(rows_px, ctx.maxval)
      rows.append({"case_id": cid, "image": name})
      truth[cid] = label
    name = rng.choice(("labels", "classes", "diagnoses"))
    sub = {"format": "csv", "path": f"submission/{name}.csv",
           "id_column": rng.choice(("case_id", "id", "study")),
           "value_column": rng.choice(("label", "class", "diagnosis"))}
    return CaseData(columns=("case_id", "image"), rows=tuple(rows), files=files, truth=truth,
                    params={"centroids": centroids},
                    schema={"type": "label", "labels": sorted(labels)}, submission=sub)


class SegmentationFamily(TrackFamily):
  track = "segmentation"
  runner = segmentation
  objective = "Produce a binary lesion mask for every case."

  def sample(self, ctx: SampleContext) -> CaseData:
    rng = ctx.rng

    def mask(boxes):
      inside = _inside(boxes)
      return [[int(inside(x, y)) for x in range(ctx.width)] for y in range(ctx.height)]

    rows, files, truth = _lesion_cases(ctx, 2, rng.random() < 0.5, mask)
    sub = {"format": "pgm_dir", "path": f"submission/{rng.choice(('masks', 'seg', 'labels'))}",
           "suffix": rng.choice((".pgm", "_mask.pgm")), "maxval": 1}
    return CaseData(columns=("case_id", "image"), rows=tuple(rows), files=files, truth=truth,
                    params={"threshold": round(rng.uniform(0.4, 0.5), 3)},
                    schema={"type": "image", "width": ctx.width, "height": ctx.height,
                            "maxval": 1}, submission=sub)


class DetectionFamily(TrackFamily):
  track = "detection"
  runner = detection
  objective = "Report a bounding box for every lesion in every case."

  def sample(self, ctx: SampleContext) -> CaseData:
    rng = ctx.rng
    rows, files, truth = _lesion_cases(ctx, 3, True, lambda boxes: [list(b) for b in sorted(boxes)])
    sub = {"format": "coco_json", "path": f"submission/{rng.choice(('detections', 'boxes'))}.json",
           "id_key": rng.choice(("image_id", "case_id"))}
    return CaseData(columns=("case_id", "image"), rows=tuple(rows), files=files, truth=truth,
                    params={"threshold": round(rng.uniform(0.4, 0.5), 3), "min_area": 3},
                    schema={"type": "boxes", "width": ctx.width, "height": ctx.height},
                    submission=sub)


class VqaFamily(TrackFamily):
  track = "vqa"
  runner = vqa
  objective = "Answer every question about its image."

  def validation_group(self, row, params) -> str:
    return "count" if params["question_cues"]["count"] in row["question"].lower() else "side"

  def sample(self, ctx: SampleContext) -> CaseData:
    rng = ctx.rng
    cues = {"count": rng.choice(("how many", "number of")),
            "side": rng.choice(("left or right", "which side"))}
    answers = {"left": rng.choice(("left", "Left")), "right": rng.choice(("right", "Right")),
               "none": "none"}
    images = _lesion_images(ctx, 3, rng.random() < 0.5)
    rows, files, truth = [], {}, {}
    image_ids = list(images)
    for i, qid in enumerate(ctx.case_ids):
      name, data, boxes = images[image_ids[i // 2]]
      files[name] = data
      kind = "count" if (i % 2 == 0) == (rng.random() < 0.7) else "side"
      if kind == "count":
        question = (f"{cues['count'].capitalize()} bright lesions are visible?"
                    if cues["count"] == "how many" else "Number of bright lesions visible?")
        truth[qid] = str(len(boxes))
      else:
        question = f"{cues['side'].capitalize()}: is the largest lesion in the left or right half?"
        big = max(boxes, key=lambda b: (b[2] - b[0]) * (b[3] - b[1]))
        truth[qid] = answers["left" if (big[0] + big[2] - 1) / 2 < (ctx.width - 1) / 2
                             else "right"]
      rows.append({"case_id": qid, "image": name, "question": question})
    sub = {"format": "jsonl", "path": "submission/answers.jsonl",
           "id_key": rng.choice(("question_id", "qid")), "value_key": "answer"}
    return CaseData(columns=("case_id", "image", "question"), rows=tuple(rows), files=files,
                    truth=truth, params={"threshold": round(rng.uniform(0.4, 0.5), 3),
                                         "min_area": 3, "question_cues": cues,
                                         "answers": answers},
                    schema={"type": "answer"}, submission=sub)


_TEMPLATES = (
    "Findings: {count} lesion(s); the largest ({area} px) lies in the {quadrant} quadrant.\n"
    "Impression: {impression}.",
    "FINDINGS\n{count} lesion(s) detected. Dominant lesion: {area} pixels, {quadrant} quadrant.\n"
    "IMPRESSION\n{impression}.",
)


class ReportFamily(TrackFamily):
  track = "report"
  runner = report
  objective = "Write a findings-and-impression report for every case."

  def sample(self, ctx: SampleContext) -> CaseData:
    rng = ctx.rng
    impressions = {"none": "No focal lesion.",
                   "single": rng.choice(("Solitary focal lesion", "Single focal abnormality")),
                   "multiple": rng.choice(("Multifocal disease", "Multiple focal lesions"))}

    def findings(boxes):
      big = max(boxes, key=lambda b: (b[2] - b[0]) * (b[3] - b[1]))
      vert = "upper" if (big[1] + big[3] - 1) / 2 < (ctx.height - 1) / 2 else "lower"
      horiz = "left" if (big[0] + big[2] - 1) / 2 < (ctx.width - 1) / 2 else "right"
      kind = "single" if len(boxes) == 1 else "multiple"
      return [f"{len(boxes)} lesion", f"{vert} {horiz}", impressions[kind]]

    rows, files, truth = _lesion_cases(ctx, 3, True, findings)
    sub = {"format": "txt_dir", "path": f"submission/{rng.choice(('reports', 'narratives'))}",
           "suffix": ".txt"}
    return CaseData(columns=("case_id", "image"), rows=tuple(rows), files=files, truth=truth,
                    params={"threshold": round(rng.uniform(0.4, 0.5), 3), "min_area": 3,
                            "template": rng.choice(_TEMPLATES), "impressions": impressions},
                    schema={"type": "text", "min_chars": 20}, submission=sub)


class EnhancementFamily(TrackFamily):
  track = "enhancement"
  runner = enhancement
  objective = "Denoise every image (impulse noise) and return it at the original bit depth."

  def sample(self, ctx: SampleContext) -> CaseData:
    rng = ctx.rng
    rows, files, truth = [], {}, {}
    for cid in ctx.case_ids:
      bg, fg = _levels(rng)
      slope = rng.uniform(-0.1, 0.1)
      inside = _inside(_blobs(ctx, 1, range(4, 7), False))
      clean = _image(ctx, lambda x, y: (fg if inside(x, y) else bg) + slope * x / ctx.width,
                     noise=0.0)
      noisy = [row[:] for row in clean]
      for y in range(ctx.height):
        for x in range(ctx.width):
          if rng.random() < 0.1:
            noisy[y][x] = rng.choice((ctx.maxval, round(0.08 * ctx.maxval)))
      name = _stem(ctx, cid)
      files[name] = pgm_bytes(noisy, ctx.maxval)
      rows.append({"case_id": cid, "image": name})
      truth[cid] = {"clean": clean, "maxval": ctx.maxval,
                    "noisy_psnr": round(metrics.psnr(noisy, clean, ctx.maxval), 4)}
    sub = {"format": "pgm_dir", "path": f"submission/{rng.choice(('enhanced', 'denoised'))}",
           "suffix": ".pgm", "maxval": ctx.maxval}
    return CaseData(columns=("case_id", "image"), rows=tuple(rows), files=files, truth=truth,
                    params={"kernel": 3},
                    schema={"type": "image", "width": ctx.width, "height": ctx.height,
                            "maxval": ctx.maxval}, submission=sub)


_SHAPE_NAMES = {2: ("disc", "round", "circle", "ball"), 1: ("diamond", "rhombus", "lozenge"),
                "inf": ("square", "box", "block")}


class SynthesisFamily(TrackFamily):
  track = "synthesis"
  runner = synthesis
  objective = "Synthesise one image per requested condition (shape, position, size, levels)."

  def sample(self, ctx: SampleContext) -> CaseData:
    rng = ctx.rng
    norms = {rng.choice(names): p for p, names in _SHAPE_NAMES.items()}
    columns = ("case_id", "shape", "cx", "cy", "radius", "fg_level", "bg_level", "width",
               "height", "maxval")
    rows, truth = [], {}
    for cid in ctx.case_ids:
      shape = rng.choice(sorted(norms))
      radius = rng.randint(2, 4)
      cx = rng.randint(radius, ctx.width - radius - 1)
      cy = rng.randint(radius, ctx.height - radius - 1)
      bg, fg = (round(v * ctx.maxval) for v in _levels(rng))
      row = {"case_id": cid, "shape": shape, "cx": cx, "cy": cy, "radius": radius,
             "fg_level": fg, "bg_level": bg, "width": ctx.width, "height": ctx.height,
             "maxval": ctx.maxval}
      rows.append({k: str(v) for k, v in row.items()})
      p = norms[shape]
      def dist(x, y, p=p, cx=cx, cy=cy, r=radius):
        dx, dy = abs(x - cx) / r, abs(y - cy) / r
        return max(dx, dy) if p == "inf" else (dx ** p + dy ** p) ** (1 / p)
      mask = [[int(dist(x, y) <= 1.0) for x in range(ctx.width)] for y in range(ctx.height)]
      truth[cid] = {"mask": mask, "fg": fg, "bg": bg, "maxval": ctx.maxval}
    sub = {"format": "pgm_dir", "path": f"submission/{rng.choice(('synthetic', 'generated'))}",
           "suffix": ".pgm", "maxval": ctx.maxval}
    return CaseData(columns=columns, rows=tuple(rows), files={}, truth=truth,
                    params={"shape_norms": norms},
                    schema={"type": "image", "width": ctx.width, "height": ctx.height,
                            "maxval": ctx.maxval}, submission=sub)


# track -> family class; each side binds them to its own names: `cls(names, write_brief)`.
FAMILY_TYPES: dict[str, type[TrackFamily]] = {f.track: f for f in (
    ClassificationFamily, SynthesisFamily, DetectionFamily, SegmentationFamily,
    VqaFamily, ReportFamily, EnhancementFamily)}
