"""Conditional renderer: draws the requested shape (a p-norm ball) on a flat background."""


def predict_case(params, case, image, intensity_scale):
  width, height, maxval = int(case["width"]), int(case["height"]), int(case["maxval"])
  scale = intensity_scale or maxval
  fg = min(1.0, max(0.0, float(case["fg_level"]) / scale))
  bg = min(1.0, max(0.0, float(case["bg_level"]) / scale))
  p = params["shape_norms"][case["shape"]]
  cx, cy, radius = float(case["cx"]), float(case["cy"]), float(case["radius"])
  out = []
  for y in range(height):
    row = []
    for x in range(width):
      dx, dy = abs(x - cx) / radius, abs(y - cy) / radius
      dist = max(dx, dy) if p == "inf" else (dx ** p + dy ** p) ** (1.0 / p)
      row.append(int(round((fg if dist <= 1.0 else bg) * maxval)))
    out.append(row)
  return out
