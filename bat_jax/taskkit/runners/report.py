"""Template report: lesion count, size and quadrant of the largest, and an impression."""
from .common import binary_mask, components, normalise  # inlined


def predict_case(params, case, image, intensity_scale):
  _, _, maxval, rows = image
  img = normalise(rows, intensity_scale or maxval)
  found = components(binary_mask(img, params["threshold"]), params["min_area"])
  if not found:
    return params["impressions"]["none"]
  largest = max(found, key=len)
  cy = sum(p[0] for p in largest) / len(largest)
  cx = sum(p[1] for p in largest) / len(largest)
  vertical = "upper" if cy < (len(img) - 1) / 2.0 else "lower"
  horizontal = "left" if cx < (len(img[0]) - 1) / 2.0 else "right"
  kind = "single" if len(found) == 1 else "multiple"
  return params["template"].format(
      count=len(found), area=len(largest), quadrant=vertical + " " + horizontal,
      impression=params["impressions"][kind])
