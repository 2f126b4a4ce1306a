from worker.engine.stop import StopStringMatcher, TextOutput


def stream(matcher: StopStringMatcher, deltas: list[str], can_stop: bool = True) -> tuple[list[str], bool]:
    emitted = []
    for d in deltas:
        text, stopped = matcher.push(d, can_stop)
        emitted.append(text)
        if stopped:
            return emitted, True
    return emitted, False


def test_stop_string_split_across_deltas_is_cut_and_never_emitted():
    emitted, stopped = stream(StopStringMatcher(["</end>"]), ["Hello </", "en", "d> more"])
    assert stopped
    assert emitted == ["Hello ", "", ""]


def test_held_text_is_released_once_it_cannot_start_a_stop_string():
    m = StopStringMatcher(["STOP"])
    assert m.push("abcST", True) == ("abc", False)
    assert m.push("AR", True) == ("STAR", False)
    assert m.flush() == ""


def test_the_earliest_of_several_stop_strings_wins():
    emitted, stopped = stream(StopStringMatcher(["world", "lo w"]), ["hel", "lo world"])
    assert stopped and "".join(emitted) == "hel"


def test_stop_strings_do_not_end_text_before_min_tokens_but_partial_matches_wait():
    m = StopStringMatcher(["ab"])
    assert m.push("xab", False) == ("xab", False)  # complete before min_tokens: ignored, emitted
    assert m.push("ya", False) == ("y", False)  # "a" may start "ab": held
    assert m.push("b!", True) == ("", True)  # completes once stopping is allowed


def test_flush_releases_held_text():
    m = StopStringMatcher(["xyz"])
    assert m.push("abx", True) == ("ab", False)
    assert m.flush() == "x"


class FakeDetokenizer:
    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces

    def push(self, ids):
        return "".join(self.pieces[i] for i in ids)

    def flush(self):
        return ""


def test_text_output_accumulates_exactly_what_was_emitted():
    out = TextOutput(FakeDetokenizer({1: "a", 2: "-", 3: "-b", 4: "c"}), ["--"])
    deltas = [out.push(t, True) for t in (1, 2, 4)]
    assert deltas == [("a", False), ("", False), ("-c", False)]
    assert out.push(2, True) == ("", False)
    assert out.finish() == "-"
    assert out.text == "a-c-"
