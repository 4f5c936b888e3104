"""State: where training is in the data, as a few integers, plus a fingerprint of what defines the order.

Algorithm: because the order is a pure function of (seed, epoch, data, global_batch_size, sort_buffer_size),
the position ``(epoch, step)`` — global optimizer steps consumed in the epoch — is all that a resume needs;
the remaining batches are recomputed, never replayed. ``step`` counts microbatches that were handed to the
training loop, divided by microbatches per step and rounded down: a checkpoint taken inside an accumulation
window (whose gradients are not in the checkpoint) resumes at the start of that optimizer step and replays
its microbatches, so no optimizer step is ever short.

The position is counted in global steps, not per-rank microbatches, so it is the same on every rank (rank 0's
saved copy is valid for all) and stays valid when world size, microbatch size or worker count change.

Trade-off: the fingerprint samples a few sort keys instead of hashing all of them, so two datasets with the
same length that differ only between the sampled keys are not told apart; hashing every key would cost O(N)
at every resume.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class OrderFingerprint:
    """What defines the training order; a resume into a different one would silently train another order."""

    seed: int
    num_samples: int
    global_batch_size: int
    sort_buffer_size: int | None
    shuffle: bool
    sort_keys_digest: str

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        """Human-readable differences ``name: checkpoint X vs now Y`` against a saved fingerprint."""
        differences = []
        for field in dataclasses.fields(self):
            now, then = getattr(self, field.name), saved.get(field.name)
            if now != then:
                differences.append(f"{field.name}: checkpoint {then!r} vs now {now!r}")
        return differences


@dataclasses.dataclass
class TrainPosition:
    """The one place that knows where training is: epoch, and microbatches handed out in that epoch.

    ``microbatches`` is this rank's count; ``step`` turns it into whole global optimizer steps.
    """

    epoch: int = 0
    microbatches: int = 0
    microbatches_per_step: int = 1

    @property
    def step(self) -> int:
        return self.microbatches // self.microbatches_per_step

    def start(self, epoch: int, step: int, microbatches_per_step: int) -> None:
        self.epoch, self.microbatches_per_step = epoch, microbatches_per_step
        self.microbatches = step * microbatches_per_step

    def to_state(self, fingerprint: OrderFingerprint) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "fingerprint": dataclasses.asdict(fingerprint)}


def check_state(state: Any) -> tuple[int, int, dict[str, Any]]:
    """Validate a saved data state and return ``(epoch, step, fingerprint)``.

    Raises:
        ValueError: a state that is not what ``D9DDataModule.state_dict()`` writes.
    """
    if not isinstance(state, dict) or not {"epoch", "step", "fingerprint"} <= state.keys():
        raise ValueError(
            f"not a lightning_d9d data state: expected a dict with 'epoch', 'step' and 'fingerprint', got {state!r}"
        )
    epoch, step = state["epoch"], state["step"]
    if not isinstance(epoch, int) or not isinstance(step, int) or epoch < 0 or step < 0:
        raise ValueError(f"data state has invalid position epoch={epoch!r}, step={step!r}: both must be integers >= 0")
    return epoch, step, dict(state["fingerprint"])
