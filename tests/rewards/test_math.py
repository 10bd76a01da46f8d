"""Answer extraction, normalisation and matching on tricky strings; the format reward."""
from fractions import Fraction

import pytest

from megalign.rewards import answers_match, extract_answer, format_reward, math_accuracy, normalize_answer, parse_number


@pytest.mark.parametrize(
    "response, expected",
    [
        (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"first \boxed{3}, finally \boxed{4}", "4"),  # the last box wins
        (r"\boxed{\sqrt{\frac{a}{b}}} and \boxed{x", r"\sqrt{\frac{a}{b}}"),  # an unbalanced last box is skipped
        (r"\fbox{7}", "7"),
        ("<answer>1</answer> no wait <answer>2</answer>", "2"),  # the last tag wins
        (r"<answer>The answer is \boxed{12}</answer>", "12"),  # a box inside the tag is unwrapped
        (r"\boxed{9} <answer>8</answer>", "8"),  # tags win over boxes outside them
        ("<answer>\n 42 \n</answer>", "\n 42 \n"),
        ("<answer>5", None),  # unclosed tag
        (r"\boxed{5", None),  # unbalanced box
        ("the answer is 5", None),
        ("</answer>5<answer>", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        (" $5$ ", "5"),
        ("5.", "5"),
        ("1,000", "1000"),
        ("-12,345.5", "-12345.5"),
        ("1,2", "1,2"),  # not a thousands grouping: a list stays a list
        (r"\text{ 3 apples}", "3apples"),
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        ("50\\%", "50"),
        ("+7", "7"),
        ("New York.", "NewYork"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    "text, value",
    [("-3", Fraction(-3)), ("2.50", Fraction(5, 2)), ("1e3", Fraction(1000)), ("3/4", Fraction(3, 4)),
     (r"-\frac{1}{2}", Fraction(-1, 2)), (r"\frac{-3}{6}", Fraction(-1, 2)), (".5", Fraction(1, 2)),
     ("1/0", None), ("x", None), ("1,2", None), ("", None)],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "pred, gold, match",
    [
        (r"\frac{1}{2}", "0.5", True),
        ("1/2", r"\frac{1}{2}", True),
        ("1,000", 1000, True),
        ("$5$", "5", True),
        ("5.", 5, True),
        ("5.0", "5", True),
        ("-3", -3, True),
        ("-3", 3, False),
        ("+3", 3, True),
        ("0.333", r"\frac{1}{3}", False),  # beyond the tolerance
        ("0.3333333", r"\frac{1}{3}", True),  # |diff| = 3.3e-8 <= 1e-6
        ("1000001", 1000000, True),  # relative tolerance: 1 <= 1e-6 * 1e6
        ("1000002", 1000000, False),
        ("50%", "50", True),
        ("NewYork", "New York", True),
        ("new york", "New York", False),
        ("", "", False),  # an empty answer never matches
        (None, 5, False),
        ("5", r"the answer is \boxed{5}", True),  # a boxed gold is unwrapped
    ],
)
def test_answers_match(pred, gold, match):
    assert answers_match(pred, gold) is match


def test_math_accuracy_on_whole_responses():
    assert math_accuracy(r"<think>2+2=4</think><answer>4</answer>", 4) == 1.0
    assert math_accuracy(r"... so the total is \boxed{1,024}.", "1024") == 1.0
    assert math_accuracy("I think it is 4", 4) == 0.0  # no extractable answer
    assert math_accuracy("<answer>4<answer>", 4) == 0.0  # malformed tags
    assert math_accuracy("<answer>5</answer>", 4) == 0.0


@pytest.mark.parametrize(
    "response, reward",
    [
        ("<think>2+2</think><answer>4</answer>", 1.0),
        ("  <think>\nsteps\n</think>\n<answer> 4 </answer>\n", 1.0),
        ("<think></think><answer>4</answer>", 1.0),  # an empty think part is allowed
        ("<answer>4</answer>", 0.0),  # no think part
        ("<think>a</think>", 0.0),  # no answer part
        ("<think>a</think><answer>  </answer>", 0.0),  # blank answer
        ("so <think>a</think><answer>4</answer>", 0.0),  # text before
        ("<think>a</think><answer>4</answer> done", 0.0),  # text after
        ("<think>a</think>x<answer>4</answer>", 0.0),  # text between
        ("<answer>4</answer><think>a</think>", 0.0),  # wrong order
        ("<think>a<think>b</think><answer>4</answer>", 0.0),  # nested think
        ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0),  # two answers
        ("<think>a</think><answer>4", 0.0),  # unclosed
    ],
)
def test_format_reward(response, reward):
    assert format_reward(response) == reward
