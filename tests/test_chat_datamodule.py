"""Conversations through the DataModule (issue 20): every source, the token cache, pad / truncate / pack loaders,
truncation by whole turns, conversations with nothing to learn, and a real Trainer.

The loaders are checked against the pure core (``encode_conversation``, ``chat_truncation.truncate``) on the same
conversations: what a user's model sees is what the core says it should.
"""

import json

import datasets
import lightning as L
import numpy as np
import pytest
import torch

from lightning_seqmem.batch import IGNORE_INDEX
from lightning_seqmem.data.chat_corpus import load_builtin_chat_corpus
from lightning_seqmem.data.chat_template import BUILTIN_CHAT_TEMPLATE, ChatRenderer
from lightning_seqmem.data.chat_truncation import truncate
from lightning_seqmem.data.conversations import ConversationSettings, encode_conversation
from lightning_seqmem.datamodule.module import SeqMemDataModule
from lightning_seqmem.training.model import CausalLM


@pytest.fixture(scope="module")
def conversations():
    """40 conversations of the built-in chat corpus (2 to 12 turns, some with a system message, some long)."""
    return [row["messages"] for row in load_builtin_chat_corpus()["validation"][:40]]


def _dm(dataset, tok, tmp_path, **kwargs):
    kwargs = {"max_length": 512, "micro_batch_size": 4, "eval_batch_size": 4, "cache_dir": tmp_path / "cache", **kwargs}
    dm = SeqMemDataModule(dataset=dataset, tokenizer=tok, **kwargs)
    dm.setup("fit")
    return dm


def _both(convs):
    """Train and validation the same conversations (validation is served in order)."""
    ds = datasets.Dataset.from_dict({"messages": convs})
    return datasets.DatasetDict(train=ds, validation=ds)


def _expected(convs, tok, max_length, settings=ConversationSettings()):
    renderer = ChatRenderer(tok)
    return [truncate(encode_conversation(m, renderer, i, settings), max_length) for i, m in enumerate(convs)]


def _rows(batch):
    """Real tokens of each row of a padded batch: ``(input_ids, labels)`` numpy pairs."""
    mask = batch["attention_mask"].bool()
    return [(ids[m].numpy(), lab[m].numpy()) for ids, lab, m in zip(batch["input_ids"], batch["labels"], mask)]


def _segments(batch):
    """Documents of a packed batch, cut where ``position_ids`` restart: ``(input_ids, labels)`` pairs."""
    out = []
    for ids, lab, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        starts = torch.nonzero(pos == 0).flatten().tolist() + [len(pos)]
        out += [(ids[a:b].numpy(), lab[a:b].numpy()) for a, b in zip(starts, starts[1:])]
    return out


@pytest.mark.slow
def test_every_source_gives_the_same_rows(tmp_path, chat_tokenizer, conversations):
    """A Dataset, jsonl, parquet, a list of rows and a Python list of conversations: the same stats and tokens."""
    datasets.Dataset.from_dict({"messages": conversations}).to_parquet(str(tmp_path / "chat.parquet"))
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in conversations)
    sources = {
        "dataset": datasets.Dataset.from_dict({"messages": conversations}),
        "jsonl": str(tmp_path / "chat.jsonl"),
        "parquet": str(tmp_path / "chat.parquet"),
        "rows": [{"messages": m} for m in conversations],
        "list": conversations,
    }
    seen = {}
    for name, source in sources.items():
        dm = _dm(source, chat_tokenizer, tmp_path / name, strategy="pad")
        seen[name] = (dm.stats(), [tuple(ids) for batch in dm.val_dataloader() for ids, _ in _rows(batch)])
    first = seen["dataset"]
    assert first[0]["train"]["documents"] > 0 and first[0]["train"]["mask_method"] == "generation_markers"
    for name, value in seen.items():
        assert value == first, name


@pytest.mark.parametrize("strategy", ["pad", "truncate"])
def test_padded_rows_are_the_encoded_conversations(tmp_path, chat_tokenizer, conversations, strategy):
    """Each served row is its conversation cut by whole turns, labels on the assistant turns and their EOS."""
    max_length = 256
    dm = _dm(_both(conversations), chat_tokenizer, tmp_path, strategy=strategy, max_length=max_length)
    rows = [row for batch in dm.val_dataloader() for row in _rows(batch)]
    expected = _expected(conversations, chat_tokenizer, max_length)
    assert len(rows) == len(expected)
    for (ids, labels), enc in zip(rows, expected):
        assert len(ids) <= max_length
        np.testing.assert_array_equal(ids, enc.input_ids)
        np.testing.assert_array_equal(labels, enc.labels())
    stats = dm.stats()["validation"]
    assert stats["tokens_truncated"] == sum(enc.num_truncated for enc in expected) > 0
    assert stats["trained_tokens"] == sum(enc.num_trained for enc in expected)
    assert stats["tokens"] - stats["tokens_truncated"] == sum(len(enc.input_ids) for enc in expected)
    assert stats["trained_share"] == pytest.approx(stats["trained_tokens"] / sum(len(e.input_ids) for e in expected))


def test_packed_conversations_stay_whole_and_keep_their_masks(tmp_path, chat_tokenizer, conversations):
    """Packing puts whole conversations in rows (never split), each first token's label -100, positions restart."""
    max_length = 256
    dm = _dm(_both(conversations), chat_tokenizer, tmp_path, strategy="pack", max_length=max_length)
    assert dm.stats()["validation"]["documents_split"] == 0
    segments = [seg for batch in dm.val_dataloader() for seg in _segments(batch)]
    expected = {tuple(enc.input_ids.tolist()): enc for enc in _expected(conversations, chat_tokenizer, max_length)}
    real = [(ids, labels) for ids, labels in segments if not (ids == chat_tokenizer.pad_token_id).all()]
    assert sorted(tuple(ids.tolist()) for ids, _ in real) == sorted(expected)
    for ids, labels in real:
        want = expected[tuple(ids.tolist())].labels()
        want[0] = IGNORE_INDEX  # no conversation predicts another
        np.testing.assert_array_equal(labels, want)


def test_conversations_with_nothing_to_learn_are_dropped_kept_or_refused(tmp_path, chat_tokenizer, conversations):
    """No assistant turn under train_on='assistant': dropped and counted by default, 'keep' or 'error' on request."""
    convs = conversations[:10] + [[{"role": "user", "content": "Is anyone there?"}]]
    dm = _dm(_both(convs), chat_tokenizer, tmp_path, strategy="pack")
    stats = dm.stats()["validation"]
    assert stats["conversations_dropped_empty"] == 1
    assert stats["tokens_dropped"] == len(encode_conversation(convs[-1], ChatRenderer(chat_tokenizer), 0).input_ids)
    assert stats["rows"] > 0
    kept = _dm(_both(convs), chat_tokenizer, tmp_path, strategy="pad", on_empty_labels="keep").stats()["validation"]
    assert kept["conversations_dropped_empty"] == 0 and kept["tokens_dropped"] == 0
    with pytest.raises(ValueError, match="conversation 10"):
        _dm(_both(convs), chat_tokenizer, tmp_path, on_empty_labels="error")


def test_train_on_and_the_template_are_part_of_the_cache_key(tmp_path, chat_tokenizer, conversations):
    """Another train_on or template tokenizes again; on_empty_labels and max_length do not."""
    data = _both(conversations[:8])
    entries = lambda: len(list((tmp_path / "cache" / "tokenized").iterdir()))  # noqa: E731
    _dm(data, chat_tokenizer, tmp_path)
    n = entries()
    _dm(data, chat_tokenizer, tmp_path, max_length=128, on_empty_labels="keep")
    assert entries() == n
    last = _dm(data, chat_tokenizer, tmp_path, train_on="last_assistant")
    assert entries() == n + 1  # train and validation are the same data: one entry
    assert (
        last.stats()["validation"]["trained_tokens"]
        < _dm(data, chat_tokenizer, tmp_path).stats()["validation"]["trained_tokens"]
    )
    from lightning_seqmem.data.tokenizer import load_tokenizer

    other = load_tokenizer()
    other.chat_template = BUILTIN_CHAT_TEMPLATE.replace("'\n'", "':\n'")
    _dm(data, other, tmp_path)
    assert entries() == n + 2


def test_bad_conversations_and_tokenizers_are_refused_with_the_fix(tmp_path, chat_tokenizer, conversations):
    from lightning_seqmem.data.tokenizer import load_tokenizer

    plain = load_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"has no chat template.*tokenizer\.chat_template = "):
        _dm(conversations, plain, tmp_path)
    with pytest.raises(ValueError, match=r"'messages' column \(conversations\) and \['text'\]"):
        _dm(datasets.Dataset.from_dict({"messages": conversations[:2], "text": ["a", "b"]}), chat_tokenizer, tmp_path)
    bad = conversations[:3] + [[{"role": "user", "content": "hi"}, {"role": "gpt", "content": "hello"}]]
    with pytest.raises(ValueError, match="Conversation 3, turn 1 has role 'gpt'"):
        _dm(bad, chat_tokenizer, tmp_path)


def test_a_real_trainer_fits_on_packed_conversations(tmp_path, chat_tokenizer, conversations):
    """A tiny Llama from a config trains on packed conversations: finite loss, tokens counted by the model."""
    torch.manual_seed(0)
    dm = SeqMemDataModule(
        dataset=_both(conversations),
        tokenizer=chat_tokenizer,
        strategy="pack",
        max_length=256,
        micro_batch_size=2,
        cache_dir=tmp_path / "cache",
    )
    model = CausalLM(
        model_config=dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=2,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert 0 < dm.stats()["train"]["trained_share"] < 1


def test_wrapped_packing_is_refused_for_conversations(tmp_path, chat_tokenizer, conversations):
    from lightning_seqmem.batching.options import Pack

    with pytest.raises(ValueError, match=r"Pack\(method='wrapped'\) cuts rows .* Use Pack\(method='bfd'\)"):
        _dm(conversations, chat_tokenizer, tmp_path, batching=Pack(method="wrapped"))


def _compose(name, overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        return compose(name, overrides=overrides, return_hydra_config=name == "config")


# The two app tests below read the built-in conversations through the default token cache, as a user's runs do: its
# key leaves max_length out, so they share one entry with each other and with the suite's other runs of the built-in
# conversations (data=mix in docs/mixing.md, test_mix_sweep): the corpus is tokenized once, by whichever runs first.
@pytest.mark.slow  # the app end to end over the whole built-in chat corpus
def test_seqmem_train_data_chat_trains_on_the_builtin_conversations(tmp_path):
    """``seqmem-train data=chat``: the built-in tokenizer with its template, the built-in conversations, packed."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from lightning_seqmem.apps.train import train

    cfg = _compose(
        "config",
        [
            "data=chat",
            "data.max_length=64",
            "trainer.max_steps=3",
            "trainer.limit_val_batches=2",
            "trainer.val_check_interval=3",
            "+trainer.enable_progress_bar=false",
            "+trainer.enable_model_summary=false",
            "print_summary=false",
        ],
    )
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    summary = train(cfg)
    assert summary["optimizer_steps"] == 3 and np.isfinite(summary["final_val_loss"])
    assert summary["strategy"] == "pack_bfd" and summary["dataset_documents_split"] == 0


@pytest.mark.slow
def test_seqmem_plan_data_chat_reports_the_trained_share_the_datamodule_measures():
    from hydra.utils import instantiate

    from lightning_seqmem.apps.plan_app import plan_from_config
    from lightning_seqmem.apps.planner import format_plan

    overrides = ["data=chat", "data.max_length=256"]
    plan, _ = plan_from_config(_compose("plan", overrides + ["plan.memory=false", "plan.max_lengths=[128,256]"]))
    dm = instantiate(_compose("config", overrides).data)
    train = dm.stats()["train"]
    configured = plan.configured
    assert (configured.strategy, configured.max_length) == ("pack_bfd", 256)
    assert configured.token_efficiency == train["token_efficiency"]
    assert configured.trained_share == pytest.approx(train["trained_share"])
    assert configured.tokens_lost == train["tokens_truncated"] + train["tokens_dropped"]
    assert "pack_wrapped" not in {s.strategy for s in plan.strategies}  # conversations: packed whole
    assert any("efficiency" in line and "trained" in line for line in format_plan(plan).splitlines())


def _template_tokenizer(template):
    from lightning_seqmem.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = template
    return tok


NO_MARKERS = BUILTIN_CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


def test_a_template_without_markers_gives_the_same_rows_by_prefix_difference(tmp_path, chat_tokenizer, conversations):
    """The fallback (rendering growing prefixes) reaches the loaders with the same labels as the markers."""
    with pytest.warns(UserWarning, match="no {% generation %} markers"):
        fallback = _dm(
            _both(conversations[:12]), _template_tokenizer(NO_MARKERS + "{#- dm -#}"), tmp_path / "a", strategy="pad"
        )
    markers = _dm(_both(conversations[:12]), chat_tokenizer, tmp_path / "b", strategy="pad")
    assert fallback.stats()["validation"]["mask_method"] == "prefix_difference"
    rows = [
        [(ids.tolist(), labels.tolist()) for ids, labels in _rows(b)]
        for dm in (fallback, markers)
        for b in [next(iter(dm.val_dataloader()))]
    ]
    assert rows[0] == rows[1]


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_turn(tmp_path, conversations):
    """A template that drops past reasoning blocks renders an earlier turn differently once later turns follow:
    its prefix-difference mask would be wrong, so the DataModule refuses it."""
    drops_reasoning = NO_MARKERS.replace(
        "message['content'] + eos_token -}}{%- else -%}",
        "(message['content'] if loop.last else message['content'].split('</think>')[-1]) + eos_token -}}{%- else -%}",
        1,
    )
    assert drops_reasoning != NO_MARKERS
    convs = conversations[:3] + [
        [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "<think>hm</think>Because."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes."},
        ]
    ]
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"Conversation 3, turn 1 \(assistant\)"):
        _dm(convs, _template_tokenizer(drops_reasoning), tmp_path)


def test_streamed_conversations_are_packed_whole_with_their_masks(chat_tokenizer, conversations):
    """A ``datasets.IterableDataset`` of conversations: rendered, cut by whole turns and packed on the fly, the
    same segments and labels as the map-style path; one with nothing to learn is skipped (or refused)."""
    max_length = 256
    convs = conversations + [[{"role": "user", "content": "Is anyone there?"}]]  # nothing to learn: skipped
    stream = datasets.IterableDataset.from_generator(lambda: ({"messages": m} for m in convs))
    dm = SeqMemDataModule(
        dataset=stream,
        tokenizer=chat_tokenizer,
        strategy="pack",
        max_length=max_length,
        micro_batch_size=4,
        streaming_buffer_size=8,
        streaming_validation_documents=0,
    )
    dm.setup("fit")
    segments = [seg for batch in dm.train_dataloader() for seg in _segments(batch)]
    expected = {tuple(enc.input_ids.tolist()): enc for enc in _expected(conversations, chat_tokenizer, max_length)}
    real = [(ids, labels) for ids, labels in segments if not (ids == chat_tokenizer.pad_token_id).all()]
    assert sorted(tuple(ids.tolist()) for ids, _ in real) == sorted(expected)  # each whole, none lost, none added
    for ids, labels in real:
        want = expected[tuple(ids.tolist())].labels()
        want[0] = IGNORE_INDEX
        np.testing.assert_array_equal(labels, want)
    refusing = SeqMemDataModule(
        dataset=stream,
        tokenizer=chat_tokenizer,
        strategy="pack",
        max_length=max_length,
        on_empty_labels="error",
        streaming_validation_documents=0,
    )
    refusing.setup("fit")
    with pytest.raises(ValueError, match=rf"no trained token \(first: conversation {len(convs) - 1}\)"):
        list(refusing.train_dataloader())


def test_streams_of_other_kinds_are_refused_with_the_fix():
    pairs = datasets.IterableDataset.from_generator(
        lambda: ({"prompt": "q", "chosen": "a", "rejected": "b"} for _ in range(4))
    )
    with pytest.raises(
        ValueError,
        match=r"stream of preference \(columns \['chosen', 'prompt', 'rejected'\]\).*"
        r"without streaming=True",
    ):
        SeqMemDataModule(dataset=pairs, strategy="pack").setup("fit")
