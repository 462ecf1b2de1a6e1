"""Request bodies of the control plane's APIs: JSON into a wire model, or a 400
that names the first offending field (one place, for every route)."""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from hedgerow.asgi import Request
from hedgerow.errors import InvalidRequest
from hedgerow.wire import AdminOnlyField

MAX_BODY = 64 * 1024
# A body must arrive within this of its headers: a client that trickles one (on the
# join listener, needing no certificate) must not hold a connection for ever.
BODY_DEADLINE_S = 10.0

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M], what: str, *,
                     limit: int = MAX_BODY) -> M:
    body = await request.body(limit, deadline_s=BODY_DEADLINE_S)
    try:
        return model.model_validate(orjson.loads(body))
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"body is not valid JSON: {error}") from None
    except ValidationError as error:
        raise _invalid(what, error) from None


def _invalid(what: str, error: ValidationError) -> InvalidRequest:
    """A 400 that names the first offending field and says what is wrong with it."""
    first = error.errors(include_url=False)[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, AdminOnlyField):
        return InvalidRequest(f"invalid {what}: {cause}", param=cause.field,
                              code="field_not_allowed")
    field = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return InvalidRequest(f"invalid {what}: {field + ': ' if field else ''}{message}",
                          param=field or None)
