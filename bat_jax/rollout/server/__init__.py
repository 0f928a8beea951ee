"""HTTP server over the in-process JAX engine: SGLang's protocol and OpenAI's chat API.

    python -m bat_jax.serve --model-path=DIR --port=P [--served-model-name=NAME]

Endpoints:
  GET  /health, /health_generate       200 when the server is up.
  GET  /model_info (/get_model_info)   model_path, weight_version, limits (SGLang).
  GET  /get_weight_version             {"weight_version": ...}.
  GET  /v1/models, /v1/models/{id}     the served model (OpenAI).
  POST /generate                       SGLang: input_ids or text, sampling_params (SGLang
                                       0.5.23's fields and semantics), return_logprob,
                                       top_logprobs_num, rid; single, batched, n samples.
  POST /update_weights_from_disk       {model_path, flush_cache, weight_version}.
  POST /flush_cache                    drops every cached conversation.
  POST /release_memory_occupation      {tags: ["weights", "kv_cache"] | null}: weights to host
  POST /resume_memory_occupation       memory, KV cache freed; resume puts them back.
  POST /v1/chat/completions            OpenAI chat: tools, tool_choice (auto, none, required,
                                       named), n, stop, logprobs, top_logprobs, stream (SSE)
                                       with stream_options, response_format (json_object,
                                       json_schema: constrained decoding, `grammar`),
                                       chat_template_kwargs (enable_thinking), the developer
                                       role; answers split `reasoning_content` off.
  POST /v1/completions                 OpenAI completions: text or token prompts, echo,
                                       logprobs with prompt logprobs (lm-eval's
                                       local-completions), stop, n, seed.

Unknown fields of the OpenAI endpoints are ignored (one warning per field name, as vLLM);
`--api-key KEY` makes every endpoint but /health need `Authorization: Bearer KEY` (401 else).

Logprobs (SGLang `output_token_logprobs`, OpenAI `logprobs`) are those the engine reports for
the sampled tokens; OpenAI `top_logprobs` / SGLang `output_top_logprobs` are re-scored from the
served params at the request's temperature (greedy: 1). Concurrent requests share engine steps
(`scheduler`); junk requests get a 4xx naming the field at fault (`params`, `http`).
"""

from bat_jax.rollout.server.app import ServeApp, ServedModel
from bat_jax.rollout.server.cli import load_served_model, main
from bat_jax.rollout.server.http import make_server, serve_in_thread

__all__ = ["ServeApp", "ServedModel", "make_server", "serve_in_thread", "load_served_model",
           "main"]
