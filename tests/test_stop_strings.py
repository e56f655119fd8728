"""Stop strings cut the stream exactly, even when split across tokens."""

import pytest

from mlxvlm.generate import StopStrings


def feed(stops, segments):
    matcher = StopStrings(stops)
    emitted = []
    for segment in segments:
        text, hit = matcher.push(segment)
        emitted.append(text)
        if hit:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


@pytest.mark.parametrize(
    "segments",
    [["Hello", " wor", "ld", "END", "more"], ["Hello world", "E", "N", "Dmore"], ["Hello worldEND"]],
)
def test_stop_string_split_across_segments(segments):
    assert feed(["END"], segments) == ("Hello world", True)


def test_partial_match_is_released_when_it_does_not_complete():
    text, hit = feed(["END"], ["abc E", "N", "x"])
    assert (text, hit) == ("abc ENx", False)


def test_held_text_is_not_emitted_early():
    matcher = StopStrings(["</s>"])
    assert matcher.push("hi <") == ("hi ", False)
    assert matcher.push("/") == ("", False)
    assert matcher.push("p>") == ("</p>", False)


def test_earliest_of_several_stops_wins():
    assert feed(["zz", "b"], ["a", "bzz"]) == ("a", True)


def test_no_stops_passes_everything():
    assert feed([], ["a", "b"]) == ("ab", False)
