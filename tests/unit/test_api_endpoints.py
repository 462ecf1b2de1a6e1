"""Every public route, and every field of the Messages and embeddings requests, is in
the code's tables and README's, with the same verdict; the tables follow the official SDKs."""

from __future__ import annotations

import re
from pathlib import Path

from anthropic.types import message_create_params as sdk_messages
from openai.types import embedding_create_params as sdk_embeddings

from hedgerow import api_params

README = Path(__file__).resolve().parents[2] / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    body = text[text.index(title):]
    return body[:body.index("\n#", 1)]


def rows(title: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in section(title).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_.]+)`", cells[0]):
                found[name] = cells[1]
    return found


def test_the_messages_table_classifies_every_field_the_anthropic_sdk_sends() -> None:
    # The table also keeps what earlier SDKs sent (temperature, top_p, top_k …).
    fields = set(sdk_messages.MessageCreateParamsBase.__annotations__) | {"stream"}
    assert fields - set(api_params.MESSAGES_PARAMS) == set()
    assert {"temperature", "top_p", "top_k"} <= set(api_params.MESSAGES_PARAMS)


def test_the_embeddings_table_classifies_every_field_the_openai_sdk_sends() -> None:
    assert set(sdk_embeddings.EmbeddingCreateParams.__annotations__) == set(
        api_params.EMBEDDINGS_PARAMS)


def test_the_readme_tables_say_what_the_code_does() -> None:
    for title, table in [("### Anthropic's Messages API", api_params.MESSAGES_PARAMS),
                         ("### Embeddings", api_params.EMBEDDINGS_PARAMS)]:
        listed = rows(title)
        for name, param in table.items():
            assert name in listed, f"README's {title} has no row for {name}"
            assert param.support in listed[name], (title, name, listed[name], param.support)


def test_the_readme_lists_every_public_route() -> None:
    routes = section("## API")
    for route in api_params.ENDPOINTS:
        assert f"| `{route}` |" in routes, route
