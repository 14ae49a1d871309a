"""Where `sparsecache serve` meets vLLM's OpenAI server, in one place (vLLM 0.32, `setup.sh`'s pin).

What the server uses of vLLM, and how public each part is:

- The prompt goes in through request fields vLLM documents: a completion's `prompt` may be token
  ids, and a chat request's `kv_transfer_params["prompt_token_ids"]` makes vLLM's renderer use those
  ids instead of templating the messages (its decode-side token reuse in disaggregated serving: the
  ids are checked against the vocabulary, then removed before the engine sees the params).
- The server itself is vLLM's launcher, step by step (`build_async_engine_client`, `build_app`,
  `init_app_state`, `serve_http`), as `vllm serve` runs it, with one step between building the app
  and serving it: the chat and completion handlers on the app's state (`openai_serving_chat`,
  `openai_serving_completion`) are wrapped. vLLM has no public hook for a handler around its own
  (`--middleware` sees bytes, not the parsed request), so this is the one internal it relies on.
- Errors take vLLM's own shape (`create_error_response`, `ErrorResponse`).

`tests/vllm/test_vllm_hooks.py` checks each of these against the installed vLLM, so an upgrade that moves
one fails there, by name, rather than in a served request.
"""

from __future__ import annotations

from collections.abc import Callable

PROMPT_IDS = "prompt_token_ids"  # the key of a chat request's kv_transfer_params vLLM's renderer reads


def use_prompt(request, prompt_ids: list[int], kv_transfer_params: dict, chat: bool) -> None:
    """Give `request` (vLLM's parsed chat or completion request) our prompt and our connector's
    params, replacing whatever the client sent in either."""
    params = dict(kv_transfer_params)
    if chat:
        params[PROMPT_IDS] = list(prompt_ids)
    else:
        request.prompt = list(prompt_ids)
    request.kv_transfer_params = params


def error_response(message: str, err_type: str, status):
    """vLLM's error response (OpenAI's error shape) with our message."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    return create_error_response(message, err_type=err_type, status_code=status)


def is_error(result) -> bool:
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    return isinstance(result, ErrorResponse)


async def run_server(args, install: Callable) -> None:
    """vLLM's OpenAI server for the parsed `args`, as `vllm serve` runs it, with `install(app, state,
    listen_address)` called between building the app and serving it."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine:
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            await init_app_state(engine, app.state, args, tasks)
            install(app, app.state, listen_address)
            shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port, log_level="warning",
                                        access_log=False)
        await shutdown
    finally:
        sock.close()
