"""Chat templates without transformers: find a model folder's template and render it as transformers does.

The template comes from a string, a ``.jinja`` file or a ``tokenizer_config.json``, rendered in transformers'
sandboxed Jinja environment; a ``{% generation %}`` block records its body's character span.

Trade-off: keeping transformers out of the runtime means following its conventions by hand (tests compare outputs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from lightning_d9d.core.digest import digest

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateRenderError(ValueError):
    """The template raised (``raise_exception`` or a Jinja error) while rendering a conversation."""


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A rendered conversation and the character spans of its ``{% generation %}`` blocks."""

    text: str
    generation_spans: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template (``source``) and the ``special_tokens`` strings it is rendered with."""

    source: str
    special_tokens: tuple[tuple[str, str], ...] = ()

    @property
    def has_generation_blocks(self) -> bool:
        return GENERATION_TAG.search(self.source) is not None

    @property
    def digest(self) -> str:
        """The digest of the template and its special tokens (what decides the rendered text)."""
        return digest(json.dumps([self.source, list(self.special_tokens)], ensure_ascii=False))

    def special(self, name: str) -> str | None:
        return dict(self.special_tokens).get(name)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> Rendered:
        """Render one conversation, recording generation spans; ``TemplateRenderError`` if the template raises."""
        import jinja2

        template = _compile(self.source)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        tracker = template.environment.generation_tracker  # type: ignore[attr-defined]
        tracker.start(blocks, spans)
        try:
            for block in template.generate(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **dict(self.special_tokens),
            ):
                blocks.append(block)
        except jinja2.TemplateError as error:
            raise TemplateRenderError(f"the chat template raised: {error}") from error
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as error:
            # Python errors inside the template's expressions (a message field of an unexpected type, ...).
            raise TemplateRenderError(f"the chat template failed: {type(error).__name__}: {error}") from error
        finally:
            tracker.stop()
        return Rendered("".join(blocks), tuple(spans))


def load_chat_template(source: str | None, tokenizer_path: str) -> ChatTemplate | None:
    """The chat template named by ``source``, or found beside the tokenizer file (``None`` if there is none).

    Args:
        source: a Jinja string, a ``.jinja`` file, a ``tokenizer_config.json``, or ``None``.

    Raises:
        ValueError: a file without a template, or an unparsable template.
        FileNotFoundError: ``source`` looks like a file path that does not exist.
    """
    folder = Path(tokenizer_path).expanduser().parent
    config_file = folder / "tokenizer_config.json"
    if source is None:
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            text, where = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        elif config_file.is_file() and _read_json(config_file).get("chat_template"):
            text, where = _config_template(_read_json(config_file), str(config_file)), str(config_file)
        else:
            return None
    elif source.endswith((".jinja", ".json")) and "{" not in source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"chat_template file {source!r} does not exist")
        where = str(path)
        if path.suffix == ".json":
            config_file = path
            text = _config_template(_read_json(path), where)
        else:
            text = path.read_text(encoding="utf-8")
    else:
        text, where = source, "the chat_template string"
    special = _config_special_tokens(config_file)
    template = ChatTemplate(text, tuple(sorted(special.items())))
    try:
        _compile(text)
    except Exception as error:  # jinja2.TemplateSyntaxError, with its line
        raise ValueError(f"cannot parse the chat template from {where}: {error}") from error
    return template


def special_tokens_beside(tokenizer_path: str) -> dict[str, str]:
    """The special-token strings of the configs in the tokenizer file's folder (``{}`` when there are none)."""
    return _config_special_tokens(Path(tokenizer_path).expanduser().parent / "tokenizer_config.json")


def _config_special_tokens(config_file: Path) -> dict[str, str]:
    special = _special_tokens(_read_json(config_file)) if config_file.is_file() else {}
    # Older model folders keep their special tokens in special_tokens_map.json only (transformers reads both).
    map_file = config_file.parent / "special_tokens_map.json"
    if map_file.is_file():
        special = {**_special_tokens(_read_json(map_file)), **special}
    return special


def check_special_tokens_defined(template: ChatTemplate) -> None:
    """Raise ValueError when the template reads a special token no config defines (Jinja would render it empty)."""
    from jinja2 import meta

    used = meta.find_undeclared_variables(_compile(template.source).environment.parse(template.source))
    missing = sorted(name for name in used & set(SPECIAL_TOKEN_KEYS) if template.special(name) is None)
    if missing:
        raise ValueError(
            f"the chat template uses {missing} but no tokenizer_config.json defines them; put them in a "
            "tokenizer_config.json next to the tokenizer.json (or pass chat_template= such a file), e.g. "
            '{"eos_token": "</s>"}'
        )


def with_special_tokens(template: ChatTemplate, extra: dict[str, str]) -> ChatTemplate:
    """``template`` with ``extra`` special tokens added (those it has already win)."""
    merged = {**extra, **dict(template.special_tokens)}
    return dataclasses.replace(template, special_tokens=tuple(sorted(merged.items())))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def _config_template(config: dict[str, Any], where: str) -> str:
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        if "default" not in named:
            raise ValueError(f"{where}: chat_template is a list without a 'default' entry (names: {sorted(named)})")
        template = named["default"]
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where} holds no chat_template")
    return template


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken saved as {"content": ..., "lstrip": ...}
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return special


class _Tracker:
    """Records generation-block spans while a render is active (one render at a time per process)."""

    def __init__(self) -> None:
        self.state: tuple[list[str], list[tuple[int, int]]] | None = None

    def start(self, blocks: list[str], spans: list[tuple[int, int]]) -> None:
        self.state = (blocks, spans)

    def stop(self) -> None:
        self.state = None


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tracker = _Tracker()

    class GenerationBlocks(jinja2.ext.Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

        def _record(self, caller: Any) -> str:
            text = caller()
            if tracker.state is not None:
                blocks, spans = tracker.state
                # Output is streamed block by block, so what was yielded before this block is its offset.
                start = sum(len(block) for block in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.generation_tracker = tracker  # type: ignore[attr-defined]
    return environment.from_string(source)
