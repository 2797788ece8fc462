"""Metric tests on hand-made cases whose values were worked out by hand from the official
definitions (LOFT, LongBench, HotpotQA); comments show the arithmetic."""

from __future__ import annotations

import random

import pytest

from pced.evaluation.metrics import (
    METRICS,
    classification_score,
    code_sim_score,
    count_score,
    em,
    extract_icl_answer,
    extract_loft_prediction,
    hotpot_em,
    hotpot_f1,
    hotpot_f1_precision_recall,
    icl_em,
    icl_em_pced,
    icl_lenient,
    loft_f1,
    multi_answer_scores,
    normalize_answer,
    normalize_answer_squad,
    qa_f1_score,
    retrieval_score,
    rouge_l,
    rouge_score,
    score,
    split_answer_list,
    subspan_em,
)
from pced.evaluation.records import format_exemplar

# ----------------------------------------------------------------------------- normalization


def test_normalize_answer_lower_punctuation_articles_whitespace():
    assert normalize_answer("  The  Ramones!! ") == "ramones"
    assert normalize_answer("Kobol's Last-Gleaming") == "kobols lastgleaming"
    assert normalize_answer("An apple a day") == "apple day"
    # articles only as whole words
    assert normalize_answer("Theater of Dan") == "theater of dan"


def test_normalize_answer_nfd_makes_composed_and_decomposed_equal_but_keeps_accents():
    composed, decomposed = "Ta\u00edno", "Tai\u0301no"
    assert composed != decomposed
    assert normalize_answer(composed) == normalize_answer(decomposed)
    assert normalize_answer(composed) != normalize_answer("Taino")
    # SQuAD normalization (LongBench, HotpotQA) has no NFD step
    assert normalize_answer_squad(composed) != normalize_answer_squad(decomposed)


def test_loft_normalization_turns_option_a_into_empty_string():
    # why icl_em_pced does not use it: "(A)" -> "a" -> article removed -> "" (LOFT's icl_em
    # does, so there "(A)" equals every answer that normalizes to "")
    assert normalize_answer("(A)") == ""
    assert normalize_answer("(B)") == "b"


# ----------------------------------------------------------------------------- LOFT


def test_subspan_em():
    assert subspan_em("It was Wilhelm Conrad Röntgen.", ["Wilhelm Conrad Röntgen"]) == 1.0
    assert subspan_em("Röntgen", ["Wilhelm Conrad Röntgen"]) == 0.0
    assert subspan_em("The Tai\u0301no people", ["Spain", "Ta\u00edno"]) == 1.0
    assert subspan_em("The Taino people", ["Ta\u00edno"]) == 0.0
    assert subspan_em("ramones", ["the Ramones"]) == 1.0
    assert subspan_em("kobols last gleaming", ["Kobol's Last Gleaming"]) == 1.0
    assert subspan_em("anything", []) == 0.0
    assert subspan_em("Nala", "Nala") == 1.0  # a single gold string is accepted


def test_em_and_loft_f1():
    assert em("The Nala.", ["nala"]) == 1.0
    assert em("Nala the lioness", ["nala"]) == 0.0
    # "nala lioness" vs "nala": P = 1/2, R = 1 -> F1 = 2/3
    assert loft_f1("Nala the lioness", ["nala", "simba"]) == pytest.approx(2 / 3)
    assert loft_f1("simba", ["nala"]) == 0.0


def test_multi_answer_scores_partial():
    # golds paris, lyon, nice; "paris france" contains paris, "lyon" equals lyon: M = 2
    s = multi_answer_scores(["Paris, France", "Lyon"], ["Paris", "Lyon", "Nice"])
    assert s["subspan_em"] == 0.0
    assert s["precision"] == 1.0
    assert s["recall"] == pytest.approx(2 / 3)
    assert s["f1"] == pytest.approx(0.8)  # 2 * 1 * 2/3 / (1 + 2/3)
    assert s["em"] == 0.0
    assert s["coverage"] == pytest.approx(1 / 3)  # only "lyon" is an exact normalized match


def test_multi_answer_scores_all_matched_and_exact():
    s = multi_answer_scores(["lyon", "The Paris"], ["Paris", "Lyon"])
    assert s == {"subspan_em": 1.0, "precision": 1.0, "recall": 1.0, "f1": 1.0, "em": 1.0,
                 "coverage": 1.0}


def test_multi_answer_scores_alignment_is_one_to_one_and_optimal():
    # one prediction cannot satisfy two golds
    s = multi_answer_scores(["New York"], ["New York", "York"])
    assert (s["subspan_em"], s["recall"], s["precision"]) == (0.0, 0.5, 1.0)
    # greedy gold order would give cat->"black cat" and leave "black cat" unmatched;
    # the optimal assignment is cat->"cat food", black cat->"black cat"
    s = multi_answer_scores(["black cat", "cat food"], ["cat", "black cat"])
    assert s["subspan_em"] == 1.0 and s["f1"] == 1.0


def test_multi_answer_scores_empty_and_article_only_predictions():
    assert multi_answer_scores([], ["Paris"])["subspan_em"] == 0.0
    # "the" normalizes to "", a substring of "paris": LOFT keeps it and it matches the gold
    # (this assertion was `recall == 0.0` when pced dropped such items)
    assert multi_answer_scores(["the"], ["Paris"])["recall"] == 1.0


# LOFT MultiValueRagEvaluation (rag.py) on these lists: compute_multi_value_subspan_em,
# compute_em_multi_value, compute_coverage; items normalizing to "" are kept.
@pytest.mark.parametrize(
    ("predictions", "golds", "subspan", "exact", "coverage"),
    [
        (["the"], ["Paris"], 1.0, 0.0, 0.0),  # "" in "paris"
        ([""], ["Paris"], 1.0, 0.0, 0.0),
        (["", "Lyon"], ["Paris", "Lyon"], 1.0, 0.0, 0.5),  # "" -> paris, "lyon" -> lyon
        (["the"], ["Paris", "Lyon"], 0.0, 0.0, 0.0),  # one item, one gold (one-to-one)
        (["An", "the"], ["Paris", "Lyon"], 1.0, 0.0, 0.0),
        (["Paris", "the"], ["Paris"], 1.0, 0.0, 1.0),  # {"paris", ""} != {"paris"}
        (["a"], ["The"], 1.0, 1.0, 1.0),  # both sides normalize to ""
    ],
)
def test_multi_answer_scores_keep_items_normalizing_to_empty_as_loft(
        predictions, golds, subspan, exact, coverage):
    s = multi_answer_scores(predictions, golds)
    assert (s["subspan_em"], s["em"], s["coverage"]) == (subspan, exact, coverage)


def test_multi_answer_empty_items_precision_recall():
    # golds paris, lyon; preds "paris", "": paris matches both, lyon matches "": M = 2
    s = multi_answer_scores(["Paris", ""], ["Paris", "Lyon"])
    assert (s["precision"], s["recall"], s["f1"]) == (1.0, 1.0, 1.0)
    # one gold, two predictions that both match it: M = 1, P = 1/2
    s = multi_answer_scores(["Paris", "the"], ["Paris"])
    assert (s["precision"], s["recall"]) == (0.5, 1.0)


def test_split_answer_list():
    assert split_answer_list("Final Answer: ['A Case of Need', 'The devil's sleep']") == [
        "A Case of Need", "The devil's sleep"]
    assert split_answer_list("**Final Answer:** [\"x\", \"y\"]") == ["x", "y"]
    assert split_answer_list("['Lyon', 'Nice']") == ["Lyon", "Nice"]
    assert split_answer_list("Paris, Lyon\n- Nice") == ["Paris", "Lyon", "Nice"]
    assert split_answer_list("1. Paris\n2. Lyon") == ["Paris", "Lyon"]
    assert split_answer_list("Nala [1]") == ["Nala [1]"]  # a citation is not a list
    assert split_answer_list("") == []
    # items of a parsed list are kept even when blank, as LOFT keeps them
    assert split_answer_list("Final Answer: ['Paris', '']") == ["Paris", ""]
    assert split_answer_list("['Lyon', ' ']") == ["Lyon", ""]
    assert split_answer_list("Paris, , Lyon") == ["Paris", "Lyon"]  # plain-text splitting is ours


def test_multi_answer_registry_scores_free_text():
    assert score("multi_answer_em", "Final Answer: ['Lyon', 'Paris', 'Nice']",
                 ["Paris", "Lyon", "Nice"]) == 1.0
    assert score("multi_answer_em", "Lyon, Paris", ["Paris", "Lyon", "Nice"]) == 0.0
    assert score("multi_answer_recall", "Lyon, Paris", ["Paris", "Lyon", "Nice"]) == \
        pytest.approx(2 / 3)
    assert score("multi_answer_f1", "Lyon, Paris", ["Paris", "Lyon", "Nice"]) == \
        pytest.approx(0.8)
    # LOFT: the blank item normalizes to "", which matches "paris"
    assert score("multi_answer_em", "Final Answer: ['Lyon', '']", ["Paris", "Lyon"]) == 1.0


# ----------------------------------------------------------------------------- HotpotQA


def test_hotpot_em():
    assert hotpot_em("The Yes.", "yes") == 1.0
    assert hotpot_em("yes sir", "yes") == 0.0


def test_hotpot_f1_yes_no_rule():
    assert hotpot_f1("yes", "no") == 0.0
    # gold is "yes" and the prediction differs: 0, although token F1 would give 0.5
    assert hotpot_f1("yes it is", "yes") == 0.0
    assert qa_f1_score("yes it is", "yes") == pytest.approx(0.5)
    assert hotpot_f1("noanswer", "no answer") == 0.0  # "noanswer" vs "no answer" differ
    assert hotpot_f1("No.", "no") == 1.0


def test_hotpot_f1_values():
    # "eiffel tower in paris" vs "eiffel tower": P = 2/4, R = 2/2, F1 = 2/3
    f1, p, r = hotpot_f1_precision_recall("The Eiffel Tower, in Paris!", "Eiffel Tower")
    assert (f1, p, r) == (pytest.approx(2 / 3), 0.5, 1.0)
    assert hotpot_f1("Louvre", "Eiffel Tower") == 0.0


# ----------------------------------------------------------------------------- LongBench


def test_qa_f1_score():
    assert qa_f1_score("The Eiffel Tower, in Paris!", "Eiffel Tower") == pytest.approx(2 / 3)
    # tokens count with multiplicity: "x x y" vs "x y y" share {x: 1, y: 1} = 2 tokens,
    # P = R = 2/3, F1 = 2/3
    assert qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)
    assert qa_f1_score("", "x") == 0.0


def test_rouge_l_counts_distinct_words_like_the_rouge_package():
    # LCS("the cat is on the mat", "the cat sat on the mat") = the cat on the mat, whose
    # DISTINCT words are {the, cat, on, mat} = 4; distinct words: 5 on each side.
    s = rouge_l("the cat sat on the mat", "the cat is on the mat")
    assert s["p"] == pytest.approx(0.8) and s["r"] == pytest.approx(0.8)
    assert s["f"] == pytest.approx(2 * 0.8 * 0.8 / (1.6 + 1e-8), abs=1e-12)


def test_rouge_l_summary_level_union_over_sentences():
    # hyp sentences "a b c" | "d e", ref "a c e": LCS unions {a, c} + {e} = 3 words;
    # P = 3/5 distinct hyp words, R = 3/3, F = 2 * .6 / 1.6 = 0.75
    s = rouge_l("a b c. d e", "a c e")
    assert (s["p"], s["r"]) == (pytest.approx(0.6), pytest.approx(1.0))
    assert rouge_score("a b c. d e", "a c e") == pytest.approx(0.75, abs=1e-7)


def test_rouge_quirks_case_empty_and_trailing_space_sentence():
    assert rouge_score("The Cat", "the cat") == 0.0  # case-sensitive
    assert rouge_score("", "a") == 0.0
    assert rouge_score("...", "a") == 0.0  # no sentence: the package raises, LongBench -> 0
    # "the cat sat. " has a second sentence " " -> the empty word: P = 3/4, R = 1
    assert rouge_score("the cat sat. ", "the cat sat.") == pytest.approx(6 / 7, abs=1e-7)


def test_code_sim_first_code_line():
    assert code_sim_score("```python\nx = foo(1)\n```", "x = foo(1)") == 1.0
    # a line CONTAINING '#' or '//' is skipped, not only one starting with it
    assert code_sim_score("a = 1  # note\nb = 2", "b = 2") == 1.0
    assert code_sim_score("\n\n// comment\nb = 2", "b = 2") == 1.0
    # "y = 2" vs "y = 3": M = 4 of T = 10 -> round(100 * 8/10) = 80
    assert code_sim_score("# comment\ny = 2", "y = 3") == 0.8
    # "abc" vs "abd": M = 2, T = 6 -> round(66.67) = 67
    assert code_sim_score("abc", "abd") == 0.67
    assert code_sim_score("# only comments", "x") == 0.0  # no code line -> "" -> 0


def test_code_sim_uses_fuzzywuzzy_matching_blocks_not_lcs():
    # difflib blocks: "return " (7) then "y" (1): M = 8, T = 24 -> round(66.7) = 67.
    # An LCS/Levenshtein ratio (rapidfuzz) would find 9 and give 75.
    assert code_sim_score("return y + x", "return x - y") == 0.67


def test_classification_score():
    classes = ["Description", "Entity", "Human being", "Location"]
    assert classification_score("Entity", "Entity", classes) == 1.0
    assert classification_score("Description or Entity", "Entity", classes) == 0.5
    assert classification_score("Location", "Entity", classes) == 0.0
    assert classification_score("no idea", "Entity", classes) == 0.0
    # a class that is a proper substring of the gold is not held against it
    assert classification_score("abc", "abc", ["abc", "ab"]) == 1.0


def test_classification_score_keeps_the_official_remove_while_iterating_quirk():
    # matches [a, b, ab]; removing "a" makes the loop skip "b", which stays: 1/2
    assert classification_score("ab", "ab", ["a", "b", "ab"]) == 0.5


def test_count_and_retrieval_scores():
    assert count_score("There are 3 paragraphs, maybe 4", "3") == 0.5
    assert count_score("none", "3") == 0.0
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 2 or 12", "Paragraph 12") == 0.5


# ----------------------------------------------------------------------------- ICL


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("Output: ['(A)']", "(A)"),
        ("Output: [(A)]", "(A)"),
        ("Output: ['Yes']", "Yes"),
        ('Output: ["No"]', "No"),
        ("Output: ['(A)', '(B)']", "(A)"),
        ("Let me think.\nOutput: ['(B)']\nOutput: ['(C)']", "(B)"),
        ("Output: (C)", "(C)"),
        ("Output:\n['(E)']", "(E)"),
        ("  (D)  ", "(D)"),
        ("Output: ['the devil's sleep']", "the devil's sleep"),
    ],
)
def test_extract_icl_answer(prediction, expected):
    assert extract_icl_answer(prediction) == expected


def test_icl_em():
    assert icl_em("Output: ['(A)']", "(A)") == 1.0
    assert icl_em("Output: ['yes']", "Yes") == 1.0  # case-insensitive
    assert icl_em("Output: ['(A) 12/25/1937']", "(A)") == 0.0  # exact, not subspan
    assert icl_em("Output: ['(A)']", "(B)") == 0.0
    assert icl_em("Output: ['(A)']", ["(B)", "(A)"]) == 1.0


def test_icl_em_pced():
    # moved here from test_icl_em: pced's own variant, not LOFT's (LOFT scores it 0)
    assert icl_em_pced(" (B) ", "(B)") == 1.0  # no Output: -> whole stripped prediction
    assert icl_em_pced("Output: ['(A)']", "(A)") == 1.0
    assert icl_em_pced("Output: ['yes']", "Yes") == 1.0
    assert icl_em_pced("Output: ['(A) 12/25/1937']", "(A)") == 0.0
    assert icl_em_pced("Output: [(B)]", "(B)") == 1.0  # LOFT: not a literal -> 0
    assert icl_em_pced("output: ['(B)']", "(B)") == 0.0  # case-sensitive "Output:"
    assert icl_em_pced("Output: ['the']", "(A)") == 0.0  # no LOFT normalization
    assert score("icl_em_pced", "(B)", ["(B)"]) == 1.0


# (prediction, target, LOFT's em). Each value is what LOFT's own code gives: utils.py
# extract_prediction(prediction, answer_prefix="output"), then evaluation/icl.py IclEvaluation
# with the "icl" config (normalize_answers / normalize_answer) and gold target.split(" ").
LOFT_ICL_CASES = [
    # bare answers: no line with "[" and "]" -> no prediction -> 0
    ("(B)", "(B)", 0.0),
    (" (B) ", "(B)", 0.0),
    ("(C) 12/25/1937\n\n", "(C)", 0.0),
    ("Yes", "Yes", 0.0),
    # the paper's format
    ("Output: ['(B)']", "(B)", 1.0),
    ("Output: ['(B)']", "(C)", 0.0),
    ('Output: ["No"]', "No", 1.0),
    ("Output:['(G)']\r\n", "(G)", 1.0),
    ("\n\n  Output: [ '(D)' ]  \n", "(D)", 1.0),
    # the prefix is not looked at: any case, or none at all
    ("output: ['(b)']", "(B)", 1.0),
    ('OUTPUT: ["yes"]', "Yes", 1.0),
    ("output: ['yes']", "No", 0.0),
    ("['(F)']", "(F)", 1.0),
    ("Final answer: ['(E)']", "(E)", 1.0),
    # markdown "*" and "`" are deleted everywhere first
    ("**Output:** ['(C)']", "(C)", 1.0),
    ("**Output: ['(D)']**", "(D)", 1.0),
    ("`Output: ['(C)']`", "(C)", 1.0),
    ("Output: ```['No']```", "No", 1.0),
    ("Output: ['**(B)**']", "(B)", 1.0),
    # lines without brackets are skipped; the first line with both decides, even if it fails
    ("Let me think.\nThe answer is (B).\nOutput: ['(B)']", "(B)", 1.0),
    ("The answer is (B).\nOutput: (B)", "(B)", 0.0),
    ("See [note]\nOutput: ['(B)']", "(B)", 0.0),
    ("Output: [(B)]\nOutput: ['(B)']", "(B)", 0.0),
    ("Output: ['(B)'\nOutput: ['(C)']", "(C)", 1.0),  # first line lacks "]"
    # unparsable lists score 0
    ("Output: [(B)]", "(B)", 0.0),
    ("Output: [B]", "(B)", 0.0),
    ("Output: ['(B)'] or [C]", "(B)", 0.0),
    ("] then [", "(B)", 0.0),
    ("Output: ['Jones' dog']", "Jones' dog", 0.0),  # "s' " is not an in-word apostrophe
    # "[" to the LAST "]" of the line: "['(E)'] because ['(A)']" is no literal -> 0
    ("Output: ['(E)'] because ['(A)']", "(E)", 0.0),
    ("Output: ['(E)'] (not [A])", "(E)", 0.0),
    # an empty list is no prediction
    ("Output: []", "(A)", 0.0),
    # apostrophes inside items are escaped, then the item is normalized ("'" is punctuation)
    ("Output: ['devil's']", "devil's", 1.0),
    ('Output: ["it\'s"]', "it's", 1.0),
    ("Output: ['the devil's sleep', '(B)']", "(B)", 0.0),  # only the first item counts
    # gold = target.split(" "), each piece normalized: a multi-word target matches a piece only
    ("Output: ['the devil's sleep']", "the devil's sleep", 0.0),
    ("Output: ['sleep']", "the devil's sleep", 1.0),
    ("Output: ['yes']", "yes no", 1.0),
    # only the first item counts
    ("Output: ['(A)', '(B)']", "(B)", 0.0),
    ("Output: ['(B)', '(A)']", "(B)", 1.0),
    # LOFT normalization: case, punctuation, articles; "(A)" normalizes to ""
    ("Output: ['(a)']", "(A)", 1.0),
    ("Output: ['Yes.']", "Yes", 1.0),
    ("Output: ['the']", "(A)", 1.0),
    ("Output: ['']", "(A)", 1.0),
    ("Output: ['()']", "(A)", 1.0),
    ("Output: ['(A) 12/25/1937']", "(A)", 0.0),
]


@pytest.mark.parametrize(("prediction", "target", "expected"), LOFT_ICL_CASES)
def test_icl_em_is_loft(prediction, target, expected):
    assert icl_em(prediction, target) == expected
    assert score("icl_em", prediction, [target]) == expected


def test_extract_loft_prediction():
    assert extract_loft_prediction("(B)") == []
    assert extract_loft_prediction("**Output:** ['(C)']") == ["(C)"]
    assert extract_loft_prediction("output: ['the devil's sleep', '(B)']") == [
        "the devil's sleep", "(B)"]
    assert extract_loft_prediction("Output: [(B)]") == []
    assert extract_loft_prediction("Output: ['(E)'] because ['(A)']") == []
    assert extract_loft_prediction("Output: ['(E)'], ['(A)']") == [["(E)"], ["(A)"]]  # a tuple
    assert extract_loft_prediction("Output: ['', 'x']") == ["", "x"]


def test_icl_em_non_string_item_is_our_only_deviation_from_loft():
    # LOFT's icl config has no convert_to_str, so normalize_answer(12) raises TypeError there;
    # we compare str(item), as LOFT's rag configs do
    assert icl_em("Output: [12]", "12") == 1.0
    assert icl_em("Output: [['(B)']]", "(B)") == 1.0  # "['(B)']" normalizes to "b"
    assert icl_em("Output: ['(B)'], ['(C)']", "(B)") == 1.0  # a tuple of lists: same


def test_icl_lenient_forgives_only_the_missing_wrapper():
    assert icl_lenient("(C) 12/25/1937\n\n", "(C)") == 1.0  # the strict metric scores this 0
    assert icl_em("(C) 12/25/1937\n\n", "(C)") == 0.0
    assert icl_lenient("It is 12/25/1937, so (B).", "(B)") == 1.0
    assert icl_lenient("(A) or (B)", "(B)") == 0.0  # the first label is the answer
    assert icl_lenient("Yes, Gwenn tells the truth.", "Yes") == 1.0
    assert icl_lenient("No.", ["Yes"]) == 0.0
    assert icl_lenient("Output: ['(A)'] (B)", "(B)") == 0.0  # with Output: it is icl_em_pced
    assert icl_lenient("Output: [(B)]", "(B)") == 1.0  # icl_em_pced's parsing, not LOFT's
    assert icl_em("Output: [(B)]", "(B)") == 0.0
    assert icl_lenient("nothing useful", "(A)") == 0.0
    assert score("icl_lenient", "(D) 05/23/2021", ["(D)"]) == 1.0


def test_exemplar_format_round_trips_through_icl_em():
    exemplar = format_exemplar("Is the sky blue?\nOptions:\n(A) yes\n(B) no", "(A)")
    assert exemplar.endswith("Output: ['(A)']")
    assert icl_em(exemplar, "(A)") == 1.0


# ----------------------------------------------------------------------------- registry


def test_score_registry_best_over_answers_and_errors():
    assert score("subspan_em", "It is Nala.", ["Simba", "Nala"]) == 1.0
    assert score("qa_f1", "Eiffel Tower", ["Louvre", "The Eiffel Tower"]) == 1.0
    assert score("rouge", "a b c. d e", ["zzz", "a c e"]) == pytest.approx(0.75, abs=1e-7)
    assert score("hotpot_f1", "yes", ["no"]) == 0.0
    assert score("icl_em", "Output: ['No']", ["No"]) == 1.0
    assert score("classification", "Entity", ["Entity"], all_classes=["Entity", "Location"]) == 1
    with pytest.raises(ValueError, match="all_classes"):
        score("classification", "Entity", ["Entity"])
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "a", ["a"])


def test_score_first_line_rule():
    # LongBench scores only the first line for trec/triviaqa/samsum/lsht
    assert score("qa_f1", "Paris\nis the capital", ["Paris"], first_line=True) == 1.0
    assert score("qa_f1", "Paris\nis the capital", ["Paris"]) == pytest.approx(0.5)


def test_every_metric_stays_in_unit_interval_on_random_text():
    rng = random.Random(0)
    words = ["the", "a", "Paris", "yes", "no", "(A)", "Output:", "['x']", ".", "#", "\n", "é"]
    for name, fn in METRICS.items():
        for _ in range(50):
            prediction = " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
            answers = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))]
            value = fn(prediction, answers, all_classes=["Paris", "yes"])
            assert 0.0 <= value <= 1.0, (name, prediction, answers, value)
