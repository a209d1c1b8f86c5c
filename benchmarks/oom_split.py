"""What ``on_oom="split"`` costs a step that does not run out of memory, on 2 gloo ranks (CPU).

Two forked ranks each train a Llama built from a config (random weights) on ``[rows, length]`` micro-batches,
``accumulate`` per step, in the two ways ``CausalLM`` can:

- ``ddp``: DDP's own step: local backward for the first micro-batches (``no_sync``), the gradient reduced during the
  last backward (``on_oom="raise"``);
- ``split``: what ``on_oom="split"`` does: every backward local, the ranks' agreement after each micro-batch
  (``OomSplitter.agree``: one all-reduce of two numbers and one host read), the gradient averaged once at the end
  of the window (``oom.reduce.WindowReduction``: presence agreed, buckets through kept buffers).

Reported per configuration: the median step of each way, the agreement's median time per micro-batch (timed alone,
in a tight loop) and its share of the ``split`` step (the goal: at most 1 %), and the step's difference.

    python benchmarks/oom_split.py              # the table in docs/oom.md
    python benchmarks/oom_split.py --smoke      # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time

CONFIGS = [  # (hidden, layers, rows, length, accumulate): small steps, where a fixed cost weighs the most
    (64, 2, 2, 64, 2),
    (128, 2, 4, 128, 2),
    (256, 4, 4, 256, 2),
    (512, 4, 4, 512, 2),
]
SMOKE = [(64, 1, 1, 32, 2)]


def _rank(rank: int, port: int, config: tuple, steps: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_seqmem.oom.reduce import WindowReduction, all_reduce_max
    from lightning_seqmem.oom.runner import OomSplitter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hidden, layers, rows, length, accumulate = config
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=length,
    )
    model = LlamaForCausalLM(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 4096, (rows, length), generator=g) for _ in range(accumulate)]
    splitter, device, reduction = OomSplitter(), torch.device("cpu"), WindowReduction()

    def ddp_step() -> None:
        for i, ids in enumerate(batches):
            if i < accumulate - 1:
                with ddp.no_sync():
                    (ddp(input_ids=ids, labels=ids).loss / accumulate).backward()
            else:
                (ddp(input_ids=ids, labels=ids).loss / accumulate).backward()
        model.zero_grad(set_to_none=True)

    def split_step() -> None:
        for ids in batches:
            (model(input_ids=ids, labels=ids).loss / accumulate).backward()
            splitter.agree(False, all_reduce_max, device)
        reduction(model.parameters(), 2, rank)
        model.zero_grad(set_to_none=True)

    def timed(fn, n: int) -> float:
        times = []
        for _ in range(n):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    ddp_step(), split_step()  # warm up both (DDP builds its buckets on the first synced backward)
    result = {"ddp_s": timed(ddp_step, steps), "split_s": timed(split_step, steps)}
    agree = []
    for _ in range(200):
        start = time.perf_counter()
        splitter.agree(False, all_reduce_max, device)
        agree.append(time.perf_counter() - start)
    result["agree_s"] = statistics.median(agree)
    result["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    dist.destroy_process_group()
    if rank == 0:
        out.put(result)


def run(config: tuple, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, port, config, steps, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        return queue.get(timeout=1800)
    finally:
        for p in ranks:
            p.join(10)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    configs = SMOKE if args.smoke else CONFIGS
    print("| params | micro-batch | accumulate | DDP step | split step | agreement / micro-batch | agreement share |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for config in configs:
        hidden, layers, rows, length, accumulate = config
        r = run(config, args.steps)
        share = accumulate * r["agree_s"] / r["split_s"]
        print(
            f"| {r['params_m']:.1f} M | {rows} x {length} | {accumulate} | {r['ddp_s'] * 1e3:.0f} ms "
            f"| {r['split_s'] * 1e3:.0f} ms | {r['agree_s'] * 1e6:.0f} µs | {share:.3%} |"
        )


if __name__ == "__main__":
    main()
