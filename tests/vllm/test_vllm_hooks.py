"""Every vLLM name and behaviour `sparsecache/vllm/hooks.py` relies on, checked against the installed
vLLM (#96 item 5): an upgrade that moves one fails here, by name, not in a served request."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def test_the_launcher_steps_serve_runs_exist_with_the_arguments_it_passes():
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    inspect.signature(setup_server).bind("args", reuse_port=False)
    inspect.signature(build_async_engine_client).bind("args")
    inspect.signature(build_app).bind("args", "tasks", "model_config")
    inspect.signature(init_app_state).bind("engine", "state", "args", "tasks")
    inspect.signature(serve_http).bind("app", sock=None, host="h", port=1, log_level="warning", access_log=False)
    # the routes read their handler from the app's state at each request: what serve wraps there is what runs
    import vllm.entrypoints.openai.chat_completion.api_router as chat
    import vllm.entrypoints.openai.completion.api_router as completion

    assert "app.state.openai_serving_chat" in inspect.getsource(chat)
    assert "app.state.openai_serving_completion" in inspect.getsource(completion)


def test_the_wrapped_handlers_take_a_request_and_the_raw_request():
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    inspect.signature(OpenAIServingChat.create_chat_completion).bind("self", "request", "raw")
    inspect.signature(OpenAIServingCompletion.create_completion).bind("self", "request", "raw")


def test_a_chat_requests_prompt_ids_replace_its_template():
    """vLLM's decode-side token reuse: `kv_transfer_params["prompt_token_ids"]` on a chat request is the
    prompt the renderer hands the engine (and is removed from the params), unless echo is set."""
    import vllm.renderers.online_renderer as online
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from sparsecache.vllm.hooks import PROMPT_IDS, use_prompt

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    kv_transfer_params={"client": "theirs"})
    use_prompt(request, [5, 6, 7], {"sparsecache": {"chunks": ["a"]}}, chat=True)
    assert request.kv_transfer_params == {"sparsecache": {"chunks": ["a"]}, PROMPT_IDS: [5, 6, 7]}
    renderer = SimpleNamespace(validate_token_ids=lambda ids, parameter=None: None)
    assert online._reused_prompt_token_ids(request, renderer, request.messages) == [5, 6, 7]
    assert request.kv_transfer_params == {"sparsecache": {"chunks": ["a"]}}  # what the connector then sees
    assert "_reused_prompt_token_ids(request" in inspect.getsource(online.OnlineRenderer)  # the chat path uses it
    echoed = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], echo=True,
                                   kv_transfer_params={PROMPT_IDS: [5]})
    assert online._reused_prompt_token_ids(echoed, renderer, echoed.messages) is None  # why serve refuses echo


def test_a_completions_prompt_may_be_token_ids_and_errors_take_vllms_shape():
    from http import HTTPStatus

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from sparsecache.vllm.hooks import error_response, is_error, use_prompt

    request = CompletionRequest(model="m", prompt="question")
    use_prompt(request, [1, 2, 3], {"sparsecache": {}}, chat=False)
    assert request.prompt == [1, 2, 3] and request.kv_transfer_params == {"sparsecache": {}}
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompt == [1, 2, 3]
    err = error_response("no", "BadRequestError", HTTPStatus.BAD_REQUEST)
    assert is_error(err) and not is_error(request)
