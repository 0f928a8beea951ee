"""Answers templated questions about the bright lesions of an image."""
from .common import binary_mask, components, normalise  # inlined


def predict_case(params, case, image, intensity_scale):
  _, _, maxval, rows = image
  img = normalise(rows, intensity_scale or maxval)
  found = components(binary_mask(img, params["threshold"]), params["min_area"])
  question = case["question"].lower()
  for kind, cue in sorted(params["question_cues"].items()):
    if cue in question:
      break
  else:
    raise ValueError("question %r matches no known cue" % case["question"])
  if kind == "count":
    return str(len(found))
  if not found:
    return params["answers"]["none"]
  largest = max(found, key=len)
  centre_x = sum(p[1] for p in largest) / len(largest)
  return params["answers"]["left" if centre_x < (len(img[0]) - 1) / 2.0 else "right"]
