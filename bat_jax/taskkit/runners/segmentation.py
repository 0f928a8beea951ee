"""Threshold segmentation: a binary mask [H][W] of the normalised image."""
from .common import binary_mask, normalise  # inlined


def predict_case(params, case, image, intensity_scale):
  _, _, maxval, rows = image
  return binary_mask(normalise(rows, intensity_scale or maxval), params["threshold"])
