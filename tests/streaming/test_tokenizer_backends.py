"""Tokenizer backends: a fast backend gives ``tokenizers``' ids, so every packing's rows are the same bit for bit
(hostile text, long documents in pieces, workers, a token cache written under the other backend); ``"auto"`` falls
back where the fast backend cannot serve the tokenizer; a named one that cannot is refused; the guard stops a run
whose backend gives other ids."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
from support import BOS, WORDS, fill_token_cache, make_docs, small_run, step_rows, train_tokenizer, write_parquet
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from lightning_d9d import PretrainingDataModule, TextDataModule
from lightning_d9d.datamodules.pretraining import specs as pretraining_specs
from lightning_d9d.streaming.tokens import tokenize
from lightning_d9d.tokenization.backends import (
    EncodedBatch,
    FastokensBackend,
    HuggingFaceBackend,
    TokenizerBackendError,
    TokenizerBackendMismatch,
    backend_for,
    hostile_texts,
    register_backend,
    resolve_backend,
    unregister_backend,
)

pytest.importorskip("fastokens")
PACKINGS = ["concat", "bestfit", "bestfit_split"]
PIECE = 3000  # LONG_DOCUMENT_CHARS in these tests: long documents are tokenized in pieces


def hostile_docs() -> list[str | None]:
    """Documents that stress an encoder: special and added tokens written in the text, emoji, combining marks,
    CRLF, NUL, 5,000 spaces, a 100k-character word, CJK, zero-width spaces, empty ones, long ones with spaces."""
    rng = random.Random(3)
    odd = [
        f"a {BOS} written in the text{BOS}{BOS} and <eos> and <|user|>x<|user|>",
        "emoji 👩‍👩‍👧‍👦 🇫🇷😀 and combining e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
        "line\r\nendings\r\n\r\nnul\x00inside\x00\x00",
        " " * 5000 + "after five thousand spaces",
        "y" * 100_000,
        "中文字符和日本語のテキスト、한국어 zero\u200bwidth\u200bspaces\ufeff",
        " ".join(rng.choice(WORDS) for _ in range(3000)),  # about 12K characters with spaces: pieces cut at spaces
        "",
        None,
    ]
    docs = make_docs(160, seed=5)
    for i, doc in enumerate(odd):
        docs[7 + 17 * i] = doc
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Parquet files of :func:`hostile_docs`, a byte-level BPE with special and added tokens (``bpe.json``, served
    by fastokens) and a WordPiece tokenizer (``wordpiece.json``, which fastokens cannot load)."""
    root = tmp_path_factory.mktemp("backends")
    docs = hostile_docs()
    write_parquet(root / "train", docs, files=2, row_group_size=20)
    texts = [d for d in docs if d and len(d) < 20_000]
    bpe = train_tokenizer(texts, kind="bpe", bos=None, vocab_size=400)
    bpe.add_special_tokens([BOS])
    bpe.add_tokens([AddedToken("<|user|>", normalized=False)])
    bpe.save(str(root / "bpe.json"))
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", BOS], show_progress=False)
    wordpiece.train_from_iterator(texts, trainer)
    wordpiece.save(str(root / "wordpiece.json"))
    return root


def reference_ids(tokenizer_path: Path, text: str) -> list[int]:
    """``tokenizers`` called directly, as a user would: the reference independent of the backend layer."""
    return Tokenizer.from_file(str(tokenizer_path)).encode(text, add_special_tokens=False).ids


def test_fastokens_gives_the_ids_of_tokenizers_on_hostile_texts(corpus: Path) -> None:
    tokenizer_json = (corpus / "bpe.json").read_text()
    texts = [*hostile_texts(Tokenizer.from_file(str(corpus / "bpe.json")).to_str()), *(d or "" for d in hostile_docs())]
    fast = backend_for("fastokens", Tokenizer.from_str(tokenizer_json).to_str()).encode(texts)
    assert isinstance(fast, EncodedBatch) and len(fast) == len(texts)
    assert fast.ids.dtype == np.int32
    for text, encoded in zip(texts, fast):
        assert encoded.ids.tolist() == reference_ids(corpus / "bpe.json", text), text[:40]


def test_long_documents_in_pieces_are_the_same_under_both_backends(corpus: Path, monkeypatch) -> None:
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    tokenizer_json = Tokenizer.from_file(str(corpus / "bpe.json")).to_str()
    texts = [d for d in hostile_docs() if d is not None]
    assert sum(len(t) > PIECE for t in texts) >= 3  # the spaces, the long word and the long text are cut
    fast = tokenize.encode_documents(backend_for("fastokens", tokenizer_json), texts)
    slow = tokenize.encode_documents(backend_for("tokenizers", tokenizer_json), texts)
    np.testing.assert_array_equal(fast.offsets, slow.offsets)
    np.testing.assert_array_equal(fast.ids, slow.ids)
    # Where a piece ends at a clean space the ids are one call's: the long text with spaces.
    with_spaces = next(i for i, t in enumerate(texts) if len(t) > PIECE and " " in t.strip() and "y" * 50 not in t)
    assert slow[with_spaces].ids.tolist() == reference_ids(corpus / "bpe.json", texts[with_spaces])


@pytest.mark.parametrize("packing", PACKINGS)
def test_every_packing_gives_the_same_rows_under_fastokens(corpus: Path, monkeypatch, packing: str) -> None:
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT_CHARS", PIECE)
    options = dict(tokenizer=str(corpus / "bpe.json"), bos_token=BOS, seq_len=48, global_batch_size=8)
    want = step_rows(small_run(corpus, packing, 12, tokenizer_backend="tokenizers", **options), 12)
    dm = small_run(corpus, packing, 12, tokenizer_backend="fastokens", **options)
    assert dm.train_spec.sources[0].tokenizer_backend == "fastokens"
    got = step_rows(dm, 12)
    assert len(got) == len(want) == 12 and all(len(step) == 8 for step in got)
    assert got == want
    # "auto" picks the fast backend for this tokenizer, and says why.
    auto = small_run(corpus, packing, 2, **options)
    assert auto.tokenizer_backend_in_use[0] == "fastokens" and "identical" in auto.tokenizer_backend_in_use[1]


@pytest.mark.slow
def test_rows_are_the_same_in_workers(corpus: Path) -> None:
    options = dict(tokenizer=str(corpus / "bpe.json"), bos_token=BOS, seq_len=48, global_batch_size=8)
    want = step_rows(small_run(corpus, "bestfit_split", 10, tokenizer_backend="tokenizers", **options), 10)
    got = step_rows(small_run(corpus, "bestfit_split", 10, tokenizer_backend="fastokens", num_workers=2, **options), 10)
    assert len(got) == len(want) == 10 and got == want


@pytest.mark.parametrize(("writer", "reader"), [("fastokens", "tokenizers"), ("tokenizers", "fastokens")])
def test_a_token_cache_written_under_one_backend_serves_the_other(
    corpus: Path, tmp_path: Path, monkeypatch, writer: str, reader: str
) -> None:
    options = dict(tokenizer=str(corpus / "bpe.json"), bos_token=BOS, seq_len=48, global_batch_size=8)
    want = step_rows(small_run(corpus, "concat", 10, tokenizer_backend=reader, **options), 10)
    cache = str(tmp_path / "cache")
    fill_token_cache(str(corpus / "train"), str(corpus / "bpe.json"), cache, bos_token=BOS, seq_len=48,
                     global_batch_size=8, num_streams=4, tokenizer_backend=writer)  # fmt: skip
    dm = small_run(corpus, "concat", 10, tokenizer_backend=reader, token_cache=cache, **options)
    encoded: list[int] = []
    for cls in (HuggingFaceBackend, FastokensBackend):
        real = cls.encode
        monkeypatch.setattr(
            cls, "encode", lambda self, texts, *a, _real=real: encoded.append(1) or _real(self, texts, *a)
        )
    got = step_rows(dm, 10)
    assert not encoded, "the cache written under the other backend was not read"
    assert len(got) == len(want) == 10 and got == want


def test_auto_falls_back_to_tokenizers_where_fastokens_cannot_serve(corpus: Path) -> None:
    options = dict(tokenizer=str(corpus / "wordpiece.json"), bos_token=BOS, seq_len=32, global_batch_size=8)
    auto = small_run(corpus, "bestfit_split", 6, **options)
    name, why = auto.tokenizer_backend_in_use
    assert name == "tokenizers" and "fastokens cannot load this tokenizer" in why and "Whitespace" in why
    forced = small_run(corpus, "bestfit_split", 6, tokenizer_backend="tokenizers", **options)
    got, want = step_rows(auto, 6), step_rows(forced, 6)
    assert len(got) == 6 and got == want


def test_a_named_backend_that_cannot_serve_is_refused_with_one_clear_error(corpus: Path) -> None:
    options = dict(tokenizer=str(corpus / "wordpiece.json"), bos_token=BOS, seq_len=32, global_batch_size=8)
    with pytest.raises(TokenizerBackendError, match=r"tokenizer_backend='fastokens' cannot serve this tokenizer.*"
                       r"Whitespace"):  # fmt: skip
        small_run(corpus, "concat", 4, tokenizer_backend="fastokens", **options)
    with pytest.raises(ValueError, match=r"tokenizer_backend='sentencepiece' is not a tokenizer backend: pass one "
                       r"of \['auto', 'tokenizers', 'fastokens'"):  # fmt: skip
        PretrainingDataModule(str(corpus / "train"), str(corpus / "bpe.json"), tokenizer_backend="sentencepiece")


class _Missing(HuggingFaceBackend):
    name = "missing-backend"
    module = "lightning_d9d_no_such_module"


class _Perturbing(HuggingFaceBackend):
    """The reference's ids, except one id changed in documents that hold ``MARK``: a backend gone wrong."""

    name = "perturbing"
    MARK = "wab wab wab"

    def encode(self, texts, add_special_tokens=False):
        batch = super().encode(texts, add_special_tokens)
        ids = batch.ids.copy()
        for i, text in enumerate(texts):
            if self.MARK in text and batch.offsets[i + 1] > batch.offsets[i]:
                ids[batch.offsets[i]] += 1
        return EncodedBatch(ids, batch.offsets)


@pytest.fixture
def test_backends():
    register_backend(_Missing, fast=False)
    register_backend(_Perturbing, fast=False)
    yield
    unregister_backend(_Missing.name)
    unregister_backend(_Perturbing.name)


@pytest.mark.usefixtures("test_backends")
def test_a_named_backend_not_installed_is_refused(corpus: Path) -> None:
    with pytest.raises(TokenizerBackendError, match=r"'missing-backend' is not installed .*pip install"):
        resolve_backend("missing-backend", Tokenizer.from_file(str(corpus / "bpe.json")).to_str(), [])


@pytest.mark.usefixtures("test_backends")
def test_a_named_backend_with_other_ids_on_the_sample_is_refused_at_setup(corpus: Path) -> None:
    tokenizer_json = Tokenizer.from_file(str(corpus / "bpe.json")).to_str()
    with pytest.raises(TokenizerBackendError, match=r"'perturbing' cannot serve.*other ids than tokenizers"):
        resolve_backend("perturbing", tokenizer_json, [f"a {_Perturbing.MARK} b"])
    assert resolve_backend("perturbing", tokenizer_json, ["no mark"])[0] == "perturbing"


@pytest.mark.usefixtures("test_backends")
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_the_guard_stops_a_run_whose_backend_gives_other_ids(
    corpus: Path, tmp_path: Path, monkeypatch, workers: int
) -> None:
    docs = make_docs(120, seed=9, empties=False)
    docs[77] = f"{docs[77]} {_Perturbing.MARK}"
    write_parquet(tmp_path / "train", docs, files=2, row_group_size=20)
    # The setup sample misses the document (as a sample may): only the guard can see it.
    monkeypatch.setattr(pretraining_specs, "backend_sample", lambda index, max_chars: [])
    monkeypatch.setattr("lightning_d9d.tokenization.backends.GUARD_EVERY", 1)  # every document checked
    options = dict(tokenizer=str(corpus / "bpe.json"), bos_token=BOS, seq_len=48, global_batch_size=8)
    dm = small_run(tmp_path, "concat", 30, tokenizer_backend="perturbing", num_workers=workers, **options)
    with pytest.raises(TokenizerBackendMismatch, match=r"'perturbing' gave other ids than tokenizers for parquet "
                       r"file '.*part-001.parquet', row group 0, row 17 .*first difference at token 0"):  # fmt: skip
        step_rows(dm, 30)


def test_the_guard_checks_about_one_document_in_guard_every() -> None:
    from lightning_d9d.tokenization.backends import GUARD_EVERY, BackendGuard

    guard = BackendGuard("fastokens", "{}")
    picked = sum(len(guard.picks(group, np.arange(1000))) for group in range(200))
    assert abs(picked / 200_000 - 1 / GUARD_EVERY) < 0.3 / GUARD_EVERY
    assert not BackendGuard("tokenizers", "{}").active


def test_backends_pickle_as_their_name_and_json(corpus: Path) -> None:
    tokenizer_json = Tokenizer.from_file(str(corpus / "bpe.json")).to_str()
    backend = backend_for("fastokens", tokenizer_json)
    again = pickle.loads(pickle.dumps(backend))
    assert again is backend  # rebuilt through backend_for: the process's one instance
    assert len(pickle.dumps(backend)) < len(tokenizer_json.encode()) + 200  # the JSON and the name, nothing more


@pytest.mark.parametrize("max_length", [8, 64])
def test_text_datamodule_tokenizes_the_same_under_fastokens(corpus: Path, tmp_path: Path, max_length: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [d or "" for d in hostile_docs()]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": texts}), tmp_path / "data" / "train.parquet")

    def rows(backend: str) -> tuple[list[list[int]], tuple[str, str]]:
        dm = TextDataModule(dataset=str(tmp_path / "data"), tokenizer=str(corpus / "bpe.json"), max_length=max_length,
                            global_batch_size=8, microbatch_size=4, num_workers=0, tokenizer_backend=backend,
                            cache_dir=str(tmp_path / f"cache-{backend}"))  # fmt: skip
        dm.setup("fit")
        return [row.tolist() for row in dm.train_dataset["input_ids"]], dm.tokenizer_backend_in_use

    want, (reference, _) = rows("tokenizers")
    got, (used, why) = rows("auto")
    assert (reference, used) == ("tokenizers", "fastokens"), why
    # Independent reference: tokenizers called as the map did before backends (truncation, post-processor).
    direct = Tokenizer.from_file(str(corpus / "bpe.json"))
    direct.enable_truncation(max_length)
    expected = [e.ids for e in direct.encode_batch(texts) if len(e.ids) >= 2]
    assert len(got) == len(want) == len(expected) and got == want == expected


def test_text_datamodule_checks_the_backend_on_many_documents_cut_to_a_bounded_sample(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check before a fast backend is used encodes the split's first documents as both backends do, each cut to
    an equal share of a fixed number of characters: long documents cost tokenizers' encoding of the share only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_d9d.text import tokenize as text_tokenize

    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4000))) for _ in range(300)]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": texts}), tmp_path / "data" / "train.parquet")
    checked: list[list[str]] = []
    real = text_tokenize.resolve_backend

    def resolve(setting, tokenizer_json, sample, *args, **kwargs):  # type: ignore[no-untyped-def]
        checked.append(list(sample()))
        return real(setting, tokenizer_json, lambda: checked[-1], *args, **kwargs)

    monkeypatch.setattr(text_tokenize, "resolve_backend", resolve)
    dm = TextDataModule(dataset=str(tmp_path / "data"), tokenizer=str(corpus / "bpe.json"), max_length=64,
                        global_batch_size=8, microbatch_size=4, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    assert dm.tokenizer_backend_in_use[0] == "fastokens"
    (sample,) = checked
    share = text_tokenize._BACKEND_SAMPLE_CHARS // text_tokenize._BACKEND_SAMPLE
    assert sample == [text[:share] for text in texts[: text_tokenize._BACKEND_SAMPLE]]
    assert sum(map(len, sample)) <= text_tokenize._BACKEND_SAMPLE_CHARS < sum(map(len, texts[:256]))


def test_the_default_install_gets_fastokens_only_where_it_ships_wheels() -> None:
    tomllib = pytest.importorskip("tomllib")
    Requirement = pytest.importorskip("packaging.requirements").Requirement

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (requirement,) = [Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("fastokens")]
    # The platforms of fastokens 0.3.5's wheels (cp39-abi3: manylinux and musllinux x86_64, macOS x86_64 and arm64,
    # Windows amd64); Linux aarch64 and Windows ARM64 have none, so they install and run on tokenizers alone.
    wheels = [("linux", "x86_64"), ("darwin", "x86_64"), ("darwin", "arm64"), ("win32", "AMD64")]
    without = [("linux", "aarch64"), ("win32", "ARM64"), ("linux", "ppc64le")]
    for platform, machine in wheels + without:
        env = {"sys_platform": platform, "platform_machine": machine}
        assert requirement.marker.evaluate(env) == ((platform, machine) in wheels), env


def test_without_fastokens_auto_runs_on_tokenizers(corpus: Path, monkeypatch) -> None:
    monkeypatch.setattr(FastokensBackend, "installed", classmethod(lambda cls: False))
    tokenizer_json = Tokenizer.from_file(str(corpus / "bpe.json")).to_str()
    assert resolve_backend("auto", tokenizer_json, ["some text"]) == ("tokenizers", "auto: fastokens is not installed")
    with pytest.raises(TokenizerBackendError, match=r"'fastokens' is not installed .*pip install fastokens"):
        resolve_backend("fastokens", tokenizer_json, ["some text"])


def test_a_batch_fastokens_refuses_is_encoded_by_tokenizers() -> None:
    # A byte-level BPE trained without the full byte alphabet: fastokens refuses a byte it has no token for, where
    # tokenizers passes over it.
    texts = ["plain ascii text only", "more plain words here"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=80, show_progress=False))
    batch = ["emoji 😀 and ascii", "plain words"]
    fast = backend_for("fastokens", tok.to_str()).encode(batch)
    assert [d.ids.tolist() for d in fast] == [e.ids for e in tok.encode_batch(batch, add_special_tokens=False)]
    assert resolve_backend("auto", tok.to_str(), batch)[0] == "fastokens"
