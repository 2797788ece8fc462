"""Paired comparison of eval configs: hand-made records with known differences."""

import pytest

from pced.evaluation.compare import format_comparison, paired_comparison


def rec(config, example, score, method="pced"):
    return {"config": config, "example_id": example, "score": score, "method": method}


def test_identical_configs_differ_by_exactly_zero():
    records = [rec(c, e, float(e % 2)) for c in ("ref", "same") for e in range(20)]
    rows = {r["config"]: r for r in paired_comparison(records)["rows"]}
    assert rows["same"]["delta"] == 0.0 and (rows["same"]["ci_low"], rows["same"]["ci_high"]) == (0.0, 0.0)
    assert rows["same"]["wins"] == rows["same"]["losses"] == 0


def test_a_config_right_on_every_question_the_reference_missed_wins_measurably():
    records = [rec("ref", e, 0.0) for e in range(30)] + [rec("better", e, 1.0) for e in range(30)]
    row = paired_comparison(records)["rows"][1]
    assert (row["delta"], row["ci_low"], row["ci_high"], row["wins"], row["losses"]) == (100.0, 100.0, 100.0, 30, 0)
    assert "+100.0 *" in format_comparison(paired_comparison(records))


def test_only_shared_questions_count_and_noise_is_not_called_a_win():
    # "other" has 3 questions the reference never answered; on the shared 40 it wins 11, loses 9
    ref = [rec("ref", e, 1.0 if e < 20 else 0.0) for e in range(40)]
    other = [rec("other", e, 0.0 if e < 9 else (1.0 if e < 20 or e < 31 else 0.0)) for e in range(40)]
    extra = [rec("other", 100 + e, 1.0) for e in range(3)]
    row = paired_comparison(ref + other + extra, reference="ref")["rows"][1]
    assert row["n"] == 40 and (row["wins"], row["losses"]) == (11, 9)
    assert row["delta"] == pytest.approx(100 * 2 / 40)
    assert row["ci_low"] < 0 < row["ci_high"]
    assert "*" not in format_comparison(paired_comparison(ref + other, reference="ref")).split("\n")[-2]


def test_unknown_reference_is_refused():
    with pytest.raises(KeyError, match="no results"):
        paired_comparison([rec("a", 1, 1.0)], reference="b")
