"""Line-retrieval prompts and scoring (kvarn.eval.lines)."""

from __future__ import annotations

import re

from kvarn.eval.lines import ALPHABET, make_query, score


def test_queries_are_deterministic_and_well_formed(seed):
    text, code = make_query(12, seed, 3)
    assert (text, code) == make_query(12, seed, 3)
    assert make_query(12, seed, 4) != (text, code)
    lines = re.findall(r"^line (\d+): REGISTER_CONTENT is <([A-Z0-9]+)>$", text, flags=re.M)
    assert [int(i) for i, _ in lines] == list(range(1, 13))
    assert all(len(c) == 10 and set(c) <= set(ALPHABET) for _, c in lines)
    asked = int(re.search(r"in line (\d+)\?", text).group(1))
    assert lines[asked - 1][1] == code


def test_score_takes_the_last_ten_character_token():
    assert score("The REGISTER_CONTENT in line 3 is <AB12CD34EF>.", "AB12CD34EF")
    assert score("AB12CD34EF? no wait: ZZ12CD34EF", "ZZ12CD34EF")
    assert not score("AB12CD34EF? no wait: ZZ12CD34EF", "AB12CD34EF")
    assert not score("AB12CD34EFG", "AB12CD34EF")  # 11 characters: not a 10-character token
    assert not score("line 12", "AB12CD34EF")
    assert not score("ab12cd34ef", "AB12CD34EF")  # exact match, case included
