"""TextDataModule on fine-tuning data: formats detected from the columns, masked labels in every batch mode, exact
step_label_tokens over ranks, counted drops and cuts, the fine-tuning settings in the resume fingerprint, and one
clear error for bad rows."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sft_support import CHATML, LLAMA_LIKE, hf_tokenizer, write_model_folder
from support import make_texts, train_tokenizer

from lightning_d9d import TextDataModule
from lightning_d9d.cli import inspect
from lightning_d9d.text.collate import IGNORE_INDEX

transformers = pytest.importorskip("transformers")
SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}


def make_conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    texts = [text for text in make_texts(count * 3, seed=seed) if text]
    rng = np.random.default_rng(seed)
    conversations = []
    for number in range(count):
        words = texts[number % len(texts)].split()
        messages = [{"role": "system", "content": "Be brief."}] if number % 4 == 0 else []
        for turn in range(1 + number % 2):
            cut = int(rng.integers(2, 12))
            messages += [
                {"role": "user", "content": " ".join(words[turn * 6 : turn * 6 + cut]) or "hi"},
                {"role": "assistant", "content": " ".join(words[cut : cut + int(rng.integers(1, 25))]) or "ok"},
            ]
        conversations.append(messages)
    return conversations


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sft_data")
    tokenizer = write_model_folder(root / "model", CHATML, **SPECIAL)
    conversations = make_conversations(160)
    with open(root / "chats.jsonl", "w") as file:
        for messages in conversations:
            file.write(json.dumps({"messages": messages, "id": "x"}) + "\n")
    with open(root / "sharegpt.jsonl", "w") as file:
        speakers = {"system": "system", "user": "human", "assistant": "gpt"}
        for messages in conversations[:40]:
            turns = [{"from": speakers[m["role"]], "value": m["content"]} for m in messages]
            file.write(json.dumps({"conversations": turns}) + "\n")
    pq.write_table(
        pa.table(
            {
                "prompt": [" ".join(m["content"] for m in chat[:-1]) + "\n" for chat in conversations],
                "completion": [chat[-1]["content"] for chat in conversations],
            }
        ),
        root / "pairs.parquet",
    )
    return {"root": root, "tokenizer": tokenizer, "conversations": conversations}


def make_dm(data: dict, tmp_path: Path, dataset: str = "chats.jsonl", **overrides: Any) -> TextDataModule:
    kwargs: dict[str, Any] = dict(
        dataset=str(data["root"] / dataset),
        tokenizer=str(data["tokenizer"]),
        max_length=128,
        global_batch_size=16,
        microbatch_size=4,
        sort_buffer_size=64,
        num_workers=0,
        cache_dir=str(tmp_path / "hf_cache"),
    )
    kwargs.update(overrides)
    dm = TextDataModule(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_drops_are_warned_about_and_a_split_without_any_says_nothing(
    data: dict, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.warns(UserWarning, match=r"training split .*: [1-9][0-9]* rows dropped \(longer than max_length=64"):
        make_dm(data, tmp_path / "short", max_length=64)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        dm = make_dm(data, tmp_path / "long", max_length=512)
    assert dm.dropped_samples == dm.truncated_samples == 0
    said = [str(w.message) for w in caught] + capfd.readouterr().err.splitlines() + caplog.messages
    assert not [text for text in said if "rows dropped" in text], "nothing dropped or cut: no line about it"


def test_conversations_are_tokenized_as_transformers_with_assistant_labels(data: dict, tmp_path: Path) -> None:
    dm = make_dm(data, tmp_path, max_length=64)
    hf = hf_tokenizer(data["tokenizer"], CHATML, **SPECIAL)
    expected = []
    for messages in data["conversations"]:
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        expected.append((tuple(out["input_ids"]), tuple(out["assistant_masks"])))
    kept = [pair for pair in expected if len(pair[0]) <= 64]
    assert 0 < dm.dropped_samples == len(expected) - len(kept) and dm.truncated_samples == 0
    got = [
        (tuple(dm.train_dataset[i]["input_ids"].tolist()), tuple((dm.train_dataset[i]["labels"] != -100).astype(int)))
        for i in range(len(dm.train_dataset))
    ]
    assert got == kept  # same ids and masks, in dataset order, the too-long rows left out


@pytest.mark.parametrize(
    "budget",
    [
        dict(global_batch_size=16, microbatch_size=4),
        dict(global_batch_size=None, microbatch_size=None, global_batch_tokens=1024, microbatch_tokens=256),
        dict(
            global_batch_size=None,
            microbatch_size=None,
            global_batch_tokens=1024,
            microbatch_tokens=256,
            padding_free=True,
        ),
    ],
    ids=["sample-counts", "token-budgets", "padding-free"],
)
def test_step_label_tokens_counts_the_trained_targets_of_the_step_over_all_ranks(data, tmp_path, budget) -> None:
    dm = make_dm(data, tmp_path, **budget)
    world = 2
    loaders = [list(dm.train_dataloader_for_rank(rank, world)) for rank in range(world)]
    per_rank = len(loaders[0]) // dm.steps_in_epoch(0)
    assert dm.steps_in_epoch(0) > 2
    for step in range(dm.steps_in_epoch(0)):
        batches = [batch for rank in range(world) for batch in loaders[rank][step * per_rank : (step + 1) * per_rank]]
        counted = sum(int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) for batch in batches)
        assert {batch.step_label_tokens for batch in batches} == {counted}
        tokens = sum(int((batch.input_ids != -1).sum()) for batch in batches)
        assert counted < tokens  # prompts are masked: fewer targets than tokens
    # The fine-tuning schedule wraps the sample-count order or the token plan; both stay visible through it.
    if "global_batch_tokens" in budget:
        assert dm.plan is not None and dm.order is None
        assert dm.plan.steps_in_epoch(0) == dm.steps_in_epoch(0)
        assert "step: 1024 tokens" in inspect(dm, None)
    else:
        assert dm.plan is None and dm.order is not None


def test_keep_start_cuts_and_counts(data: dict, tmp_path: Path) -> None:
    dm = make_dm(data, tmp_path, max_length=40, truncation="keep_start")
    lengths = [len(dm.train_dataset[index]["input_ids"]) for index in range(len(dm.train_dataset))]
    assert max(lengths) == 40
    assert dm.truncated_samples > 0
    assert len(dm.train_dataset) + dm.dropped_samples == len(data["conversations"])
    for index in range(len(dm.train_dataset)):
        assert (dm.train_dataset[index]["labels"][1:] != IGNORE_INDEX).any()  # nothing emitted untrained
    with pytest.raises(ValueError, match="has .* tokens, more than max_length=40"):
        make_dm(data, tmp_path, max_length=40, truncation="error")


def test_sharegpt_and_prompt_completion_are_detected(data: dict, tmp_path: Path) -> None:
    sharegpt = make_dm(data, tmp_path, dataset="sharegpt.jsonl", global_batch_size=8)
    assert sharegpt.sft.recipes["split"].format == "messages" and len(sharegpt.train_dataset) == 40
    chats = make_dm(data, tmp_path, max_length=1024)
    assert [sharegpt.train_dataset[i]["labels"].tolist() for i in range(40)] == [
        chats.train_dataset[i]["labels"].tolist() for i in range(40)
    ]
    pairs = make_dm(data, tmp_path, dataset="pairs.parquet")
    recipe = pairs.sft.recipes["split"]
    assert recipe.format == "prompt_completion" and recipe.loss_on == "completion"
    sample = pairs.train_dataset[0]
    eos = sample["input_ids"][-1]
    assert sample["labels"][-1] == eos  # the completion ends with a trained EOS
    assert sample["labels"][0] == IGNORE_INDEX


def test_prompt_completion_strings_refuse_a_tokenizer_without_eos_and_take_one_from_eos_token_or_its_config(
    data: dict, tmp_path: Path
) -> None:
    # A real word-level tokenizer whose only special tokens are <unk> and <end>: no usual EOS name, no
    # post-processor, no tokenizer_config.json. Its completions would be trained with no end token.
    folder = tmp_path / "no_eos"
    folder.mkdir()
    tokenizer = train_tokenizer([message["content"] for chat in data["conversations"] for message in chat], bos=None)
    tokenizer.add_special_tokens(["<end>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    path = str(folder / "tokenizer.json")
    refusal = (
        rf"the tokenizer '{re.escape(path)}' has no end-of-sequence token, and prompt/completion strings need one .* "
        r"never learns to stop.* pass eos_token= \(a token of the tokenizer; its added/special tokens: "
        r"\['<end>', '<unk>'\]\) to TextDataModule, or put \{\"eos_token\": \"\.\.\.\"\} in a "
        r"tokenizer_config\.json next to the tokenizer\.json"
    )
    with pytest.raises(ValueError, match=refusal):
        make_dm(data, tmp_path, dataset="pairs.parquet", tokenizer=path)
    with pytest.raises(ValueError, match=r"eos_token='<nope>' is not a token of the tokenizer .*pass eos_token= one"):
        make_dm(data, tmp_path, dataset="pairs.parquet", tokenizer=path, eos_token="<nope>")
    end = tokenizer.token_to_id("<end>")
    given = make_dm(data, tmp_path, dataset="pairs.parquet", tokenizer=path, eos_token="<end>")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))  # a config without a template
    configured = make_dm(data, tmp_path, dataset="pairs.parquet", tokenizer=path)
    for dm in (given, configured):
        for i in range(len(dm.train_dataset)):
            sample = dm.train_dataset[i]
            assert sample["input_ids"][-1] == end == sample["labels"][-1]  # every completion ends, trained, in <end>
            assert (sample["input_ids"] == end).sum() == 1
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"the tokenizer config's eos_token '</s>' is not a token of the tokenizer"):
        make_dm(data, tmp_path, dataset="pairs.parquet", tokenizer=path)
    with pytest.raises(ValueError, match=r"eos_token must be a non-empty token string or None, got ''"):
        make_dm(data, tmp_path, dataset="pairs.parquet", tokenizer=path, eos_token="")


def test_the_fine_tuning_settings_are_part_of_the_fingerprint(data: dict, tmp_path: Path) -> None:
    state = make_dm(data, tmp_path).state_dict()
    assert state["fingerprint"]["format"] == "messages" and state["fingerprint"]["loss_on"] == "assistant"
    make_dm(data, tmp_path).load_state_dict(state)  # the same settings resume
    changes = {
        "loss_on": dict(loss_on="last_assistant"),
        "truncation": dict(truncation="keep_start"),
        "chat_template": dict(chat_template=CHATML.replace("<|im_start|>", "<|im_start|> ")),
    }
    for field, change in changes.items():
        with pytest.raises(ValueError, match=rf"{field}: checkpoint") as error:
            make_dm(data, tmp_path, **change).load_state_dict(state)
        assert "sort_keys_digest" not in str(error.value) or field == "chat_template"


def test_text_data_keeps_its_plain_fingerprint_and_batches(data: dict, tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": make_texts(80)}), tmp_path / "text.parquet")
    dm = TextDataModule(
        dataset=str(tmp_path / "text.parquet"),
        tokenizer=str(data["tokenizer"]),
        max_length=64,
        global_batch_size=8,
        microbatch_size=4,
        num_workers=0,
        cache_dir=str(tmp_path / "hf_cache"),
    )
    dm.prepare_data()
    dm.setup("fit")
    assert "format" not in dm.state_dict()["fingerprint"] and dm.sft.recipes == {}
    assert dm.train_dataset.column_names == ["input_ids", "token_counts"]
    first_step = list(dm.train_dataloader())[:2]  # 2 microbatches a step
    counted = sum(int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) for batch in first_step)
    assert [batch.step_label_tokens for batch in first_step] == [counted, counted]
    assert counted == sum(int(batch.attention_mask.sum()) - len(batch.input_ids) for batch in first_step)
    with pytest.raises(ValueError, match="loss_on='assistant' does not apply to 'text' data"):
        make_dm(data, tmp_path, dataset=str(tmp_path / "text.parquet"), loss_on="assistant")


def test_bad_rows_and_settings_are_one_clear_error(data: dict, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 3
    rows.append({"messages": [{"role": "critic", "content": "hmm"}, {"role": "assistant", "content": "a"}]})
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match="row 3: the chat template raised: unknown role critic"):
        make_dm(data, tmp_path, dataset=str(bad), global_batch_size=2, microbatch_size=1)
    untrained = tmp_path / "untrained.jsonl"
    untrained.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(ValueError, match="row 0 has no assistant turn"):
        make_dm(data, tmp_path, dataset=str(untrained), global_batch_size=1, microbatch_size=1)
    with pytest.raises(ValueError, match=r"format 'prompt_completion' needs column\(s\) \['prompt', 'completion'\]"):
        make_dm(data, tmp_path, format="prompt_completion")
    with pytest.raises(ValueError, match="truncation must be one of"):
        make_dm(data, tmp_path, truncation="middle")
    no_template = tmp_path / "plain_model"
    no_template.mkdir()
    (no_template / "tokenizer.json").write_bytes(Path(data["tokenizer"]).read_bytes())
    with pytest.raises(ValueError, match="row 0 holds messages, which need a chat template"):
        make_dm(data, tmp_path, tokenizer=str(no_template / "tokenizer.json"))
    # A template that writes eos_token, with no config defining it, would train without end-of-turn tokens.
    with pytest.raises(
        ValueError, match=r"the chat template uses \['bos_token', 'eos_token'\] but no tokenizer_config"
    ):
        make_dm(data, tmp_path, tokenizer=str(no_template / "tokenizer.json"), chat_template=LLAMA_LIKE)


def test_the_cache_is_reused_with_exact_counts_and_missed_when_the_recipe_changes(data: dict, tmp_path: Path) -> None:
    first = make_dm(data, tmp_path, max_length=64)
    again = make_dm(data, tmp_path, max_length=64)
    files = {entry["filename"] for entry in first.train_dataset.cache_files}
    assert files == {entry["filename"] for entry in again.train_dataset.cache_files}  # one map, reused
    assert (
        (again.dropped_samples, again.truncated_samples) == (first.dropped_samples, first.truncated_samples) != (0, 0)
    )
    last = make_dm(data, tmp_path, max_length=64, loss_on="last_assistant")
    assert files.isdisjoint({entry["filename"] for entry in last.train_dataset.cache_files})
    fewer = sum(int((last.train_dataset[i]["labels"] != -100).sum()) for i in range(len(last.train_dataset)))
    every = sum(int((first.train_dataset[i]["labels"] != -100).sum()) for i in range(len(first.train_dataset)))
    assert fewer < every
