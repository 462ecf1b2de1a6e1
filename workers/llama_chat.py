"""What llama-cpp-python is asked to generate for a request (runs in a slot's thread).

A chat is rendered with the GGUF's own template -- the formatter
llama-cpp-python builds for its default chat handler -- and then completed as
text, so that a forced tool call can start the answer (``call_prefill``) and
any answer can be held to a grammar (``workers.tool_calls``). Each generator
here yields (text, llama's finish_reason) pairs.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import TYPE_CHECKING, Any, Generator

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from llama_cpp.llama_grammar import LlamaGrammar

from hedgerow.errors import RuntimeFault
from workers.backend import GenerationRequest
from workers.tool_calls import (
    CALL_OPEN,
    call_prefill,
    first_token_grammar,
    forced,
    grammar_for,
    render_messages,
)

if TYPE_CHECKING:
    from workers.llama_backend import _MeteredLlama as MeteredLlama

Chunk = tuple[str, str | None]  # (text, llama's finish_reason)


def llama_chunks(llama: MeteredLlama, request: GenerationRequest,
                  grammar: str | None) -> Generator[Chunk, None, None]:
    """llama-cpp-python's stream for ``request`` as (text, finish_reason) pairs.

    A chat is rendered with the model's own template, as llama-cpp-python's
    chat handler does, so that a forced tool call can start the answer
    (``call_prefill``) and any answer can be held to ``grammar``.
    """
    sampling = _sampling_arguments(request)
    if request.messages is None:
        yield from _completion_chunks(llama, request.prompt or "", sampling, grammar)
        return
    prompt, template_stops = _chat_prompt(llama, request, sampling)
    if request.tool_mode == "auto" and request.response_schema is None:
        yield from _auto_chunks(llama, request, prompt, sampling, template_stops)
        return
    yield from _completion_chunks(llama, prompt, sampling, grammar)


def _completion_chunks(llama: MeteredLlama, prompt: str | list[int], sampling: dict[str, Any],
                       grammar: str | None) -> Generator[Chunk, None, None]:
    if grammar is not None:
        sampling = {**sampling, "grammar": LlamaGrammar.from_string(grammar,
                                                                              verbose=False)}
    stream: Any = llama.create_completion(prompt=prompt, stream=True, **sampling)
    with contextlib.closing(stream):
        for chunk in stream:
            choice = chunk["choices"][0]
            yield choice["text"], choice["finish_reason"]


def _auto_chunks(llama: MeteredLlama, request: GenerationRequest, prompt: list[int],
                 sampling: dict[str, Any], template_stops: list[str],
                 ) -> Generator[Chunk, None, None]:
    """``tool_choice: "auto"`` in two steps: the first token, under a grammar that
    lets it open a call or start text, decides; then either the call under its
    grammar, or free text with no grammar to slow every token down (llama.cpp
    checks a grammar against the whole vocabulary at each step)."""
    first: Any = llama.create_completion(
        prompt=prompt, stream=False, **{**sampling, "max_tokens": 1, "grammar":
                                        LlamaGrammar.from_string(first_token_grammar(),
                                                                           verbose=False)})
    text, reason = first["choices"][0]["text"], first["choices"][0]["finish_reason"]
    if text.startswith("<"):
        yield CALL_OPEN, None
        opened = prompt + llama.tokenize(CALL_OPEN.encode(), add_bos=False, special=False)
        calls = grammar_for(request.tools, "required", None)
        yield from _completion_chunks(llama, opened, {**sampling, "stop": template_stops}, calls)
        return
    if reason == "length" and llama.tally.limit is not None and llama.tally.limit <= 1:
        yield text, "length"
        return
    if reason == "stop":  # the model ended at once, or the client's stop matched
        yield text, "stop"
        return
    if text:
        yield text, None
    said = llama.tokenize(text.encode(), add_bos=False, special=False) if text else []
    yield from _completion_chunks(llama, prompt + said, sampling, None)


def _chat_prompt(llama: MeteredLlama, request: GenerationRequest,
                 sampling: dict[str, Any]) -> tuple[list[int], list[str]]:
    """The chat's prompt tokens and its template's stops; sets the stops in ``sampling``."""
    assert request.messages is not None
    formatter = llama.chat_formatter
    if formatter is None:
        raise RuntimeFault("this model has no chat template", code="generation_failed")
    messages: Any = render_messages(request.messages, request.tools, request.tool_mode)
    rendered = formatter(messages=messages)
    text = rendered.prompt + call_prefill(request.tools, request.tool_mode)
    stops = rendered.stop if isinstance(rendered.stop, list) else [rendered.stop or ""]
    template_stops = [s for s in stops if s]
    # A forced call ends where its grammar does; the client's stops would cut its JSON.
    own = [] if forced(request.tool_mode) else sampling["stop"]
    sampling["stop"] = own + template_stops
    sampling["stopping_criteria"] = rendered.stopping_criteria
    tokens = llama.tokenize(text.encode("utf-8"), add_bos=not rendered.added_special, special=True)
    return tokens, template_stops


def chat_formatter(llama: llama_cpp.Llama) -> Jinja2ChatFormatter | None:
    """The GGUF's chat template as a formatter, made as llama-cpp-python makes its default."""
    template = llama.metadata.get("tokenizer.chat_template")
    if not template:
        return None
    eos, bos = llama.token_eos(), llama.token_bos()
    text_of = llama._model.token_get_text
    return Jinja2ChatFormatter(template=template, eos_token=text_of(eos) if eos != -1 else "",
                               bos_token=text_of(bos) if bos != -1 else "",
                               stop_token_ids=[eos])


def _sampling_arguments(request: GenerationRequest) -> dict[str, Any]:
    # Without an explicit seed llama-cpp-python reuses one fixed seed for every
    # call, which would make every temperature > 0 answer identical.
    seed = request.seed if request.seed is not None else secrets.randbits(31)
    return {
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": seed,
        "stop": list(request.stop),
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": dict(request.logit_bias) or None,
    }
