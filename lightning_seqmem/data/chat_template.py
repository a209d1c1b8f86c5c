"""Chat templates: the built-in ChatML-style template, finding a tokenizer's template, rendering and tokenizing.

Rendering goes through transformers' own Jinja renderer (``render_jinja_template``, the one
``apply_chat_template`` calls) with the tokenizer's special tokens as template variables, so the text is the one
``apply_chat_template`` and TRL produce; tokenizing the text once with character offsets lets every turn boundary
and ``{% generation %}`` span be mapped to token indices without tokenizing again.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import warnings
from typing import Any

import numpy as np

from lightning_seqmem.data.backend import plain_backend

BUILTIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- bos_token + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- bos_token + 'assistant\n' -}}{%- endif -%}"
)
"""ChatML's layout (``<turn start>role\\ncontent<turn end>``) spelled with the tokenizer's own ``bos_token`` and
``eos_token``, so the built-in tokenizer needs no new tokens (and the model no new embeddings). The assistant's
content and its closing EOS sit inside ``{% generation %}``: the model is trained to stop. Set it with
``tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE``."""

MARKERS = "generation_markers"
"""Mask method: the template's ``{% generation %}`` blocks say which tokens the assistant wrote."""
PREFIX_DIFFERENCE = "prefix_difference"
"""Mask method for templates without markers: a turn's tokens are what its message adds to the rendered prefix."""

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_warned_templates: set[str] = set()


def has_generation_markers(template: str) -> bool:
    """Whether ``template`` has ``{% generation %}`` blocks (whitespace-trim variants included)."""
    return _GENERATION_TAG.search(template) is not None


def chat_template_of(tokenizer: Any) -> str:
    """The tokenizer's chat template as one string (the ``"default"`` one of a dict of named templates).

    Raises:
        ValueError: the tokenizer has no chat template; the message says how to set one.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ValueError(
            f"Tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no chat template, "
            "so conversations (a 'messages' column) cannot be rendered. Set one before passing it: "
            "tokenizer.chat_template = '<jinja template>' (for the built-in tokenizer: tokenizer.chat_template = "
            "lightning_seqmem.data.chat_template.BUILTIN_CHAT_TEMPLATE), or load the tokenizer of an instruct model."
        )
    return template


def template_fingerprint(template: str) -> str:
    """SHA-256 of the template text: part of the token-cache key, since a new template means new tokens."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def mask_method(template: str) -> str:
    """Which mask method a template gets: :data:`MARKERS` or :data:`PREFIX_DIFFERENCE`, said once per template
    (a ``UserWarning``) for the fallback."""
    if has_generation_markers(template):
        return MARKERS
    key = template_fingerprint(template)
    if key not in _warned_templates:
        _warned_templates.add(key)
        warnings.warn(
            "The chat template has no {% generation %} markers: the trained tokens of each turn are found by "
            "rendering growing prefixes of every conversation and taking the difference (checked on each "
            "conversation: a template that renders an earlier turn differently depending on what follows is "
            "refused). Add {% generation %}...{% endgeneration %} around the assistant's output to use the markers.",
            UserWarning,
            stacklevel=3,
        )
    return PREFIX_DIFFERENCE


class ChatRenderer:
    """A tokenizer and its chat template, ready to render conversations and map characters to tokens.

    Args:
        tokenizer: a fast Hugging Face tokenizer (offsets are needed) with a chat template.
        masks: whether trained-token masks will be asked for (the mask method is then decided, and its fallback
            said); preference pairs render whole sequences only.

    Raises:
        ValueError: no chat template, or a tokenizer that cannot return offsets (a slow, Python one).
    """

    def __init__(self, tokenizer: Any, masks: bool = True) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template_of(tokenizer)
        self.method = mask_method(self.template) if masks else None
        if not getattr(tokenizer, "is_fast", True):
            raise ValueError(
                f"Tokenizer {type(tokenizer).__name__} is a slow (Python) tokenizer: conversations need character "
                "offsets. Load the fast one (AutoTokenizer.from_pretrained(..., use_fast=True))."
            )
        self._variables = dict(tokenizer.special_tokens_map)
        self._backend = plain_backend(tokenizer)  # never pads nor cuts, whatever tokenizer.json pins
        self._direct = None
        self._direct = self._direct_renderer()
        self.preamble = self.try_render([])
        """What the template writes before any message (a BOS, a default system prompt), or ``None``."""

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False, spans: bool = True
    ) -> tuple[str, list[tuple[int, int]]]:
        """Render one conversation as ``apply_chat_template(tokenize=False)`` does (``None`` values dropped).

        Returns:
            ``(text, generation_spans)``: the character spans of the ``{% generation %}`` blocks (empty without
            markers, or when ``spans`` is False: finding them costs a second pass).
        """
        return self.render_prepared(self.prepare(messages), add_generation_prompt, spans)

    def prepare(self, messages: list[dict]) -> list[dict]:
        """The turns as the template sees them (``None`` values dropped, plain data, reasoning fields aliased: what
        ``render_jinja_template`` makes of them), made once per conversation so that its prefixes render without
        converting it again (``render_prepared(chat[:i])``)."""
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return conversation if self._direct is None else self._direct[1](conversation)

    def render_prepared(
        self, chat: list[dict], add_generation_prompt: bool = False, spans: bool = True
    ) -> tuple[str, list[tuple[int, int]]]:
        """:meth:`render` of turns from :meth:`prepare` (or a prefix of them).

        Why: ``render_jinja_template`` converts the whole conversation and sets its options up on every call; a
        conversation's turn boundaries take one render per prefix, so that setup was half of the rendering time.
        Here the compiled template is called directly, as ``render_jinja_template`` calls it (checked on a probe
        conversation when the renderer is made; where it differs, every render goes through it instead).
        """
        if self._direct is None:
            return self._render_jinja(chat, add_generation_prompt, spans)
        template = self._direct[0]
        if spans and self.method == MARKERS:
            blocks: list[str] = []
            indices: list[tuple[int, int]] = []
            with template.environment.activate_tracker(blocks, indices):
                for block in template.generate(messages=chat, add_generation_prompt=add_generation_prompt, **self._kw):
                    blocks.append(block)
                text = "".join(blocks)
            return text, [tuple(s) for s in indices]
        return template.render(messages=chat, add_generation_prompt=add_generation_prompt, **self._kw), []

    def _render_jinja(self, messages: list[dict], add_generation_prompt: bool, spans: bool):
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, found = render_jinja_template(
            conversations=[messages],
            chat_template=self.template,
            return_assistant_tokens_mask=spans and self.method == MARKERS,
            add_generation_prompt=add_generation_prompt,
            **self._variables,
        )
        return texts[0], [tuple(s) for s in found[0]] if found else []

    def _direct_renderer(self):
        """``(compiled template, prepare)`` for calling the template directly, or ``None`` where this
        transformers lacks the pieces or renders a probe conversation otherwise."""
        try:
            from transformers.utils import chat_template_utils as ctu

            template = ctu._compile_jinja_template(self.template)
            plain, alias = ctu._plain_template_data, ctu._alias_reasoning_fields
            self._kw = {"tools": None, "documents": None, **plain(self._variables)}

            def prepare(conversation):
                return alias(plain(conversation))

            self._direct = (template, prepare)
            probe = [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u v"},
                {"role": "assistant", "content": "a b"},
                {"role": "user", "content": "w"},
                {"role": "assistant", "content": "c"},
            ]
            for n in (1, 2, 3, 5):
                for prompt in (False, True):
                    for spans in (False, True):
                        fast = _outcome(lambda: self.render_prepared(prepare(probe[:n]), prompt, spans))
                        if fast != _outcome(lambda: self._render_jinja(probe[:n], prompt, spans)):
                            return None
        except Exception:  # noqa: BLE001 (any failure: the documented path is used instead)
            return None
        return self._direct

    def try_render(self, messages: list[dict], add_generation_prompt: bool = False) -> str | None:
        """The rendered text, or ``None`` where the template refuses this (partial) conversation."""
        return self.try_render_prepared(self.prepare(messages), add_generation_prompt)

    def try_render_prepared(self, chat: list[dict], add_generation_prompt: bool = False) -> str | None:
        """:meth:`try_render` of turns from :meth:`prepare`."""
        from jinja2 import TemplateError

        try:
            return self.render_prepared(chat, add_generation_prompt, spans=False)[0]
        except (TemplateError, IndexError, KeyError, TypeError, ValueError):
            return None

    def tokenize(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``input_ids`` (int32) of ``text`` as ``apply_chat_template`` tokenizes it (no special tokens added),
        and the character end of each token (int64), to map characters to tokens with ``searchsorted``."""
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`tokenize` of each text, in one call to the Rust tokenizer (which spreads a batch over threads)."""
        return [self.ids_and_ends(raw) for raw in self.encode_raw(texts)]

    def encode_raw(self, texts: list[str]) -> list:
        """The texts tokenized in one call, not yet read into arrays (:meth:`ids_and_ends` reads each).

        Why apart: the Rust call releases the GIL and can run on a thread of its own; reading its results is Python
        work, better done by the thread that uses them than by one that would hold the GIL against it."""
        if self._backend is not None:  # the Rust tokenizer itself: no per-token Python objects for the offsets
            return self._backend.encode_batch(texts, add_special_tokens=False)
        enc = self.tokenizer(
            texts, add_special_tokens=False, padding=False, truncation=False, return_offsets_mapping=True
        )
        return list(zip(enc["input_ids"], enc["offset_mapping"]))

    @property
    def thread_safe(self) -> bool:
        """Whether :meth:`encode_raw` may run on several threads at once (it calls the Rust tokenizer itself)."""
        return self._backend is not None

    @staticmethod
    def ids_and_ends(raw) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, character end of each token)`` of one result of :meth:`encode_raw`."""
        return _ids_and_ends(*raw) if isinstance(raw, tuple) else _ids_and_ends(raw.ids, raw.offsets)


def _outcome(render) -> Any:
    """What a render gives: its result, or the type of what it raised (a template that refuses a system turn
    refuses it on both paths alike)."""
    try:
        return render()
    except Exception as error:  # noqa: BLE001
        return type(error)


def _ids_and_ends(ids, offsets) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int32)
    # ``fromiter`` over the flattened pairs: twice as fast as ``asarray`` on a list of tuples.
    ends = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))[1::2]
    # Offsets of the pieces after a trimmed or unmapped character can step back to 0: keep ends non-decreasing.
    return ids, np.maximum.accumulate(ends) if len(ends) else ends


def char_to_token(ends: np.ndarray, char: int) -> int:
    """Index of the token that holds character ``char`` (the next token where that character is not mapped);
    ``len(ends)`` past the end."""
    return int(np.searchsorted(ends, char, side="right"))
