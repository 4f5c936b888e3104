"""Fine-tuning split: load a split, recognise its format and tokenize it with loss masks (or hand text back).

Trade-off: the format is known only once the split is loaded, so a text split is opened twice (the second time
from datasets' cache); that keeps the text path untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lightning_d9d.text.chat_template import (
    ChatTemplate,
    check_special_tokens_defined,
    load_chat_template,
    with_special_tokens,
)
from lightning_d9d.text.formats import FORMATS, Columns, LossOn, detect_format, loss_on_setting, resolve_loss_on
from lightning_d9d.text.masks import TRUNCATIONS
from lightning_d9d.text.sft_tokenize import (
    SFTRecipe,
    SFTSplit,
    completion_eos_token,
    sft_tokenized_split,
)
from lightning_d9d.text.tokenize import load_raw_split
from lightning_d9d.tokenization.tokenizer import load_tokenizer, tokenizer_digest

DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '### Assistant:\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '### ' + message['role'] | capitalize + ':\\n' + message['content'] + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)
"""The demo tokenizer's chat template (plain-text headers, ``<eos>`` ending each assistant turn)."""
DEMO_SPECIAL_TOKENS = {"eos_token": "<eos>", "pad_token": "<pad>"}


@dataclasses.dataclass
class FineTuningState:
    """What tokenizing the fine-tuning splits found, per split.

    Attributes:
        recipes: the recipe each split was tokenized with.
        counts: ``(dropped, truncated)`` rows of each split.
        label_counts: trained targets of every kept training row (``None`` until it is read).
    """

    recipes: dict[str, SFTRecipe] = dataclasses.field(default_factory=dict)
    counts: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    label_counts: np.ndarray | None = None

    def record(self, which: str, recipe: SFTRecipe, split: SFTSplit) -> None:
        self.recipes[which], self.counts[which] = recipe, (split.dropped, split.truncated)
        if which == "split":
            self.label_counts = split.label_counts


@dataclasses.dataclass(frozen=True)
class FineTuningOptions:
    """The fine-tuning settings of a TextDataModule (as its arguments of the same names).

    Attributes:
        demo_tokenizer: the tokenizer is the demo's (its template is ``DEMO_CHAT_TEMPLATE``).
    """

    format: str | None = None
    columns: Columns = dataclasses.field(default_factory=Columns)
    chat_template: str | None = None
    loss_on: LossOn | None = None
    truncation: str = "drop"
    demo_tokenizer: bool = False
    eos_token: str | None = None

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)} or None (detect), got {self.format!r}")
        object.__setattr__(self, "loss_on", loss_on_setting(self.loss_on))
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {list(TRUNCATIONS)}, got {self.truncation!r}")
        if self.eos_token is not None and (not isinstance(self.eos_token, str) or not self.eos_token):
            raise ValueError(f"eos_token must be a non-empty token string or None, got {self.eos_token!r}")

    def template(self, tokenizer_path: str) -> ChatTemplate | None:
        template = load_chat_template(self.chat_template, tokenizer_path)
        if self.demo_tokenizer:
            template = template or ChatTemplate(DEMO_CHAT_TEMPLATE)
            template = with_special_tokens(template, DEMO_SPECIAL_TOKENS)
        if template is not None:
            check_special_tokens_defined(template)
        return template

    def split(
        self, dataset_path: str, split: str, tokenizer_path: str, max_length: int, name: str, **load: Any
    ) -> tuple[SFTRecipe | None, SFTSplit | None]:
        """``(recipe, tokenized split)``, or ``(None, None)`` for a text split.

        Raises:
            ValueError: see ``detect_format``, ``resolve_loss_on``, ``sft_tokenized_split``.
        """
        if self.format == "text":
            resolve_loss_on("text", self.loss_on)
            return None, None
        num_proc = load.pop("num_proc", None)
        raw = load_raw_split(dataset_path, split, load.get("data_files"), load.get("cache_dir"), name)
        format = detect_format(raw.column_names, self.columns, self.format)
        loss_on = resolve_loss_on(format, self.loss_on)
        if format == "text":
            return None, None
        if len(raw) == 0:
            raise ValueError(f"dataset {name!r} split {split!r} is empty")
        digest = tokenizer_digest(tokenizer_path)
        template = self.template(tokenizer_path)
        tokenizer = load_tokenizer(tokenizer_path, digest)
        strings = format == "prompt_completion" and _holds_strings(raw, self.columns.completion)
        recipe = SFTRecipe(
            format=format,
            loss_on=loss_on,
            truncation=self.truncation,
            max_length=max_length,
            columns=self.columns,
            template=template,
            eos_token=completion_eos_token(tokenizer, template, tokenizer_path, self.eos_token, strings),
        )
        return recipe, sft_tokenized_split(raw, recipe, tokenizer_path, digest, num_proc=num_proc, name=name)


def _holds_strings(raw: Any, column: str) -> bool:
    """Whether ``column`` holds strings (one Arrow type per column, so the features tell)."""
    from datasets import Value

    feature = raw.features.get(column)
    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")
