"""The emulator's generated text: token i is OUTPUT_WORDS[i % 10], for any slice of a stream."""

from __future__ import annotations

from worker.emulator.generation import OUTPUT_WORDS, output_text


def test_every_slice_is_the_words_of_its_tokens() -> None:
    for start in range(0, 43):
        for count in range(0, 57):
            expected = "".join(OUTPUT_WORDS[i % 10] for i in range(start, start + count))
            assert output_text(start, count) == expected, (start, count)


def test_a_stream_written_in_pieces_reads_as_one() -> None:
    pieces = [(0, 3), (3, 1), (4, 17), (21, 500)]
    assert "".join(output_text(s, c) for s, c in pieces) == output_text(0, 521)
