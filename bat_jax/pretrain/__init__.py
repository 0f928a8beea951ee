"""The tiny base: a generated pretraining corpus (`corpus`) and its cached, probed build (`base`)."""
