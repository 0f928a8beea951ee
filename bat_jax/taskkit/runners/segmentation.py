"""Threshold segmentation: a binary mask [H][W] of the normalised image."""
from .common import *  # noqa: F403 (dropped in a workspace)  # inlined


def predict_case(params, case, image, intensity_scale):
  _, _, maxval, rows = image
  return binary_mask(normalise(rows, intensity_scale or maxval), params["threshold"])
