"""A model folder's Jinja `chat_template` (Kimi-Linear, docs/MODEL.md §6), rendered like
transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, `tojson`,
`raise_exception`, `strftime_now`). Message contents are rendered as placeholders
first, so that special-token names are only recognised in the template's own text; the
text between special tokens is then encoded as one plain-text run, exactly as tiktoken
would encode the whole string.

The chat format that uses it (`JinjaFormat`) and the choice between it and K3's XTML
(`chat_format_for`) are in k3.chat_format, which imports `JinjaTemplate` from here
(and re-exports it)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Iterable, Sequence

from .errors import UsageError
from .tokenizer import Segment

_SENT = "\ue000k3:{}\ue001"
_SENT_RE = re.compile("\ue000k3:(\\d+)\ue001")


class JinjaTemplate:
    """A Jinja chat template rendered the way transformers renders it."""

    def __init__(self, source: str, special_names: Iterable[str] = (), bos_token: str | None = None,
                 eos_token: str | None = None):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover
            raise UsageError("rendering this model's chat template needs the jinja2 package (pip install jinja2).") from None

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._jinja = jinja2
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise UsageError(f"the chat template does not parse (line {e.lineno}: {e.message}).") from None
        names = sorted({n for n in special_names if n}, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names)) if names else None
        self.bos_token, self.eos_token = bos_token, eos_token

    def _render(self, messages, add_generation_prompt, tools, extra) -> str:
        try:
            return self.template.render(messages=messages, tools=tools or None,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except self._jinja.exceptions.TemplateError as e:
            raise UsageError(f"the chat template refused the conversation: {e}") from None

    def render_text(self, messages, add_generation_prompt=True, tools=None, **extra) -> str:
        return self._render(list(messages), add_generation_prompt, tools, extra)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, tools=None,
               **extra) -> list[Segment]:
        """Segments: special-token names found in the template's own text are control
        segments; message contents never are."""
        contents: list[str] = []

        def hide(text):
            contents.append(text)
            return _SENT.format(len(contents) - 1)

        masked = []
        for m in messages:
            m2 = dict(m)
            for key in ("content", "reasoning_content"):
                v = m2.get(key)
                if isinstance(v, str):
                    m2[key] = hide(v)
                elif isinstance(v, list):
                    m2[key] = [dict(p, text=hide(p["text"])) if isinstance(p, dict) and isinstance(p.get("text"), str)
                               else p for p in v]
            masked.append(m2)
        out = self._render(masked, add_generation_prompt, tools, extra)
        found = [int(x) for x in _SENT_RE.findall(out)]
        if sorted(found) != sorted(set(found)) or any(c and _SENT.format(i) not in out
                                                      for i, c in enumerate(contents)):
            # The template transformed or repeated a content string: fall back to what
            # transformers does (the whole rendered text with specials recognised).
            return [(self._render(list(messages), add_generation_prompt, tools, extra), True)]
        segs: list[Segment] = []
        plain: list[str] = []
        pos = 0
        for m in _SENT_RE.finditer(out):
            self._template_text(out[pos:m.start()], segs, plain)
            plain.append(contents[int(m.group(1))])
            pos = m.end()
        self._template_text(out[pos:], segs, plain)
        if "".join(plain):
            segs.append(("".join(plain), False))
        return segs

    def _template_text(self, text: str, segs: list, plain: list) -> None:
        if self._special_re is None:
            plain.append(text)
            return
        pos = 0
        for m in self._special_re.finditer(text):
            plain.append(text[pos:m.start()])
            if "".join(plain):
                segs.append(("".join(plain), False))
            plain.clear()
            segs.append((m.group(0), True))
            pos = m.end()
        plain.append(text[pos:])
