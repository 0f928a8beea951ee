"""Median-filter denoiser: returns the enhanced image [H][W] at the input's maxval."""
from .common import normalise  # inlined


def predict_case(params, case, image, intensity_scale):
  _, _, maxval, rows = image
  img = normalise(rows, intensity_scale or maxval)
  height, width, r = len(img), len(img[0]), params["kernel"] // 2
  out = []
  for y in range(height):
    row = []
    for x in range(width):
      window = sorted(img[yy][xx] for yy in range(max(0, y - r), min(height, y + r + 1))
                      for xx in range(max(0, x - r), min(width, x + r + 1)))
      row.append(int(round(window[len(window) // 2] * maxval)))
    out.append(row)
  return out
