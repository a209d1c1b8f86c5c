"""Issue 30, first contact with preference pairs and DPO as a user meets them (the built-in tokenizer, tiny
models): an outlier pair whose prompt alone is longer than ``max_length`` is dropped and counted, not a refusal
of the whole dataset."""

import warnings

import datasets
import pytest

from lightning_seqmem import SeqMemDataModule
from lightning_seqmem.batching.preference import PreferenceLimits, preference_spans


def pair_rows(n=30, long_prompt_at=(12,)):
    rows = [
        {
            "prompt": f"Question {i}: how do I sort a list?",
            "chosen": "Call sorted(items)." + " It is stable." * (i % 3),
            "rejected": "You cannot." + " Sorry." * (i % 2),
        }
        for i in range(n)
    ]
    for i in long_prompt_at:
        rows[i]["prompt"] = "A very long question about sorting lists. " * 40
    return rows


def test_a_pair_with_an_overlong_prompt_is_dropped_counted_and_warned_once(tmp_path):
    rows = pair_rows()
    data = datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[6:]), validation=datasets.Dataset.from_list(rows[:6])
    )
    dm = SeqMemDataModule(data, max_length=32, micro_batch_size=4, cache_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    overlong = [w for w in caught if "prompt alone longer than max_length=32" in str(w.message)]
    assert len(overlong) == 1 and "row 6" in str(overlong[0].message)  # train row 6 is dataset row 12
    stats = dm.stats()["train"]
    assert stats["pairs_dropped_overlong_prompt"] == 1 and stats["documents"] == 24
    assert stats["rows_without_completion"] == 0  # counted once, under its own key
    assert stats["tokens_truncated"] + stats["tokens_dropped"] > 0
    assert dm.stats()["validation"]["pairs_dropped_overlong_prompt"] == 0


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_overlong_prompts_drop_under_both_modes_or_are_refused_on_request(mode):
    lengths = [[2, 40, 3], [3, 4, 5], [4, 5, 2]]  # prompt, chosen, rejected (chosen 40: a cut, not an overlong)
    p, c, r = (list(x) for x in zip(*lengths))
    p[1] = 50
    spans = preference_spans(p, c, r, PreferenceLimits(16, truncation_mode=mode))
    assert spans.lost.tolist() == [False, True, False] and spans.dropped()["pairs_dropped_overlong_prompt"] == 1
    assert spans.dropped()["rows_without_completion"] == 0
    with pytest.raises(ValueError, match=r'row 1: the prompt alone is longer than max_length=16.*"drop"'):
        preference_spans(p, c, r, PreferenceLimits(16, truncation_mode=mode, on_overlong_prompt="error"))
    with pytest.raises(ValueError, match="on_overlong_prompt='skip' is not valid"):
        PreferenceLimits(16, on_overlong_prompt="skip")


# ------------------------------------------------------------------------------- DPO, numbers and vocabularies
TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
)


def quiet_trainer(**kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
        limit_val_batches=0,
        **kwargs,
    )


def text_module(tmp_path):
    texts = [f"Document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 5) for i in range(30)]
    return SeqMemDataModule(
        datasets.Dataset.from_dict({"text": texts}), max_length=32, micro_batch_size=4, cache_dir=tmp_path
    )


def test_dpo_on_plain_text_is_refused_at_setup_naming_the_data(tmp_path):
    from lightning_seqmem import DPO

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"DPO needs preference pairs .* holds text data \(Dataset\)"):
            quiet_trainer().fit(DPO(model_config=TINY), datamodule=text_module(tmp_path))
    from lightning_seqmem.training.checks import check_pair_batch

    with pytest.raises(ValueError, match=r"DPO needs pair batches .*'completion_mask'.*\['input_ids', 'labels'\]"):
        check_pair_batch({"input_ids": None, "labels": None})  # a user's own loader


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 0.0])
def test_non_finite_learning_rate_and_beta_are_refused(value):
    from lightning_seqmem import DPO, CausalLM

    with pytest.raises(ValueError, match=r"learning_rate=.* must be a finite number > 0 .*use e.g. 1e-4"):
        CausalLM(model_config=TINY, learning_rate=value)
    with pytest.raises(ValueError, match=r"beta=.* must be a finite number > 0 .*use e.g. 0.1"):
        DPO(model_config=TINY, beta=value)


def test_a_nan_reference_logp_is_refused_naming_row_and_column(tmp_path):
    rows = [
        {
            "prompt_ids": [5 + i % 7, 6],
            "chosen_ids": [7, 8 + i % 5],
            "rejected_ids": [9 + i % 3],
            "ref_chosen_logps": -3.0 - i % 4,
            "ref_rejected_logps": -2.5,
        }
        for i in range(24)
    ]
    rows[5]["ref_rejected_logps"] = float("nan")
    dm = SeqMemDataModule(
        datasets.Dataset.from_list(rows), max_length=16, micro_batch_size=4, pad_token_id=0, cache_dir=tmp_path
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"row \d+: column 'ref_rejected_logps' is nan .*reference='copy'"):
            dm.setup("fit")


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused_at_setup(tmp_path):
    from lightning_seqmem import CausalLM

    dm = text_module(tmp_path)
    size = len(dm.tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=rf"vocabulary has 64 tokens .* tokenizer has {size} .*vocab_size={size}"):
            quiet_trainer().fit(CausalLM(model_config=TINY, vocab_size=64), datamodule=dm)


def _pairs_with_reference(chosen_logps):
    return [
        {
            "prompt_ids": [5 + i % 7, 6],
            "chosen_ids": [7, 8 + i % 5],
            "rejected_ids": [9 + i % 3],
            "ref_chosen_logps": chosen_logps(i),
            "ref_rejected_logps": -2.5,
        }
        for i in range(24)
    ]


@pytest.mark.parametrize(
    "chosen_logps,found",
    [
        (lambda i: [-1.0, -0.5], "holds a list of 2 numbers"),  # per-token, one length: would pass as a 2-D array
        (lambda i: [-1.0] * (2 + i % 3), "holds a list of 2 numbers"),  # per-token, ragged
        (lambda i: str(-1.0 - i), r"is '-\d+.0' \(string\)"),  # train row 0 is some dataset row
    ],
)
def test_reference_logps_that_are_not_one_number_per_sequence_are_refused_by_column_and_row(
    tmp_path, chosen_logps, found
):
    data = datasets.Dataset.from_list(_pairs_with_reference(chosen_logps))
    dm = SeqMemDataModule(data, max_length=16, micro_batch_size=4, pad_token_id=0, cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=rf"split 'train': row 0: column 'ref_chosen_logps' {found}.*one number"):
            dm.setup("fit")


def test_the_pair_collator_refuses_per_token_reference_logps_by_example():
    from lightning_seqmem.batching.pair_collate import ref_logps

    examples = _pairs_with_reference(lambda i: -1.0)
    assert ref_logps(examples)["ref_chosen_logps"].shape == (24,)
    examples[3]["ref_chosen_logps"] = [-1.0, -0.5]
    with pytest.raises(ValueError, match=r"example 3: 'ref_chosen_logps' is \[-1.0, -0.5\]; .*not one per token"):
        ref_logps(examples)


@pytest.mark.parametrize("container", ["list", "DataFrame"])
def test_pairs_that_mix_text_and_turns_are_refused_by_row_and_column(tmp_path, container):
    rows = pair_rows(12, long_prompt_at=())
    rows.insert(7, {"prompt": [{"role": "user", "content": "Hi?"}], "chosen": "Hello.", "rejected": "Go."})
    data = rows if container == "list" else pytest.importorskip("pandas").DataFrame(rows)
    with pytest.raises(ValueError, match=r"row 7, column 'prompt' holds turns .* where row 0 holds text"):
        SeqMemDataModule(data, max_length=32, micro_batch_size=4, cache_dir=tmp_path).setup("fit")


def test_reference_logps_stay_with_their_pair_in_a_selected_dataset(tmp_path):
    """A dataset that is a selection of another (``select``, a shuffle): each pair keeps its own reference values."""
    rows = _pairs_with_reference(lambda i: 0.0)
    for i, row in enumerate(rows):
        row["chosen_ids"] = [40 + i, 8]
        row["ref_chosen_logps"] = -float(40 + i)  # names the pair by its first chosen token
    data = datasets.Dataset.from_list(rows).select(list(range(23, -1, -1)))  # an indices mapping over the table
    dm = SeqMemDataModule(data, max_length=16, micro_batch_size=4, pad_token_id=0, strategy="pad", cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup("fit")
    checked = 0
    for batch in dm.train_dataloader():
        pairs = batch["ref_chosen_logps"].shape[0]
        for row in range(pairs):  # chosen rows first: the first completion token is the pair's 40 + i
            first = batch["input_ids"][row][batch["completion_mask"][row].bool()][0]
            assert batch["ref_chosen_logps"][row].item() == -float(first)
            checked += 1
    assert checked == dm.stats()["train"]["documents"]
