"""Threshold + connected components: one box per bright lesion, scored by mean intensity."""
from .common import binary_mask, box_of, components, normalise  # inlined


def predict_case(params, case, image, intensity_scale):
  _, _, maxval, rows = image
  img = normalise(rows, intensity_scale or maxval)
  boxes = []
  for pixels in components(binary_mask(img, params["threshold"]), params["min_area"]):
    score = sum(img[y][x] for y, x in pixels) / len(pixels)
    boxes.append({"box": box_of(pixels), "score": round(score, 4)})
  return sorted(boxes, key=lambda b: b["box"])
