"""Mixture controllers without a model: scripted losses against the formulas written out here (numpy, not the
controllers' code), the edge cases of online mixing (no tokens, NaN, one source, permutations, bad weights), the
exact rationals a decision is journaled as, and the journaled plan: exact rows from the effective step, a worker
process that waits for a decision it needs and then makes the same rows as the training process."""

from __future__ import annotations

import json
import multiprocessing
import time
from fractions import Fraction

import numpy as np
import pytest

from lightning_d9d.mixtures import (
    DENOMINATOR,
    DoReMi,
    LossProportional,
    MixtureController,
    SourceStats,
    WeightsFile,
    check_controller,
    check_stats,
    checked_weights,
    quantised,
)
from lightning_d9d.streaming.plans.mixture import MixturePlan, MixtureSchedule
from lightning_d9d.streaming.plans.mixture_journal import (
    MIXTURE_LAG,
    JournaledPlan,
    JournalEntry,
    MixtureJournal,
    training_step_of,
)


def stats(losses: dict[str, float | None], weights: dict[str, float] | None = None, tokens: int = 100) -> dict:
    """A window where each source's mean loss is ``losses[name]`` (``None``: no tokens)."""
    weights = weights or {name: 1 / len(losses) for name in losses}
    return {
        name: SourceStats(
            0.0 if loss is None else loss * tokens,
            0 if loss is None else tokens,
            0 if loss is None else 4,
            weights[name],
        )
        for name, loss in losses.items()
    }


def softmax_mix(losses: list[float], temperature: float, smoothing: float, prior: list[float]) -> np.ndarray:
    z = np.asarray(losses, np.float64) / temperature
    p = np.exp(z - z.max())
    return (1 - smoothing) * p / p.sum() + smoothing * np.asarray(prior)


# ------------------------------------------------------------------------------------------------ LossProportional
def test_loss_proportional_is_the_smoothed_softmax_of_the_window_losses() -> None:
    controller = LossProportional(every=5, temperature=1.0, smoothing=0.1)
    for step in (5, 10, 15):
        got = controller.update(step, stats({"hard": 4.0, "easy": 1.0}))
        want = softmax_mix([4.0, 1.0], 1.0, 0.1, [0.5, 0.5])
        assert list(got) == ["hard", "easy"]
        np.testing.assert_allclose([got["hard"], got["easy"]], want, rtol=1e-12)
    assert got["hard"] > 0.9  # the high-loss source gets the share
    gentle = LossProportional(temperature=4.0, smoothing=0.1).update(5, stats({"hard": 4.0, "easy": 1.0}))
    assert 0.5 < gentle["hard"] < got["hard"]  # a higher temperature moves less


def test_loss_proportional_smooths_with_an_ema_and_a_prior() -> None:
    controller = LossProportional(temperature=2.0, smoothing=0.2, ema=0.5, prior={"a": 3, "b": 1})
    controller.update(10, stats({"a": 2.0, "b": 2.0}))
    got = controller.update(20, stats({"a": 4.0, "b": 2.0}))
    ema = [0.5 * 2.0 + 0.5 * 4.0, 2.0]
    np.testing.assert_allclose([got["a"], got["b"]], softmax_mix(ema, 2.0, 0.2, [0.75, 0.25]), rtol=1e-12)


def test_equal_losses_give_exactly_the_prior_and_one_source_keeps_everything() -> None:
    got = LossProportional(temperature=0.3, smoothing=0.05).update(3, stats({"a": 2.5, "b": 2.5, "c": 2.5}))
    assert quantised(list(got.values())) == (Fraction(333334, 10**6), Fraction(333333, 10**6), Fraction(333333, 10**6))
    assert LossProportional().update(3, stats({"only": 7.0})) == {"only": pytest.approx(1.0)}
    assert DoReMi({"only": 1.0}).update(3, stats({"only": 7.0})) == {"only": pytest.approx(1.0)}


def test_permuting_the_sources_permutes_the_weights() -> None:
    losses = {"a": 3.0, "b": 1.5, "c": 2.2}
    forward = LossProportional(temperature=0.7).update(5, stats(losses))
    backward = LossProportional(temperature=0.7).update(5, stats(dict(reversed(list(losses.items())))))
    assert forward == pytest.approx(backward)
    ref = {"a": 1.0, "b": 1.0, "c": 1.0}
    assert DoReMi(ref).update(5, stats(losses)) == pytest.approx(DoReMi(ref).update(5, stats(dict(reversed(list(
        losses.items()))))))  # fmt: skip


def test_a_source_without_tokens_keeps_its_previous_score_and_never_gets_nan() -> None:
    controller = LossProportional(temperature=1.0, smoothing=0.1)
    first = controller.update(5, stats({"a": 3.0, "b": 1.0}))
    again = controller.update(10, stats({"a": None, "b": 1.0}))  # a had no tokens in this window
    assert again == pytest.approx(first)
    fresh = LossProportional().update(5, stats({"a": None, "b": 2.0, "c": 4.0}))  # a never seen: the others' mean
    np.testing.assert_allclose([fresh[n] for n in "abc"], softmax_mix([3.0, 2.0, 4.0], 1.0, 0.1, [1 / 3] * 3))
    assert LossProportional().update(5, stats({"a": None, "b": None})) is None  # nothing known: keep the shares
    assert LossProportional(warmup=100).update(50, stats({"a": 1.0, "b": 2.0})) is None


# ------------------------------------------------------------------------------------------------ DoReMi
def test_doremi_follows_the_exponentiated_excess_loss_recursion() -> None:
    reference = {"a": 2.0, "b": 1.0, "c": 3.0}
    eta, c = 0.5, 0.01
    windows = [{"a": 3.0, "b": 1.5, "c": 2.0}, {"a": 2.5, "b": None, "c": 3.5}, {"a": 1.0, "b": 2.0, "c": 3.2}]
    controller = DoReMi(reference, every=4, step_size=eta, smoothing=c)
    start = {"a": 0.5, "b": 0.3, "c": 0.2}
    # The paper's recursion written out: log α ← log α + η·max(L − ref, 0); normalise; (1 − c)·α + c/k.
    alpha, last, seen = np.array([0.5, 0.3, 0.2]), {}, []
    for number, window in enumerate(windows):
        got = controller.update(4 * (number + 1), stats(window, start))
        for name, loss in window.items():
            if loss is not None:
                last[name] = loss
        excess = np.array([max(last.get(n, reference[n]) - reference[n], 0.0) for n in "abc"])
        logits = np.log(alpha) + eta * excess
        alpha = (1 - c) * np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() + c / 3
        seen.append(alpha)
        np.testing.assert_allclose([got[n] for n in "abc"], alpha, rtol=1e-12)
    np.testing.assert_allclose([controller.average_weights[n] for n in "abc"], np.mean(seen, axis=0), rtol=1e-12)


def test_doremi_refuses_a_source_without_a_reference_loss_and_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"update step 8: no reference loss for sources \['b'\]"):
        DoReMi({"a": 1.0}).update(8, stats({"a": 1.0, "b": 2.0}))
    with pytest.raises(ValueError, match="step_size"):
        DoReMi({"a": 1.0}, step_size=0)
    with pytest.raises(ValueError, match="reference_losses"):
        DoReMi({"a": float("nan")})
    with pytest.raises(ValueError, match="temperature"):
        LossProportional(temperature=0)
    with pytest.raises(ValueError, match="every"):
        LossProportional(every=0)


def test_controllers_state_round_trips_so_a_resume_continues_identically() -> None:
    for make in (lambda: LossProportional(ema=0.7), lambda: DoReMi({"a": 1.0, "b": 1.0}, ema=0.3)):
        one, two = make(), make()
        one.update(5, stats({"a": 3.0, "b": 2.0}))
        two.load_state_dict(json.loads(json.dumps(one.state_dict())))  # through plain JSON, as a checkpoint holds it
        window = stats({"a": 2.0, "b": 4.0})
        assert one.update(10, window) == two.update(10, window)


# ------------------------------------------------------------------------------------------------ WeightsFile
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_weights_file_applies_each_edit_once(tmp_path, suffix: str) -> None:
    path = tmp_path / f"weights{suffix}"
    controller = WeightsFile(str(path), every=3)
    window = stats({"a": 1.0, "b": 1.0})
    assert controller.update(3, window) is None  # no file yet
    path.write_text('{"a": 1, "b": 3}' if suffix == ".json" else "a: 1\nb: 3\n")
    assert controller.update(6, window) == {"a": 1, "b": 3}
    assert controller.update(9, window) is None  # unchanged
    path.write_text('{"a": 2}' if suffix == ".json" else "a: 2\n")
    assert controller.update(12, window) == {"a": 2}
    restored = WeightsFile(str(path))
    restored.load_state_dict(controller.state_dict())
    assert restored.update(15, window) is None


def test_weights_file_names_the_file_and_step_of_a_bad_edit(tmp_path) -> None:
    path = tmp_path / "w.json"
    path.write_text('{"a": -1}')
    with pytest.raises(ValueError, match=r"WeightsFile at update step 6 returned weight -1 for source 'a'"):
        WeightsFile(str(path)).update(6, stats({"a": 1.0, "b": 1.0}))
    path.write_text('{"a": ')
    with pytest.raises(ValueError, match=r"WeightsFile '.*w.json' at update step 9: cannot parse it"):
        WeightsFile(str(path)).update(9, stats({"a": 1.0}))


# ------------------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": -0.5, "b": 1}, r"at update step 7 returned weight -0.5 for source 'a': weights are numbers >= 0"),
        ({"a": 1, "zz": 1}, r"at update step 7 returned weights for unknown sources \['zz'\]; the sources are"),
        ({"a": float("nan")}, r"at update step 7 returned weight nan for source 'a': weights are finite"),
        ({"a": float("inf")}, r"at update step 7 returned weight inf for source 'a'"),
        ({"a": "x"}, r"at update step 7 returned weight 'x' for source 'a'"),
        ({"a": 0, "b": 0}, r"at update step 7 returned all-zero weights"),
        ([0.5, 0.5], r"at update step 7 returned \[0.5, 0.5\]: give a mapping"),
    ],
)
def test_bad_weights_get_one_error_naming_the_update_step(weights, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checked_weights(7, weights, ["a", "b"], LossProportional())


def test_nan_or_infinite_losses_are_refused_naming_the_update_step() -> None:
    window = stats({"a": 1.0, "b": 2.0})
    check_stats(20, window)
    window["b"] = SourceStats(float("nan"), 10, 1, 0.5)
    with pytest.raises(ValueError, match=r"mixture update at step 20: source 'b' has a training loss sum of nan"):
        check_stats(20, window)
    window["b"] = SourceStats(1.0, 10, 1, 0.5, val_loss=float("inf"))
    with pytest.raises(ValueError, match=r"step 20: source 'b' has a validation loss of inf"):
        check_stats(20, window)


def test_a_controller_is_checked_for_the_protocol() -> None:
    assert isinstance(LossProportional(), MixtureController)
    with pytest.raises(ValueError, match=r"lacks \['update', 'state_dict', 'load_state_dict'\]"):
        check_controller(object())

    class NoEvery:
        every = 0
        update = state_dict = load_state_dict = staticmethod(lambda *a: None)

    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        check_controller(NoEvery())


# ------------------------------------------------------------------------------------------------ exact rationals
def test_quantised_shares_are_exact_and_keep_a_floor() -> None:
    shares = quantised([0.7, 0.2999995, 5e-7])
    assert sum(shares) == 1 and all((s * DENOMINATOR).denominator == 1 for s in shares)
    assert shares[2] == Fraction(1, DENOMINATOR)  # a positive weight never rounds to 0
    assert quantised([1, 0, 3]) == (Fraction(1, 4), Fraction(0), Fraction(3, 4))  # a 0 stays 0 (paused)
    floored = quantised([0.98, 0.01, 0.01], floor=Fraction(1, 8))
    assert floored[1] >= Fraction(1, 8) and floored[2] >= Fraction(1, 8) and sum(floored) == 1


def test_the_floor_keeps_every_source_at_a_row_every_step() -> None:
    g = 8
    shares = quantised([0.995, 0.004, 0.001], floor=Fraction(1, g))
    plan = MixturePlan(MixtureSchedule(["a", "b", "c"], dict(zip("abc", shares))), g)
    quotas = plan.quotas_from(0)
    for _ in range(200):
        quota = next(quotas)
        assert sum(quota) == g and min(quota) >= 1


# ------------------------------------------------------------------------------------------------ the journaled plan
NAMES = ("a", "b")


def journaled(entries: list[tuple[int, dict[str, str] | None]], g: int = 8, every: int = 3, feed=None,
              settle: int = 0) -> tuple:  # fmt: skip
    """A journal of decisions ``(update_step, shares)`` over equal base shares, each with the rows the plan had
    given by its effective step, as the DataModule journals them; updates settled through ``settle``."""
    base = MixturePlan(MixtureSchedule(NAMES), g)
    journal = MixtureJournal(NAMES, feed=feed)
    plan = JournaledPlan(base, journal, every)
    for update, shares in entries:
        step = update + MIXTURE_LAG
        exact = None if shares is None else tuple(Fraction(shares[n]) for n in NAMES)
        rows = None if exact is None else plan.cumulative_rows(step)
        journal.add(JournalEntry(update, step, step, exact, rows))
    journal.settle_through(settle)
    return base, journal, plan


def test_a_journaled_plan_takes_each_decisions_rows_from_its_effective_step() -> None:
    _, _, plan = journaled([(3, {"a": "3/4", "b": "1/4"}), (6, None), (9, {"a": "1/8", "b": "7/8"})], settle=100)
    quotas = plan.quotas_from(0)
    got = [next(quotas) for _ in range(30)]
    assert got[:5] == [(4, 4)] * 5  # before step 3 + lag: the base shares
    assert got[5:11] == [(6, 2)] * 6  # 3/4 of 8 rows, exactly, from step 5 (update 6 kept them)
    assert got[11:] == [(1, 7)] * 19
    assert [plan.rows_of_step(s) for s in range(30)] == got
    assert plan.cumulative_rows(30) == tuple(map(sum, zip(*got)))


def test_a_journaled_plan_stays_within_a_row_of_each_decisions_target() -> None:
    decisions = {5: (Fraction(2, 3), Fraction(1, 3)), 14: (Fraction(1, 7), Fraction(6, 7))}  # effective: shares
    _, _, plan = journaled(
        [(3, {"a": "2/3", "b": "1/3"}), (6, None), (9, None), (12, {"a": "1/7", "b": "6/7"})], g=5, settle=100
    )
    quotas, rows = plan.quotas_from(0), [0, 0]
    for step in range(60):
        quota = next(quotas)
        assert sum(quota) == 5 and min(quota) >= 0
        rows = [r + q for r, q in zip(rows, quota)]
        starts = [e for e in decisions if e <= step]
        if starts:  # from the effective step on: the rows there plus 5 rows a step at the decision's shares
            start = max(starts)
            at = plan.cumulative_rows(start)
            for i in range(2):
                assert abs(rows[i] - (at[i] + 5 * (step + 1 - start) * decisions[start][i])) < 1


def test_the_training_process_never_waits_it_says_what_is_missing() -> None:
    _, _, plan = journaled([])
    assert plan.rows_of_step(MIXTURE_LAG + 2) == (4, 4)  # depends on no update yet
    with pytest.raises(RuntimeError, match=r"needs the controller's update at step 3, which has not been made"):
        plan.rows_of_step(3 + MIXTURE_LAG)


def test_training_steps_of_data_steps_count_the_skipped_ones() -> None:
    skipped = ((3, 6), (10, 12))
    assert [training_step_of(d, skipped) for d in range(14)] == [0, 1, 2, 3, 3, 3, 3, 4, 5, 6, 7, 7, 7, 8]


def _worker_quotas(plan: JournaledPlan, steps: int, out) -> None:
    quotas = plan.quotas_from(0)
    out.send([next(quotas) for _ in range(steps)])


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_worker_waits_for_the_decisions_it_needs_and_then_makes_the_training_processs_rows(tmp_path, method) -> None:
    feed = str(tmp_path / "feed.jsonl")
    base, journal, plan = journaled([(3, {"a": "7/8", "b": "1/8"})], feed=feed)
    context = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker_quotas, args=(plan, 16, send))
    worker.start()
    try:
        # The worker can make steps up to 6 + lag − 1 at once and must wait for update 6 beyond them.
        assert not receive.poll(1.5), "the worker made steps that depend on an update not yet decided"
        journal.add(JournalEntry(6, 8, 8, None, None))
        time.sleep(0.3)
        assert not receive.poll(0.2)
        rows = plan.cumulative_rows(11)
        journal.add(JournalEntry(9, 11, 11, (Fraction(1, 4), Fraction(3, 4)), rows))
        journal.add(JournalEntry(12, 14, 14, None, None))
        assert receive.poll(30)
        got = receive.recv()
    finally:
        worker.join(10)
    here = plan.quotas_from(0)
    assert got == [next(here) for _ in range(16)]
    assert got[5:11] == [(7, 1)] * 6 and got[11:] == [(2, 6)] * 5
    assert base.rows_of_step(12) == (4, 4)  # the base plan itself is untouched
