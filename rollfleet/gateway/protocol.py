"""Request bodies the gateway accepts: OpenAI's, plus a few documented extensions. Data only.

Validation is strict (``"5"`` is not an integer, ``true`` is not a number), as OpenAI's own API
is, so that a typo in an agent's request fails loudly with the field named instead of being
coerced. Unknown keys are ignored (clients send newer OpenAI options the fleet has no use for),
each logged once by name.

Extensions (vLLM-style names where vLLM has one):

* every route: ``session_id`` (same as the ``X-Session-ID`` header or ``user``: turns of one
  session share a replica and its prefix cache), ``top_k``, ``min_tokens``, ``stop_token_ids``,
  ``ignore_eos``, ``repetition_penalty``, ``return_token_ids`` (token ids, logprobs and weight
  versions of every choice, so an RL agent trains on exactly the tokens it was served);
* every generation route: ``structured_outputs`` (vLLM's: exactly one of ``json``, ``regex``,
  ``choice``, ``grammar``, ``json_object``, ``structural_tag``), or OpenAI's ``response_format``
  (``json_object``, ``json_schema``): the engine samples under the constraint, so the tokens the
  trainer gets are the ones that satisfied it (the sim engine, whose tokens are random, ignores it);
* ``/v1/completions``: ``prompt`` may be token ids (``[1, 2, 3]`` or a batch of them);
* ``/v1/completions/tokens``: token ids in (``prompt_token_ids``), token ids out, no tokenizer.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

#: Bounds on what a request may ask the gateway to stop on. A stop string must be one token of the
#: vocabulary (:meth:`~rollfleet.gateway.codec.TextCodec.stop_token_ids`), and each is tokenised
#: on the event loop: unbounded, one body of 1.6 million stops held every other request for ~19 s.
MAX_STOPS = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # OpenAI's cap is 300 entries; vLLM's none

_Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

logger = logging.getLogger(__name__)

#: Ignored body fields already logged, by model: each is logged once, so that a framework sending
#: its own field on every request does not flood the log (bounded against bodies of random keys).
_IGNORED_LOGGED: set[tuple[str, str]] = set()
_MAX_IGNORED_LOGGED = 1024


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """JSON ``null`` for a field means its default, as OpenAI's spec marks ``n``, ``stream``,
        ``logprobs``, ``echo``... nullable: the ``openai`` client sends ``null`` for a parameter given
        as ``None``, and frameworks forward unset settings that way (``"n": null`` was a 400)."""
        if isinstance(data, dict):
            _log_ignored(cls, data)
            return {k: v for k, v in data.items() if v is not None}
        return data


def _log_ignored(model: type[BaseModel], data: dict[Any, Any]) -> None:
    """Say which fields a body had that the gateway ignores, as vLLM's server does: a misspelled
    ``temprature`` otherwise samples at the default without a word anywhere."""
    if len(_IGNORED_LOGGED) >= _MAX_IGNORED_LOGGED or model.model_config.get("extra") == "allow":
        return  # a model that takes any field (the profile options) ignores none
    for key in data.keys() - model.model_fields.keys():
        seen = (model.__name__, str(key)[:64])
        if seen not in _IGNORED_LOGGED and len(_IGNORED_LOGGED) < _MAX_IGNORED_LOGGED:
            _IGNORED_LOGGED.add(seen)
            logger.warning("the gateway ignores the body field %r of %s: it is not one it knows", seen[1], seen[0])


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    """OpenAI's ``response_format``; ``json_schema`` holds ``{"name", "schema", "strict"}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


class _GenerationRequest(_Body):
    """Fields shared by every generation route."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, le=2**31 - 1)  # engines hold it in 32 bits
    min_p: Optional[float] = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1)
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stop: Optional[Union[_Stop, Annotated[list[_Stop], Field(max_length=MAX_STOPS)]]] = None
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: Optional[int] = Field(None, ge=0)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    session_id: Optional[str] = Field(None, min_length=1, max_length=512)
    return_token_ids: bool = False
    structured_outputs: Optional[dict[str, Any]] = None
    response_format: Optional[ResponseFormat] = None
    #: Token id (as a string, OpenAI's JSON) -> a bias in [-100, 100] added to its logit.
    logit_bias: Optional[dict[str, Union[int, float]]] = Field(None, max_length=MAX_LOGIT_BIAS)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: text or token-id prompts, one or a batch."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: Optional[int], info: ValidationInfo) -> Optional[int]:
        """OpenAI samples ``best_of`` and returns the best ``n``; a fleet that trains on what it
        sampled returns every sample, so only ``best_of == n`` means what the caller asked."""
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of ({best_of}) other than n ({n}) is not supported: ask for n samples")
        return best_of


class ContentPart(_Body):
    """One part of a message's content; only text parts carry meaning for a text model."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top: Optional[int], info: ValidationInfo) -> Optional[int]:
        if top is not None and not info.data.get("logprobs"):  # OpenAI's 400 too
            raise ValueError("top_logprobs is given only with logprobs: true")
        return top


class TokenCompletionRequest(_GenerationRequest):
    """``POST /v1/completions/tokens``: token ids in, token ids + logprobs + weight versions out."""

    prompt_token_ids: list[int] = Field(min_length=1)


class AddReplicasRequest(_Body):
    num_replicas: int = Field(1, ge=1, le=1024)


class RemoveReplicasRequest(_Body):
    replica_ids: list[str] = Field(min_length=1)
    drain_timeout_s: float = Field(30.0, ge=0)


class UpdateWeightsRequest(_Body):
    path: str = Field(min_length=1, description="A weights file or folder the replicas can read.")
    version: int = Field(ge=0, description="The new weight version; must be above the current one.")
    mode: Optional[Literal["abort", "keep", "rolling"]] = Field(
        None, description="How the commit treats in-flight requests; None: the fleet's rollout.weight_sync.mode."
    )


class ProfileRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)


__all__ = [
    "StreamOptions",
    "ResponseFormat",
    "CompletionRequest",
    "ContentPart",
    "ChatMessage",
    "ChatCompletionRequest",
    "TokenCompletionRequest",
    "AddReplicasRequest",
    "RemoveReplicasRequest",
    "UpdateWeightsRequest",
    "ProfileRequest",
]
