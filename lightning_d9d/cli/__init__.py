"""The ``lightning-d9d`` command: LightningCLI for any LightningModule + DataModule, plus ``inspect`` and
``provenance``.

``fit|validate|test|predict`` take model and data in subclass mode; on the CPU they leave the DataLoader workers
their cores (``cpu_threads``). ``inspect`` builds the data at world size 1 and prints one epoch's steps,
microbatches, tokens and padding, and the first microbatch's shapes.

Trade-off: with sample counts padding is measured on the first ``--steps`` steps only, to stay fast.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lightning_d9d.cli.errors import (
    CONFIGURATION_ERRORS,
    ConfigurationError,
    ReadableErrorParser,
    full_tracebacks,
    report_configuration_error,
)
from lightning_d9d.cli.provenance import provenance_report
from lightning_d9d.core.batches import count_tokens, row_sources
from lightning_d9d.core.checks import microbatches_per_step, token_microbatches_per_step
from lightning_d9d.core.cpu_threads import choose_cpu_threads
from lightning_d9d.datamodules.base import SteppedDataModule
from lightning_d9d.datamodules.d9d import D9DDataModule
from lightning_d9d.datamodules.pretraining.datamodule import PretrainingDataModule
from lightning_d9d.parallel.topology import DataParallelTopology

INSPECT = "inspect"
_INSPECT_HELP = "Print steps per epoch, microbatches and tokens per step, padding and the first batch's shapes."
PROVENANCE = "provenance"
_PROVENANCE_HELP = "Print (or write) which pieces of which documents every row of the given steps holds."
_INSPECT_DEFAULT_STEPS = 20
# Values LightningCLI's --ckpt_path accepts besides a file: Lightning resolves them itself.
_CKPT_PATH_KEYWORDS = ("last", "best", "hpc", "registry")


class D9DCLI(LightningCLI):
    """LightningCLI with model and data in subclass mode, a config saved per run, and an ``inspect`` subcommand.

    Args:
        args: command-line arguments (``None``: ``sys.argv[1:]``).
        **kwargs: any other LightningCLI argument.
    """

    def __init__(self, args: Any = None, **kwargs: Any):
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        # A resumed run writes its config into a new log version, but a user who pins the log dir would hit
        # LightningCLI's "config.yaml already exists" refusal; overwriting keeps resume a one-flag change.
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", ReadableErrorParser)
        super().__init__(
            model_class=kwargs.pop("model_class", None),
            datamodule_class=kwargs.pop("datamodule_class", None),
            args=args,
            **kwargs,
        )

    _building_inspect = False

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        if not self._building_inspect:
            super().add_core_arguments_to_parser(parser)
            return
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(
            self._model_class, "model", subclass_mode=self.subclass_mode_model, required=False
        )
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (TypeError, ImportError) as error:  # a bad argument of a class or of the Trainer, not a bug here
            if full_tracebacks():
                raise
            raise ConfigurationError(str(error)) from error

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        # LightningCLI's subcommands must be Trainer methods; inspect and provenance are not, so their parsers are
        # added here with the same model/data/trainer arguments (the model optional: they read data only) and run
        # by _run_subcommand below.
        inspect_parser = self._data_parser(parser, INSPECT, _INSPECT_HELP)
        inspect_parser.add_argument(
            "--steps",
            type=int,
            default=_INSPECT_DEFAULT_STEPS,
            help="global batches to read for the tokens-per-step and padding figures",
        )
        provenance_parser = self._data_parser(parser, PROVENANCE, _PROVENANCE_HELP)
        provenance_parser.add_argument("--steps", type=str, required=True, help="a step, or steps a:b (b excluded)")
        provenance_parser.add_argument(
            "--ckpt_path",
            type=str,
            default=None,
            help="the run's checkpoint: a file, 'last', or a folder (its newest); only its data state is read",
        )
        provenance_parser.add_argument("--output", type=str, default=None, help="a .jsonl or .parquet file to write")
        provenance_parser.add_argument(
            "--text", action="store_true", help="add each document's first characters and token count"
        )
        provenance_parser.add_argument(
            "--untrained", action="store_true", help="also answer steps the run has not trained yet (said so)"
        )

    def _data_parser(self, parser: LightningArgumentParser, name: str, help: str) -> LightningArgumentParser:
        """A subcommand with the model/data/trainer arguments (the model optional: it reads data only)."""
        subparser = self.init_parser(description=help)
        self._building_inspect = True
        try:
            self._add_arguments(subparser)
        finally:
            self._building_inspect = False
        self._subcommand_parsers[name] = subparser
        self._subcommand_method_arguments[name] = []
        assert parser._subcommands_action is not None
        parser._subcommands_action.add_subcommand(name, subparser, help=help)
        return subparser

    def _run_subcommand(self, subcommand: str) -> None:
        if subcommand == INSPECT:
            steps = self.config_init[INSPECT]["steps"]
            if steps < 1:
                raise ValueError(f"--steps must be a positive integer, got {steps}")
            print(inspect(self.datamodule, self.trainer, steps))
            return
        if subcommand == PROVENANCE:
            options = self.config_init[PROVENANCE]
            ckpt_path = options["ckpt_path"]
            if ckpt_path is not None and ckpt_path != "last" and not os.path.isdir(ckpt_path):
                check_ckpt_path(ckpt_path)
            print(provenance_report(self.datamodule, self.trainer, options["steps"], ckpt_path, options["output"],
                                    options["text"], options["untrained"]))  # fmt: skip
            return
        check_ckpt_path(self.config_init[subcommand].get("ckpt_path"))
        self._choose_cpu_threads()
        super()._run_subcommand(subcommand)

    def _choose_cpu_threads(self) -> None:
        """On the CPU, leave the DataLoader workers their cores (``lightning_d9d.core.cpu_threads``)."""
        if not isinstance(self.trainer.accelerator, CPUAccelerator):
            return
        workers = int(getattr(self.datamodule, "num_workers", 0) or 0)
        said = choose_cpu_threads(int(self.trainer.num_devices), workers)
        if said is not None:
            rank_zero_info(said)


def check_ckpt_path(ckpt_path: Any) -> None:
    """Raise ``FileNotFoundError`` before training when ``--ckpt_path`` names a missing local file."""
    text = str(ckpt_path)
    if ckpt_path is None or text in _CKPT_PATH_KEYWORDS or text.startswith("registry:") or "://" in text:
        return  # Lightning resolves the keywords ("registry:name:version" too); a URL is read by fsspec
    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(
            f"--ckpt_path {str(ckpt_path)!r} is not a file: give an existing checkpoint file, a URL, or one of "
            f"{list(_CKPT_PATH_KEYWORDS)} ('last': the newest checkpoint the ModelCheckpoint callback wrote)"
        )


def inspect(datamodule: Any, trainer: Any, steps: int = _INSPECT_DEFAULT_STEPS) -> str:
    """Describe one epoch of a DataModule's training data without training; returns the report text.

    Args:
        trainer: the configured, unfitted Trainer, read for the world and data-parallel sizes.
        steps: global batches to read for the tokens and padding figures.
    """
    world_size, lines = _layout_lines(datamodule, trainer)  # world_size: what the data is dealt among
    datamodule.prepare_data()
    datamodule.setup("fit")
    backend = getattr(datamodule, "tokenizer_backend_in_use", None)
    if backend is not None:
        lines.append(f"tokenizer backend: {backend[0]} ({backend[1]})")
    if isinstance(datamodule, D9DDataModule) and datamodule.plan is not None:
        return "\n".join(lines + describe_token_plan(datamodule, world_size))
    stepped = isinstance(datamodule, SteppedDataModule)
    global_batch_size = datamodule.global_batch_size if stepped else None
    microbatch_size = datamodule.microbatch_size if stepped else None
    batches: Iterator[Any] = iter(datamodule.train_dataloader())
    if global_batch_size is None or microbatch_size is None:
        lines.append("first batch:")
        lines += [f"  {line}" for line in describe_batch(next(batches))]
        return "\n".join(lines)

    if isinstance(datamodule, PretrainingDataModule) and not datamodule.shapes.fixed:
        return "\n".join(lines + _scheduled_lines(datamodule, trainer, world_size, batches, steps))
    per_step_here = global_batch_size // microbatch_size  # microbatches of one global batch at world size 1
    lines += [
        f"steps per epoch: {datamodule.steps_per_epoch}",
        f"global batch: {global_batch_size} samples = {world_size} rank(s) x "
        f"{microbatches_per_step(global_batch_size, world_size, microbatch_size)} microbatch(es) per step "
        f"x {microbatch_size} samples",
        f"microbatches per step per rank: {microbatches_per_step(global_batch_size, world_size, microbatch_size)}",
        f"samples per step: {global_batch_size}",
    ]
    steps = min(steps, datamodule.steps_per_epoch)
    # With yield_packs each batch is already one step's pack of microbatches.
    packs = bool(datamodule.yield_packs)
    token_lines, first, rows_by_source = _read_steps(batches, steps, 1 if packs else per_step_here, packs)
    lines += token_lines
    lines += _pretraining_lines(datamodule, trainer, rows_by_source, steps)
    lines.append("first microbatch:")
    lines += [f"  {line}" for line in describe_batch(first)]
    return "\n".join(lines)


_NO_TOKEN_COUNT = "tokens per step, padding: n/a (the batch has no attention_mask, targets or 2-D input_ids)"


def _read_steps(
    batches: Iterator[Any], steps: int, batches_per_step: int, packs: bool
) -> tuple[list[str], Any, Counter[int]]:
    """The tokens and padding lines of the first ``steps`` steps, the first microbatch and the rows per source."""
    first: Any = None
    real_tokens = positions = 0
    rows_by_source: Counter[int] = Counter()  # a mixture's rows per source
    for _ in range(steps * batches_per_step):
        batch = next(batches)
        rows_by_source.update(row_sources(batch))
        if first is None:
            first = batch[0] if packs else batch
        counts = count_tokens(batch)
        if counts is None:
            return (
                [_NO_TOKEN_COUNT],
                first,
                rows_by_source,
            )
        real_tokens += counts[0]
        positions += counts[1]
    if not positions:
        return (
            [_NO_TOKEN_COUNT],
            first,
            rows_by_source,
        )
    lines = [
        f"tokens per step (mean of the first {steps} steps): {real_tokens / steps:,.0f} real, "
        f"{positions / steps:,.0f} with padding",
        f"padding: {100.0 * (1 - real_tokens / positions):.2f} %",
    ]
    return lines, first, rows_by_source


def _scheduled_lines(datamodule: Any, trainer: Any, world_size: int, batches: Iterator[Any], steps: int) -> list[str]:
    """A pretraining run whose shapes change: its phases, then what the first steps read (one replica of the world
    size: the rows of every step, at every shape of them)."""
    run_steps = _run_steps(trainer, datamodule.steps_per_epoch)
    lines = [f"steps per epoch: {datamodule.steps_per_epoch}", *datamodule.shape_report(run_steps, world_size)]
    steps = min(steps, datamodule.steps_per_epoch)
    counts: dict[int, list[int]] = {}  # per phase read (its first step): real tokens, positions
    starts = [start for start, _, _ in datamodule.shapes.phases()]
    rows_by_source: Counter[int] = Counter()
    first = None
    for step in range(steps):
        phase = counts.setdefault(max(s for s in starts if s <= step), [0, 0])
        for _ in range(datamodule.global_batch_size_at(step) // datamodule.microbatch_size):
            batch = next(batches)
            first = batch if first is None else first
            rows_by_source.update(row_sources(batch))
            real, positions = count_tokens(batch)
            phase[0], phase[1] = phase[0] + real, phase[1] + positions
    real, positions = (sum(c[i] for c in counts.values()) for i in (0, 1))
    read = [f"steps {s}-{min(steps, *(e for e in starts if e > s), steps) - 1}: "
            f"{100.0 * (1 - c[0] / max(1, c[1])):.2f} %" for s, c in counts.items()]  # fmt: skip
    lines.append(
        f"padding in the first {steps} steps: {100.0 * (1 - real / max(1, positions)):.2f} % ({', '.join(read)})"
    )
    lines += _pretraining_lines(datamodule, trainer, rows_by_source, steps)
    lines.append("first microbatch:")
    return lines + [f"  {line}" for line in describe_batch(first)]


def _layout_lines(datamodule: Any, trainer: Any) -> tuple[int, list[str]]:
    """The data-parallel size, and the report's first lines."""
    processes = int(trainer.num_nodes) * int(trainer.num_devices) if trainer is not None else 1
    replicas = _data_parallel_size(datamodule, trainer, processes)
    lines = [f"data: {type(datamodule).__module__}.{type(datamodule).__qualname__}", f"world size: {processes}"]
    if replicas != processes:
        lines.append(f"data-parallel size: {replicas} (each replica's {processes // replicas} processes share data)")
    return replicas, lines


def _data_parallel_size(datamodule: Any, trainer: Any, processes: int) -> int:
    """Replicas the data will be dealt among, known before any process starts (a mesh: one per process)."""
    given = datamodule.data_parallel if isinstance(datamodule, SteppedDataModule) else None
    if isinstance(given, DataParallelTopology):
        return given.dp_size
    size = getattr(getattr(trainer, "strategy", None), "_data_parallel_size", None)
    if size is not None:
        return int(trainer.num_nodes) if size == "auto" else int(size)
    return processes


def _pretraining_lines(datamodule: Any, trainer: Any, rows_by_source: Counter[int], steps: int) -> list[str]:
    """A pretraining mixture's phases, expected passes, realised shares and token cache."""
    if not isinstance(datamodule, PretrainingDataModule):
        return []
    sources = range(len(datamodule.source_names))
    shares = [rows_by_source[i] for i in sources]
    lines = datamodule.mixture_report(_run_steps(trainer, datamodule.steps_per_epoch), shares, steps)
    return lines + datamodule.edits_report() + datamodule.token_cache_report()


def _run_steps(trainer: Any, steps_per_epoch: int) -> int:
    """The optimizer steps ``fit`` would run: ``max_steps``, else ``max_epochs`` epochs (1 when unbounded)."""
    max_steps = getattr(trainer, "max_steps", -1) if trainer is not None else -1
    if max_steps is not None and max_steps > 0:
        return int(max_steps)
    max_epochs = getattr(trainer, "max_epochs", None) if trainer is not None else None
    return steps_per_epoch * (max_epochs if max_epochs and max_epochs > 0 else 1)


def describe_token_plan(datamodule: Any, world_size: int) -> list[str]:
    """The token-budget lines of ``inspect``, read from the epoch's plan, plus one batch."""
    plan, budget = datamodule.plan, datamodule.budget
    figures = plan.describe(0)
    per_rank = token_microbatches_per_step(budget.global_batch_tokens, budget.microbatch_tokens, world_size)
    samples_mean, samples_min, samples_max = figures["samples_per_step"]
    tokens_mean, tokens_min, tokens_max = figures["tokens_per_step"]
    mode = "padding-free (sum of lengths)" if budget.padding_free else "padded (samples × padded longest)"
    lines = [
        f"steps per epoch: {figures['steps']} (epoch 1: {plan.steps_in_epoch(1)}; token-budget epochs differ a little)",
        f"step: {budget.global_batch_tokens} tokens = {world_size} rank(s) x {per_rank} microbatch(es) per step x "
        f"{budget.microbatch_tokens} tokens, {mode}",
        f"microbatches per step per rank: {per_rank}",
        f"samples per step: {samples_mean:,.1f} mean ({samples_min}-{samples_max})",
        f"tokens per step: {tokens_mean:,.0f} real mean ({tokens_min:,}-{tokens_max:,}) "
        f"of {budget.global_batch_tokens:,}",
        f"fill: {100.0 * figures['fill']:.2f} % of microbatch_tokens are real tokens",
    ]
    if not budget.padding_free:
        used = figures["budget_used"]
        lines.append(
            f"padding: {100.0 * (1 - figures['fill'] / used):.2f} % of the padded positions "
            f"(padded microbatches use {100.0 * used:.2f} % of microbatch_tokens)"
        )
    else:
        lines.append("padding: 0.00 % (padding-free)")
    lines.append(f"dropped in epoch 0: {figures['dropped_samples']} samples (fewer than one step's worth)")
    lines.append("first microbatch:")
    lines += [f"  {line}" for line in describe_batch(next(iter(datamodule.train_dataloader())))]
    return lines


def describe_batch(batch: Any, name: str = "batch") -> list[str]:
    """One line per tensor of a batch tree: ``name.field: shape dtype``."""
    if isinstance(batch, torch.Tensor):
        return [f"{name}: {tuple(batch.shape)} {str(batch.dtype).removeprefix('torch.')}"]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [(field.name, getattr(batch, field.name)) for field in dataclasses.fields(batch)]
        items = [(field, value) for field, value in items if value is not None]  # e.g. set only by cp_shard_batch
        return [line for field, value in items for line in describe_batch(value, f"{name}.{field}")]
    if isinstance(batch, dict):
        return [line for key, value in batch.items() for line in describe_batch(value, f"{name}[{key!r}]")]
    if isinstance(batch, (list, tuple)):
        return [line for index, value in enumerate(batch) for line in describe_batch(value, f"{name}[{index}]")]
    return [f"{name}: {type(batch).__name__}"]


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-d9d``: errors end with one line and exit 2 (parsing) or 1 (running)."""
    try:
        D9DCLI(args=args)
    except CONFIGURATION_ERRORS as error:
        if full_tracebacks():
            raise
        report_configuration_error(error)


if __name__ == "__main__":
    main()
