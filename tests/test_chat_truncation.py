"""Truncation that respects turns: whole oldest turns first, system kept, the last trained turn keeps its start."""

import numpy as np
import pytest

from lightning_seqmem.data.chat_truncation import truncate, truncate_turns
from lightning_seqmem.data.conversations import EncodedConversation

# system [0, 4), user [4, 8), assistant [8, 14) trained, user [14, 18), assistant [18, 26) trained, user [26, 30)
TURN_ENDS = np.array([4, 8, 14, 18, 26, 30])
SPANS = np.array([[10, 14], [20, 26]])


@pytest.mark.parametrize(
    ("max_length", "ranges", "dropped"),
    [
        (None, [[0, 30]], 0),
        (30, [[0, 30]], 0),
        (29, [[0, 26]], 4),  # the trailing user turn carries no loss: it goes first
        (26, [[0, 26]], 4),
        (25, [[0, 4], [8, 26]], 8),  # then the oldest turn after the system message
        (16, [[0, 4], [14, 26]], 14),
        (12, [[0, 4], [18, 26]], 18),  # the last trained turn alone, whole
        (10, [[0, 4], [18, 24]], 20),  # ... or its start
        (4, [[0, 4]], 26),  # the system message fills the limit: nothing trained is left (flagged by the caller)
    ],
)
def test_truncate_turns(max_length, ranges, dropped):
    kept, lost = truncate_turns(TURN_ENDS, SPANS, 1, max_length)
    assert kept.tolist() == ranges and lost == dropped
    assert int((kept[:, 1] - kept[:, 0]).sum()) + lost == 30  # every token counted
    assert max_length is None or int((kept[:, 1] - kept[:, 0]).sum()) <= max_length


def test_without_system_message_the_oldest_turn_goes_first():
    kept, lost = truncate_turns(TURN_ENDS, SPANS, 0, 16)
    assert kept.tolist() == [[14, 26]] and lost == 18


def test_nothing_trained_keeps_the_start():
    kept, lost = truncate_turns(TURN_ENDS, np.zeros((0, 2), dtype=np.int32), 1, 10)
    assert kept.tolist() == [[0, 10]] and lost == 20


def test_truncate_moves_labels_and_turns_with_the_tokens():
    ids = np.arange(100, 130, dtype=np.int32)
    enc = EncodedConversation(ids, SPANS.astype(np.int32), TURN_ENDS.astype(np.int32), keep_turns=1)
    for max_length in (30, 25, 16, 10, 4):
        cut = truncate(enc, max_length)
        kept, lost = truncate_turns(enc.turn_ends, enc.label_spans, 1, max_length)
        expected = np.concatenate([ids[s:e] for s, e in kept])
        assert cut.input_ids.tolist() == expected.tolist()
        # A token is trained after the cut exactly when it was before.
        before = np.concatenate([enc.trained_mask()[s:e] for s, e in kept])
        assert cut.trained_mask().tolist() == before.tolist()
        assert cut.num_truncated == lost and cut.turn_ends[-1] == len(cut.input_ids)
        assert np.all(np.diff(cut.turn_ends) > 0) and cut.keep_turns == 1
    assert truncate(enc, 4).num_trained == 0
