"""A weighted mixture under a real Trainer: exact per-step shares, an exact resume from a checkpoint (across an
epoch end and a phase change), a deliberate change of shares on resume, one validation loader per source, the
same steps on 2 DDP ranks with resumes across world sizes, and the demo mixture config through the CLI."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from support import make_docs, ranked_rows, train_tokenizer, write_parquet

from lightning_d9d import PretrainingDataModule
from lightning_d9d.core.digest import digest
from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule

G, K = 8, 4
WEIGHTS = [[0, {"web": 3, "code": 1}], [6, {"web": 1, "code": 3}]]

pytestmark = pytest.mark.slow


class SourceRecorder(pl.LightningModule):
    """Trains one weight; records, per training microbatch, its step and each row's (source, digest), and per
    validation microbatch its ``dataloader_idx`` and sources."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_rows: list[tuple[int, list[tuple[int, str]]]] = []
        self.val_batches: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        rows = []
        for i in range(len(batch)):
            row = digest(batch.input_ids[i].numpy().tobytes(), batch.targets[i].numpy().tobytes())
            rows.append((int(batch.sources[i]), row))
        self.train_rows.append((self.global_step, rows))
        return ((self.weight - batch.input_ids.float().mean() / 100) ** 2).mean()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.val_batches.append((dataloader_idx, batch.sources.tolist()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixture_trainer")
    web, code = make_docs(200, seed=1, max_words=20), [d.upper() if d else d for d in make_docs(40, seed=2)]
    write_parquet(root / "web", web, files=2, row_group_size=10)
    write_parquet(root / "code", code, files=1, row_group_size=10, column="content")
    write_parquet(root / "val_web", make_docs(40, seed=3), files=1, row_group_size=10)
    train_tokenizer(web + code + make_docs(40, seed=3), root / "tokenizer.json")
    return root


def datamodule(data: Path, **changes: Any) -> PretrainingDataModule:
    options = dict(
        train_files={"web": str(data / "web"), "code": {"files": str(data / "code"), "text_column": "content"}},
        val_files={"web": str(data / "val_web"), "code": {"files": str(data / "code"), "text_column": "content"}},
        tokenizer=str(data / "tokenizer.json"), seq_len=16, global_batch_size=G, microbatch_size=2, num_streams=K,
        num_workers=0, steps_per_epoch=5, val_steps=2, tokenizer_batch_size=8, bestfit_buffer_size=8,
        packing="bestfit_split", weights=WEIGHTS,
    )  # fmt: skip
    options.update(changes)
    return PretrainingDataModule(**options)


def fit(data: Path, tmp: Path, max_steps: int, ckpt_path: str | None = None, **changes: Any) -> SourceRecorder:
    module = SourceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp),
        callbacks=[ModelCheckpoint(dirpath=str(tmp / "ckpt"), filename="{step}", every_n_train_steps=4,
                                   save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule(data, **changes), ckpt_path=ckpt_path)
    return module


def steps_of(module: SourceRecorder) -> dict[int, list[tuple[int, str]]]:
    steps: dict[int, list[tuple[int, str]]] = {}
    for step, rows in module.train_rows:
        steps.setdefault(step, []).extend(rows)
    return steps


def test_a_mixture_trains_exact_shares_resumes_exactly_and_validates_per_source(data: Path, tmp_path: Path) -> None:
    full = fit(data, tmp_path / "full", 12)
    steps = steps_of(full)
    plan = MixturePlan(MixtureSchedule(["web", "code"], WEIGHTS), G)
    assert sorted(steps) == list(range(12))
    for step, rows in steps.items():
        counts = Counter(source for source, _ in rows)
        assert (counts[0], counts[1]) == plan.rows_of_step(step)
    # One validation loader per source, in the mapping's order, its batches saying their source.
    assert {idx for idx, _ in full.val_batches} == {0, 1}
    assert all(set(sources) == {idx} for idx, sources in full.val_batches)

    # Resumed from step 4 (mid-epoch 0 ... across the epoch end and the phase change at step 6): the same rows.
    resumed = fit(data, tmp_path / "resumed", 12, ckpt_path=str(tmp_path / "full" / "ckpt" / "step=4.ckpt"))
    assert steps_of(resumed) == {step: rows for step, rows in steps.items() if step >= 4}

    # Other shares on resume: refused by default, continued on request (every source from where it stopped).
    with pytest.raises(ValueError, match=r"checkpoint \{web 75%, code 25%\}, now \{web 50%, code 50%\}"):
        fit(data, tmp_path / "refused", 12, ckpt_path=str(tmp_path / "full" / "ckpt" / "step=4.ckpt"), weights=None)
    changed = fit(
        data, tmp_path / "changed", 12, ckpt_path=str(tmp_path / "full" / "ckpt" / "step=4.ckpt"), weights=None,
        on_mixture_change="continue",
    )  # fmt: skip
    before = [sum(1 for s in range(4) for source, _ in steps[s] if source == i) for i in range(2)]
    continued = MixturePlan(MixtureSchedule(["web", "code"], None), G, 4, before)
    assert sorted(steps_of(changed)) == list(range(4, 12))
    for step, rows in steps_of(changed).items():
        counts = Counter(source for source, _ in rows)
        assert (counts[0], counts[1]) == continued.rows_of_step(step)


def test_the_demo_mixture_config_fits_and_resumes_across_its_phase_change(tmp_path: Path, monkeypatch) -> None:
    """``lightning-d9d fit --config configs/demo_mixture.yaml`` with a smaller model, its phase change at step 2,
    then ``--ckpt_path last`` past it; the checkpoint loads with ``weights_only=True``."""
    import json

    from lightning_d9d.cli import main

    monkeypatch.setenv("LIGHTNING_D9D_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True, "every_n_train_steps": 2},
        }
    ]
    config = Path(__file__).resolve().parents[2] / "configs" / "demo_mixture.yaml"
    args = [
        "--config", str(config), "--model.init_args.width=32", "--model.init_args.num_layers=1",
        "--model.init_args.num_heads=2", "--data.init_args.steps_per_epoch=6", "--data.init_args.val_steps=1",
        '--data.init_args.weights=[[0, {"prose": 0.8, "code": 0.2}], [2, {"prose": 0.3, "code": 0.7}]]',
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
        f"--trainer.callbacks={json.dumps(callbacks)}",
    ]  # fmt: skip
    per_source_val = ['--data.init_args.val_files={"prose": "demo:validation", "code": "demo:code"}',
                      "--trainer.val_check_interval=8"]  # fmt: skip
    main(["fit", *args, *per_source_val, "--trainer.max_steps=2"])
    metrics = next((tmp_path / "lightning_logs" / "demo_mixture").rglob("metrics.csv")).read_text()
    assert "val/loss/prose" in metrics and "val/loss/code" in metrics  # the demo model logs a loss per source
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2
    state = saved["DemoPretrainingDataModule"]
    assert state["plan"]["mixture"]["schedule"]["phases"][1][0] == 2
    assert {stream["step"] for stream in state["streams"].values()} == {2}
    main(["fit", *args, "--trainer.max_steps=4", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt")])
    resumed = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 4
    assert {stream["step"] for stream in resumed["DemoPretrainingDataModule"]["streams"].values()} == {4}


def recorded_steps(tmp: Path, data: Path, runs: list[dict], devices: int) -> dict:
    """Per run, per (epoch, step): the sorted row digests over all ranks (support's RecordingModule, DDP on gloo)."""
    from support import fit as fit_config
    from support import fit_in_processes, read_records

    options = dict(
        train_files={"web": str(data / "web"), "code": {"files": str(data / "code"), "text_column": "content"}},
        tokenizer=str(data / "tokenizer.json"), seq_len=16, global_batch_size=G, microbatch_size=2, num_streams=K,
        num_workers=0, steps_per_epoch=5, tokenizer_batch_size=8, bestfit_buffer_size=8, packing="bestfit",
        weights=WEIGHTS,
    )  # fmt: skip
    config = {"data": "pretraining", "options": options, "record_dir": str(tmp / "records"),
              "ckpt_dir": str(tmp / "ckpt"), "devices": devices, "runs": runs}  # fmt: skip
    if devices > 1:
        fit_in_processes(config)
    else:
        fit_config(config)
    # Per run and step, the rows in order over the ranks (rank 0's microbatches in order, then rank 1's): a row's
    # place also says which rank trained it.
    steps: dict = {}
    for r in read_records(tmp / "records"):
        by_rank = steps.setdefault(r["run"], {}).setdefault((r["epoch"], r["step"]), {})
        by_rank.setdefault(r["dp_rank"], []).append((r["batch_idx"], r["rows"]))
    return {
        run: {
            key: ranked_rows([[row for _, rows in sorted(parts[rank]) for row in rows] for rank in sorted(parts)])
            for key, parts in by_step.items()
        }
        for run, by_step in steps.items()
    }


def test_a_mixture_trains_the_same_steps_on_two_ddp_ranks_and_resumes_across_world_sizes(
    data: Path, tmp_path: Path
) -> None:
    one = recorded_steps(tmp_path / "one", data, [dict(name="full", max_steps=12, every_n_train_steps=4)], 1)
    two = recorded_steps(
        tmp_path / "two",
        data,
        [
            dict(name="full", max_steps=12, every_n_train_steps=4),
            dict(name="from_one", max_steps=12, ckpt_path=str(tmp_path / "one" / "ckpt" / "epoch=0-step=4.ckpt")),
        ],
        2,
    )
    full = one["full"]
    assert len(full) == 12
    assert two["full"] == full  # 1 and 2 ranks: the same rows in every step, across the phase change at step 6
    assert two["from_one"] == {key: rows for key, rows in full.items() if key[1] >= 4}
    # Back to one rank from the two ranks' checkpoint (its streams gathered from both ranks).
    back = recorded_steps(
        tmp_path / "back", data,
        [dict(name="from_two", max_steps=12, ckpt_path=str(tmp_path / "two" / "ckpt" / "epoch=1-step=8.ckpt"))], 1,
    )  # fmt: skip
    assert back["from_two"] == {key: rows for key, rows in full.items() if key[1] >= 8}


def test_validation_losses_are_logged_under_their_source_names(data: Path, tmp_path: Path) -> None:
    """``dm.val_metric_name`` names each validation loader's metric by its source; the demo model logs with it:
    ``val/loss/web`` and ``val/loss/code``, each the token-weighted mean of that source's loader computed by hand."""
    from lightning_d9d.demo.model import TinyGPT

    dm = datamodule(data)
    assert [dm.val_metric_name("val/loss", i) for i in (0, 1)] == ["val/loss/web", "val/loss/code"]
    with pytest.raises(ValueError, match=r"0 to 1 \(val_source_names=\['web', 'code'\]\), got 2"):
        dm.val_metric_name("val/loss", 2)
    single = datamodule(data, val_files=str(data / "val_web"))
    assert single.val_metric_name("val/loss") == "val/loss"

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=512, max_positions=32, width=16, num_layers=1, num_heads=2)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.validate(model, datamodule=dm)
    logged = {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("val/")}
    assert sorted(logged) == ["val/loss/code", "val/loss/web"]
    for index, name in enumerate(["web", "code"]):
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in dm.val_dataloader()[index]:
                logits = model(batch.input_ids, torch.ones_like(batch.input_ids), batch.position_ids)
                total += float(torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100, reduction="sum"
                ))  # fmt: skip
                count += int((batch.targets != -100).sum())
        assert logged[f"val/loss/{name}"] == pytest.approx(total / count, rel=1e-5)
