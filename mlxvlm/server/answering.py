"""What every generating endpoint shares (chat completions, Messages, Responses): a chat
request through admission, preparation and the engine, within one ``RequestLifetime``,
to the endpoint's own body or stream of events.

An endpoint translates its request into a ``ChatCompletionRequest`` (the one validated
form of a conversation and its sampling options) and gives two writers: ``body(first,
stream)`` for a whole answer and ``events(first, stream)`` for a stream.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from mlxvlm.batching import BatchStep
from mlxvlm.sampling.constrained import ConstraintError, GrammarConstraint, json_schema_constraint
from mlxvlm.generate.loop import fit_to_context
from mlxvlm.generate.text import eos_token_ids
from mlxvlm.distributed.group import RankLostError
from mlxvlm.server.sharded_stop import ServerStopping
from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.media import MediaError, PixelBudgetError
from mlxvlm.sampling import SamplingOptions
from mlxvlm.text.answer_parts import AnswerSplitter, Part
from mlxvlm.server.chat_completions import sampling_options, to_messages
from mlxvlm.server.errors import APIError
from mlxvlm.server.lifetime import RequestLifetime
from mlxvlm.server.schemas import ChatCompletionRequest
from mlxvlm.server.security import KEY_ID
from mlxvlm.server.service import GenerationService, TokenStream
from mlxvlm.server.thinking_budget import ThinkingBudget, tag_ids
from mlxvlm.server.tools import AnswerPlan
from mlxvlm.text.tokenization import processor_state, tokenizer_of

BodyWriter = Callable[[BatchStep, TokenStream], Awaitable[dict]]
EventWriter = Callable[[BatchStep, TokenStream], AsyncIterator[str]]

logger = logging.getLogger("mlxvlm.server")


def server_unavailable(error: BaseException) -> BaseException | None:
    """The server's own failure in ``error`` or behind it (a rank of a sharded model lost,
    the server stopping), which no request caused: a 503."""
    for found in (error, error.__cause__):
        if isinstance(found, (RankLostError, ServerStopping)):
            return found
    return None


def as_api_error(error: Exception, param: str = "messages") -> APIError:
    """A user-input error from preparing or running a request, as a 400 (including a
    chat template that refuses the conversation, e.g. roles out of order)."""
    unavailable = server_unavailable(error)
    if unavailable is not None:  # the server's fault, not the request's
        code = "rank_lost" if isinstance(unavailable, RankLostError) else "server_stopping"
        return APIError(503, str(unavailable), code=code)
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), param=param, code="context_length_exceeded")
    if isinstance(error, PixelBudgetError) and error.shared:
        return APIError(429, str(error), code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(error, PixelBudgetError):
        return APIError(400, str(error), param=param, code="too_many_pixels")
    if isinstance(error, MediaError):
        return APIError(400, str(error), param=param, code="invalid_media")
    return APIError(400, str(error), param=param)


def plan_answer(chat: ChatCompletionRequest,
                service: GenerationService) -> tuple[SamplingOptions, AnswerPlan]:
    """The request's sampling options (those left out: the checkpoint's, else OpenAI's
    defaults, and the thinking budget where the template thinks) and its plan (tools,
    thinking)."""
    options = sampling_options(chat, service.config.max_tokens, service.vocab_size,
                               processor_state(service.processor).sampling_defaults)
    plan = AnswerPlan(chat, service.processor)
    options.kept_token_ids = plan.kept_token_ids()
    if chat.thinking_budget is not None and plan.thinking:
        tokenizer = tokenizer_of(service.processor)
        options.extra_processors = (
            ThinkingBudget(tokenizer, chat.thinking_budget, plan.think),)
    return options, plan


def response_constraint(chat: ChatCompletionRequest, processor: Any) -> GrammarConstraint | None:
    """The grammar a ``response_format`` asks for (None for plain text); raises
    ``ConstraintError`` for a schema that cannot be used."""
    fmt = chat.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.json_schema if fmt.type == "json_schema" else None
    strict = bool(fmt.json_schema.strict) if fmt.type == "json_schema" else False
    return json_schema_constraint(tokenizer_of(processor),
                                  eos_token_ids(processor), schema, strict=strict)


def refusal(error: ConstraintError, service: GenerationService, param: str) -> APIError:
    """A grammar that cannot run, or a budget too small for it, as a counted 400 naming
    the field at fault (``param``: the grammar's)."""
    service.counters.refuse(error.reason)
    if error.reason == "max_tokens":
        return APIError(400, str(error), param="max_tokens")
    code = "invalid_response_format" if param != "tools" else None
    return APIError(400, str(error), param=param, code=code)


def _checked_grammar(build: Callable[[], GrammarConstraint | None], max_tokens: int,
                     context: int | None) -> GrammarConstraint | None:
    """The request's grammar compiled and walked through a whole answer: what cannot run,
    or not within ``max_tokens`` (nor the model's ``context``), is refused before the
    request takes a slot."""
    constraint = build()
    if constraint is not None:
        constraint.check_budget(max_tokens, context)
    return constraint


def fit_grammar_to_thoughts(options: SamplingOptions, plan: AnswerPlan,
                            service: GenerationService) -> None:
    """On a thinking template, a grammar applies after the thoughts where the prompt
    opened them (so the answer is the grammar's, not the thoughts', and a thinking
    budget's forced end tag is one the grammar expects). Where the prompt did not open
    them the grammar leaves no room for thoughts, and a thinking budget has nothing to
    end."""
    if options.constraint is None or not plan.thinking:
        return
    if plan.think.opened_by(plan.prompt_text):
        tokenizer = tokenizer_of(service.processor)
        constraint = options.constraint.after_thoughts(tag_ids(tokenizer, plan.think.close))
        constraint.check_budget(options.max_tokens, getattr(service.model, "max_context", None))
        options.constraint = constraint
    else:
        options.extra_processors = tuple(extra for extra in options.extra_processors
                                         if not isinstance(extra, ThinkingBudget))


async def answer(request: Request, chat: ChatCompletionRequest, options: SamplingOptions,
                 service: GenerationService, *, body: BodyWriter, events: EventWriter,
                 plan: AnswerPlan | None = None, param: str = "messages",
                 format_param: str = "response_format") -> Response:
    """Run ``chat`` and answer with ``body``'s JSON or ``events``' stream (``param``: the
    request field that input errors name; ``format_param``: the one a response format
    that cannot be used names). ``plan``: the request's tools and thinking; it learns
    the rendered prompt (``plan.prompt_text``) before the writers run."""
    # Compiling a grammar can take a while: not on the event loop. A response format
    # shapes a text answer, so it wins over "auto" tools.
    build, grammar_param = None, format_param
    if plan is not None and plan.forces_calls:
        build, grammar_param = plan.constraint, "tools"
    elif chat.response_format is not None:
        build = functools.partial(response_constraint, chat, service.processor)
    elif plan is not None and plan.tools:
        build, grammar_param = plan.constraint, "tools"
    if build is not None:
        try:
            options.constraint = await asyncio.to_thread(
                _checked_grammar, build, options.max_tokens,
                getattr(service.model, "max_context", None))
        except ConstraintError as error:
            raise refusal(error, service, grammar_param) from None
        except APIError:  # the tools' grammar, refused as it was built
            service.counters.refuse("grammar")
            raise
    template_options = plan.template_options if plan is not None else None
    messages = to_messages(chat)
    if plan is not None:
        messages = plan.conversation(messages)
    with RequestLifetime(service, request) as life:
        try:
            # With API keys, prefix reuse stays within the key (cached_tokens would
            # otherwise tell one client what another sent).
            namespace = request.scope.get("state", {}).get(KEY_ID)
            prepared = await life.until_disconnect(
                service.prepare(messages, namespace, template_options))
            if plan is not None:
                plan.prompt_text = prepared.inputs.prompt_text
            # The budget is what the context leaves (the engine cuts it so too), known
            # before a grammar's processor is made: its closing path counts on it, and a
            # whole answer must still fit in it.
            fitted = fit_to_context(service.model, prepared.inputs.num_tokens,
                                    options.max_tokens)
            if options.constraint is not None and fitted < options.max_tokens:
                options.constraint.check_budget(fitted)
            options.max_tokens = fitted
            if plan is not None:
                fit_grammar_to_thoughts(options, plan, service)
            stream = life.submit(prepared, options)
            # Wait for the first token before answering, so that a request that fails
            # in prefill still gets a proper error status.
            first = await life.until_disconnect(stream.__anext__())
            if not chat.stream:
                return JSONResponse(await life.until_disconnect(body(first, stream)))
        except ConstraintError as error:  # its budget, its grammar failing as it ran
            raise refusal(error, service, grammar_param) from error
        except (MlxvlmError, ValueError, TemplateError) as error:
            limit = getattr(error, "limit", None)  # a refusal for passing a limit
            if limit is not None:
                service.counters.refuse(limit)
            raise as_api_error(error, param) from error
        return life.event_stream(events(first, stream))


async def whole_answer(first: BatchStep, stream: TokenStream, plan: AnswerPlan
                       ) -> tuple[list[Part], AnswerSplitter, BatchStep]:
    """A request's whole answer split by its plan: the parts, the splitter (its calls)
    and the last step."""
    texts = []
    async for step in steps(first, stream):
        texts.append(step.text)
    splitter = plan.splitter()
    return splitter.feed("".join(texts)) + splitter.finish(), splitter, step


async def split_steps(first: BatchStep, stream: TokenStream, splitter: AnswerSplitter
                      ) -> AsyncIterator[tuple[BatchStep, list[Part]]]:
    """Each step with the parts of the answer it completes (the last one: all that was
    still held back)."""
    async for step in steps(first, stream):
        parts = splitter.feed(step.text)
        if step.finish_reason is not None:
            parts += splitter.finish()
        yield step, parts


async def steps(first: BatchStep, stream: TokenStream) -> AsyncIterator[BatchStep]:
    """The request's steps from its first to its last (the one with a finish reason)."""
    step = first
    while True:
        yield step
        if step.finish_reason is not None:
            return
        step = await stream.__anext__()


def stream_failure(error: Exception) -> tuple[int, str]:
    """The status and message of a failure once a stream's headers are sent."""
    unavailable = server_unavailable(error)
    if unavailable is not None:
        return 503, str(unavailable)
    status = 400 if isinstance(error, (MlxvlmError, ValueError)) else 500
    message = str(error) if status == 400 else "generation failed; see the server log"
    return status, message


def logged_stream_failure(error: Exception) -> tuple[int, str]:
    """``stream_failure``'s status and message, logged (called where the stream caught
    ``error``): a stream the server's own stop ended (a rank lost, the server stopping:
    expected, and its cause is logged where it was seen) as one warning line; any other
    failure with its traceback."""
    status, message = stream_failure(error)
    if server_unavailable(error) is not None:
        logger.warning("a streamed answer ended with a %d: %s", status, message)
    else:
        logger.error("generation failed while streaming", exc_info=error)
    return status, message
