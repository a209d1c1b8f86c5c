import pytest

from lightning_seqmem.data.tokenizer import load_tokenizer


def test_default_tokenizer_round_trips_and_has_special_tokens(tokenizer):
    text = 'def parse(text):\n    """Return the tokens — ünïcödé too."""\n    return text.split()  # 42\n'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # the BPE actually learned merges
    specials = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert len(specials) == 3 and None not in specials


def test_default_tokenizer_is_cached_and_deterministic(tokenizer):
    again = load_tokenizer("builtin")
    assert again.get_vocab() == tokenizer.get_vocab()


def test_tokenizer_without_pad_token_gets_eos_with_a_warning(tokenizer, tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="</s>")
    assert tok.pad_token_id is None
    with pytest.warns(UserWarning, match=r"Tokenizer \w+ \(built in memory, 4,096 tokens\) has no pad"):
        fixed = load_tokenizer(tok)
    assert fixed.pad_token_id == fixed.eos_token_id
    tokenizer.save_pretrained(tmp_path / "no_pad")
    saved = PreTrainedTokenizerFast.from_pretrained(tmp_path / "no_pad", pad_token=None)
    saved.pad_token = None
    with pytest.warns(UserWarning, match=rf"Tokenizer '{tmp_path / 'no_pad'}' has no pad token"):
        load_tokenizer(saved)


def test_local_tokenizer_directory_loads(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]


def test_unloadable_tokenizer_name_is_a_clear_error():
    with pytest.raises(
        ValueError, match="(?s)Could not load tokenizer 'no-such-org/no-such-tokenizer'.*local directory"
    ):
        load_tokenizer("no-such-org/no-such-tokenizer")


def test_wrong_tokenizer_type():
    with pytest.raises(TypeError, match="tokenizer must be"):
        load_tokenizer(42)
