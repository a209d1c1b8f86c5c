"""What a turn's ``content`` may be, and a chat template's own errors told with the conversation that raised them.

Turns are rendered as ``apply_chat_template`` renders them wherever it renders them at all; where it cannot, the
choice is said here once:

- a string is rendered as it is;
- a list of parts (OpenAI's format, ``[{"type": "text", "text": ...}, ...]``) is passed to the template as it is
  where the template reads parts (multimodal-style templates loop over them: the text is then exactly
  ``apply_chat_template``'s), else its text parts are joined with ``"\\n"`` (as vLLM does for templates that take
  a string; ``apply_chat_template`` would raise or print the list's Python form). A part of another type (an
  image, audio) is refused with the row, turn and part named: these are text models;
- a number (int or float: a math answer such as ``4``; ``datasets`` also turns a JSON column's ``"4"`` into
  ``4``) is rendered as ``str(value)``, what a template's ``{{ message['content'] }}`` prints, for every template
  (one that adds it to a string would raise instead);
- anything else (a bool, a dict, a list that is not parts) is refused, the row, turn and column named.

A template that raises (its own ``raise_exception``, e.g. "roles must alternate", or a field a turn lacks) is
reported with the conversation's row and the first turn it refuses; a turn with ``tool_calls`` under a template
that never reads them is refused, since the calls would vanish from the text silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_seqmem.messages import short_repr

PARTS_SEPARATOR = "\n"
"""Joins the text parts of a turn for a template that takes a string (vLLM's choice)."""
_PROBE = "lightning-seqmem-parts-probe"
TEMPLATE_ERRORS: tuple[type[BaseException], ...] = (IndexError, KeyError, TypeError, ValueError, AttributeError)
"""Besides ``jinja2.TemplateError``: what a template's Python-level mistakes raise."""


def template_errors() -> tuple[type[BaseException], ...]:
    from jinja2 import TemplateError

    return (TemplateError, *TEMPLATE_ERRORS)


def takes_parts(renderer: Any) -> bool:
    """Whether the renderer's template reads a list of content parts (their text appears, not the list's
    Python form); asked once per renderer."""
    known = getattr(renderer, "_takes_parts", None)
    if known is None:
        text = renderer.try_render([{"role": "user", "content": [{"type": "text", "text": _PROBE}]}])
        known = text is not None and _PROBE in text and "'type'" not in text and '"type"' not in text
        renderer._takes_parts = known
    return known


def _parts(value: Sequence, where: str) -> list[dict]:
    parts = []
    for p, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}, content part {p} is {short_repr(part)}: only text parts ({{'type': 'text', 'text': "
                "...}) can be rendered for a text model. Drop the other parts (images, audio) from the data, or train "
                "a multimodal model with its processor."
            )
        parts.append({k: v for k, v in part.items() if v is not None})  # Arrow gives every part every key
    return parts


def plain_content(value: Any, where: str, parts_ok: bool) -> Any:
    """A turn's ``content`` as the template gets it (the rules in the module docstring).

    Args:
        value: the content.
        where: names the row and turn in errors.
        parts_ok: the template reads a list of parts (:func:`takes_parts`).

    Raises:
        ValueError: a non-text part, or content that is neither text, parts nor a number.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value):
        parts = _parts(value, where)
        return parts if parts_ok else PARTS_SEPARATOR.join(part["text"] for part in parts)
    raise ValueError(
        f"{where}, column 'content' is {type(value).__name__} ({short_repr(value)}): a turn's content must be a "
        "string, a number or a list of {'type': 'text', 'text': ...} parts. Fix the row, e.g. "
        "dataset.map(lambda r: {'messages': [{**m, 'content': str(m['content'])} for m in r['messages']]})."
    )


def plain_turns(messages: Sequence[Mapping], row: Any, renderer: Any) -> list[dict]:
    """The turns with their ``None`` fields dropped (as ``apply_chat_template`` does) and their content made plain
    (:func:`plain_content`).

    Raises:
        ValueError: a bad content, or ``tool_calls`` under a template that never reads them; names row and turn.
    """
    parts_ok = None
    out = []
    for turn, message in enumerate(messages):
        where = f"Conversation {row}, turn {turn}"
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            parts_ok = takes_parts(renderer) if parts_ok is None else parts_ok
            message["content"] = plain_content(content, where, parts_ok)
        if message.get("tool_calls") and "tool_calls" not in renderer.template:
            raise ValueError(
                f"{where} ({message.get('role')}) has tool_calls, but the chat template never reads 'tool_calls' "
                "(it has no tool branch), so the calls would vanish from the rendered text (apply_chat_template "
                "drops them too). Use the chat template of a model trained for tool use, or write the call into "
                "the turn's 'content'."
            )
        out.append(message)
    return out


def render_refused(error: BaseException, messages: Sequence[Mapping], row: Any, renderer: Any) -> ValueError:
    """The error to raise when the template refuses a whole conversation: the row, the first turn whose prefix it
    refuses (when a prefix shows it) and the fix."""
    turn = next((i for i in range(len(messages)) if renderer.try_render(list(messages[: i + 1])) is None), None)
    where = f"Conversation {row}" + (f", turn {turn} ({messages[turn].get('role')})" if turn is not None else "")
    said = str(error).strip() or type(error).__name__
    if "alternat" in said.lower():
        fix = (
            "The template wants user and assistant turns to alternate (a system message first at most): merge "
            "consecutive turns of one role, or leave the conversation out (dataset.filter)."
        )
    else:
        fix = (
            "The template cannot render this conversation (apply_chat_template raises the same): give the turns "
            "the fields and order it expects, leave the conversation out (dataset.filter), or use another template."
        )
    return ValueError(f"{where}: the chat template raised {type(error).__name__}: {said}. {fix}")


def render_turns(
    renderer: Any, messages: list[dict], row: Any, add_generation_prompt: bool = False, spans: bool = True
) -> tuple[str, list[tuple[int, int]]]:
    """``renderer.render`` of plain turns (:func:`plain_turns`), a template error told by :func:`render_refused`."""
    try:
        return renderer.render(messages, add_generation_prompt, spans)
    except template_errors() as error:
        raise render_refused(error, messages, row, renderer) from error
