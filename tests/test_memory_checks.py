"""ConfigChecks: each check fires on its case and stays quiet otherwise; resolve_precision."""

import re
import types

import pytest
import torch
from _memory_helpers import TinyData, TinyLM, trainer

from lightning_seqmem.batching.options import Pad
from lightning_seqmem.memory import checks
from lightning_seqmem.memory.checks import CHECKS, ConfigChecks, RunFacts, find_problems, resolve_precision
from lightning_seqmem.memory.loss_watch import LossWatch

SAFE = frozenset({"flash_attention_2", "eager", "sdpa"})


class PackedTinyData(TinyData):
    """TinyData that says it packs (``protocols.DescribesBatching``), as ``SeqMemDataModule(strategy="pack")`` does."""

    def batching_label(self) -> str:
        return "pack_bfd"

    def constant_shapes(self) -> bool:
        return True

    def packs_documents(self) -> bool:
        return True


# One case per check: the facts that trigger it (on top of a quiet baseline).
CASES = {
    "eval_batch_size": dict(micro_batch_size=8, eval_batch_size=32),
    "batch_size": dict(batch_size=64, micro_batch_size=8, accumulate_grad_batches=2),
    "fp16_packing": dict(precision="16-true", packing=True, attn_implementation="sdpa", adapter=True),
    "fp16_full_finetuning": dict(precision="16-true"),
    "fp8_compile": dict(precision="transformer-engine"),
    "packing_attention": dict(packing=True, attn_implementation="my_custom_attention"),
    "flash_varlen": dict(packing=True, attn_implementation="flash_attention_2"),
    "dynamic_shapes": dict(on_cuda=True, dynamic_shapes=True),
    "stream_validation": dict(streaming=True, world_size=2, val_check_interval=1.0),
}
QUIET = RunFacts(micro_batch_size=8, eval_batch_size=8, attn_implementation="sdpa")


def test_baseline_is_quiet():
    assert find_problems(QUIET, SAFE) == {}


@pytest.mark.parametrize("name", CHECKS)
def test_each_check_fires_on_its_case_only(name):
    facts = RunFacts(**{**vars(QUIET), **CASES[name]})
    assert list(find_problems(facts, SAFE)) == [name]


@pytest.mark.parametrize(
    "fix",
    [
        dict(micro_batch_size=8, eval_batch_size=8),  # eval_batch_size
        dict(batch_size=32, micro_batch_size=8, accumulate_grad_batches=2, world_size=2),  # batch_size consistent
        dict(precision="bf16-mixed", packing=True, attn_implementation="sdpa"),  # fp16_packing: mixed precision
        dict(
            precision="16-true",
            packing=True,
            attn_implementation="flash_attention_2",
            flash_varlen=True,
            adapter=True,  # flash
        ),
        dict(precision="16-true", adapter=True),  # fp16_full_finetuning: an adapter trains, the base is frozen
        dict(packing=True, attn_implementation="kernels-community/flash-attn2", flash_varlen=True),  # varlen passed
        dict(packing=True, attn_implementation="flash_attention_2", micro_batch_size=1, eval_batch_size=1),  # 1 row
        dict(precision="transformer-engine", compiled=True),  # fp8 with compile
        dict(packing=True, attn_implementation="eager"),  # eager keeps documents apart in current transformers
        dict(on_cuda=True, dynamic_shapes=True, preallocating=True),
        dict(on_cuda=True, dynamic_shapes=True, expandable_segments=True),
        dict(on_cuda=False, dynamic_shapes=True),
        dict(streaming=True, world_size=2, val_check_interval=500),  # validation every 500 steps
        dict(streaming=True, world_size=1, val_check_interval=1.0),  # one process: the stream ends, so does the epoch
        dict(streaming=True, world_size=2, val_check_interval=1.0, validating=False),
    ],
)
def test_quiet_when_fixed(fix):
    assert find_problems(RunFacts(**{**vars(QUIET), **fix}), SAFE) == {}


def test_auto_and_torch_varlen_keep_packed_documents_apart():
    # ConfigChecks runs before CausalLM resolves "auto" (torch_varlen or sdpa): neither name is a packing problem
    facts = RunFacts(**{**vars(QUIET), "packing": True})
    for name in ("auto", "torch_varlen"):
        assert "packing_attention" not in find_problems(RunFacts(**{**vars(facts), "attn_implementation": name}))


def test_batch_size_without_micro_batch_size_under_accumulation():
    problems = find_problems(RunFacts(batch_size=64, accumulate_grad_batches=4), SAFE)
    assert list(problems) == ["batch_size"] and "effective batch is 256" in problems["batch_size"]


def test_flash_varlen_reads_the_module_and_says_the_fix(tmp_path):
    problems = find_problems(
        RunFacts(
            packing=True,
            attn_implementation="flash_attention_3",
            micro_batch_size=1,
            eval_batch_size=1,
            dynamic_shapes=True,
        ),
        SAFE,
    )  # warmup may reshape rows
    assert list(problems) == ["flash_varlen"]
    assert "flash_varlen_kwargs(batch['position_ids'])" in problems["flash_varlen"]
    model, dm = TinyLM(), PackedTinyData()
    model.model.config._attn_implementation = "flash_attention_2"
    t = trainer(tmp_path, [], max_steps=1)
    t.strategy.connect(model)
    t.datamodule = dm
    assert not checks.gather_facts(t, model).flash_varlen
    model.passes_flash_varlen_kwargs = True  # what CausalLM declares
    assert checks.gather_facts(t, model).flash_varlen


def test_installed_transformers_keeps_packed_documents_apart_in_sdpa():
    assert {"eager", "sdpa", "flash_attention_2"} <= checks.packed_safe_attention()


def test_callback_reads_a_real_run_and_warns_once(tmp_path):
    cb = ConfigChecks()
    with pytest.warns(UserWarning, match=r"ConfigChecks \[eval_batch_size\]") as record:
        t = trainer(tmp_path, [cb], max_steps=1)
        t.fit(TinyLM(), datamodule=TinyData(rows=2, eval_rows=4))
        cb.setup(t, t.lightning_module, "fit")  # a second setup does not warn again
    assert list(cb.problems) == ["eval_batch_size"]
    assert sum("ConfigChecks" in str(w.message) for w in record) == 1


def test_callback_gathers_facts_defensively(tmp_path):
    model = TinyLM()
    model.model.config._attn_implementation = "my_custom_attention"
    dm = PackedTinyData()
    t = trainer(tmp_path, [], max_steps=1)
    t.strategy.connect(model)
    t.datamodule = dm  # what fit() does
    facts = checks.gather_facts(t, model)
    assert facts.packing and facts.attn_implementation == "my_custom_attention" and not facts.on_cuda
    assert facts.micro_batch_size == 2 and facts.precision == "32-true" and not facts.compiled
    bare = types.SimpleNamespace(
        datamodule=None, callbacks=[], strategy=t.strategy, precision="32-true", accumulate_grad_batches=1, world_size=1
    )
    assert checks.gather_facts(bare, torch.nn.Linear(2, 2)) == RunFacts()  # any model, no DataModule: all unknown


def test_skip_is_checked():
    with pytest.raises(ValueError, match="Unknown checks"):
        ConfigChecks(skip=("nope",))


def test_resolve_precision(monkeypatch):
    assert resolve_precision("16-mixed") == "16-mixed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_precision("auto") == "32-true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision() == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision() == "16-mixed"


TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


@pytest.mark.filterwarnings("ignore:.*never reach the model.*")
@pytest.mark.parametrize(
    "settings, dynamic, packing",
    [
        (dict(strategy="pad"), True, False),
        (dict(batching=Pad(to_max_length=True)), False, False),  # one shape: no dynamic-shapes warning
        (dict(strategy="pack"), False, True),
        (dict(strategy="pack", eval_strategy="pad"), True, True),  # validation batches change shape
    ],
)
def test_dynamic_shapes_and_packing_are_asked_of_the_datamodule(
    tmp_path, small_text_dataset, settings, dynamic, packing
):
    """A real fit: the facts come from the DataModule's strategies (train and validation), not a strategy name."""
    from lightning_seqmem import CausalLM, SeqMemDataModule

    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=2, **settings)
    t = trainer(tmp_path, [ConfigChecks()], max_steps=1)
    t.fit(CausalLM(model_config=TINY), datamodule=dm)
    facts = checks.gather_facts(t, t.lightning_module)
    assert (facts.dynamic_shapes, facts.packing) == (dynamic, packing)
    on_cuda = find_problems(RunFacts(**{**vars(facts), "on_cuda": True}), SAFE)  # what a GPU run would warn
    assert ("dynamic_shapes" in on_cuda) == dynamic


def test_the_datamodule_s_batch_size_is_its_micro_batch_not_an_effective_batch(tmp_path, small_text_dataset):
    """``SeqMemDataModule.batch_size`` is ``micro_batch_size`` under the name Lightning's batch-size finder uses: with
    gradient accumulation (or several ranks, ddp_spawn's run warned too) it is not a batch_size to warn about."""
    from lightning_seqmem import CausalLM, SeqMemDataModule

    model = CausalLM(model_config=TINY)
    dm = SeqMemDataModule(dataset=small_text_dataset, max_length=64, micro_batch_size=2)
    t = trainer(tmp_path, [], max_steps=1, accumulate_grad_batches=2)
    t.strategy.connect(model)
    t.datamodule = dm  # what fit() does
    facts = checks.gather_facts(t, model)
    assert (facts.batch_size, facts.micro_batch_size, facts.accumulate_grad_batches) == (None, 2, 2)
    assert "batch_size" not in find_problems(RunFacts(**{**vars(facts), "world_size": 2}), SAFE)


class NanAtBatch2(TinyLM):
    """Its loss becomes NaN at batch 2, as fp16 full fine-tuning's did at step 4."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx >= 2 else loss


@pytest.mark.parametrize("precision", ["32-true", "16-true"])
# The NaN loss this test makes also reaches the module's torchmetrics means, which warn on their own.
@pytest.mark.filterwarnings("ignore:Encountered `nan` values in tensor:UserWarning")
def test_a_nonfinite_training_loss_is_warned_once_with_the_batch_and_the_likely_cause(tmp_path, precision):
    """16-true: the tiny Llama trained whole in fp16 goes NaN by itself within a few steps (the issue's run)."""
    torch.manual_seed(0)
    model = TinyLM() if precision == "16-true" else NanAtBatch2()
    cb = ConfigChecks(skip=("fp16_full_finetuning",))  # the setup-time rule off: the loss itself is flagged
    with pytest.warns(UserWarning, match=r"ConfigChecks \[nonfinite_loss\]") as record:
        trainer(tmp_path, [cb], max_steps=6, precision=precision).fit(model, datamodule=TinyData())
    assert sum("nonfinite_loss" in str(w.message) for w in record) == 1  # the batches after it are NaN too: once
    text = cb.problems["nonfinite_loss"]
    batch = re.search(r"the training loss is nan at batch (\d+) \(optimizer step (\d+)\)", text)
    assert batch and int(batch[2]) == int(batch[1]) + 1
    if precision == "16-true":
        assert "fp16 weights" in text and "Axolotl" in text and "CausalLM(lora=dict(r=16))" in text
        assert "'bf16-mixed'" in text and "'16-mixed'" in text
    else:
        assert batch[1] == "2" and "learning rate" in text and "Axolotl" not in text


def test_a_finite_run_and_a_skipped_check_stay_quiet(tmp_path, recwarn):
    trainer(tmp_path, [cb := ConfigChecks()], max_steps=3).fit(TinyLM(), datamodule=TinyData())
    quiet = ConfigChecks(skip=("nonfinite_loss",))
    trainer(tmp_path, [quiet], max_steps=4).fit(NanAtBatch2(), datamodule=TinyData())
    assert "nonfinite_loss" not in cb.problems and "nonfinite_loss" not in quiet.problems
    assert not any("nonfinite_loss" in str(w.message) for w in recwarn)


def test_accelerator_losses_are_read_every_n_steps_and_the_first_bad_batch_named():
    watch = LossWatch(every_n_steps=3)
    watch.host_devices = ()  # treat CPU tensors as on an accelerator: kept, read in groups
    losses = [1.0, float("inf"), float("nan"), 2.0, float("nan")]
    found = [watch.add(torch.tensor(v), i, i + 1) for i, v in enumerate(losses)]
    assert found[:2] == [None, None]  # nothing read before the third batch
    assert found[2] == (float("inf"), 1, 2) and found[3:] == [None, None]
    assert watch.flush()[1:] == (4, 5)  # the end of training reads what is left
    assert watch.flush() is None
